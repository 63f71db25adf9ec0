#!/usr/bin/env bash
# Checks lora_trainer's GPT-2 tokenizer against the reference encoder (gpt-3-encoder's Encoder.js,
# through tests/tools/tokenizer_reference.js) on every document of the real corpora: each file that
# prepare.sh tokenizes, the english *.txt sources (State of the Union, Moby-Dick, Austen) and the
# Python standard library's *.py files. With arguments, checks those files (directories: every file
# under them) instead.
#
# Usage: bash datasets/check_tokenizer.sh [FILE|DIR...]
#   env: LAUNCHER (default build/lora_trainer), LORA_TRAINER_TOKENIZER_DIR (default
#        datasets/tokenizer/gpt2), JOBS (parallel node processes, default 2)
#
# How: `lora_trainer tokenize` runs once over all the documents with --val-fraction 1e-9, so the
# dataset holds every document in sorted path order, each followed by the end-of-text id 50256 (the
# last document goes to val.bin, the rest to train.bin); train.bin + val.bin is split at those ids
# back into one id list per document (their count must equal the number of documents). Each list is
# compared with the reference's ids for the same file (`--raw FILE`, which reads it as Node does),
# JOBS files at a time. Stops at the first mismatch and prints the file, the first differing
# position and the ids around it.
# Prints "N documents, M tokens: all equal" and exits 0 when every document matches; exits 1 on a
# mismatch, 2 when something needed is missing. Needs node; run prepare.sh first for the corpora.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
LAUNCHER="${LAUNCHER:-$ROOT/build/lora_trainer}"
TOK_DIR="${LORA_TRAINER_TOKENIZER_DIR:-$HERE/tokenizer/gpt2}"
REF="$ROOT/tests/tools/tokenizer_reference.js"
JOBS="${JOBS:-2}"
EOT=50256

die() { echo "check_tokenizer.sh: error: $*" >&2; exit 2; }
[[ -x "$LAUNCHER" ]] || die "$LAUNCHER not found: run scripts/setup.sh first"
[[ -f "$TOK_DIR/encoder.json" && -f "$TOK_DIR/Encoder.js" ]] ||
  die "GPT-2 tokenizer files not found in $TOK_DIR: run bash datasets/fetch_tokenizer.sh"
command -v node >/dev/null || die "node not found (apt-get install nodejs)"
[[ -f "$REF" ]] || die "$REF not found"

W="$(mktemp -d "${TMPDIR:-/tmp}/check_tokenizer.XXXXXX")"
trap 'rm -rf "$W"' EXIT

