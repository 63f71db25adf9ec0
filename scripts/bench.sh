#!/usr/bin/env bash
# The speed benchmark side by side: lora_trainer's own steps (`lora_trainer bench`) and the plain
# PyTorch reference (scripts/reference_gpt.py) on the same model, batch, threads and precision,
# starting from the same weights; prints both and their ratio, and writes bench.json,
# reference.json and bench-summary.json in OUT_DIR (default: the current directory).
# The reference is the best plain script we know for the CPU: PEFT's unmerged adapters, the frozen base
# in f32 where the run is f32, and glibc's allocator tuned as lora_trainer's runtime tunes it (so the
# ratio measures the code, not the allocator). REFERENCE_ARGS adds options of reference_gpt.py (e.g.
# "--lora merged" for the reference framework's way, "--adamw foreach").
# Usage: scripts/bench.sh [CONFIG] [OUT_DIR] [key=value ...]   (CONFIG default: configs/demo.json)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${1:-$ROOT/configs/demo.json}"; shift || true
OUT="${1:-.}"; shift || true
mkdir -p "$OUT"
bash "$ROOT/scripts/setup.sh" lora_trainer >/dev/null
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "bench: installing Debian's python3-torch (the reference runs on it)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-torch >/dev/null
fi
"$ROOT/build/lora_trainer" bench "$CONFIG" --out "$OUT/bench.json" --weights-out "$OUT/bench-weights.pt" "$@"
# shellcheck disable=SC2086
MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 OMP_NUM_THREADS="$(nproc)" \
  /usr/bin/python3 "$ROOT/scripts/reference_gpt.py" "$OUT/bench.json" --out "$OUT/reference.json" ${REFERENCE_ARGS:-}
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
ours = json.load(open(f"{out}/bench.json"))["phases"]
ref = json.load(open(f"{out}/reference.json"))["phases"]
summary = []
print(f"\n{'phase':6s} {'lora_trainer tok/s':>19s} {'reference tok/s':>16s} {'ratio':>7s}")
for a, b in zip(ours, ref):
    ratio = a["tokens_per_s"] / b["tokens_per_s"]
    summary.append({"phase": a["phase"], "lora_trainer_tokens_per_s": a["tokens_per_s"],
                    "reference_tokens_per_s": b["tokens_per_s"], "ratio": ratio})
    print(f"{a['phase']:6s} {a['tokens_per_s']:19.0f} {b['tokens_per_s']:16.0f} {ratio:6.2f}x")
json.dump(summary, open(f"{out}/bench-summary.json", "w"), indent=2)
PY
rm -f "$OUT/bench-weights.pt"
