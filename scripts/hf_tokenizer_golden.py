#!/usr/bin/env python3
"""Golden files for lora_trainer's Hugging Face tokenizer.json support (`--tokenizer hf:DIR`), made with
the real `tokenizers` library (Debian sid's python3-tokenizers; see docs/huggingface.md, "Checking
with the real libraries").

  python3 scripts/hf_tokenizer_golden.py REPO_ROOT OUT_DIR    train the tokenizers, then write the goldens
  python3 scripts/hf_tokenizer_golden.py --goldens OUT_DIR    only rewrite every golden.json from the
                                                              tokenizer.json files already in OUT_DIR

With no network, small byte-level BPE tokenizers are *trained* here on text from the repository
(docs/*.md and a few lora_trainer/*.cpp), in the three layouts lora_trainer supports:
  gpt2/    ByteLevel pre-tokenizer (GPT-2's regex), merges saved as "a b" strings (GPT-2's files do);
           special token <|endoftext|>.
  llama3/  Sequence[Split(Llama 3's pattern, isolated), ByteLevel(use_regex=False)], BPE with
           ignore_merges (as Llama 3's tokenizer.json), merges as [a, b] pairs; special tokens
           <|begin_of_text|>, <|end_of_text|>, <|eot_id|>; a TemplateProcessing post-processor that adds
           <|begin_of_text|>; tokenizer_config.json names eos_token <|eot_id|> (as Llama 3 Instruct).
  qwen2/   NFC normalizer, Split(Qwen2's pattern) + ByteLevel(use_regex=False); special tokens
           <|endoftext|>, <|im_start|>, <|im_end|>.
  order/    a hand-made GPT-2-style tokenizer whose merges are out of order ("ab a" before "a b"), so that
           merging one pair at a time (the library) and every occurrence at once give other ids; its
           golden.json has strings only.
  llama3 also gets a vocabulary token, "_zyxwv", that no merge makes: with ignore_merges a word that
  is a token is that token.
  unsupported/{wordpiece,unigram}/tokenizer.json: tiny tokenizers of types lora_trainer refuses.
Each supported directory gets golden.json: {"eot_token", "vocab_size" (get_vocab_size(with_added_tokens
=True)), "strings": [{"text", "ids"}], "files": [{"path", "ids"}]}, ids from
encode(text, add_special_tokens=False) (so no BOS); paths are relative to OUT_DIR, whose corpus/ gets
copies of a few repository files (the whole-file goldens; tests tokenize them with the CLI too).
qwen2's golden.json also has NORMALIZATION_STRINGS (text that Unicode normalization changes: decomposed
accents, Hangul jamo, ligatures, compatibility characters, combining marks next to special tokens),
"normalized" (the library's normalize_str) for each string the normalizer changes, and
"normalizer_variants": qwen2's tokenizer.json with its normalizer replaced (NFD, NFKC, NFKD, a Sequence)
or with added tokens of both kinds (normalized true: matched in the normalized text; false: in the
raw text), each {"name", "normalizer", "extra_added_tokens", "strings"}.

Training is deterministic for one library version and one set of input files, but the inputs (docs)
change with the repository: to add strings without changing the committed tokenizers, run --goldens
on a copy of tests/data/hf_tokenizers (the corpus/ copies there are what the file goldens read).
"""
import json
import os
import shutil
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

STRINGS = [
    "", "Hello world", "Hello, world! How are you?", "  leading spaces", "trailing spaces   ",
    "a    b", "   ", " ", "\t", "tabs\tand\nnewlines\r\nhere", "\n\n\n", "a\n\n b\n \n", "\t\t  \n  \t x",
    "I'm sure you've seen it; they'll say 'don't'. IT'S WE'LL HE'D", "can't won't shan't y'all 's 'S",
    "1 12 123 1234 12345 123456 1234567", "3.14159 -42 +7 1,000,000 2026-11-23 0x1F 1e-10",
    "\u0663\u0664\u0665 \u2167 \u00bd \u00b2", "na\u00efve caf\u00e9 r\u00e9sum\u00e9 \u00c5ngstr\u00f6m",
    "e\u0301 (decomposed)", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\U0001F44B\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F389\U0001F389 \u2764\ufe0f",
    "x \u00a0 y\u3000z\u2003w", "zero\u200bwidth \ufeffbom", "\U0001D518\U0001D52B\U0001D526 math",
    "def f(x):\n    return x**2  # square\n", "if (a && b) { c[i] += 0x1F; } // done\n",
    "std::vector<uint32_t> ids; ids.push_back(42);", "    \n\tindented\n        more\n",
    "before<|endoftext|>after", " <|endoftext|> ", "<|endoftext|><|endoftext|>", "<|endoftext|",
    "<|end_of_text|> and <|eot_id|>x<|begin_of_text|>", "<|im_start|>user\nhi<|im_end|>\n",
    "\u00ff\u0100\u0120 \u010a odd byte-map chars", "!!!??? ... --- ***", "'''\"\"\" '' \"",
    "lora_zyxwv and the_zyxwv _zyxwvu", "abab ababab abcab",
]

