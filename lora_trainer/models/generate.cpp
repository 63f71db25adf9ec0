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

std::vector<uint32_t> generate(CausalLM& model, const Runtime& rt, const std::vector<uint32_t>& prompt,
                               const GenerateOptions& o) {
  if (prompt.empty()) throw UserError("sample: the prompt encodes to no tokens; give some text");
  torch::NoGradGuard ng;
  model->eval();
  const int64_t V = model->options().vocab_size, T = model->options().block_size;
  auto gen = at::detail::createCPUGenerator(o.seed);
  check_token_ids(prompt, V, o.tokenizer, o.where);
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  std::vector<uint32_t> out;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - T);
    auto ctx = torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()), torch::kLong).unsqueeze(0);
    torch::Tensor logits;
    {
      AutocastGuard autocast(rt);
      logits = model->forward(ctx.to(rt.device));  // (1, t, V)
    }
    auto last = logits[0][-1].to(torch::kFloat32).to(torch::kCPU);  // (V)
    if (o.vocab_limit > 0 && o.vocab_limit < V) last = last.slice(0, 0, o.vocab_limit);  // ids the tokenizer can decode
    if (!torch::isfinite(last).all().item<bool>())
      throw UserError("sample: the model's output is NaN or infinite after " + std::to_string(ids.size()) +
                      " tokens: the checkpoint's weights are not finite (a diverged run, or a damaged file). "
                      "`lora_trainer inspect --verify CHECKPOINT` checks its data; sample an earlier checkpoint");
    int64_t next;
    if (o.temperature <= 0) {
      next = last.argmax().item<int64_t>();
    } else {
      last = last / o.temperature;
      if (o.top_k > 0 && o.top_k < last.size(0)) {
        auto kth = std::get<0>(last.topk(o.top_k)).min();
        last = last.masked_fill(last < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(last, -1), 1, false, gen).item<int64_t>();
    }
    ids.push_back(next);
    out.push_back(static_cast<uint32_t>(next));
    if (o.on_token) o.on_token(static_cast<uint32_t>(next));
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), static_cast<uint32_t>(next)) != o.stop_ids.end()) break;
  }
  return out;
}

}  // namespace lt
