#!/usr/bin/env bash
# The main job: sets up whatever is missing, prepares the real corpora (English prose; Python source),
# then runs configs/demo.json: phase 1 pretrains a small GPT on English (with 2% code), phase 2 trains LoRA adapters
# on code over the frozen bf16 base. Output goes under ./checkpoints/demo/ and ./runs/demo/.
# Re-running continues from the latest checkpoint, or says the job is finished.
# Extra arguments are key=value config overrides (e.g. runtime/threads=4).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh lora_trainer
bash datasets/prepare.sh
build/lora_trainer run demo configs/demo.json . "$@"