# The documents, as lora_trainer takes them: regular files (or links to them), canonical paths,
# sorted bytewise and without duplicates.
{
  if (($#)); then
    for a in "$@"; do
      [[ -e "$a" ]] || die "$a: no such file or directory"
      find "$a" -xtype f -print0
    done
  else
    EN="$HERE/cache/text/english"
    PY=/usr/lib/python3.11
    [[ -d "$EN/austen" ]] || die "$EN/austen not found: run bash datasets/prepare.sh first"
    [[ -d "$PY" ]] || die "$PY not found (apt-get install libpython3.11-stdlib)"
    find "$EN" -xtype f -name '*.txt' -print0
    find "$PY" -xtype f -name '*.py' -print0
  fi
} | xargs -0 -r realpath -z -- | LC_ALL=C sort -zu > "$W/files"
mapfile -d '' FILES < "$W/files"
N=${#FILES[@]}
((N > 0)) || die "no documents to check"
total_bytes=$(xargs -0 stat -c %s -- < "$W/files" | awk '{s += $1} END {print s + 0}')
echo "check: $N documents, $total_bytes bytes; tokenizing with $LAUNCHER"

# lora_trainer, all documents in one run. A single document is split by tokens rather than by
# documents; with 1e-9 only its end-of-text id goes to val.bin, so the concatenation is the same.
start=$SECONDS
"$LAUNCHER" tokenize --tokenizer gpt2 --tokenizer-dir "$TOK_DIR" --name ids --data-dir "$W" \
  --val-fraction 1e-9 "${FILES[@]}" > "$W/tokenize.log" 2>&1 ||
  { cat "$W/tokenize.log" >&2; die "$LAUNCHER tokenize failed"; }
docs=$(sed -n 's/.*"documents": *\([0-9]*\).*/\1/p' "$W/ids/meta.json")
[[ "$docs" == "$N" ]] || die "lora_trainer tokenized $docs documents, expected $N"

# Split into $W/c/<index>, one id per line (an empty file for an empty document).
mkdir -p "$W/c"
pieces=$(od -An -v -tu4 -w4 "$W/ids/train.bin" "$W/ids/val.bin" |
  awk -v d="$W/c" -v eot=$EOT '
    BEGIN { i = 0; f = d "/0"; printf "" > f }
    $1 == eot { close(f); i++; f = d "/" i; printf "" > f; next }
    { print $1 > f }
    END { close(f); print i }')
rm -f "$W/c/$pieces" "$W/ids/train.bin" "$W/ids/val.bin"
[[ "$pieces" == "$N" ]] ||
  { echo "check: FAILED: lora_trainer's output holds $pieces end-of-text ids for $N documents" \
         "(it emitted id $EOT inside a document)"; exit 1; }
echo "check: lora_trainer done in $((SECONDS - start)) s; comparing with $REF ($JOBS at a time)"

# One document: reference ids -> $W/n<index>; prints "ok INDEX TOKENS" or "bad INDEX POSITION".
check_one() {
  local i=$1 f=$2 pos
  if ! LORA_TRAINER_TOKENIZER_DIR="$TOK_DIR" node "$REF" --raw "$f" > "$W/n$i.json" 2> "$W/n$i.err"; then
    echo "error $i"
    exit 255  # stops xargs
  fi
  awk 'BEGIN { RS = "[][,\n]+" } NF' "$W/n$i.json" > "$W/n$i"
  if cmp -s "$W/n$i" "$W/c/$i"; then
    echo "ok $i $(wc -l < "$W/c/$i")"
    rm -f "$W/n$i" "$W/n$i.json" "$W/n$i.err" "$W/c/$i"
  else
    # The first differing line is the 1-based token position (paste pads the shorter list with "").
    echo "bad $i $(paste -d, "$W/n$i" "$W/c/$i" | awk -F, '$1 != $2 { print NR; exit }')"
    exit 255
  fi
}
export -f check_one
export W REF TOK_DIR

start=$SECONDS
done_docs=0 done_bytes=0 tokens=0 failed=""
declare -a SIZE
mapfile -t SIZE < <(xargs -0 stat -c %s -- < "$W/files")
step=$(( N / 20 > 0 ? N / 20 : 1 ))
while read -r status i rest; do
  case $status in
    ok)
      done_docs=$((done_docs + 1)); done_bytes=$((done_bytes + SIZE[i])); tokens=$((tokens + rest))
      if ((done_docs % step == 0 || done_docs == N)); then
        echo "check: $done_docs/$N documents, $done_bytes/$total_bytes bytes, $((SECONDS - start)) s"
      fi ;;
    bad | error) failed="$status $i $rest" ;;
  esac
done < <(for i in "${!FILES[@]}"; do printf '%s\0%s\0' "$i" "${FILES[i]}"; done |
         xargs -0 -n 2 -P "$JOBS" bash -c 'check_one "$@"' _ 2> "$W/xargs.err" || true)

if [[ -n "$failed" ]]; then
  read -r status i pos <<<"$failed"
  f=${FILES[i]}
  if [[ $status == error ]]; then
    echo "check: FAILED: the reference encoder failed on $f:"
    cat "$W/n$i.err"
    exit 1
  fi
  from=$((pos > 3 ? pos - 3 : 1)) to=$((pos + 3))
  echo "check: FAILED: $f (document $((i + 1)) of $N): ids differ first at token $((pos - 1)) (0-based)"
  echo "  reference ids $((from - 1))..$((to - 1)): $(sed -n "${from},${to}p" "$W/n$i" | tr '\n' ' ')"
  echo "  lora_trainer  $((from - 1))..$((to - 1)): $(sed -n "${from},${to}p" "$W/c/$i" | tr '\n' ' ')"
  echo "  (reference $(wc -l < "$W/n$i") tokens, lora_trainer $(wc -l < "$W/c/$i"))"
  exit 1
fi
((done_docs == N)) || { cat "$W/xargs.err"; echo "check: FAILED: only $done_docs of $N documents were compared"; exit 1; }
echo "$N documents, $tokens tokens: all equal ($total_bytes bytes, $((SECONDS - start)) s comparing)"
