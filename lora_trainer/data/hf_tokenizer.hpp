// Hugging Face `tokenizers` files (tokenizer.json) for byte-level BPE models: `--tokenizer hf:DIR`.
//
// Supported, with the ids of the reference library's encode(text, add_special_tokens=False):
//  - model.type "BPE" with `vocab` and `merges` (as "a b" strings or [a, b] pairs), ignore_merges;
//  - pre_tokenizer ByteLevel (use_regex true: GPT-2's pattern; add_prefix_space false), or a Sequence
//    of Split (a Regex pattern, behavior Isolated, not inverted) steps followed by ByteLevel with
//    use_regex false (Llama 3, Qwen2);
//  - normalizer none, NFC, NFD, NFKC or NFKD, or a Sequence of them (utf8proc's), applied as the
//    library applies it: to the text between the added tokens with normalized false, before the added
//    tokens with normalized true are matched (by their normalized content) and before pre-tokenisation;
//  - decoder none or ByteLevel; the post-processor (e.g. Llama 3's BOS) is not applied;
//  - added_tokens (special or not): matched in the text as the library does, before pre-tokenisation,
//    leftmost first and the longest where several start at the same place.
// Anything else (WordPiece, Unigram/SentencePiece such as Llama 2, byte_fallback, other normalizers
// such as Lowercase, Replace or Prepend, other pre-tokenizers) is refused with an lt::UserError naming it.
//
// A hostile or broken file is refused with an lt::UserError naming the file and the key path, never a
// crash or a huge allocation:
//  - token ids (model.vocab values, added_tokens ids) are integers from 0 to 2^31 - 1 (not negative,
//    not a float, not a string), and the highest is below 4 x the number of tokens + 65,536 (the id
//    table spans 0..highest; real tokenizers number their tokens densely). The post_processor's ids
//    are not read (it is not applied);
//  - JSON nested deeper than 512 levels, a key given twice, or a value of the wrong type anywhere;
//  - a pre-tokenizer pattern that does not compile, or that backtracks catastrophically on a text
//    (PCRE2's limits, which grow with the text: byte_level_bpe.hpp), names the pattern. Valid text of
//    any length under the real patterns (12 million spaces under Llama 3's) tokenizes.
//
// The end-of-text id: tokenizer_config.json's eos_token when the directory has one, else the first
// added token of <|endoftext|> (GPT-2, Qwen2), <|end_of_text|> (Llama 3 base), <|eot_id|>, </s>.
#pragma once

#include <memory>
#include <string>

#include "lora_trainer/data/tokenizer.hpp"

namespace lt {

// dir: a directory holding tokenizer.json (and optionally tokenizer_config.json). name(): "hf:" + dir.
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& dir);

}  // namespace lt
