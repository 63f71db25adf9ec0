#!/usr/bin/env bash
# Builds lora_trainer under AddressSanitizer and UBSan in build-asan/ (a separate build: -O0 compiles
# fast, and every sanitizer report stops the process) and runs the tests that feed it hostile input:
# the fuzz tests of every reader (tests/formats/test_fuzz.cpp, LT_FUZZ_SCALE times their usual number of
# mutations), the hostile-file, output-safety and deletion cases, the checks of datasets' and
# checkpoints' files, the logs' failed writes and the chat templates' limits (TEST_FILES below). Sets up what is missing first (scripts/setup.sh, the launcher only).
#
#   bash scripts/sanitize.sh                 # LT_FUZZ_SCALE=4 by default
#   LT_FUZZ_SCALE=20 bash scripts/sanitize.sh
#   bash scripts/sanitize.sh '[fuzz]'        # a Catch2 test spec instead of every test built there
#
# LibTorch itself is not instrumented (Debian's build): reports are about this project's code and what
# it hands to libraries. Leak checking is off (LibTorch and HDF5 keep their globals to the end).
# Exit status: non-zero when the build fails, a test fails or a sanitizer reports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh lora_trainer >/dev/null

BUILD="$ROOT/build-asan"
# The tests that feed the code hostile input: readers, deletions, failed writes, template limits.
TEST_FILES="test_fuzz|test_hostile_inputs|test_outputs|test_job_lock|test_keep_checkpoints|test_dataset_files|test_user_input|test_export_trust|test_tensorboard|test_jinja_limits"
if [[ ! -f "$BUILD/build.ninja" ]] || ! grep -qxF "LT_TEST_FILES:STRING=$TEST_FILES" "$BUILD/CMakeCache.txt"; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O0 -g1" \
    -DLT_SANITIZE=address,undefined -DLT_TEST_FILES="$TEST_FILES"
fi
echo "sanitize: building build-asan (a first build takes a while)"
cmake --build "$BUILD" -j "$(nproc)" --target lora_trainer lora_trainer_tests

export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LT_FUZZ_SCALE="${LT_FUZZ_SCALE:-4}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
SPEC="${1:-}"
echo "sanitize: running ${SPEC:-every test built there} with LT_FUZZ_SCALE=$LT_FUZZ_SCALE"
start=$(date +%s)
"$BUILD/lora_trainer_tests" ${SPEC:+"$SPEC"} --durations yes
echo "sanitize: passed in $(( $(date +%s) - start )) s under AddressSanitizer and UBSan"
