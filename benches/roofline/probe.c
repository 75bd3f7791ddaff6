/* The host's limits for the roofline (benches/roofline.py): memory read bandwidth and int8 / bf16
 * multiply-accumulate peaks, with the number of threads a benchmark runs.
 *
 *   probe read  THREADS MiB   -> GB/s reading a buffer of MiB (each thread its own slice)
 *   probe int8  THREADS       -> GMAC/s of AVX-512 VNNI (vpdpbusd) or AVX-VNNI, whichever is there
 *   probe bf16  THREADS       -> GMAC/s of AVX-512 BF16 (vdpbf16ps), 0 without it
 *
 * Built by roofline.py with the host's compiler (`cc -O2 -march=native -pthread`). Written by
 * hand: no packaged tool measures these three on x86 and ARM alike, and each is a few lines. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const uint64_t *p;
    size_t n;
    int reps;
    uint64_t sink;
    const char *mode;
    double macs;
} job_t;

/* Eight independent xor chains: the loads, not the arithmetic, limit the loop. */
static void *read_slice(void *arg) {
    job_t *j = arg;
    uint64_t a[8] = {0};
    for (int r = 0; r < j->reps; r++)
        for (size_t i = 0; i + 8 <= j->n; i += 8)
            for (int k = 0; k < 8; k++) a[k] ^= j->p[i + k];
    for (int k = 0; k < 8; k++) j->sink ^= a[k];
    return NULL;
}

#define ITERS 20000000L
static void *mac_loop(void *arg) {
    job_t *j = arg;
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    if (!strcmp(j->mode, "bf16")) {
        __m512 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
        __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (long i = 0; i < ITERS; i++)
            for (int k = 0; k < 8; k++) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
        float s = 0;
        for (int k = 0; k < 8; k++) s += _mm512_reduce_add_ps(acc[k]);
        j->sink = (uint64_t)s;
        j->macs = (double)ITERS * 8 * 32;
        return NULL;
    }
#endif
#if defined(__AVX512VNNI__)
    if (!strcmp(j->mode, "int8")) {
        __m512i acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_si512();
        __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
        for (long i = 0; i < ITERS; i++)
            for (int k = 0; k < 8; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
        int64_t s = 0;
        for (int k = 0; k < 8; k++) s += _mm512_reduce_add_epi32(acc[k]);
        j->sink = (uint64_t)s;
        j->macs = (double)ITERS * 8 * 64;
        return NULL;
    }
#elif defined(__AVXVNNI__)
    if (!strcmp(j->mode, "int8")) {
        __m256i acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
        __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(1);
        for (long i = 0; i < ITERS; i++)
            for (int k = 0; k < 8; k++) acc[k] = _mm256_dpbusd_avx_epi32(acc[k], a, b);
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, acc[0]);
        j->sink = (uint64_t)t[0];
        j->macs = (double)ITERS * 8 * 32;
        return NULL;
    }
#endif
    j->macs = 0;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: probe read|int8|bf16 THREADS [MiB]\n");
        return 2;
    }
    const char *mode = argv[1];
    int threads = atoi(argv[2]);
    if (threads < 1 || threads > 1024) return 2;
    pthread_t th[1024];
    job_t jobs[1024];
    memset(jobs, 0, sizeof jobs);
    if (!strcmp(mode, "read")) {
        size_t mib = argc > 3 ? strtoul(argv[3], NULL, 10) : 512;
        size_t n = mib * (1u << 20) / 8;
        uint64_t *buf = aligned_alloc(64, n * 8);
        if (!buf) return 1;
        for (size_t i = 0; i < n; i++) buf[i] = i * 0x9e3779b97f4a7c15ull;
        double best = 0;
        for (int trial = 0; trial < 5; trial++) {
            double t = now();
            for (int k = 0; k < threads; k++) {
                jobs[k] = (job_t){.p = buf + n / threads * k, .n = n / threads, .reps = 2};
                pthread_create(&th[k], NULL, read_slice, &jobs[k]);
            }
            uint64_t sink = 0;
            for (int k = 0; k < threads; k++) pthread_join(th[k], NULL), sink ^= jobs[k].sink;
            double gbs = 2.0 * (n / threads) * threads * 8 / (now() - t) / 1e9;
            if (gbs > best) best = gbs;
            if (sink == 42) puts("");
        }
        printf("%.2f\n", best);
        return 0;
    }
    double t = now(), macs = 0;
    for (int k = 0; k < threads; k++) {
        jobs[k].mode = mode;
        pthread_create(&th[k], NULL, mac_loop, &jobs[k]);
    }
    for (int k = 0; k < threads; k++) pthread_join(th[k], NULL), macs += jobs[k].macs;
    printf("%.2f\n", macs / (now() - t) / 1e9);
    return 0;
}