# qwen2 only (the other goldens stay as they were): what NFC, NFD, NFKC and NFKD change.
NORMALIZATION_STRINGS = [
    "cafe\u0301 re\u0301sume\u0301 nai\u0308ve e\u0301le\u0300ve",  # decomposed accents
    "\ufb01le \ufb02ow o\ufb03ce \ufb00",  # ligatures: NFC and NFD keep them, NFKC and NFKD do not
    "\u1112\u1161\u11ab\u1100\u116e\u11a8\u110b\u1165 \u1112\u1161\u11ab \ud55c",  # Hangul jamo, syllables
    "A\u030angstr\u00f6m \u212bngstro\u0308m \u00c5 a\u030a",  # A + ring, the Angstrom sign
    "\u03b1\u0301\u03bb\u03c6\u03b1 \u1f00\u0301 \u03b5\u0313\u0301 \u03ac\u03ad \u0390",  # Greek
    "x = e\u0301 + 1; // caf\u00e9 vs cafe\u0301\nprint('n\u0303')",  # among ASCII
    "\u2167 \u00bd x\u00b2 \u2460 \uff21\uff22\uff23 \u3000 \u00a0 \u3392 \u2026",  # compatibility
    "\u1e9b\u0323 o\u0308\u0304 o\u0304\u0308 q\u0307\u0323 q\u0323\u0307",  # canonical order
    "\u0958 \u2126 \u212a \u0344",  # singletons and composition exclusions
    "<|im_start|>e\u0301<|im_end|>\u0301a",  # a combining mark after a special token
    "\u0301 starts with a combining mark \u0308",
    "\U0001d400\U0001d401 \ufdfa \u00c5\u0301",
]

