#!/usr/bin/env bash
# Builds candlewick with CUDA (`cargo build --release --features cuda` and a Python wheel with
# `cuda`) on a machine with no GPU and no CUDA toolkit: the toolkit comes from PyPI's
# nvidia-* wheels. CPU CI never runs this.
#
#   bash benches/cuda_build.sh            # both builds; the wheel lands in dist-cuda/
#   CUDA_COMPUTE_CAP=80 bash benches/cuda_build.sh wheel
#
# Environment: CUDA_COMPUTE_CAP (default 90: H100/H200), CANDLEWICK_CUDA_PYTHON (the interpreter
# the wheel is for, default python3.12: the device image's), CANDLEWICK_CUDA_TOOLKIT (where
# the toolkit venv and its assembled CUDA root live), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"   # all | cargo | wheel
# 13.0, not the newest: the driver runs PTX only up to its own CUDA version, and the device
# machines here have a 13.0 driver (580); cudarc 0.19 accepts 11.4 to 13.4.
CUDA_PIN=13.0
TOOLKIT="${CANDLEWICK_CUDA_TOOLKIT:-/var/tmp/candlewick-cuda-toolkit}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/candlewick-target-cuda}"
# Portable CPU code: the wheel runs on whatever CPU hosts the GPU (see README, "Wheels").
export RUSTFLAGS="${RUSTFLAGS:--C target-cpu=x86-64-v3}"
PYTHON="${CANDLEWICK_CUDA_PYTHON:-python3.12}"

if [ -z "${CUDA_ROOT:-}" ] && ! command -v nvcc >/dev/null; then
    # Every part pinned, nvvm too: nvcc's wheel takes any nvidia-nvvm, and a newer cicc writes
    # PTX that 13.0's ptxas refuses ("Unsupported .version 9.5").
    if ! ls "$TOOLKIT"/venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then
        python3 -m venv "$TOOLKIT/venv"
        "$TOOLKIT/venv/bin/pip" install -q --disable-pip-version-check \
            "nvidia-cuda-nvcc==$CUDA_PIN.*" "nvidia-nvvm==$CUDA_PIN.*" "nvidia-cuda-crt==$CUDA_PIN.*" "nvidia-cuda-cccl==$CUDA_PIN.*" \
            "nvidia-cuda-runtime==$CUDA_PIN.*" "nvidia-cuda-nvrtc==$CUDA_PIN.*" \
            "nvidia-cublas==$CUDA_PIN.*" "nvidia-curand==10.4.0.*"
    fi
    # The wheels unpack into one folder (nvidia/cu13) that lacks what a toolkit's layout has:
    # unversioned .so names for the linker and the driver stub libcuda.so (the driver itself
    # comes with the GPU). Assemble a CUDA root of links beside it.
    cu13="$(echo "$TOOLKIT"/venv/lib/python3*/site-packages/nvidia/cu13)"
    root="$TOOLKIT/cuda"
    mkdir -p "$root/lib/stubs"
    for d in bin include nvvm; do ln -sfn "$cu13/$d" "$root/$d"; done
    for so in "$cu13"/lib/lib*.so.*; do
        base="$(basename "$so")"
        ln -sf "$so" "$root/lib/$base"
        ln -sf "$so" "$root/lib/${base%%.so.*}.so"
    done
    ln -sfn lib "$root/lib64"
    if [ ! -f "$root/lib/stubs/libcuda.so" ]; then
        # Every cu* name in cuda.h, as empty functions: the linker only needs the names and the
        # soname, and the real libcuda.so.1 answers for them at load time.
        grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$cu13/include/cuda.h" \
            | sort -u | sed 's/.*/void &(void) {}/' >"$root/lib/stubs/cuda_stub.c"
        cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/cuda_stub.c"
    fi
    export CUDA_ROOT="$root"
    export PATH="$root/bin:$PATH"
fi
nvcc --version | tail -2

start=$SECONDS
if [ "$what" = all ] || [ "$what" = cargo ]; then
    nice -n 19 cargo build --release --features cuda
    echo "cargo build --release --features cuda: $((SECONDS - start)) s"
fi
if [ "$what" = all ] || [ "$what" = wheel ]; then
    command -v maturin >/dev/null || { echo "maturin is needed for the wheel (pip install maturin)" >&2; exit 1; }
    t=$SECONDS
    # The CUDA libraries stay outside the wheel (the driver cannot be bundled at all, and cuBLAS
    # alone is ~500 MB): they come from the nvidia-* wheels or the system at run time.
    nice -n 19 maturin build --release --features cuda --auditwheel skip -i "$PYTHON" -o dist-cuda
    echo "maturin build --features cuda: $((SECONDS - t)) s"
fi
echo "total: $((SECONDS - start)) s (CUDA_ROOT=${CUDA_ROOT:-system}, compute cap $CUDA_COMPUTE_CAP)"
