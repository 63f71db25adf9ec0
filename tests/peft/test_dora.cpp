// DoRA (optimization/lora/dora): the magnitude per output feature in the layer, the trainer, its
// checkpoints, the merge, AdaptersOff, activation checkpointing and init_from. The PEFT side against
// Hugging Face's layouts is in test_dora_hf.cpp.
#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "lora_fixtures.hpp"

using namespace lt;
using lt::test::Contains;
using Data = test::TwoDatasets;
using test::logits_of;
using test::make_lora;

namespace {

const char* kDora = "optimization/lora/dora=true";

double max_abs(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// The logits of `t`'s model with its adapters switched off: the frozen base's.
torch::Tensor base_logits(Trainer& t, const torch::Tensor& idx) {
  AdaptersOff off(*t.model());
  return logits_of(*t.model(), idx);
}

}  // namespace

TEST_CASE("DoRA at injection: the magnitudes are the base's row norms and the model computes its base", "[lora][dora][numerics]") {
  Data d;
  auto t = make_lora(d, "inject", {kDora, "runtime/precision=f32"});
  for (int i = 0; i < 5; ++i) t->train_step();
  t->transition_to_lora();
  const LoraParams& l = t->lora_params();
  REQUIRE(l.dora());
  REQUIRE(l.magnitude.size() == l.names.size());
  std::map<std::string, torch::Tensor> params;
  for (auto& [n, p] : named_params(*t->model())) params[n] = p;
  for (size_t i = 0; i < l.names.size(); ++i) {
    INFO(l.names[i]);
    const torch::Tensor& W = params.at(l.names[i]);  // bf16, (out, in)
    CHECK(W.scalar_type() == torch::kBFloat16);
    CHECK(l.magnitude[i].scalar_type() == torch::kFloat32);
    CHECK(l.magnitude[i].sizes() == at::IntArrayRef({W.size(0)}));
    CHECK(torch::equal(l.magnitude[i], W.to(torch::kFloat32).norm(2, {1})));
  }
  // B = 0 and m = ||W||: the factor m / ||W + 0|| is 1 exactly, so the output is the base's up to the
  // order of the bias addition (measured on the CPU: identical).
  auto idx = torch::randint(0, 257, {2, 32}, torch::kLong);
  auto with = logits_of(*t->model(), idx), base = base_logits(*t, idx);
  UNSCOPED_INFO("DoRA at injection vs base: " << max_abs(with, base));
  CHECK(max_abs(with, base) < 1e-6);
}

TEST_CASE("DoRA steps change only A, B and the magnitudes, m at B's lr without weight decay", "[lora][dora]") {
  Data d;
  auto t = make_lora(d, "steps", {kDora, "optimization/lora/lr_ratio=4", "optimization/lora/weight_decay=0.1"});
  for (int i = 0; i < 5; ++i) t->train_step();
  t->transition_to_lora();
  auto base = test::snapshot(base_params(*t->model()));
  auto before = test::snapshot(t->lora_params().named());
  for (int i = 0; i < 3; ++i) t->train_step();
  auto base_after = base_params(*t->model());
  for (size_t i = 0; i < base.size(); ++i) {
    INFO(base[i].first);
    CHECK(torch::equal(base[i].second, base_after[i].second));
  }
  // A, B, magnitude of each adapted weight in turn: the optimizer's order and the checkpoint's names.
  const NamedTensors after = t->lora_params().named();
  REQUIRE(after.size() == 3 * 8);
  CHECK(after[2].first == "h.0.attn.c_attn.lora_magnitude");
  CHECK(t->optimizer().param_names() == names_of(after));
  for (size_t i = 0; i < after.size(); ++i) {
    INFO(after[i].first);
    CHECK_FALSE(torch::equal(before[i].second, after[i].second));  // every A, B and m moved
    const bool magnitude = i % 3 == 2;
    CHECK(t->optimizer().lr_scale()[i] == (i % 3 == 0 ? 1.0 : 4.0));
    CHECK(t->optimizer().decays(i) == !magnitude);
  }
  CHECK(t->optimizer().state().size() == 2 * after.size() + 1);
  // Saved with the parameters of its layer (params/), with lora.dora in the metadata.
  t->save("ntoks/1024");
  const std::string ck = t->job_dir() + "/ntoks/1024";
  CHECK(read_checkpoint_metadata(ck)["lora"]["dora"] == true);
  std::map<std::string, torch::Tensor> saved;
  for (auto& [n, v] : read_checkpoint_tensors(ck)) saved[n] = v;
  CHECK(torch::equal(saved.at("params/h.1.mlp.c_proj.lora_magnitude"), t->lora_params().magnitude.back().cpu()));
}

TEST_CASE("DoRA's layer computes m (W + s A B) / ||W + s A B|| x + b, and the merge gives the same model", "[lora][dora][numerics]") {
  GPT adapted = test::tiny_gpt(), merged = test::tiny_gpt();
  auto params = named_params(*adapted);
  auto lora = inject_lora_params(params, param_filter(params, {"attn", "mlp"}), 4, at::detail::createCPUGenerator(1),
                                 LoraInit::Gaussian, true);
  for (auto& b : lora.B) b.normal_(0.0, 0.05);
  for (auto& m : lora.magnitude) m.mul_(torch::rand(m.sizes()) + 0.5);  // magnitudes away from the norms
  // One layer by hand, the formula with W' formed: h.0.mlp.c_fc.
  const double s = lora_scale(16.0, 4, true);
  attach_lora(*adapted, lora, 16.0, 4, true);
  auto* fc = adapted->named_modules()["h.0.mlp.c_fc"]->as<LinearImpl>();
  REQUIRE(fc);
  auto x = torch::randn({3, 5, 32});
  auto W = fc->weight + s * torch::mm(lora.A[2], lora.B[2]).t();
  REQUIRE(lora.names[2] == "h.0.mlp.c_fc.weight");
  auto Wd = lora.magnitude[2].unsqueeze(1) * W / W.norm(2, {1}, true);
  {
    torch::NoGradGuard ng;
    CHECK(max_abs(fc->forward(x), torch::linear(x, Wd, fc->bias)) < 1e-5);
  }
  // The whole model, against merge_lora_params' weights (f32): |diff| < 1e-4.
  {
    torch::NoGradGuard ng;
    auto target = named_params(*merged);
    auto values = merge_lora_params(params, lora, 16.0, 4, true);
    for (size_t i = 0; i < target.size(); ++i) target[i].second.copy_(values[i].second);
  }
  auto idx = torch::randint(0, 257, {2, 16}, torch::kLong);
  auto a = logits_of(*adapted, idx), m = logits_of(*merged, idx);
  UNSCOPED_INFO("DoRA unmerged vs merged: " << max_abs(a, m));
  CHECK(max_abs(a, m) < 1e-4);
  // Without the magnitudes the same A and B compute another model.
  LoraParams plain = lora;
  plain.magnitude.clear();
  attach_lora(*adapted, plain, 16.0, 4, true);
  CHECK(max_abs(logits_of(*adapted, idx), m) > 1e-3);
}

TEST_CASE("DoRA's norm is detached: m and B get PEFT's gradients", "[lora][dora][numerics]") {
  // y = (m / n) (x W^T + s x A B), n = ||W + s (A B)^T|| per row held constant.
  auto W = torch::randn({6, 5}), A = torch::randn({5, 2}), B = torch::randn({2, 6}) * 0.1;
  auto m = (W.norm(2, {1}) * 1.3).requires_grad_(true);
  auto Bt = B.clone().requires_grad_(true);
  auto x = torch::randn({4, 5});
  const double s = 0.5;
  lora_linear(x, W, {}, A, Bt, s, m).sum().backward();
  auto n = (W + s * torch::mm(A, B).t()).norm(2, {1});
  auto m2 = m.detach().clone().requires_grad_(true), B2 = B.clone().requires_grad_(true);
  ((m2 / n) * (torch::linear(x, W) + s * torch::mm(torch::mm(x, A), B2))).sum().backward();
  CHECK(max_abs(m.grad(), m2.grad()) < 1e-5);
  CHECK(max_abs(Bt.grad(), B2.grad()) < 1e-5);
}

TEST_CASE("DoRA: resume mid phase 2 and from final is bit-identical, and a restore with the other setting is refused", "[lora][dora]") {
  Data d;
  const std::vector<std::string> opts = {kDora, "optimization/lora/lr_ratio=4", "optimization/lora/init=kaiming_uniform"};
  auto [straight, resumed] = test::check_resume_mid_phase2_and_final(d, opts);
  REQUIRE(resumed->lora_params().dora());
  for (size_t i = 0; i < straight->lora_params().magnitude.size(); ++i)
    CHECK(torch::equal(straight->lora_params().magnitude[i], resumed->lora_params().magnitude[i]));
  auto plain = make_lora(d, "p2");  // the job of the checkpoint, without DoRA
  CHECK_THROWS_WITH(plain->restore_from_path("ntoks/896"),
                    Contains("trained DoRA adapters") && Contains("optimization/lora/dora=false"));
  {
    auto p = make_lora(d, "plain_ck");
    for (int i = 0; i < 7; ++i) p->train_step();
    p->save("ntoks/896");
  }
  auto dora = make_lora(d, "plain_ck", {kDora});
  CHECK_THROWS_WITH(dora->restore_from_path("ntoks/896"),
                    Contains("without DoRA's magnitudes") && Contains("optimization/lora/dora=true"));
}

TEST_CASE("DoRA: AdaptersOff computes the base, without the magnitudes' rescale", "[lora][dora][numerics]") {
  Data d;
  auto t = make_lora(d, "off", {kDora, "runtime/precision=f32"});
  for (int i = 0; i < 8; ++i) t->train_step();
  auto idx = torch::randint(0, 257, {2, 32}, torch::kLong);
  const torch::Tensor on = logits_of(*t->model(), idx), off = base_logits(*t, idx);
  LoraParams lora = t->lora_params();
  detach_lora(*t->model());
  const torch::Tensor bare = logits_of(*t->model(), idx);
  CHECK(torch::equal(off, bare));
  // Only the magnitudes attached (B set back to 0): still not the base, so Off switched them off too.
  LoraParams only_m = lora;
  for (auto& b : only_m.B) b = torch::zeros_like(b);
  attach_lora(*t->model(), only_m, 16.0, 4);
  const torch::Tensor m_only = logits_of(*t->model(), idx);
  UNSCOPED_INFO("adapters on vs off: " << max_abs(on, off) << "; magnitudes alone vs base: " << max_abs(m_only, bare));
  CHECK(max_abs(m_only, bare) > 1e-3);
  CHECK(max_abs(on, off) > 1e-3);
  {
    AdaptersOff again(*t->model());
    CHECK(torch::equal(logits_of(*t->model(), idx), bare));
  }
  CHECK(torch::equal(logits_of(*t->model(), idx), m_only));  // back on when it ends
}

TEST_CASE("DoRA with activation checkpointing takes the plain path's steps bit for bit (gpt2, llama)",
          "[lora][dora][activation_checkpointing]") {
  Data d;
  const std::vector<std::string> llama = {"architecture/family=llama", "architecture/activation=silu", "architecture/n_heads=4",
                                          "architecture/n_kv_heads=2", "architecture/d_ff=48",
                                          "architecture/tie_embeddings=false", "architecture/qkv_bias=true"};
  for (bool is_llama : {false, true}) {
    INFO((is_llama ? "llama" : "gpt2"));
    auto job = [&](const std::string& name, bool ckpt) {
      std::vector<std::string> o = {kDora, "architecture/dropout=0.1", "training/per_device_batch_size=2",
                                    std::string("training/activation_checkpointing=") + (ckpt ? "true" : "false")};
      if (is_llama) o.insert(o.end(), llama.begin(), llama.end());
      return make_lora(d, name + (is_llama ? "_llama" : ""), o);
    };
    auto plain = job("plain", false);
    std::vector<StepResult> steps;
    std::vector<NamedTensors> grads;
    for (int i = 0; i < 10; ++i) {
      steps.push_back(plain->train_step());
      NamedTensors g;
      for (const auto& [n, p] : plain->trainable()) g.emplace_back(n, p.grad().defined() ? p.grad().clone() : torch::Tensor());
      grads.push_back(g);
    }
    auto ckpt = job("ckpt", true);
    for (size_t i = 0; i < 10; ++i) {
      INFO("step " << i);
      StepResult r = ckpt->train_step();
      CHECK(r.loss == steps[i].loss);
      const auto& trained = ckpt->trainable();
      REQUIRE(trained.size() == grads[i].size());
      for (size_t j = 0; j < trained.size(); ++j) {
        INFO(trained[j].first);
        REQUIRE(trained[j].second.grad().defined());  // the magnitudes' too: they are inputs of the checkpointed block
        CHECK(torch::equal(trained[j].second.grad(), grads[i][j].second));
      }
    }
    REQUIRE(ckpt->lora_params().dora());
    test::require_same_state(*plain, *ckpt);
  }
}

TEST_CASE("DoRA export: merged weights, eval's model, the PEFT files, and init_from from both", "[lora][dora]") {
  Data d;
  auto src = make_lora(d, "src", {kDora, "runtime/precision=f32"});
  src->run();
  const std::string ck = src->job_dir() + "/final/1280";
  auto idx = torch::randint(0, 257, {2, 32}, torch::kLong);
  const torch::Tensor ours = logits_of(*src->model(), idx);
  // eval and sample rebuild the checkpoint's model with its magnitudes.
  CHECK(torch::equal(test::load(ck).logits(idx), ours));
  // export: DoRA's rule merged into the weights.
  export_merged(ck, d.dir / "merged");
  CHECK(read_checkpoint_metadata(d.dir / "merged")["merged_adapters"] == 8);
  const double merged_diff = max_abs(test::load(d.dir / "merged").logits(idx), ours);
  UNSCOPED_INFO("DoRA job vs its merged export: " << merged_diff);
  CHECK(merged_diff < 1e-4);

  // PEFT: use_dora and one lora_magnitude_vector (out) per module, ours unchanged.
  export_peft(ck, d.dir / "peft");
  auto cfg = nlohmann::json::parse(read_file(d.dir / "peft/adapter_config.json"));
  CHECK(cfg["use_dora"] == true);
  std::map<std::string, torch::Tensor> adapter;
  for (auto& [n, t] : read_safetensors(d.dir / "peft/adapter_model.safetensors")) adapter[n] = t;
  CHECK(adapter.size() == 8 * 3);
  const LoraParams& l = src->lora_params();
  for (size_t i = 0; i < l.names.size(); ++i) {
    INFO(l.names[i]);
    const std::string key = peft_module_path(ModelFamily::Gpt2, l.names[i]) + ".lora_magnitude_vector";
    REQUIRE(adapter.count(key));
    CHECK(adapter.at(key).sizes() == at::IntArrayRef({l.B[i].size(1)}));
    CHECK(torch::equal(adapter.at(key), l.magnitude[i].cpu()));
  }
  CHECK(adapter.at("base_model.model.transformer.h.0.attn.c_attn.lora_magnitude_vector").sizes() == at::IntArrayRef({96}));
  CHECK(adapter.at("base_model.model.transformer.h.0.mlp.c_proj.lora_magnitude_vector").sizes() == at::IntArrayRef({32}));

  // init_from: the magnitudes come back exactly, from our checkpoint and from the PEFT directory.
  for (const std::string from : {ck, d.dir / "peft"}) {
    INFO(from);
    auto t = make_lora(d, "from", {kDora, "optimization/lora/init_from=\"" + from + "\""});
    for (int i = 0; i < 5; ++i) t->train_step();
    t->transition_to_lora();
    const LoraParams& a = t->lora_params();
    REQUIRE(a.names == l.names);
    for (size_t i = 0; i < a.names.size(); ++i) {
      CHECK(torch::equal(a.A[i], l.A[i]));
      CHECK(torch::equal(a.B[i], l.B[i]));
      CHECK(torch::equal(a.magnitude[i], l.magnitude[i]));
    }
    // A source whose DoRA setting differs from the job's is refused (a UserError: exit status 2).
    auto plain = make_lora(d, "from_plain", {"optimization/lora/init_from=\"" + from + "\""});
    for (int i = 0; i < 5; ++i) plain->train_step();
    try {
      plain->transition_to_lora();
      FAIL("a DoRA source into a job without DoRA was accepted");
    } catch (const UserError& e) {
      CHECK_THAT(e.what(), Contains("holds DoRA adapters") && Contains("optimization/lora/dora=false"));
    }
  }
}