# qwen2's tokenizer.json with another normalizer, or with more added tokens.
NORMALIZER_VARIANTS = [
    ("nfd", {"type": "NFD"}, []),
    ("nfkc", {"type": "NFKC"}, []),
    ("nfkd", {"type": "NFKD"}, []),
    ("sequence", {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFKC"}]}, []),
    # normalized true: matched after NFC, with its content normalized too (U+212B -> U+00C5);
    # normalized false: matched in the text as given, before normalization.
    ("added_tokens", {"type": "NFC"}, [("\u212b", True, False), ("e\u0301", False, True)]),
]

CORPUS_FILES = ["lora_trainer/data/tokenize.hpp", "docs/huggingface.md", "configs/demo.json"]


def training_files(root):
    files = sorted(os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    for f in ["data/tokenizer.cpp", "data/tokenize.cpp", "core/util.cpp", "cli/main.cpp"]:
        files.append(os.path.join(root, "lora_trainer", f))
    return files


def train(files, pre, specials, vocab_size, normalizer=None, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def encode_strings(tok, strings):
    out = []
    for s in strings:
        entry = {"text": s, "ids": tok.encode(s, add_special_tokens=False).ids}
        if tok.normalizer is not None and tok.normalizer.normalize_str(s) != s:
            entry["normalized"] = tok.normalizer.normalize_str(s)
        out.append(entry)
    return out


def write_golden(tok, out, eot_token, corpus, extra_strings=(), variants=None):
    strings = encode_strings(tok, STRINGS + list(extra_strings))
    files = []
    for rel in corpus or []:
        with open(os.path.join(os.path.dirname(out), rel), encoding="utf-8") as f:
            text = f.read()
        files.append({"path": rel, "ids": tok.encode(text, add_special_tokens=False).ids})
    golden = {"eot_token": eot_token, "eot_id": tok.token_to_id(eot_token),
              "vocab_size": tok.get_vocab_size(with_added_tokens=True), "strings": strings, "files": files}
    if variants is not None:
        golden["normalizer_variants"] = variants
    with open(os.path.join(out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=True, separators=(",", ":"))
        f.write("\n")


def normalizer_variants(path):
    """The NORMALIZER_VARIANTS of the tokenizer.json at path, encoded by the library."""
    with open(path, encoding="utf-8") as f:
        base = json.load(f)
    variants = []
    for name, normalizer, extra in NORMALIZER_VARIANTS:
        j = json.loads(json.dumps(base))
        j["normalizer"] = normalizer
        extra_tokens = []
        next_id = max(list(j["model"]["vocab"].values()) + [t["id"] for t in j["added_tokens"]]) + 1
        for content, normalized, special in extra:
            extra_tokens.append({"id": next_id, "content": content, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": normalized, "special": special})
            next_id += 1
        j["added_tokens"] += extra_tokens
        tok = Tokenizer.from_str(json.dumps(j))
        variants.append({"name": name, "normalizer": normalizer, "extra_added_tokens": extra_tokens,
                         "strings": encode_strings(tok, STRINGS + NORMALIZATION_STRINGS)})
    return variants


def write_goldens(out_root):
    """Every golden.json, from the tokenizer.json files in out_root."""
    corpus = ["corpus/" + os.path.basename(rel) for rel in CORPUS_FILES]
    for style, eot in [("gpt2", "<|endoftext|>"), ("llama3", "<|eot_id|>")]:
        out = os.path.join(out_root, style)
        write_golden(Tokenizer.from_file(os.path.join(out, "tokenizer.json")), out, eot, corpus)
    out = os.path.join(out_root, "qwen2")
    path = os.path.join(out, "tokenizer.json")
    write_golden(Tokenizer.from_file(path), out, "<|endoftext|>", corpus, NORMALIZATION_STRINGS,
                 normalizer_variants(path))
    out = os.path.join(out_root, "order")
    order = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert order.encode("abab").ids == [order.token_to_id("aba"), order.token_to_id("b")], order.encode("abab").ids
    write_golden(order, out, "<|endoftext|>", None)


def save(tok, out):
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=False)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--goldens":
        write_goldens(sys.argv[2])
        return
    if len(sys.argv) != 3 or sys.argv[1].startswith("-"):
        sys.exit("usage: hf_tokenizer_golden.py REPO_ROOT OUT_DIR | --goldens OUT_DIR")
    root, out_root = sys.argv[1], sys.argv[2]
    os.makedirs(os.path.join(out_root, "corpus"), exist_ok=True)
    for rel in CORPUS_FILES:
        shutil.copyfile(os.path.join(root, rel), os.path.join(out_root, "corpus", os.path.basename(rel)))
    files = training_files(root)

    # (a) GPT-2 style; merges rewritten as "a b" strings, the older format GPT-2's own file uses.
    gpt2 = train(files, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ["<|endoftext|>"], 600)
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    out = os.path.join(out_root, "gpt2")
    save(gpt2, out)
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, separators=(",", ":"))

    # (b) Llama 3 style.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    llama = train(files, pre, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], 700, ignore_merges=True)
    assert llama.token_to_id("_zyxwv") is None
    llama.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", llama.token_to_id("<|begin_of_text|>"))])
    out = os.path.join(out_root, "llama3")
    save(llama, out)
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j["model"]["vocab"]["_zyxwv"] = len(j["model"]["vocab"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, f, indent=2)
        f.write("\n")

    # (c) Qwen2 style.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    qwen = train(files, pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 650, normalizer=normalizers.NFC())
    out = os.path.join(out_root, "qwen2")
    save(qwen, out)

    # Out-of-order merges: "abab" is [aba, b] merging one pair at a time, [ab, ab] merging all at once.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0}
    for c in alphabet + ["ab", "aba"]:
        vocab[c] = len(vocab)
    order = Tokenizer(models.BPE(vocab=vocab, merges=[("ab", "a"), ("a", "b")]))
    order.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    order.decoder = decoders.ByteLevel()
    order.add_special_tokens(["<|endoftext|>"])
    out = os.path.join(out_root, "order")
    save(order, out)

    # Types lora_trainer refuses.
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    save(wp, os.path.join(out_root, "unsupported", "wordpiece"))
    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("\u2581a", -1.0), ("b", -2.0)], 0))
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    save(uni, os.path.join(out_root, "unsupported", "unigram"))

    write_goldens(out_root)  # the golden ids come from the files as saved


if __name__ == "__main__":
    main()
