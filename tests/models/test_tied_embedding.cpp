// A tied head's weight gets the looked-up rows' gradient as rows added into the head's dense gradient
// (a sparse lookup gradient, gpt2.cpp): the weight's gradient must still be dense and equal, within
// rounding, what a dense lookup gradient gives; an untied embedding's gradient must be dense.
#include "catch.hpp"

#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/models/model.hpp"

using namespace lt;

namespace {

// The token embedding module of a model (gpt2's wte, llama's model.embed_tokens).
std::shared_ptr<TokenEmbeddingImpl> token_embedding(const CausalLM& m) {
  for (const auto& item : m->named_modules())
    if (item.key() == "wte" || item.key() == "model.embed_tokens") return std::dynamic_pointer_cast<TokenEmbeddingImpl>(item.value());
  return nullptr;
}

// Every parameter's gradient after one loss's backward; ids drawn from a 50-token vocabulary, so
// that ids repeat within the batch.
std::map<std::string, torch::Tensor> gradients(const CausalLM& m, bool sparse_lookup) {
  token_embedding(m)->options.sparse(sparse_lookup);
  m->zero_grad();
  auto gen = at::detail::createCPUGenerator(3);
  auto idx = torch::randint(0, 50, {3, 16}, gen), targets = torch::randint(0, 50, {3, 16}, gen);
  auto logits = m->forward(idx);
  torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1)).backward();
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m->named_parameters())
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  return out;
}

}  // namespace

TEST_CASE("tied embedding: the weight's gradient is dense and the dense lookup's, and an untied one stays dense", "[models][numerics]") {
  for (auto [family, tied] : {std::pair{ModelFamily::Gpt2, true}, std::pair{ModelFamily::Llama, true},
                              std::pair{ModelFamily::Llama, false}}) {
    INFO(to_string(family) << (tied ? ", tied head" : ", untied head"));
    ModelOptions o;
    o.family = family;
    o.vocab_size = 50;
    o.block_size = 16;
    o.n_layer = 2;
    o.n_head = 2;
    o.d_model = 16;
    o.tie_embeddings = tied;
    if (family == ModelFamily::Llama) o.activation = ModelOptions::Activation::Silu;
    CausalLM m = make_model(o);
    m->init_weights(at::detail::createCPUGenerator(1));
    const bool built_sparse = token_embedding(m)->options.sparse();
    CHECK(built_sparse == tied);  // as the model builds it
    auto as_built = gradients(m, built_sparse);
    auto dense = gradients(m, false);
    REQUIRE(as_built.size() == dense.size());
    for (const auto& [name, g] : dense) {
      INFO(name);
      CHECK_FALSE(as_built[name].is_sparse());
      CHECK(as_built[name].layout() == torch::kStrided);
      INFO("max difference " << (as_built[name] - g).abs().max().item<double>() << " of " << g.abs().max().item<double>());
      CHECK(torch::allclose(as_built[name], g, 1e-6, 1e-7));
    }
  }
}
