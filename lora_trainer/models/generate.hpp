// Text generation from a trained model: autoregressive sampling with temperature, top-k and top-p, one
// completion (`sample`, `chat`, `eval --task`) or several of one prompt in one batch (a policy's
// rollouts). The model reads the prompt once and then each new token alone, against the keys and values
// it keeps of the earlier ones (kv_cache.hpp).
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
  double top_p = 1.0;        // nucleus: the fewest most likely ids whose probabilities reach top_p (as
                             // transformers' TopPLogitsWarper, after temperature and top-k); 1 = no cut-off
  uint64_t seed = 0;
  std::vector<uint32_t> stop_ids;  // stop after generating one of these (end of text, end of turn); none = never
  int64_t vocab_limit = -1;  // draw only ids below this (the tokenizer's vocabulary, when the model's is
                             // padded past it, as Qwen2's and the test models' are); -1 = every id
  // Whether the model keeps the context's keys and values (KvCache) instead of recomputing the whole
  // context for every token: the same tokens up to rounding, many times faster. false is the reference
  // the cache is checked against (tests, `bench --generate`).
  bool kv_cache = true;
  // Named by the message of an id past the model's vocabulary: the prompt's tokenizer, and what the
  // prompt is ("sample: the prompt", a task file's line).
  std::string tokenizer, where = "the prompt";
  // Called with each id of the first completion as it is generated (a stop id included), e.g. to print
  // the text as it comes.
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

// `n` continuations of `prompt`, drawn together as the n rows of one batch (the prompt read once):
// each its new ids, ending at its first stop id (included) or after max_new_tokens. The rows' draws
// come from one generator seeded with opts.seed, in row order at each step: deterministic for a seed
// and n. Once the context passes block_size, every row continues from its last block_size tokens,
// recomputed for each token, as without the cache.
std::vector<std::vector<uint32_t>> generate_batch(CausalLM& model, const Runtime& rt, const std::vector<uint32_t>& prompt,
                                                  int64_t n, const GenerateOptions& opts);

// The id drawn from each row of `logits` (n, V), f32 on the CPU: argmax with temperature 0, else a draw
// from softmax(logits / temperature) cut to top_k and top_p, from `gen`.
std::vector<int64_t> draw_next_ids(torch::Tensor logits, const GenerateOptions& opts, at::Generator& gen);

}  // namespace lt
