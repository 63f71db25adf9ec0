// Text generation from a trained model: autoregressive sampling with temperature and top-k, so a
// person can see what each phase learned (`lora_trainer sample`).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lora_trainer/models/model.hpp"
#include "lora_trainer/core/runtime.hpp"

namespace lt {

struct GenerateOptions {
  int64_t max_new_tokens = 100;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = no cut-off
  uint64_t seed = 0;
  std::vector<uint32_t> stop_ids;  // stop after generating one of these (end of text, end of turn); none = never
  int64_t vocab_limit = -1;  // draw only ids below this (the tokenizer's vocabulary, when the model's is
                             // padded past it, as Qwen2's and the test models' are); -1 = every id
  // Named by the message of an id past the model's vocabulary: the prompt's tokenizer, and what the
  // prompt is ("sample: the prompt", a task file's line).
  std::string tokenizer, where = "the prompt";
  // Called with each id as it is generated (a stop id included), e.g. to print the text as it comes.
  std::function<void(uint32_t)> on_token;
};

// A UserError when `ids` (`where`'s text encoded by `tokenizer`) hold an id the model cannot take, one
// past its vocabulary of `vocab` (the embedding would be indexed out of range): names the tokenizer, the
// id and the vocabulary, and says to pick the model's own tokenizer.
void check_token_ids(const std::vector<uint32_t>& ids, int64_t vocab, const std::string& tokenizer, const std::string& where);

// Continues `prompt` (token ids, at least one). The context is the last block_size tokens.
// Returns only the new ids, a stop id included when one ended it. Deterministic for a given seed.
std::vector<uint32_t> generate(CausalLM& model, const Runtime& rt, const std::vector<uint32_t>& prompt,
                               const GenerateOptions& opts);

}  // namespace lt
