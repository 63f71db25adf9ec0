#!/usr/bin/env node
// The reference GPT-2 encoder (gpt-3-encoder's Encoder.js, fetched by datasets/fetch_tokenizer.sh),
// wrapped so that the C++ tests and the golden file can ask it for ids.
//
// Usage:
//   node tokenizer_reference.js [FILE]          each line of FILE (or stdin) is one JSON string;
//                                               prints one JSON array of ids per line
//   node tokenizer_reference.js --pairs [FILE]  the same, printing {"text": ..., "ids": [...]} lines
//                                               (how tests/data/tokenizer_golden.jsonl is made)
//   node tokenizer_reference.js --raw FILE      the whole FILE is one text, decoded the way Node
//                                               decodes UTF-8 (invalid bytes -> U+FFFD); prints one
//                                               JSON array of ids
// The tokenizer directory is $LORA_TRAINER_TOKENIZER_DIR, else datasets/tokenizer/gpt2 in the repo.
'use strict';
const fs = require('fs');
const path = require('path');

const dir = process.env.LORA_TRAINER_TOKENIZER_DIR ||
            path.join(__dirname, '..', '..', 'datasets', 'tokenizer', 'gpt2');
const encoderPath = path.resolve(dir, 'Encoder.js');
if (!fs.existsSync(encoderPath)) {
  process.stderr.write(`tokenizer_reference.js: ${encoderPath} not found; ` +
                       'run `bash datasets/fetch_tokenizer.sh` to fetch it\n');
  process.exit(2);
}
// Encoder.js does `module.exports = {encode, decode}`.
const { encode } = require(encoderPath);

// Encoder.js appends each word's ids with Array.concat, which is quadratic in the text length, so a
// long text is encoded in pieces. A cut just before a "\n" whose preceding character is not
// whitespace cannot change the result: no alternative of the GPT-2 pattern matches a non-whitespace
// character followed by whitespace, and only the whitespace alternatives look ahead.
const PIECE = 8192;
const WS = /\s/u;
function encodeLong(text) {
  if (text.length <= 2 * PIECE) return encode(text);
  const ids = [];
  let start = 0;
  while (start < text.length) {
    let cut = text.length;
    if (text.length - start > 2 * PIECE) {
      cut = text.indexOf('\n', start + PIECE);
      while (cut !== -1 && WS.test(text[cut - 1])) cut = text.indexOf('\n', cut + 1);
      if (cut === -1) cut = text.length;
    }
    for (const id of encode(text.slice(start, cut))) ids.push(id);
    start = cut;
  }
  return ids;
}

const args = process.argv.slice(2);
const pairs = args[0] === '--pairs';
const raw = args[0] === '--raw';
if (pairs || raw) args.shift();
if (raw && args.length !== 1) {
  process.stderr.write('usage: tokenizer_reference.js --raw FILE\n');
  process.exit(2);
}

const out = [];
if (raw) {
  out.push(JSON.stringify(encodeLong(fs.readFileSync(args[0], 'utf8'))));
} else {
  const input = fs.readFileSync(args.length ? args[0] : 0, 'utf8');
  for (const line of input.split('\n')) {
    if (line.trim() === '') continue;
    const text = JSON.parse(line);
    const ids = encodeLong(text);
    out.push(pairs ? JSON.stringify({ text, ids }) : JSON.stringify(ids));
  }
}
process.stdout.write(out.join('\n') + (out.length ? '\n' : ''));
