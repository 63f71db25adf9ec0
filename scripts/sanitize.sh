#!/usr/bin/env bash
# Builds lora_trainer under AddressSanitizer and UBSan in build-asan/ (a separate build: -O0 compiles
# fast, and every sanitizer report stops the process) and runs the tests that feed it hostile input:
# the fuzz tests of every reader (tests/formats/test_fuzz.cpp, LT_FUZZ_SCALE times their usual number of
# mutations), the hostile-file cases (tests/formats/test_hostile_inputs.cpp) and the output-safety cases
# (tests/core/test_outputs.cpp). Sets up what is missing first (scripts/setup.sh, the launcher only).
#
#   bash scripts/sanitize.sh                 # LT_FUZZ_SCALE=4 by default
#   LT_FUZZ_SCALE=20 bash scripts/sanitize.sh
#   bash scripts/sanitize.sh '[fuzz]'        # a Catch2 test spec instead of the three files' tests
#
# LibTorch itself is not instrumented (Debian's build): reports are about this project's code and what
# it hands to libraries. Leak checking is off (LibTorch and HDF5 keep their globals to the end).
# Exit status: non-zero when the build fails, a test fails or a sanitizer reports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh lora_trainer >/dev/null

BUILD="$ROOT/build-asan"
if [[ ! -f "$BUILD/build.ninja" ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O0 -g1" \
    -DLT_SANITIZE=address,undefined -DLT_TEST_FILES="test_fuzz|test_hostile_inputs|test_outputs"
fi
echo "sanitize: building build-asan (a first build takes a while)"
cmake --build "$BUILD" -j "$(nproc)" --target lora_trainer lora_trainer_tests

export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LT_FUZZ_SCALE="${LT_FUZZ_SCALE:-4}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
SPEC="${1:-[fuzz],[hostile],[outputs]}"
echo "sanitize: running $SPEC with LT_FUZZ_SCALE=$LT_FUZZ_SCALE"
start=$(date +%s)
"$BUILD/lora_trainer_tests" "$SPEC" --durations yes
echo "sanitize: passed in $(( $(date +%s) - start )) s under AddressSanitizer and UBSan"
