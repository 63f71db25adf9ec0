#!/usr/bin/env bash
# Phase 1 of a lora/train config once, then phase 2 again for each variant, branched from the same
# pre_lora_checkpoint (`run ... --restore`): how the LoRA settings change what phase 2 learns, at the
# cost of one phase 1. Prints one line per variant: its overrides and the validation perplexity of
# every dataset after LoRA (from the report), and writes them to OUT/sweep.txt.
#
# Usage: scripts/lora_sweep.sh CONFIG OUT 'override ...' ['override ...' ...]
#   e.g. scripts/lora_sweep.sh configs/demo.json /tmp/sweep '' 'optimization/lora/lr=0.005'
#   Extra overrides for every run (e.g. runtime/device=cuda) go in the environment: COMMON='...'.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="${LORA_TRAINER:-$ROOT/build/lora_trainer}"
CONFIG="$1"
OUT="$2"
shift 2
read -r -a common <<< "${COMMON:-}"
mkdir -p "$OUT"
"$B" run base "$CONFIG" "$OUT" "${common[@]}" > "$OUT/base.log"
project=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["job"].get("project","general"))' "$CONFIG")
group=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["job"].get("group","default"))' "$CONFIG")
pre="$OUT/checkpoints/$project/$group/base/pre_lora_checkpoint"
: > "$OUT/sweep.txt"
i=0
for variant in "$@"; do
  i=$((i + 1))
  read -r -a extra <<< "$variant"
  start=$(date +%s)
  "$B" run "v$i" "$CONFIG" "$OUT" --restore "$pre" "${common[@]}" "${extra[@]}" > "$OUT/v$i.log" 2>&1
  line=$(grep -A1 -E '^\s+after LoRA' "$OUT/v$i.log" | head -1 | sed 's/^ *//')
  header=$(grep -E '^validation perplexity' "$OUT/v$i.log" | head -1)
  echo "v$i [${variant:-defaults}] ($(( $(date +%s) - start )) s): $header | $line" | tee -a "$OUT/sweep.txt"
done
grep -E '^unigram baseline' "$OUT/base.log" | tee -a "$OUT/sweep.txt"
