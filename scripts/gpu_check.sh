#!/usr/bin/env bash
# On a CUDA host with PyTorch's Python package (and no package registry): builds lora_trainer against
# that package's LibTorch, with HDF5, nlohmann-json, CLI11, Catch2, PCRE2, utf8proc, pkgconf (and,
# where the PyTorch package has none, the gloo headers) taken from the Debian .deb files that
# scripts/gpu_deps.sh downloaded into .gpu/debs on the Debian machine; then runs the test suite, the
# benchmark (`lora_trainer bench configs/bench_gpt2_124m.json`), the plain-PyTorch reference
# (scripts/reference_gpt.py --device cuda) and Hugging Face transformers + PEFT on the same model and
# batch (scripts/hf_peft_bench.py), and the benchmark again with one setting changed (--ab), and prints
# a summary table. Run it from anywhere; it works in
# the repository root.
#
# Usage: scripts/gpu_check.sh [OUT_DIR] [options]
#   OUT_DIR          where the figures and logs go (default: $OUT, else ./gpu-out); at most these
#                    files: run.log (everything printed), build.log, ctest.log, bench.json,
#                    reference.json, hf_peft.json, bench_ab.json, summary.txt, and with --scale
#                    scale.json (then pass --no-hf: at most 8 files come back from the device tool)
#   --only-build     unpack, configure and build; no tests, no benchmarks
#   --only-prefix    unpack .gpu/debs and write .gpu/env.sh (environment + CMake arguments), no build
#   --no-tests       skip ctest
#   --no-bench       skip all three benchmarks
#   --no-reference   skip scripts/reference_gpt.py
#   --no-hf          skip scripts/hf_peft_bench.py
#   --compile-reference  also the reference under torch.compile with fused AdamW (reference_gpt.py
#                    --compile --adamw fused, and REFERENCE_ARGS), after the eager one, into
#                    reference_compiled.json; its column in the summary. Compiling takes a minute or two
#   --scale SHAPE    also the scale benchmark (scripts/scale_bench.py) on a synthetic Hugging Face model
#                    of that shape (e.g. tinyllama-1.1b) on the GPU, after the tests: peak GPU memory and
#                    host RSS of a LoRA job from the model directory, load and step time, resume; into
#                    scale.json (its logs under \$TMPDIR). Default: none
#   --qlora SHAPE    also QLoRA's benchmark (scripts/qlora_bench.py) on that shape on the GPU: the same LoRA
#                    job on a bf16 and an NF4 base side by side (frozen base bytes, peak GPU memory, step
#                    time, resume), into qlora.json. Default: none
#   --ab KEY=VALUE   the setting of the second lora_trainer benchmark, side by side with the first in
#                    the summary (default runtime/loss=libtorch: LibTorch's loss against this project's
#                    CUDA loss kernels, the default since they were timed); --ab none skips it
#   --steps N        timed steps per phase in every benchmark (default 10; warm-up 3, --warmup N)
#   --config FILE    benchmark config (default configs/bench_gpt2_124m.json)
#   --budget S       wall-clock budget of the whole script in seconds (default 530); each stage gets
#                    a `timeout` from what is left, keeping time back for the stages after it
#   --clean          delete build-gpu/ first
#   --jobs N         build jobs (default: every core)
# Environment: TORCH_CMAKE_PREFIX (Torch's CMake prefix; "system" = let CMake find it unaided; default:
#   `python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'`), PYTHON (the interpreter with
#   torch; default: python3, else /opt/torch/.venv/bin/python3), BUILD_DIR (default build-gpu),
#   TORCH_CUDA_ARCH_LIST (default 9.0), CTEST_JOBS (default 8), TEST_TIMEOUT (per test, default 200 s),
#   REFERENCE_ARGS (more options of scripts/reference_gpt.py, e.g. --pad-vocab), GPU_CHECK_DEVICE (the Python benchmarks' device, default cuda; cpu for a dry run of the whole script
#   on a machine without a GPU, e.g. with --config configs/demo.json).
# Each stage runs even if an earlier one failed (where it can: no benchmark without a build) and
# its outcome is listed at the end; the exit status is 0 only if every stage that ran passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_PWD="$PWD"
cd "$ROOT" || exit 1

