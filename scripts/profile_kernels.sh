#!/usr/bin/env bash
# On a GPU machine, after scripts/gpu_check.sh has built build-gpu/: where one training step's GPU
# time goes, kernel by kernel, in each phase. Runs the benchmark once unprofiled (the step time), then
# once per phase under Nsight Compute (`ncu`) with `lora_trainer bench --cuda-profile PHASE --steps 1`,
# which records exactly one timed step's kernels, and sums them with scripts/ncu_summary.py.
#
# Usage: scripts/profile_kernels.sh [OUT_DIR] [--config FILE] [--phases "full lora"] [key=value ...]
#   OUT_DIR    default: $OUT, else ./profile-out. Writes bench.json, ncu-PHASE.csv and kernels-PHASE.txt.
#   key=value  config overrides for every run (e.g. runtime/loss=libtorch to see the other loss).
# Environment: BUILD_DIR (default build-gpu), NCU (default: ncu on PATH, else under /usr/local/cuda or
# /opt/nvidia/nsight-compute).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="" CONFIG="configs/bench_gpt2_124m.json" PHASES="full lora"
OVERRIDES=()
while (($#)); do
  case "$1" in
    --config) CONFIG="$2"; shift ;;
    --phases) PHASES="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "profile_kernels: unknown option $1 (see --help)" >&2; exit 2 ;;
    *=*) OVERRIDES+=("$1") ;;
    *) if [[ -z "$OUTDIR" ]]; then OUTDIR="$1"; else echo "profile_kernels: one OUT_DIR only" >&2; exit 2; fi ;;
  esac
  shift
done
OUTDIR="${OUTDIR:-${OUT:-$PWD/profile-out}}"
mkdir -p "$OUTDIR" || exit 1
cd "$ROOT" || exit 1
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
BIN="$BUILD/lora_trainer"
if [[ ! -x "$BIN" ]]; then
  echo "profile_kernels: no $BIN: build first (scripts/gpu_check.sh --only-build)" >&2
  exit 2
fi
# shellcheck disable=SC1091
[[ -f .gpu/env.sh ]] && source .gpu/env.sh  # the library path of gpu_check's build
PY="${PYTHON:-python3}"
NCU="${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
if [[ -z "$NCU" ]]; then
  echo "profile_kernels: Nsight Compute (ncu) not found; set NCU=/path/to/ncu" >&2
  exit 2
fi
echo "ncu: $NCU ($("$NCU" --version 2>&1 | tail -1))"

set -x
"$BIN" bench "$CONFIG" --steps 5 --warmup 2 --out "$OUTDIR/bench.json" runtime/device=cuda "${OVERRIDES[@]}" || exit 1
set +x
rc=0
for phase in $PHASES; do
  # One pass, one metric, clocks and caches left alone: the kernels run as they do unprofiled, one
  # at a time (so the sum is GPU time, not the overlapped wall time).
  "$NCU" --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --csv --target-processes all \
    "$BIN" bench "$CONFIG" --steps 1 --warmup 2 --cuda-profile "$phase" --out "$OUTDIR/bench-ncu-$phase.json" \
    runtime/device=cuda "${OVERRIDES[@]}" > "$OUTDIR/ncu-$phase.csv" 2> "$OUTDIR/ncu-$phase.log" || {
    echo "profile_kernels: ncu failed for the $phase phase; the end of its log:"; tail -20 "$OUTDIR/ncu-$phase.log"; rc=1; continue; }
  "$PY" scripts/ncu_summary.py "$OUTDIR/ncu-$phase.csv" --bench "$OUTDIR/bench.json" --phase "$phase" \
    --out "$OUTDIR/kernels-$phase.json" | tee "$OUTDIR/kernels-$phase.txt" || rc=1
done
rm -f "$OUTDIR"/bench-ncu-*.json
exit "$rc"
