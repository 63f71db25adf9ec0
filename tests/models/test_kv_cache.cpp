// Generation through the KV cache (models/kv_cache.hpp, generate.hpp): a forward over new tokens
// after the cache's gives the logits a forward over the whole context gives, and generating with the
// cache draws the tokens that recomputing the context for every token draws, greedy and sampled, one
// completion or several in a batch, across the end of block_size (where the context slides and every
// token is recomputed), from a one-token prompt, leaving the weights as they were, in both families (learned positions; rotary positions with grouped-query
// key/value heads and q/k/v biases).
//
// Tolerance: f32 on the CPU. The two forwards multiply the same numbers in other groupings (a row of
// q against the cached keys instead of the whole square), so they differ by the rounding of sums of
// a few dozen products in two layers: about 1e-6 of the logits' scale. 1e-5 of it is the bound.
// The tokens must be equal: the head is scaled so that the logits of a random model are spread (a gap
// between the two most likely ids far above that rounding), as a trained model's are.
#include <algorithm>
#include <map>

#include "catch.hpp"

#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/models/llama.hpp"

using namespace lt;

namespace {

ModelOptions small_model(ModelFamily family) {
  ModelOptions o;
  o.family = family;
  o.vocab_size = 97;
  o.block_size = 48;
  o.n_layer = 2;
  o.n_head = 4;
  o.d_model = 32;
  o.attention = ModelOptions::Attention::Manual;
  if (family == ModelFamily::Llama) {
    o.n_kv_head = 2;  // grouped-query: each key/value head serves two query heads
    o.activation = ModelOptions::Activation::Silu;
    o.d_ff = 48;
    o.tie_embeddings = false;
    o.qkv_bias = true;
    o.rope_theta = 500;
  }
  return o;
}

CausalLM make_small(ModelFamily family, ModelOptions::Attention attention = ModelOptions::Attention::Manual) {
  ModelOptions o = small_model(family);
  o.attention = attention;
  CausalLM m = make_model(o);
  m->init_weights(at::detail::createCPUGenerator(5));
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())  // the output head (tied or not): logits spread as a trained model's
    if (p.key() == "wte.weight" || p.key() == "lm_head.weight") p.value().mul_(40.0);
  m->eval();
  return m;
}

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

const char* name(ModelFamily f) { return f == ModelFamily::Gpt2 ? "gpt2" : "llama"; }

}  // namespace

TEST_CASE("kv cache: a forward over new tokens after the cache gives the whole context's logits", "[generate][numerics]") {
  std::vector<ModelOptions::Attention> paths = {ModelOptions::Attention::Manual};
  if (fused_attention_available()) paths.push_back(ModelOptions::Attention::Fused);
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama})
    for (auto attention : paths) {
      INFO(name(family) << (attention == ModelOptions::Attention::Fused ? ", fused attention" : ", manual attention"));
      CausalLM m = make_small(family, attention);
      torch::NoGradGuard ng;
      auto idx = torch::randint(0, 97, {2, 48}, at::detail::createCPUGenerator(6), torch::kLong);
      KvCache cache(2, 48);
      auto at = [&](int64_t end) { return m->forward(idx.slice(1, 0, end)).select(1, -1); };  // the whole context's
      // The prompt at once, one token at a time, three at a time (queries that see part of each other), to the end.
      CHECK(rel_diff(m->forward_cached(idx.slice(1, 0, 30), cache), at(30)) < 1e-5);
      for (int64_t p = 30; p < 40; ++p) {
        INFO("position " << p);
        CHECK(rel_diff(m->forward_cached(idx.slice(1, p, p + 1), cache), at(p + 1)) < 1e-5);
      }
      CHECK(rel_diff(m->forward_cached(idx.slice(1, 40, 43), cache), at(43)) < 1e-5);
      CHECK(cache.length() == 43);
      CHECK(rel_diff(m->forward_cached(idx.slice(1, 43, 48), cache), at(48)) < 1e-5);
      CHECK_FALSE(cache.fits(1));
      CHECK_THROWS(m->forward_cached(idx.slice(1, 0, 1), cache));  // past block_size
    }
}

