#!/usr/bin/env bash
# The llama.cpp cross-checks (the tests marked `llama_cpp`: llama-cpp-python reads the GGUF files
# candlewick writes and reads as the transformers references, and agrees with candlewick on
# gpt-oss), which CI skips because llama-cpp-python must be built from source. Run them in an
# interpreter that has candlewick, the test extra and llama-cpp-python:
#
#     pip install '.[test]'
#     CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-cache-dir llama-cpp-python==0.3.36   # ~20 min, 2 cores
#     bash benches/llama_cpp_checks.sh [PYTHON] [pytest arguments...]
#
# PYTHON defaults to `python`. CANDLEWICK_REQUIRE_LLAMA_CPP=1 makes a missing llama-cpp-python a
# failure, not a skip, so this command never passes without having run the checks; it exits
# with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-python}"
shift || true
if ! "$python" -c 'import llama_cpp, candlewick' 2>/dev/null; then
    echo "llama_cpp_checks: $python cannot import llama_cpp and candlewick; install them as the comment at the" \
         "top of $0 says" >&2
    exit 2
fi
"$python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
CANDLEWICK_REQUIRE_LLAMA_CPP=1 exec "$python" -m pytest -m llama_cpp -rs "$@"
