#include "lora_trainer/models/generate.hpp"

#include "lora_trainer/core/util.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace lt {

void check_token_ids(const std::vector<uint32_t>& ids, int64_t vocab, const std::string& tokenizer, const std::string& where) {
  for (uint32_t id : ids)
    if (id >= static_cast<uint64_t>(vocab))
      throw UserError(where + " has token id " + std::to_string(id) + (tokenizer.empty() ? "" : " of the tokenizer " + tokenizer) +
                      ", outside the model's vocabulary of " + std::to_string(vocab) + " (architecture/vocab_size, ids 0 to " +
                      std::to_string(vocab - 1) + "): this tokenizer is not the model's; give the one the model was "
                      "trained with (--tokenizer)");
}

std::vector<int64_t> draw_next_ids(torch::Tensor logits, const GenerateOptions& o, at::Generator& gen) {
  const float inf = std::numeric_limits<float>::infinity();
  torch::Tensor next;
  if (o.temperature <= 0) {
    next = logits.argmax(-1);
  } else {
    logits = logits / o.temperature;
    if (o.top_k > 0 && o.top_k < logits.size(-1)) {
      auto kth = std::get<0>(logits.topk(o.top_k, -1)).amin(-1, /*keepdim=*/true);
      logits = logits.masked_fill(logits < kth, -inf);
    }
    if (o.top_p < 1.0) {  // transformers' TopPLogitsWarper: drop the least likely ids whose probabilities sum to at most 1 - top_p
      const auto sorted = logits.sort(-1, /*descending=*/false);
      auto drop = torch::softmax(std::get<0>(sorted), -1).cumsum(-1) <= (1.0 - o.top_p);
      drop.select(-1, drop.size(-1) - 1).fill_(false);  // the most likely id always stays
      logits = logits.masked_fill(drop.scatter(-1, std::get<1>(sorted), drop), -inf);
    }
    const auto probs = torch::softmax(logits, -1);
    next = probs.size(0) == 1 ? torch::multinomial(probs[0], 1, false, gen)  // one row: the draw `sample` always made
                              : torch::multinomial(probs, 1, false, gen).squeeze(1);
  }
  next = next.reshape({-1}).contiguous();
  return std::vector<int64_t>(next.data_ptr<int64_t>(), next.data_ptr<int64_t>() + next.numel());
}

namespace {

// The rows' context windows (n, t): the last block_size tokens of each (all of one length).
torch::Tensor windows(const std::vector<std::vector<int64_t>>& rows, int64_t block_size, const torch::Device& device) {
  const int64_t len = static_cast<int64_t>(rows[0].size()), t = std::min(len, block_size);
  auto out = torch::empty({static_cast<int64_t>(rows.size()), t}, torch::kLong);
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy(rows[r].end() - t, rows[r].end(), out[static_cast<int64_t>(r)].data_ptr<int64_t>());
  return out.to(device);
}

}  // namespace

std::vector<std::vector<uint32_t>> generate_batch(CausalLM& model, const Runtime& rt, const std::vector<uint32_t>& prompt,
                                                  int64_t n, const GenerateOptions& o) {
  if (prompt.empty()) throw UserError("sample: the prompt encodes to no tokens; give some text");
  if (n < 1) throw std::invalid_argument("generate_batch: n must be at least 1");
  torch::NoGradGuard ng;
  model->eval();
  const int64_t V = model->options().vocab_size, T = model->options().block_size;
  auto gen = at::detail::createCPUGenerator(o.seed);
  check_token_ids(prompt, V, o.tokenizer, o.where);
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(n), std::vector<int64_t>(prompt.begin(), prompt.end()));
  std::vector<std::vector<uint32_t>> out(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), false);
  // The cache holds the context window and what follows it while that fits in block_size.
  const int64_t window = std::min<int64_t>(static_cast<int64_t>(prompt.size()), T);
  KvCache cache(model->options().n_layer, std::min(T, window + std::max<int64_t>(o.max_new_tokens, 1)));
  torch::Tensor logits;  // (n, V) of the next position
  {
    AutocastGuard autocast(rt);
    if (o.kv_cache) {
      std::vector<std::vector<int64_t>> first(1, rows[0]);
      logits = model->forward_cached(windows(first, T, rt.device), cache);  // the prompt read once
      cache.repeat_rows(n);
      logits = logits.expand({n, logits.size(-1)});
    } else {
      logits = model->forward(windows(rows, T, rt.device)).select(1, -1);
    }
  }
  int64_t left = n;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    auto last = logits.to(torch::kFloat32).to(torch::kCPU);  // (n, V)
    if (o.vocab_limit > 0 && o.vocab_limit < V) last = last.slice(-1, 0, o.vocab_limit);  // ids the tokenizer can decode
    if (!torch::isfinite(last).all().item<bool>())
      throw UserError("sample: the model's output is NaN or infinite after " + std::to_string(rows[0].size()) +
                      " tokens: the checkpoint's weights are not finite (a diverged run, or a damaged file). "
                      "`lora_trainer inspect --verify CHECKPOINT` checks its data; sample an earlier checkpoint");
    const std::vector<int64_t> next = draw_next_ids(last, o, gen);
    for (size_t r = 0; r < rows.size(); ++r) {
      rows[r].push_back(next[r]);
      if (done[r]) continue;
      const auto id = static_cast<uint32_t>(next[r]);
      out[r].push_back(id);
      if (r == 0 && o.on_token) o.on_token(id);
      if (std::find(o.stop_ids.begin(), o.stop_ids.end(), id) != o.stop_ids.end()) {
        done[r] = true;
        --left;
      }
    }
    if (left == 0 || i + 1 == o.max_new_tokens) break;
    AutocastGuard autocast(rt);
    if (o.kv_cache && cache.fits(1)) {
      auto ids = torch::tensor(next, torch::kLong).view({n, 1}).to(rt.device);
      logits = model->forward_cached(ids, cache);
    } else {  // no cache, or past block_size: the last block_size tokens of each row, recomputed
      logits = model->forward(windows(rows, T, rt.device)).select(1, -1);
    }
  }
  return out;
}

std::vector<uint32_t> generate(CausalLM& model, const Runtime& rt, const std::vector<uint32_t>& prompt,
                               const GenerateOptions& o) {
  return generate_batch(model, rt, prompt, 1, o)[0];
}

}  // namespace lt
