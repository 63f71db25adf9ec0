#!/usr/bin/env python3
"""Golden files for lora_trainer's Hugging Face tokenizer.json support (`--tokenizer hf:DIR`), made with
the real `tokenizers` library (Debian sid's python3-tokenizers; see docs/huggingface.md, "Checking
with the real libraries").

  python3 scripts/hf_tokenizer_golden.py REPO_ROOT OUT_DIR

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
Strings that NFC would change are left out for qwen2 (lora_trainer does not normalize, see the docs).
"""
import json
import os
import shutil
import sys
import unicodedata

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

CORPUS_FILES = ["lora_trainer/tokenize.hpp", "docs/huggingface.md", "configs/demo.json"]


def training_files(root):
    files = sorted(os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    for f in ["tokenizer.cpp", "tokenize.cpp", "util.cpp", "main.cpp"]:
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


def write_golden(tok, out, eot_token, corpus, skip=lambda s: False):
    strings = []
    for s in STRINGS:
        if skip(s):
            continue
        ids = tok.encode(s, add_special_tokens=False).ids
        strings.append({"text": s, "ids": ids})
    files = []
    for rel in corpus or []:
        with open(os.path.join(os.path.dirname(out), rel), encoding="utf-8") as f:
            text = f.read()
        files.append({"path": rel, "ids": tok.encode(text, add_special_tokens=False).ids})
    golden = {"eot_token": eot_token, "eot_id": tok.token_to_id(eot_token),
              "vocab_size": tok.get_vocab_size(with_added_tokens=True), "strings": strings, "files": files}
    with open(os.path.join(out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=True, separators=(",", ":"))
        f.write("\n")


def save(tok, out):
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=False)


def main():
    root, out_root = sys.argv[1], sys.argv[2]
    os.makedirs(os.path.join(out_root, "corpus"), exist_ok=True)
    corpus = []
    for rel in CORPUS_FILES:
        name = os.path.basename(rel)
        shutil.copyfile(os.path.join(root, rel), os.path.join(out_root, "corpus", name))
        corpus.append("corpus/" + name)
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
    gpt2 = Tokenizer.from_file(path)  # the golden ids come from the file as saved
    write_golden(gpt2, out, "<|endoftext|>", corpus)

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
    write_golden(Tokenizer.from_file(os.path.join(out, "tokenizer.json")), out, "<|eot_id|>", corpus)

    # (c) Qwen2 style.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    qwen = train(files, pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 650, normalizer=normalizers.NFC())
    out = os.path.join(out_root, "qwen2")
    save(qwen, out)
    write_golden(Tokenizer.from_file(os.path.join(out, "tokenizer.json")), out, "<|endoftext|>", corpus,
                 skip=lambda s: unicodedata.normalize("NFC", s) != s)

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
    order = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert order.encode("abab").ids == [vocab["aba"], vocab["b"]], order.encode("abab").ids
    write_golden(order, out, "<|endoftext|>", None)

    # Types lora_trainer refuses.
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    save(wp, os.path.join(out_root, "unsupported", "wordpiece"))
    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("\u2581a", -1.0), ("b", -2.0)], 0))
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    save(uni, os.path.join(out_root, "unsupported", "unigram"))


if __name__ == "__main__":
    main()