OUTDIR=""
RUN_TESTS=1 RUN_BENCH=1 RUN_REF=1 RUN_HF=1 RUN_REF_COMPILED=0 CLEAN=0 ONLY_PREFIX=0 AB="runtime/loss=libtorch" SCALE=none QLORA=none
STEPS=10 WARMUP=3 BUDGET=530 JOBS="$(nproc)"
CONFIG="configs/bench_gpt2_124m.json"
while (($#)); do
  case "$1" in
    --only-build) RUN_TESTS=0; RUN_BENCH=0 ;;
    --only-prefix) ONLY_PREFIX=1 ;;
    --no-tests) RUN_TESTS=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    --no-reference) RUN_REF=0 ;;
    --no-hf) RUN_HF=0 ;;
    --compile-reference) RUN_REF_COMPILED=1 ;;
    --ab) AB="$2"; shift ;;
    --scale) SCALE="$2"; shift ;;
    --qlora) QLORA="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --warmup) WARMUP="$2"; shift ;;
    --config) CONFIG="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --clean) CLEAN=1 ;;
    --jobs) JOBS="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) if [[ -z "$OUTDIR" ]]; then OUTDIR="$1"; else echo "gpu_check: one OUT_DIR only" >&2; exit 2; fi ;;
  esac
  shift
