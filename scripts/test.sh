#!/usr/bin/env bash
# Sets up whatever is missing (scripts/setup.sh), then runs the whole test suite with ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The real libraries some tests read our files back with (each such test skips with a note without
# them): python3-protobuf and python3-crc32c decode the TensorBoard event files; node-llama-cpp (npm)
# is the llama.cpp that runs the GGUF exports.
LT_EXTRA_PACKAGES="python3-protobuf python3-crc32c" bash "$ROOT/scripts/setup.sh"
bash "$ROOT/scripts/fetch_llama_cpp.sh"
cd "$ROOT/build"
ctest --output-on-failure -j "$(nproc)" "$@"
