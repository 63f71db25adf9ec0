#!/usr/bin/env bash
# Sets up whatever is missing (scripts/setup.sh), then runs the whole test suite with ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT/build"
ctest --output-on-failure -j "$(nproc)" "$@"
