/* Counts the guest instructions a qemu-user run executes: a QEMU TCG plugin (API version 1, as
 * in Debian 12's QEMU 7.2), for judging the NEON kernels where nothing can time them
 * (benches/arm/count.sh, BENCHMARKS.md "Arm"). The few declarations it needs are written out here
 * from QEMU's documented plugin API, so it builds without QEMU's headers:
 *
 *     gcc -shared -fPIC -O2 -o insn_count.so insn_count.c
 *     qemu-aarch64 -plugin ./insn_count.so -d plugin -D counts.txt PROGRAM ...
 *
 * Every translated block adds its instruction count to one counter each time it runs (an inline
 * add, so the guest runs at nearly full emulation speed); the total is written at exit. Run the
 * guest on one thread: the add is not atomic across vCPUs. */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
typedef struct qemu_info_t qemu_info_t;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id,
                                           void (*cb)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, void *),
                                    void *userdata);
void qemu_plugin_outs(const char *string);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t executed;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed,
                                             qemu_plugin_tb_n_insns(tb));
}

static void on_exit(qemu_plugin_id_t id, void *data) {
    (void)id;
    (void)data;
    char line[64];
    snprintf(line, sizeof line, "instructions %" PRIu64 "\n", executed);
    qemu_plugin_outs(line);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id,
                                                              const qemu_info_t *info, int argc,
                                                              char **argv) {
    (void)info;
    (void)argc;
    (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