TEST_CASE("kv cache: generation draws the tokens recomputing the context draws, across block_size, in a batch", "[generate][numerics]") {
  Runtime rt;
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama}) {
    CausalLM m = make_small(family);
    std::vector<torch::Tensor> weights;  // generation reads the model and writes nothing into it
    for (const auto& p : m->parameters()) weights.push_back(p.detach().clone());
    const std::vector<uint32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19};
    for (double temperature : {0.0, 0.9}) {
      INFO(name(family) << ", temperature " << temperature);
      GenerateOptions o;
      o.max_new_tokens = 40;  // 20 + 40 > block_size 48: the last 12 tokens slide the context
      o.temperature = temperature;
      o.top_k = 0;
      o.top_p = 0.95;
      o.seed = 17;
      GenerateOptions recomputed = o;
      recomputed.kv_cache = false;
      const auto cached = generate_batch(m, rt, prompt, 3, o);
      CHECK(cached == generate_batch(m, rt, prompt, 3, recomputed));
      CHECK(cached[0].size() == 40);
      CHECK(generate(m, rt, prompt, o) == generate(m, rt, prompt, recomputed));
      if (temperature == 0) CHECK((cached[0] == cached[1] && cached[1] == cached[2]));
      // A stop id ends each row at its first occurrence (kept), the others' draws unchanged.
      const uint32_t stop = cached[1][5];
      GenerateOptions stopping = o;
      stopping.stop_ids = {stop};
      const auto stopped = generate_batch(m, rt, prompt, 3, stopping);
      for (size_t r = 0; r < 3; ++r) {
        INFO("row " << r);
        auto end = std::find(cached[r].begin(), cached[r].end(), stop);
        const std::vector<uint32_t> expected(cached[r].begin(), end == cached[r].end() ? end : end + 1);
        CHECK(stopped[r] == expected);
      }
      // A one-token prompt: every forward reads a single row.
      GenerateOptions single = o;
      single.max_new_tokens = 8;
      GenerateOptions single_recomputed = single;
      single_recomputed.kv_cache = false;
      CHECK(generate(m, rt, {7}, single) == generate(m, rt, {7}, single_recomputed));
    }
    const auto now = m->parameters();
    for (size_t i = 0; i < weights.size(); ++i) CHECK(torch::equal(now[i].detach(), weights[i]));
  }
}

TEST_CASE("generation's top-p keeps the fewest most likely ids whose probabilities reach p, as transformers' warper", "[generate]") {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids 0..3).
  const auto logits = torch::tensor({0.5f, 0.3f, 0.15f, 0.05f}).log().unsqueeze(0);
  auto drawn = [&](double top_p) {
    GenerateOptions o;
    o.temperature = 1.0;
    o.top_k = 0;
    o.top_p = top_p;
    auto gen = at::detail::createCPUGenerator(9);
    std::map<int64_t, int> counts;
    for (int i = 0; i < 2000; ++i) ++counts[draw_next_ids(logits, o, gen)[0]];
    return counts;
  };
  auto c = drawn(0.75);  // 0.5 falls short, 0.5 + 0.3 reach it: ids 0 and 1, in about 5:3
  CHECK(c.size() == 2);
  CHECK(c.count(0) == 1);
  CHECK(c.count(1) == 1);
  CHECK(std::abs(c[0] / 2000.0 - 0.625) < 0.05);
  CHECK(drawn(0.85).size() == 3);  // 0.8 falls short: 0.15 joins
  CHECK(drawn(0.3).size() == 1);   // the most likely alone reaches it
  CHECK(drawn(1.0).size() == 4);
  // The rows of a batch draw each their own id (a policy's completions of one prompt differ).
  GenerateOptions o;
  o.temperature = 1.0;
  o.top_k = 0;
  auto gen = at::detail::createCPUGenerator(10);
  const auto ids = draw_next_ids(torch::zeros({3, 1000}), o, gen);
  CHECK((ids[0] != ids[1] || ids[1] != ids[2]));
}
