// A block's frozen weights as a BlockShard (peft/block_shard.hpp) in one process: the layout gives every
// tensor back as written, and a model whose blocks gather their sharded weights computes, bit for bit,
// what the same model with its frozen weights in place computes: losses, adapter gradients (through the
// recompute the sharded blocks always take), eval forwards; bf16 and NF4, plain LoRA and DoRA. Several
// ranks run in tests/training/test_sharded_base.cpp.
#include "catch.hpp"

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/block_shard.hpp"
#include "lora_trainer/peft/lora.hpp"

using namespace lt;

TEST_CASE("a BlockShard gives back each tensor it was given, whatever its dtype, size and offset", "[shard]") {
  BlockShard block(distributed(), torch::kCPU, "block 0");
  auto gen = at::detail::createCPUGenerator(5);
  const std::vector<torch::Tensor> tensors = {
      torch::randn({3, 5}, gen).to(torch::kBFloat16), torch::randint(0, 255, {7}, gen).to(torch::kUInt8),
      torch::randn({1}, gen), torch::randn({0}, gen), torch::randn({4, 33}, gen).to(torch::kBFloat16)};
  for (const auto& t : tensors) block.add(t.scalar_type(), t.sizes().vec());
  block.seal();
  for (size_t i = 0; i < tensors.size(); ++i) block.write(static_cast<int64_t>(i), tensors[i]);
  CHECK(block.shard_bytes() % 64 == 0);
  CHECK(block.full_bytes() >= 30 + 7 + 4 + 264);
  CHECK_FALSE(block.gathered());
  CHECK_THROWS_WITH(block.tensor(0), lt::test::Contains("block 0 is not gathered"));
  {
    BlockGathered gathered(&block, BlockGathered::Direction::Forward);
    CHECK(block.gathered());
    for (size_t i = 0; i < tensors.size(); ++i) {
      INFO(i);
      CHECK(torch::equal(block.tensor(static_cast<int64_t>(i)), tensors[i]));
    }
    BlockGathered nested(&block, BlockGathered::Direction::None);  // shares the buffer
  }
  CHECK_FALSE(block.gathered());
  CHECK_THROWS(block.write(1, torch::zeros({8}, torch::kUInt8)));  // not tensor 1's shape
}

namespace {

ModelOptions tiny(ModelFamily family) {
  ModelOptions o;
  o.family = family;
  o.vocab_size = 64;
  o.block_size = 16;
  o.n_layer = 3;
  o.n_head = 4;
  o.d_model = 32;
  if (family == ModelFamily::Llama) {
    o.n_kv_head = 2;
    o.d_ff = 48;
    o.activation = ModelOptions::Activation::Silu;
    o.tie_embeddings = false;
    o.qkv_bias = true;
  }
  return o;
}

// A model with its base frozen (block linear weights in `format`) and adapters on every adaptable weight
// but the head; its blocks' frozen weights sharded when asked.
CausalLM frozen_model(ModelFamily family, FrozenFormat format, bool dora, bool sharded) {
  CausalLM m = make_model(tiny(family));
  m->init_weights(at::detail::createCPUGenerator(3));
  const NamedTensors params = base_params(*m);
  std::vector<bool> targets;
  std::vector<std::vector<std::string>> blocks(3);
  for (const auto& [name, p] : params) {
    const bool adaptable = p.dim() == 2 && m->in_blocks(name);
    targets.push_back(adaptable);
    if (adaptable) blocks.at(static_cast<size_t>(m->block_of(name))).push_back(name);
  }
  freeze_base(*m, {}, [&](const std::string& w) { return m->in_blocks(w) ? format : FrozenFormat::Bf16; });
  NamedTensors weights = params;
  const auto storages = frozen_storages(*m);
  for (auto& [name, W] : weights)
    if (storages.count(name)) W = storages.at(name)->for_matmul(W);
  LoraParams lora = inject_lora_params(weights, targets, 4, at::detail::createCPUGenerator(7), LoraInit::Gaussian, dora);
  for (auto& B : lora.B) {
    torch::NoGradGuard ng;
    B.normal_(0.0, 0.1, at::detail::createCPUGenerator(9));  // B = 0 would hide x's gradient path
  }
  for (auto& [name, t] : lora.named()) t.requires_grad_(true);
  attach_lora(*m, lora, 8.0, 4);
  if (sharded) m->set_block_shards(shard_frozen_weights(*m, blocks, distributed(), torch::kCPU));
  return m;
}

}  // namespace

TEST_CASE("a model whose blocks gather their sharded frozen weights computes what the unsharded model computes",
          "[shard][lora]") {
  const auto idx = torch::randint(0, 64, {2, 16}, at::detail::createCPUGenerator(1));
  const auto tgt = torch::randint(0, 64, {2, 16}, at::detail::createCPUGenerator(2));
  for (auto family : {ModelFamily::Gpt2, ModelFamily::Llama})
    for (auto format : {FrozenFormat::Bf16, FrozenFormat::Nf4})
      for (bool dora : {false, true}) {
        INFO(to_string(family) << " " << to_string(format) << (dora ? " DoRA" : ""));
        CausalLM plain = frozen_model(family, format, dora, false), sharded = frozen_model(family, format, dora, true);
        REQUIRE(sharded->block_shards().size() == 3);
        // The sharded parameters are stand-ins; their storages report themselves sharded.
        const auto storages = frozen_storages(*sharded);
        REQUIRE(storages.count(family == ModelFamily::Gpt2 ? "h.1.mlp.c_fc.weight" : "model.layers.1.mlp.up_proj.weight"));
        for (const auto& [name, s] : storages) CHECK(s->sharded());
        for (bool bf16 : {false, true}) {
          INFO((bf16 ? "bf16 autocast" : "f32"));
          Runtime rt;
          rt.bf16_autocast = bf16;
          torch::Tensor la, lb;
          {
            AutocastGuard autocast(rt);
            la = plain->loss_sum(idx, tgt);
            la.backward();
            lb = sharded->loss_sum(idx, tgt);
            lb.backward();
          }
          CHECK(torch::equal(la, lb));
          const NamedTensors pa = named_params(*plain), pb = named_params(*sharded);
          int64_t adapters = 0;
          for (size_t i = 0; i < pa.size(); ++i) {
            if (!is_lora_param(pa[i].first)) continue;
            INFO(pa[i].first);
            REQUIRE(pb[i].second.grad().defined());
            CHECK(torch::equal(pa[i].second.grad(), pb[i].second.grad()));
            pa[i].second.mutable_grad().reset();
            pb[i].second.mutable_grad().reset();
            ++adapters;
          }
          CHECK(adapters > 0);
          for (const auto& b : sharded->block_shards()) CHECK_FALSE(b->gathered());  // nothing kept after the step
        }
        torch::NoGradGuard ng;
        CHECK(torch::equal(plain->forward(idx), sharded->forward(idx)));
      }
}
