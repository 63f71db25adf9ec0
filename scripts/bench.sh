#!/usr/bin/env bash
# The speed benchmark side by side: lora_trainer's own steps (`lora_trainer bench`) and the plain
# PyTorch reference (scripts/reference_gpt.py) on the same model, batch, threads and precision,
# starting from the same weights; prints both and their ratio, and writes bench.json,
# reference.json and bench-summary.json in OUT_DIR (default: the current directory).
# The reference is the best plain script we know for the CPU: PEFT's unmerged adapters, the frozen base
# in f32 where the run is f32, and glibc's allocator tuned as lora_trainer's runtime tunes it (so the
# ratio measures the code, not the allocator). REFERENCE_ARGS adds options of reference_gpt.py (e.g.
# "--lora merged" for the reference framework's way, "--adamw foreach").
# The reference also times each phase's matrix products alone (--products): "ceiling" is its step time over
# that, the most any program on this BLAS could gain on it (a ratio near the ceiling has little left to take).
# PAIRS=N (default 1) runs N alternating pairs (ours, reference, ours, ...) and reports each side's
# median tokens/s and the median of the pairs' ratios: on a shared machine one pair can be 20% off.
# It also reports each side's fastest step over all its runs and their ratio: on a machine whose speed
# swings for minutes at a time (a shared host), the fastest step is the least disturbed estimate of
# each program's own speed (as timeit advises); each side times the same number of steps (--steps and
# --warmup given here go to the reference too).
# CONFIG may be of either family: configs/bench_block256.json (GPT-2), configs/bench_llama.json (Llama 3.2 1B's
# width, 2 layers), configs/bench_qwen2.json (Qwen2.5 0.5B's, 4 layers); key=value settings go to both
# sides (optimization/lora/quantize_base=nf4: QLoRA's LoRA phase, the reference's NF4 in plain PyTorch).
# Usage: [PAIRS=N] scripts/bench.sh [CONFIG] [OUT_DIR] [key=value ...]   (CONFIG default: configs/demo.json)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${1:-$ROOT/configs/demo.json}"; shift || true
OUT="${1:-.}"; shift || true
PAIRS="${PAIRS:-1}"
mkdir -p "$OUT"
bash "$ROOT/scripts/setup.sh" lora_trainer >/dev/null
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "bench: installing Debian's python3-torch (the reference runs on it)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-torch >/dev/null
fi
# The same number of warm-up and timed steps on both sides (the fastest of more steps would favour one).
STEP_ARGS=()
args=("$@")
for ((j = 0; j < ${#args[@]}; j++)); do
  case "${args[j]}" in
    --steps | --warmup) [ $((j + 1)) -lt ${#args[@]} ] && STEP_ARGS+=("${args[j]}" "${args[j + 1]}") ;;
    --steps=* | --warmup=*) STEP_ARGS+=("${args[j]}") ;;
  esac
done
for ((i = 1; i <= PAIRS; i++)); do
  suffix=$([ "$PAIRS" -gt 1 ] && echo "-$i" || true)
  "$ROOT/build/lora_trainer" bench "$CONFIG" --out "$OUT/bench$suffix.json" --weights-out "$OUT/bench-weights.pt" "$@"
  # shellcheck disable=SC2086
  MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 OMP_NUM_THREADS="$(nproc)" \
    /usr/bin/python3 "$ROOT/scripts/reference_gpt.py" "$OUT/bench$suffix.json" --out "$OUT/reference$suffix.json" --products ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} ${REFERENCE_ARGS:-}
done
/usr/bin/python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
names = [""] if pairs == 1 else [f"-{i}" for i in range(1, pairs + 1)]
ours = [json.load(open(f"{out}/bench{n}.json"))["phases"] for n in names]
ref = [json.load(open(f"{out}/reference{n}.json"))["phases"] for n in names]
summary = []
print(f"\n{'phase':6s} {'lora_trainer tok/s':>19s} {'reference tok/s':>16s} {'ratio':>7s} {'ceiling':>8s}" + ("   (medians of %d pairs; each pair's ratio)" % pairs if pairs > 1 else ""))
for k, phase in enumerate(ours[0]):
    a = [o[k]["tokens_per_s"] for o in ours]
    b = [r[k]["tokens_per_s"] for r in ref]
    ratios = [x / y for x, y in zip(a, b)]
    # The most any program could gain on the reference with this BLAS: its step over the step's products alone.
    ceilings = [r[k]["step_s_median"] / r[k]["products_s"] for r in ref if "products_s" in r[k]]
    row = {"phase": phase["phase"], "lora_trainer_tokens_per_s": statistics.median(a),
           "reference_tokens_per_s": statistics.median(b), "ratio": statistics.median(ratios)}
    if ceilings:
        row["ceiling"] = statistics.median(ceilings)
    if pairs > 1:
        row.update({"pairs": pairs, "lora_trainer_runs": a, "reference_runs": b, "ratios": ratios})
    summary.append(row)
    print(f"{row['phase']:6s} {row['lora_trainer_tokens_per_s']:19.0f} {row['reference_tokens_per_s']:16.0f} {row['ratio']:6.2f}x"
          + (f" {row['ceiling']:7.2f}x" if "ceiling" in row else " " * 9)
          + ("   " + " ".join(f"{r:.2f}" for r in ratios) if pairs > 1 else ""))
# Each side's fastest step over all its runs: the least disturbed estimate where the machine's speed swings.
print(f"\n{'phase':6s} {'lora_trainer step':>18s} {'reference step':>15s} {'ratio':>7s}   (the fastest step of each side over %d run%s)"
      % (pairs, "s" if pairs > 1 else ""))
for k, row in enumerate(summary):
    a = min(o[k]["step_s_min"] for o in ours)
    b = min(r[k]["step_s_min"] for r in ref)
    row.update({"lora_trainer_fastest_step_s": a, "reference_fastest_step_s": b, "fastest_step_ratio": b / a})
    print(f"{row['phase']:6s} {a:17.3f}s {b:14.3f}s {b / a:6.2f}x")
json.dump(summary, open(f"{out}/bench-summary.json", "w"), indent=2)
PY
rm -f "$OUT/bench-weights.pt"