done
SCALE_RESERVE=0; [[ "$SCALE" != none ]] && SCALE_RESERVE=90
[[ "$QLORA" != none ]] && SCALE_RESERVE=$((SCALE_RESERVE + 150))
OUTDIR="${OUTDIR:-${OUT:-$ROOT/gpu-out}}"
[[ "$OUTDIR" = /* ]] || OUTDIR="$CALLER_PWD/$OUTDIR"
[[ "$CONFIG" = /* || -f "$ROOT/$CONFIG" || ! -f "$CALLER_PWD/$CONFIG" ]] || CONFIG="$CALLER_PWD/$CONFIG"
mkdir -p "$OUTDIR" || exit 1
OUTDIR="$(cd "$OUTDIR" && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
[[ "$BUILD" = /* ]] || BUILD="$ROOT/$BUILD"
P="$ROOT/.gpu/prefix"
WEIGHTS="${TMPDIR:-/tmp}/lt-gpu-check-weights-$$.pt"
ARCH_DIR=x86_64-linux-gnu
DEVICE="${GPU_CHECK_DEVICE:-cuda}"

# Everything printed goes to OUT_DIR/run.log too. An earlier run's files go first (no stale figures).
rm -f "$OUTDIR"/{build.log,ctest.log,bench.json,reference.json,reference_compiled.json,hf_peft.json,bench_ab.json,summary.txt,scale.json,qlora.json}
: > "$OUTDIR/run.log"
exec > >(tee -a "$OUTDIR/run.log") 2>&1

START=$SECONDS
declare -a STAGES=()
declare -A STATUS=()
FAILED=0
say() { printf '\n=== gpu_check [%4ds] %s\n' "$((SECONDS - START))" "$*"; }
record() {  # stage, status text
  [[ -n "${STATUS[$1]:-}" ]] || STAGES+=("$1")
  STATUS[$1]="$2"
  [[ "$2" == ok* || "$2" == skipped* ]] || FAILED=1
  printf '=== gpu_check: %s: %s\n' "$1" "$2"
}
# Seconds a stage may take: at most CAP, keeping RESERVE back for the stages after it.
allow() {  # (caps are set for the default budget of 530 s and scale with --budget)
  local cap=$(($1 * BUDGET / 530)) reserve=$2 left=$((BUDGET - (SECONDS - START)))
  local t=$((left - reserve))
  ((t > cap)) && t=$cap
  echo "$t"
}
# run_stage NAME CAP RESERVE CMD...: runs CMD under `timeout`, records its outcome.
run_stage() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local t; t=$(allow "$cap" "$reserve")
  if ((t < 15)); then
    record "$name" "skipped (no time left in the ${BUDGET}s budget)"
    return 1
  fi
  say "$name (timeout ${t}s): $*"
  timeout --kill-after=10 "$t" "$@"
  local rc=$?
  if ((rc == 0)); then record "$name" "ok"
  elif ((rc == 124 || rc == 137)); then record "$name" "TIMED OUT after ${t}s"
  else record "$name" "FAILED (exit status $rc)"; fi
  return "$rc"
}

# ---------------------------------------------------------------------------------------------
say "machine and tools"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  for c in python3 /opt/torch/.venv/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
HAVE_TORCH_PY=1
if [[ -z "$PY" ]]; then PY=python3; HAVE_TORCH_PY=0; fi
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
# cmake and ninja from the Python environment's bin (pip's), when none are on PATH.
pybin="$(dirname "$(command -v "$PY" 2>/dev/null || echo /nonexistent/python3)")"
for tool in cmake ninja; do
  if ! command -v "$tool" >/dev/null 2>&1 && [[ -x "$pybin/$tool" ]]; then export PATH="$PATH:$pybin"; fi
done
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PYTHONUNBUFFERED=1
{
  date -u '+%Y-%m-%d %H:%M:%S UTC'
  grep -E '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null
  ldd --version 2>/dev/null | head -1
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)):'
  timeout 30 nvidia-smi 2>&1 || echo "(nvidia-smi failed or is missing)"
  echo "--- g++: $(g++ --version 2>&1 | head -1)"
  echo "--- cmake: $(cmake --version 2>&1 | head -1)"
  echo "--- ninja: $(ninja --version 2>&1 | head -1)"
  echo "--- nvcc: $(nvcc --version 2>&1 | tail -2 | tr '\n' ' ')"
  echo "--- pkg-config: $(command -v pkg-config || echo none on PATH)"
  echo "--- python: $PY ($("$PY" --version 2>&1))"
  timeout 60 "$PY" - <<'PY' 2>&1 || echo "(torch could not be imported)"
import importlib
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"cuda available {torch.cuda.is_available()}, C++11 ABI {torch.compiled_with_cxx11_abi()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
for m in ("transformers", "peft", "safetensors"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "not importable:", e)
PY
} 2>&1
[[ -d datasets/tokenizer/gpt2 ]] || echo "gpu_check: WARNING: datasets/tokenizer/gpt2 is missing (carry datasets/tokenizer): the gpt2 tokenizer tests will fail"

# ---------------------------------------------------------------------------------------------
# The prefix: every .deb unpacked (dpkg -x, never into /), .pc files pointed at the prefix, and a
# directory of links to the libraries this host lacks (HDF5's always: its headers and library must
# be the same release, or HDF5 aborts at start-up).
prepare_prefix() {
  local debs=(.gpu/debs/*.deb)
  if [[ ! -e "${debs[0]}" ]]; then
    echo "gpu_check: no .gpu/debs/*.deb: run scripts/gpu_deps.sh on the Debian machine and carry .gpu" >&2
    return 1
  fi
  local stamp; stamp="$(ls -l .gpu/debs/*.deb | md5sum | cut -d' ' -f1)"
  if [[ "$(cat "$P/.unpacked" 2>/dev/null)" != "$stamp" ]]; then
    rm -rf "$P"; mkdir -p "$P"
    local d
    for d in "${debs[@]}"; do
      if command -v dpkg >/dev/null 2>&1; then
        dpkg -x "$d" "$P" || return 1
      else  # no dpkg: a .deb is an ar archive holding data.tar.*
        local t; t="$(mktemp -d)"
        (cd "$t" && ar x "$ROOT/$d" && tar -xf data.tar.* -C "$P") || { rm -rf "$t"; return 1; }
        rm -rf "$t"
      fi
    done
    echo "$stamp" > "$P/.unpacked"
    echo "unpacked ${#debs[@]} .deb files into $P"
  fi
  local pc
  while IFS= read -r pc; do
    sed -i -e "s|^prefix=/usr\$|prefix=$P/usr|" -e "s|^\\(libdir\\|includedir\\|exec_prefix\\)=/usr/|\\1=$P/usr/|" "$pc"
  done < <(find "$P/usr" -name '*.pc' -type f)

  rm -rf "$P/runtime-lib"; mkdir -p "$P/runtime-lib"
  local ldcache="" ldc
  ldc="$(command -v ldconfig || echo /sbin/ldconfig)"
  ldcache="$("$ldc" -p 2>/dev/null)"
  local f so added=() host=()
  while IFS= read -r f; do
    so="$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
    [[ -n "$so" && ! -e "$P/runtime-lib/$so" ]] || continue
    if [[ "$so" != libhdf5* ]] &&
       { grep -qF "$(printf '\t')$so (libc6,x86-64" <<<"$ldcache" ||
         [[ -e /lib/$ARCH_DIR/$so || -e /usr/lib/$ARCH_DIR/$so || -e /usr/lib64/$so || -e /lib64/$so ]]; }; then
      host+=("$so"); continue
    fi
    ln -s "$f" "$P/runtime-lib/$so"; added+=("$so")
  done < <(find "$P/lib/$ARCH_DIR" "$P/usr/lib/$ARCH_DIR" -maxdepth 1 -type f -name 'lib*.so*' 2>/dev/null | sort)
  echo "libraries from the prefix: ${added[*]}"
  echo "libraries the host has (its own are used): ${host[*]}"
  export LD_LIBRARY_PATH="$P/runtime-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  # gloo headers: PyTorch's own when its package ships them, else Debian's (2022; the newer Store API
  # in ProcessGroupGloo.hpp is behind #ifdef GLOO_STORE_HAS_STORE_V2).
  mkdir -p "$P/gloo-include"; ln -sfn ../usr/include/gloo "$P/gloo-include/gloo"
  local inc have_gloo=""
  for inc in "${TORCH_INCLUDE_DIRS[@]}"; do
    [[ -f "$inc/gloo/algorithm.h" ]] && have_gloo="$inc"
  done
  if [[ -n "$have_gloo" ]]; then
    echo "gloo headers: LibTorch's own, $have_gloo/gloo"
  else
    echo "gloo headers: Debian's (libgloo-dev), $P/gloo-include (LibTorch ships none)"
    export CPLUS_INCLUDE_PATH="$P/gloo-include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  fi

  if command -v pkg-config >/dev/null 2>&1; then PKGCONF="$(command -v pkg-config)"
  else PKGCONF="$P/usr/bin/pkgconf"; fi
  export PKG_CONFIG_PATH="$P/usr/lib/$ARCH_DIR/pkgconfig:$P/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  echo "pkg-config: $PKGCONF; libpcre2-8: $("$PKGCONF" --cflags --libs libpcre2-8 2>&1);" \
       "libutf8proc: $("$PKGCONF" --cflags --libs libutf8proc 2>&1)"
}

# Torch's CMake prefix and include directories.
TORCH_PREFIX="${TORCH_CMAKE_PREFIX:-}"
TORCH_INCLUDE_DIRS=()
if [[ -z "$TORCH_PREFIX" && $HAVE_TORCH_PY -eq 1 ]]; then
  TORCH_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
fi
if [[ -n "$TORCH_PREFIX" && "$TORCH_PREFIX" != system && ! -d "$TORCH_PREFIX" ]]; then
  echo "gpu_check: WARNING: Torch's CMake prefix $TORCH_PREFIX does not exist; letting CMake search"
  TORCH_PREFIX=system
fi
if [[ -n "$TORCH_PREFIX" && "$TORCH_PREFIX" != system ]]; then
  # pip layout: torch/share/cmake -> torch/include; a system LibTorch: <prefix>/include.
  for inc in "$TORCH_PREFIX/../../include" "$TORCH_PREFIX/../../../include" "$TORCH_PREFIX/../../../../include"; do
    [[ -d "$inc/torch" ]] && TORCH_INCLUDE_DIRS+=("$(cd "$inc" && pwd)")
  done
else
  TORCH_PREFIX=""
  TORCH_INCLUDE_DIRS=(/usr/include /usr/local/include)
fi
echo "Torch CMake prefix: ${TORCH_PREFIX:-none, CMake searches unaided}; include: ${TORCH_INCLUDE_DIRS[*]:-?}"

say "prefix from .gpu/debs"
if prepare_prefix; then record prefix ok; else record prefix "FAILED"; fi

# ---------------------------------------------------------------------------------------------
# The CMake arguments that point the project at the prefix and at Torch.
CMAKE_ARGS=(-G Ninja
  "-DCMAKE_PREFIX_PATH=${TORCH_PREFIX:+$TORCH_PREFIX;}$P/usr"
  -DHDF5_NO_FIND_PACKAGE_CONFIG_FILE=ON
  "-DHDF5_C_INCLUDE_DIR=$P/usr/include/hdf5/serial"
  "-DHDF5_CXX_INCLUDE_DIR=$P/usr/include/hdf5/serial"
  "-DHDF5_hdf5_LIBRARY_RELEASE=$P/usr/lib/$ARCH_DIR/hdf5/serial/libhdf5.so"
  "-DHDF5_hdf5_cpp_LIBRARY_RELEASE=$P/usr/lib/$ARCH_DIR/hdf5/serial/libhdf5_cpp.so"
  "-DPKG_CONFIG_EXECUTABLE=${PKGCONF:-pkg-config}"
  "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$P/runtime-lib")
[[ -n "${BUILD_TYPE:-}" ]] && CMAKE_ARGS+=("-DCMAKE_BUILD_TYPE=$BUILD_TYPE")
# CMake 4 refuses package files that declare compatibility with CMake < 3.5 (CLI11's says 2.6).
cmake_major="$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9]*\).*/\1/p')"
((${cmake_major:-3} >= 4)) && CMAKE_ARGS+=(-DCMAKE_POLICY_VERSION_MINIMUM=3.5)
# An HDF5 compiler wrapper on this host (h5cc) would describe its own HDF5: make it fail so that
# FindHDF5 takes the paths above.
if command -v h5cc >/dev/null 2>&1 || command -v h5pcc >/dev/null 2>&1 || command -v h5c++ >/dev/null 2>&1; then
  CMAKE_ARGS+=(-DHDF5_C_COMPILER_EXECUTABLE=/bin/false -DHDF5_CXX_COMPILER_EXECUTABLE=/bin/false)
fi
# The same settings for working by hand afterwards: `source .gpu/env.sh; cmake -S . -B DIR "${LT_CMAKE_ARGS[@]}"`.
{
  echo "# Written by scripts/gpu_check.sh: the environment and CMake arguments of its build."
  for v in LD_LIBRARY_PATH CPLUS_INCLUDE_PATH PKG_CONFIG_PATH TORCH_CUDA_ARCH_LIST PATH; do
    [[ -n "${!v:-}" ]] && printf 'export %s=%q\n' "$v" "${!v}"
  done
  printf 'LT_CMAKE_ARGS=('; printf ' %q' "${CMAKE_ARGS[@]}"; printf ' )\n'
} > "$ROOT/.gpu/env.sh"
echo "environment and CMake arguments written to .gpu/env.sh"
if ((ONLY_PREFIX)); then
  record configure "skipped (--only-prefix)"
  exit "$FAILED"
fi

BUILD_OK=0
if ((CLEAN)); then rm -rf "$BUILD"; fi
if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -qF "CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT" "$BUILD/CMakeCache.txt"; then
  echo "gpu_check: $BUILD was configured for another source tree; starting afresh"
  rm -rf "$BUILD"
fi
{
  echo "cmake -S $ROOT -B $BUILD ${CMAKE_ARGS[*]}"
  run_stage configure 180 240 cmake -S "$ROOT" -B "$BUILD" "${CMAKE_ARGS[@]}"
} > "$OUTDIR/build.log" 2>&1
cat "$OUTDIR/build.log"
cfg_rc=${STATUS[configure]:-}
if [[ "$cfg_rc" == ok ]]; then
  # The compiler's output goes to build.log only; its errors and warnings are shown after.
  run_stage build 420 "$(( (RUN_TESTS ? 60 : 0) + (RUN_BENCH ? 150 : 0) + SCALE_RESERVE ))" cmake --build "$BUILD" -j "$JOBS" \
    >> "$OUTDIR/build.log" 2>&1
  record build "${STATUS[build]:-FAILED (no result)}"  # run_stage printed into build.log
  grep -E '(error|FAILED|undefined reference|warning:)' "$OUTDIR/build.log" | head -60
  [[ "${STATUS[build]:-}" == ok ]] && BUILD_OK=1
  if ((!BUILD_OK)); then
    echo "--- the end of build.log:"; tail -60 "$OUTDIR/build.log"
  fi
else
  record build "skipped (configure failed: see build.log)"
  echo "--- the end of build.log:"; tail -80 "$OUTDIR/build.log"
fi
if ((BUILD_OK)); then
  say "smoke test"
  missing="$(ldd "$BUILD/lora_trainer" 2>&1 | grep 'not found')"
  if [[ -n "$missing" ]]; then echo "unresolved libraries:"; echo "$missing"; fi
  if timeout 60 "$BUILD/lora_trainer" --help >/dev/null 2>&1 && [[ -z "$missing" ]]; then record smoke ok
  else record smoke "FAILED (lora_trainer --help)"; timeout 60 "$BUILD/lora_trainer" --help 2>&1 | tail -20; fi
fi

# ---------------------------------------------------------------------------------------------
if ((RUN_TESTS)); then
  if ((BUILD_OK)); then
    { cd "$BUILD" && run_stage ctest 240 "$(( (RUN_BENCH ? 150 + RUN_REF_COMPILED * 150 : 0) + SCALE_RESERVE ))" \
        ctest --output-on-failure -j "${CTEST_JOBS:-8}" --timeout "${TEST_TIMEOUT:-200}"; cd "$ROOT" || exit 1; } > "$OUTDIR/ctest.log" 2>&1
    record ctest "${STATUS[ctest]:-FAILED (no result)}"  # run_stage printed into ctest.log
    grep -E 'tests passed|tests failed|^[[:space:]]+[0-9]+ - |Total Test time' "$OUTDIR/ctest.log" | tail -40
  else
    record ctest "skipped (no build)"
  fi
fi

# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
if [[ "$SCALE" != none ]]; then
  if ((BUILD_OK)); then
    run_stage scale 150 "$((RUN_BENCH ? 150 : 0))" "$PY" scripts/scale_bench.py --shape "$SCALE" --binary "$BUILD/lora_trainer" \
      --work "${TMPDIR:-/tmp}/lt-gpu-check-scale" --out "$OUTDIR/scale.json" --skip import,copies,export -- "runtime/device=$DEVICE"
  else
    record scale "skipped (no build)"
  fi
fi
if [[ "$QLORA" != none ]]; then
  if ((BUILD_OK)); then
    run_stage qlora 240 "$((RUN_BENCH ? 150 : 0))" "$PY" scripts/qlora_bench.py --shape "$QLORA" --binary "$BUILD/lora_trainer" \
      --work "${TMPDIR:-/tmp}/lt-gpu-check-scale" --out "$OUTDIR/qlora.json" -- "runtime/device=$DEVICE"
  else
    record qlora "skipped (no build)"
  fi
fi

AB_RESERVE=60; [[ "$AB" == none ]] && AB_RESERVE=0
if ((RUN_BENCH)); then
  if ((BUILD_OK)); then
    run_stage bench 150 "$(( (RUN_REF ? 60 + RUN_REF_COMPILED * 150 : 0) + (RUN_HF ? 75 : 0) + AB_RESERVE ))" \
      "$BUILD/lora_trainer" bench "$CONFIG" --out "$OUTDIR/bench.json" --weights-out "$WEIGHTS" \
      --steps "$STEPS" --warmup "$WARMUP" "runtime/device=$DEVICE"
  else
    record bench "skipped (no build)"
  fi
  if ((RUN_REF)); then
    if [[ -f "$OUTDIR/bench.json" && -f "$WEIGHTS" ]]; then
      run_stage reference 120 "$(( RUN_REF_COMPILED * 150 + (RUN_HF ? 75 : 0) + AB_RESERVE ))" \
        "$PY" scripts/reference_gpt.py "$OUTDIR/bench.json" --device "$DEVICE" --out "$OUTDIR/reference.json" \
        --steps "$STEPS" --warmup "$WARMUP" ${REFERENCE_ARGS:-}
      if ((RUN_REF_COMPILED)); then
        run_stage reference_compiled 240 "$(( (RUN_HF ? 75 : 0) + AB_RESERVE ))" \
          "$PY" scripts/reference_gpt.py "$OUTDIR/bench.json" --device "$DEVICE" --out "$OUTDIR/reference_compiled.json" \
          --steps "$STEPS" --warmup "$WARMUP" --compile --adamw fused ${REFERENCE_ARGS:-}
      fi
    else
      record reference "skipped (no bench.json and weights from lora_trainer bench)"
    fi
  fi
  rm -f "$WEIGHTS"
  if ((RUN_HF)); then
    src="$CONFIG"; [[ -f "$OUTDIR/bench.json" ]] && src="$OUTDIR/bench.json"
    run_stage hf_peft 180 "$((5 + AB_RESERVE))" \
      "$PY" scripts/hf_peft_bench.py "$src" --device "$DEVICE" --out "$OUTDIR/hf_peft.json" --steps "$STEPS" --warmup "$WARMUP"
  fi
  if [[ "$AB" != none ]]; then
    if ((BUILD_OK)); then
      run_stage bench_ab 150 5 \
        "$BUILD/lora_trainer" bench "$CONFIG" --out "$OUTDIR/bench_ab.json" --steps "$STEPS" --warmup "$WARMUP" \
        "runtime/device=$DEVICE" "$AB"
    else
      record bench_ab "skipped (no build)"
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------
say "summary"
{
  echo "gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - START)) s)"
  for s in "${STAGES[@]}"; do printf '  %-10s %s\n' "$s" "${STATUS[$s]}"; done
  echo
  if ((BUILD_OK)); then
    # Our library's OpenMP and LibTorch's should be one runtime (docs/performance.md, "One NVIDIA H200": "Not measured yet").
    omps="$(ldd "$BUILD/lora_trainer" 2>/dev/null | awk '/gomp|iomp|libomp/ {print $1}' | sort -u | tr '\n' ' ')"
    echo "OpenMP runtimes lora_trainer loads: ${omps:-none}"
    (($(wc -w <<<"$omps") > 1)) && echo "  WARNING: more than one OpenMP runtime: our CPU kernels and LibTorch's may not share threads"
    echo
  fi
  if ((RUN_BENCH)); then
    "$PY" - "$OUTDIR" "$AB" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return None
ours, ref, hf = load("bench.json"), load("reference.json"), load("hf_peft.json")
refc = load("reference_compiled.json")
ab, ab_setting = load("bench_ab.json"), sys.argv[2]
peak = None
for src, key in ((hf, "gpu_bf16_matmul_peak_tflops"), (ref, "gpu_bf16_matmul_peak_tflops")):
    if src and src.get(key):
        peak = src[key] * 1e12
        break
if peak is None and ours and str(ours.get("device", "")).startswith("cuda") and ours.get("matmul_peak_gflops"):
    peak = ours["matmul_peak_gflops"] * 1e9  # lora_trainer's own, measured on the GPU
def phases(d):
    return {p["phase"]: p for p in (d or {}).get("phases", []) if isinstance(p, dict)}
o, r, h = phases(ours), phases(ref), phases(hf)
def fpt(ph):
    if ph in o and o[ph].get("flops_per_token"):
        return o[ph]["flops_per_token"]
    m = (ours or {}).get("model") or (hf or {}).get("model")
    if not m:
        return None
    L, C, T, V = m["n_layers"], m["d_model"], m["block_size"], m["vocab_size"]
    n = V * C + 12 * L * C * C
    attn = 12 * L * C * T
    r_ = (hf or {}).get("lora_rank", 16)
    return 6 * n + attn if ph == "full" else 4 * n + 6 * L * r_ * 16 * C + attn
def cell(d, ph, k="tokens_per_s"):
    v = d.get(ph, {}).get(k)
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "n/a"
def mfu(d, ph):
    v, f = d.get(ph, {}).get("tokens_per_s"), fpt(ph)
    return f"{100 * v * f / peak:.1f}%" if isinstance(v, (int, float)) and f and peak else "n/a"
def ratio(a, b, ph):
    x, y = a.get(ph, {}).get("tokens_per_s"), b.get(ph, {}).get("tokens_per_s")
    return f"{x / y:.2f}x" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else "n/a"
def med(d, ph):
    v = d.get(ph, {}).get("step_s_median")
    return f"{1000 * v:.1f}" if isinstance(v, (int, float)) else "n/a"
tps = (ours or {}).get("tokens_per_step") or (hf or {}).get("tokens_per_step")
if ours:
    m = ours.get("model", {})
    print(f"model: {m.get('n_layers')} layers, d_model {m.get('d_model')}, {m.get('n_heads')} heads, block {m.get('block_size')}, "
          f"vocab {m.get('vocab_size')}; {tps} tokens a step; lora_trainer: {ours.get('precision')}")
if ref:
    print(f"reference check loss: {ref.get('first_batch_loss')} vs lora_trainer {ref.get('lora_trainer_first_batch_loss')}; "
          f"attention {ref.get('attention')}, AdamW {ref.get('adamw')}")
if hf:
    print(f"HF+PEFT: transformers {hf.get('transformers')}, peft {hf.get('peft')}, attention {hf.get('attn_implementation')}, "
          f"LoRA modules {hf.get('lora_modules')}" + (f"; errors: {hf.get('errors')}" if hf.get("errors") else ""))
print(f"MFU against the measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s" if peak else "MFU: no GPU peak measured")
print()
hdr = f"{'phase':6s} {'lora_trainer':>13s} {'reference':>10s} {'HF+PEFT':>10s} {'ours/ref':>9s} {'ours/HF':>8s} " \
      f"{'ms/step ours/ref/HF':>22s} {'MFU ours':>9s} {'MFU ref':>8s} {'MFU HF':>7s}"
print("tokens/s (median step)")
print(hdr)
for ph in ("full", "lora"):
    print(f"{ph:6s} {cell(o, ph):>13s} {cell(r, ph):>10s} {cell(h, ph):>10s} {ratio(o, r, ph):>9s} {ratio(o, h, ph):>8s} "
          f"{med(o, ph) + '/' + med(r, ph) + '/' + med(h, ph):>22s} {mfu(o, ph):>9s} {mfu(r, ph):>8s} {mfu(h, ph):>7s}")
if refc:
    rc = phases(refc)
    print(f"\nreference under {refc.get('compiled')} with AdamW {refc.get('adamw')} (reference_compiled.json):")
    for ph in ("full", "lora"):
        print(f"{ph:6s} {cell(rc, ph):>13s} tok/s, {med(rc, ph)} ms a step, MFU {mfu(rc, ph)}; lora_trainer / it: {ratio(o, rc, ph)}")
if o.get("full") and o.get("lora"):
    print(f"\nlora_trainer LoRA step / full step: {ours.get('lora_step_time_ratio', 0):.2f}")
if ab:
    a = phases(ab)
    print(f"\nlora_trainer with {ab_setting} (bench_ab.json), against the run above:")
    for ph in ("full", "lora"):
        print(f"{ph:6s} {cell(a, ph):>13s} tok/s ({ratio(a, o, ph)} the run above), {med(a, ph)} ms a step, MFU {mfu(a, ph)}, "
              f"GPU peak {(a.get(ph, {}).get('gpu_peak_mb') or 0) / 1024:.1f} GB (above: {(o.get(ph, {}).get('gpu_peak_mb') or 0) / 1024:.1f} GB)")
if ours and ours.get("matmul_peak_gflops"):
    own = ", ".join(f"{p['phase']} {100 * p['mfu']:.1f}%" for p in ours.get("phases", []) if isinstance(p.get("mfu"), (int, float)))
    print(f"(lora_trainer's own figures: matmul peak {ours['matmul_peak_gflops'] / 1000:.3g} TFLOP/s measured on "
          f"{ours.get('device', 'its device')}, MFU {own}; the MFU columns above divide by the peak measured in Python)")
PY
  fi
  if [[ -f "$OUTDIR/scale.json" ]]; then
    echo
    "$PY" - "$OUTDIR/scale.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
base, L, R = r["base_bf16_bytes"], r.get("lora", {}), r.get("resume", {})
gb = lambda b: f"{b / 1e9:.2f} GB ({b / base:.2f}x)" if b else "n/a"
print(f"scale ({r['shape']}, base {base / 1e9:.2f} GB bf16): LoRA job peak GPU memory {gb(L.get('gpu_peak_bytes'))}, "
      f"host peak RSS {gb(L.get('peak_rss'))}, load {L.get('load_s')} s, steps {L.get('step_s')} s, "
      f"LoRA checkpoint {L.get('checkpoint_bytes', 0) / 1e6:.1f} MB; resume {R.get('seconds', 0):.1f} s, host peak RSS {gb(R.get('peak_rss'))}")
PY
  fi
} > "$OUTDIR/summary.txt" 2>&1
cat "$OUTDIR/summary.txt"
echo "gpu_check: files in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
sleep 1  # let the tee into run.log finish
exit "$FAILED"
