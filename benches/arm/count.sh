#!/usr/bin/env bash
# Instruction counts of the NEON kernels under qemu-user, the proxy BENCHMARKS.md ("Arm") judges
# them by: nothing here can time an Arm core. Each probe (src/backend/kernels/arm.rs,
# `kernel_probe`) runs one kernel REPS times in the aarch64 test binary on one thread; the count
# of a run with 1 repetition (start-up, data, quantizing the weight, and the first call) is
# subtracted, so what is printed is instructions per later call: candle 0.11 repacks a weight at
# its first product (Q8_0 512 x 2048: 4.2 M instructions, 14 times a later one-row call).
#
#   bash benches/arm/count.sh            # after: cargo --config .cargo/aarch64-linux-cross.toml
#                                        #   test --release --lib --target aarch64-unknown-linux-gnu --no-run
# Environment: CARGO_TARGET_DIR (default /var/tmp/candlewick-target-aarch64), QEMU_CPU (max).
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${CARGO_TARGET_DIR:-/var/tmp/candlewick-target-aarch64}"
bin="$(ls -t "$target"/aarch64-unknown-linux-gnu/release/deps/candlewick-* | grep -v '\.d$' | head -n 1)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
gcc -shared -fPIC -O2 -Wall -o "$work/insn_count.so" benches/arm/insn_count.c

count() {  # PROBE -> instructions of the whole run
    CANDLEWICK_PROBE="$1" RAYON_NUM_THREADS=1 QEMU_CPU="${QEMU_CPU:-max}" \
        qemu-aarch64 -L /usr/aarch64-linux-gnu -plugin "$work/insn_count.so" -d plugin -D "$work/log" \
        "$bin" --exact backend::kernels::arm::probe::kernel_probe --ignored --test-threads 1 >/dev/null
    awk '/^instructions/ {print $2}' "$work/log"
}

per_call() {  # PROBE_WITHOUT_REPS REPS -> instructions per call after the first
    local base full
    base="$(count "$1:1")"
    full="$(count "$1:$(($2 + 1))")"
    echo $(( (full - base) / $2 ))
}

echo "probe instructions/call"
for shape in "1:2048:512" "16:2048:512"; do
    for fmt in q8_0 q4_1; do
        for path in portable neon neon-dotprod neon-i8mm; do
            echo "int8:$path:$fmt:$shape $(per_call "int8:$path:$fmt:$shape" 3)"
        done
        echo "tiles:neon-dotprod:$fmt:$shape $(per_call "tiles:neon-dotprod:$fmt:$shape" 3)"
        echo "candle:$fmt:$shape $(per_call "candle:$fmt:$shape" 3)"
    done
done
# The interleaved tiles beside candle's kernels (and int8_gemm's for the 32-value formats) on a
# decode row and a 128-row prompt chunk.
for shape in "1:2048:512" "128:2048:512"; do
    for fmt in q8_0 q4_0 q4_k q6_k; do
        echo "tiles:neon-dotprod:$fmt:$shape $(per_call "tiles:neon-dotprod:$fmt:$shape" 2)"
        if [ "$fmt" = q8_0 ] || [ "$fmt" = q4_0 ]; then
            for path in neon-dotprod neon-i8mm; do
                echo "int8:$path:$fmt:$shape $(per_call "int8:$path:$fmt:$shape" 2)"
            done
        fi
        echo "candle:$fmt:$shape $(per_call "candle:$fmt:$shape" 2)"
    done
done
for dtype in f32 bf16 f16; do
    for isa in portable neon; do
        echo "dense:$isa:$dtype:512:2048 $(per_call "dense:$isa:$dtype:512:2048" 3)"
    done
done
for isa in portable neon; do
    echo "attn:$isa:512 $(per_call "attn:$isa:512" 5)"
done
