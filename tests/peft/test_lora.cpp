// LoRA: the adapter helpers, the transition, and the two-phase trainer's restore in every phase.
#include "catch.hpp"

#include <csignal>

#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/training/report.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

using Data = test::TwoDatasets;
using test::logits_of;
using test::make_lora;
using test::snapshot;
using test::tiny_gpt;


TEST_CASE("param_filter picks the 2-D weights whose names contain a target", "[lora]") {
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  auto mask = param_filter(params, {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"});
  std::vector<std::string> picked;
  for (size_t i = 0; i < params.size(); ++i)
    if (mask[i]) picked.push_back(params[i].first);
  CHECK(picked == std::vector<std::string>{"h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight",
                                           "h.0.mlp.c_proj.weight", "h.1.attn.c_attn.weight", "h.1.attn.c_proj.weight",
                                           "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight"});
  CHECK_THROWS_WITH(param_filter(params, {"attn.c_attn", "q_proj"}),
                    Contains("\"q_proj\" matches no 2-D parameter") && Contains("h.0.attn.c_attn.weight"));
  CHECK_THROWS_WITH(param_filter(params, {"ln_1"}), Contains("\"ln_1\" matches no 2-D parameter"));
}

TEST_CASE("inject_lora_params: A (in x r) ~ N(0, 1/r), B (r x out) = 0, reproducible", "[lora]") {
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  auto mask = param_filter(params, {"mlp.c_fc"});
  auto lora = inject_lora_params(params, mask, 8, at::detail::createCPUGenerator(5));
  REQUIRE(lora.names.size() == 2);
  CHECK(lora.A[0].sizes() == torch::IntArrayRef({32, 8}));
  CHECK(lora.B[0].sizes() == torch::IntArrayRef({8, 128}));
  CHECK(lora.A[0].scalar_type() == torch::kFloat32);
  CHECK(torch::count_nonzero(lora.B[0]).item<int64_t>() == 0);
  auto all_a = torch::cat({lora.A[0].flatten(), lora.A[1].flatten()});
  CHECK(all_a.std().item<double>() == Approx(1.0 / 8).epsilon(0.15));
  auto again = inject_lora_params(params, mask, 8, at::detail::createCPUGenerator(5));
  CHECK(torch::equal(again.A[1], lora.A[1]));
  CHECK(count_lora_params(lora) == 2 * (32 * 8 + 8 * 128));
  CHECK(LoraParams::a_name("h.0.mlp.c_fc.weight") == "h.0.mlp.c_fc.lora_A");
}

TEST_CASE("inject_lora_params with init kaiming_uniform: A ~ U(+-1/sqrt(in)) as PEFT's default, B = 0", "[lora]") {
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  auto mask = param_filter(params, {"mlp.c_proj"});  // in = 128
  auto lora = inject_lora_params(params, mask, 8, at::detail::createCPUGenerator(5), LoraInit::KaimingUniform);
  REQUIRE(lora.names.size() == 2);
  CHECK(lora.A[0].sizes() == torch::IntArrayRef({128, 8}));
  const double bound = 1.0 / std::sqrt(128.0);
  auto all_a = torch::cat({lora.A[0].flatten(), lora.A[1].flatten()});
  CHECK(all_a.abs().max().item<double>() <= bound);
  CHECK(all_a.abs().max().item<double>() > 0.95 * bound);
  CHECK(all_a.std().item<double>() == Approx(bound / std::sqrt(3.0)).epsilon(0.1));
  CHECK(torch::count_nonzero(lora.B[1]).item<int64_t>() == 0);
  auto gaussian = inject_lora_params(params, mask, 8, at::detail::createCPUGenerator(5), LoraInit::Gaussian);
  CHECK_FALSE(torch::equal(gaussian.A[0], lora.A[0]));
  CHECK(parse_lora_init("kaiming_uniform") == LoraInit::KaimingUniform);
  CHECK_THROWS_AS(parse_lora_init("kaiming"), LoraSettingError);
  CHECK_THROWS_WITH(parse_lora_init("kaiming"), Contains("\"kaiming\" is not one of gaussian, kaiming_uniform"));
}

TEST_CASE("modules_to_save_filter: module or parameter names and their suffixes, and an error for nothing matched or adapted twice", "[lora]") {
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  auto adapted = param_filter(params, {"attn.c_attn", "mlp.c_fc"});
  auto picked = [&](const std::vector<std::string>& modules) {
    auto mask = modules_to_save_filter(params, modules, adapted);
    std::vector<std::string> out;
    for (size_t i = 0; i < params.size(); ++i)
      if (mask[i]) out.push_back(params[i].first);
    return out;
  };
  CHECK(picked({"wte"}) == std::vector<std::string>{"wte.weight"});
  CHECK_THROWS_WITH(picked({"transformer.wte"}), Contains("matches no module or parameter"));  // a Hugging Face name, not ours
  CHECK(picked({"ln_f"}) == std::vector<std::string>{"ln_f.weight", "ln_f.bias"});
  CHECK(picked({"ln_f.weight"}) == std::vector<std::string>{"ln_f.weight"});
  CHECK(picked({"ln_1"}) == std::vector<std::string>{"h.0.ln_1.weight", "h.0.ln_1.bias", "h.1.ln_1.weight", "h.1.ln_1.bias"});
  CHECK(picked({"h.1.mlp.c_proj"}) == std::vector<std::string>{"h.1.mlp.c_proj.weight", "h.1.mlp.c_proj.bias"});
  CHECK(picked({}).empty());
  CHECK_THROWS_WITH(picked({"te"}), Contains("\"te\" matches no module or parameter") &&
                                        Contains(": wte, wpe, h.*.ln_1, h.*.attn.c_attn, h.*.attn.c_proj, h.*.ln_2, h.*.mlp.c_fc, "
                                                 "h.*.mlp.c_proj, ln_f"));
  CHECK_THROWS_WITH(picked({"embed_tokens"}), Contains("\"embed_tokens\" matches no"));
  try {  // lora.cpp names the setting; the trainer adds the config key
    picked({"embed_tokens"});
  } catch (const LoraSettingError& e) {
    CHECK(e.setting() == "modules_to_save");
  }
  CHECK_THROWS_WITH(picked({"c_fc"}), Contains("selects h.0.mlp.c_fc.weight") && Contains("already gives an adapter"));
}

TEST_CASE("merged and unmerged forward agree (f32, |diff| < 1e-4)", "[lora]") {
  GPT adapted = tiny_gpt(), merged = tiny_gpt();
  auto params = named_params(*adapted);
  auto lora = inject_lora_params(params, param_filter(params, {"attn", "mlp"}), 4, at::detail::createCPUGenerator(1));
  for (auto& b : lora.B) b.normal_(0.0, 0.05);  // non-zero adapters
  attach_lora(*adapted, lora, 16.0, 4);
  {
    torch::NoGradGuard ng;
    auto target = named_params(*merged);
    auto values = merge_lora_params(params, lora, 16.0, 4);
    for (size_t i = 0; i < target.size(); ++i) target[i].second.copy_(values[i].second);
  }
  auto idx = torch::randint(0, 257, {2, 16}, torch::kLong);
  auto a = logits_of(*adapted, idx), m = logits_of(*merged, idx);
  CHECK((a - m).abs().max().item<double>() < 1e-4);
  detach_lora(*adapted);
  CHECK((logits_of(*adapted, idx) - m).abs().max().item<double>() > 1e-3);  // the adapters did matter
}

TEST_CASE("adapters are parameters of the layer they adapt: listed by name, found by name, removed with detach", "[lora]") {
  GPT m = tiny_gpt();
  const auto base = named_params(*m);
  auto lora = inject_lora_params(base, param_filter(base, {"c_attn"}), 4, at::detail::createCPUGenerator(1), LoraInit::Gaussian,
                                 /*dora=*/true);
  attach_lora(*m, lora, 8.0, 4);
  const auto all = m->named_parameters();
  // The layer's own tensors (not copies), in its order: weight, bias, lora_A, lora_B, lora_magnitude.
  REQUIRE(all.find("h.1.attn.c_attn.lora_A"));
  CHECK(all.find("h.1.attn.c_attn.lora_A")->is_same(lora.A[1]));
  CHECK(all.find("h.1.attn.c_attn.lora_B")->is_same(lora.B[1]));
  CHECK(all.find("h.1.attn.c_attn.lora_magnitude")->is_same(lora.magnitude[1]));
  CHECK(all.size() == base.size() + 3 * 2);
  CHECK(base_params(*m).size() == base.size());
  std::vector<std::string> keys = all.keys();
  auto at = [&](const std::string& k) { return std::find(keys.begin(), keys.end(), k) - keys.begin(); };
  CHECK(at("h.0.attn.c_attn.bias") + 1 == at("h.0.attn.c_attn.lora_A"));
  CHECK(at("h.0.attn.c_attn.lora_A") + 1 == at("h.0.attn.c_attn.lora_B"));
  const LoraParams found = lora_params_of(*m);
  CHECK(found.names == lora.names);
  REQUIRE(found.dora());
  for (size_t i = 0; i < found.names.size(); ++i) CHECK((found.A[i].is_same(lora.A[i]) && found.B[i].is_same(lora.B[i])));
  // LoRA+ by name: B and the magnitude at the ratio, A at 1.
  CHECK(lora_plus_lr_scale("h.0.attn.c_attn.lora_A", 16) == 1);
  CHECK(lora_plus_lr_scale("h.0.attn.c_attn.lora_B", 16) == 16);
  CHECK(lora_plus_lr_scale("h.0.attn.c_attn.lora_magnitude", 16) == 16);
  CHECK_FALSE(is_adapter_param("h.0.attn.c_attn.weight"));
  CHECK(is_adapter_param("wte.trainable_tokens_delta"));
  CHECK_FALSE(is_lora_param("wte.trainable_tokens_delta"));
  detach_lora(*m);
  CHECK(m->named_parameters().size() == base.size());
  CHECK(lora_params_of(*m).names.empty());
}

TEST_CASE("freeze_base: the base stops learning and is stored bf16 (the layers' weights through their FrozenWeight), "
          "the kept modules and the adapters train in f32", "[lora]") {
  GPT m = tiny_gpt();
  auto base = named_params(*m);
  auto lora = inject_lora_params(base, param_filter(base, {"c_fc"}), 4, at::detail::createCPUGenerator(1));
  freeze_base(*m, {"ln_f.weight"}, [](const std::string&) { return FrozenFormat::Bf16; });
  for (auto& t : lora.A) t.requires_grad_(true);
  attach_lora(*m, lora, 8.0, 4);
  for (const auto& [name, p] : named_params(*m)) {
    INFO(name);
    const bool trains = name == "ln_f.weight" || is_adapter_param(name);
    CHECK(p.requires_grad() == (name == "ln_f.weight" || name.find("lora_A") != std::string::npos));
    CHECK(p.scalar_type() == (trains ? torch::kFloat32 : torch::kBFloat16));
  }
  // The layer's matmul takes W from its FrozenWeight: the bf16 parameter itself (no copy), which
  // frozen_linear casts to the input's f32 for the product alone.
  auto& fc = *m->named_modules()["h.0.mlp.c_fc"]->as<LinearImpl>();
  auto x = torch::randn({3, 32});
  auto W = fc.base_weight(x);
  CHECK(W.scalar_type() == torch::kBFloat16);
  CHECK(W.is_same(fc.weight));
  detach_lora(*m);
  // (The product an f32 layer computes: kernels/cpu_gemm.hpp's, oneDNN's where the build has it.)
  CHECK(torch::equal(fc.forward(x), cpu_linear(x, fc.weight.to(torch::kFloat32), fc.bias.to(torch::kFloat32))));
}

TEST_CASE("with B = 0 the transition keeps the output, up to the bf16 cast of the base", "[lora]") {
  Data d;
  auto t = make_lora(d, "b0", {"runtime/precision=f32"});
  for (int i = 0; i < 5; ++i) t->train_step();
  auto idx = torch::randint(0, 257, {2, 32}, torch::kLong);
  auto before = logits_of(*t->model(), idx);
  // The same weights rounded to bf16, no adapters: what the frozen base computes.
  GPT rounded(t->model()->options());
  rounded->to(t->model()->parameters()[0].device());
  {
    torch::NoGradGuard ng;
    auto dst = named_params(*rounded), src = named_params(*t->model());
    for (size_t i = 0; i < dst.size(); ++i) dst[i].second.copy_(src[i].second.to(torch::kBFloat16).to(torch::kFloat32));
  }
  auto expected = logits_of(*rounded, idx);
  t->transition_to_lora();
  REQUIRE(t->in_lora_phase());
  auto after = logits_of(*t->model(), idx);
  CHECK((after - expected).abs().max().item<double>() < 1e-5);  // B = 0: adapters add exactly nothing
  CHECK((after - before).abs().max().item<double>() < 0.05);    // bf16 rounding of the base only
}

TEST_CASE("the plan: pre-LoRA to the boundary, then LoRA entered by transition_to_lora, which a step by hand enters as run() does", "[lora]") {
  Data d;
  auto t = make_lora(d, "phases");
  const std::vector<Phase> plan = t->phases();
  REQUIRE(plan.size() == 2);
  CHECK(plan[0].trains == Trainable::AllParameters);  // phase 1 trains the model as built
  CHECK(plan[0].first_step == 0);
  CHECK(plan[0].end_step == t->boundary_step());
  CHECK(plan[0].end_step == 5);
  CHECK(plan[1].trains == Trainable::Adapters);
  CHECK(plan[1].first_step == 5);
  CHECK(plan[1].end_step == 10);
  CHECK((plan[0].first_stage == 0 && plan[0].end_stage == 1 && plan[1].first_stage == 1 && plan[1].end_stage == 2));
  CHECK(plan[0].loss == plan[1].loss);  // the next-token loss in both (DPO's only in a DPO phase)
  CHECK(plan[1].schedule.lr == t->lora_config().schedule.lr);  // each phase its own schedule
  CHECK(plan[0].schedule.lr != plan[1].schedule.lr);
  for (int i = 0; i < 5; ++i) t->train_step();
  CHECK_FALSE(t->in_lora_phase());  // the boundary step's validation and checkpoint see the whole model
  CHECK_FALSE(is_checkpoint(t->job_dir() + "/pre_lora_checkpoint"));
  t->train_step();  // the first LoRA step enters the phase: the transition, then the step
  CHECK(t->in_lora_phase());
  CHECK(is_checkpoint(t->job_dir() + "/pre_lora_checkpoint"));
  CHECK(t->trainable().size() == t->lora_params().named().size());
  const auto names = t->optimizer().param_names();
  t->train_step();  // a later step of the phase enters nothing again: the same adapters train
  CHECK(t->optimizer().param_names() == names);
  CHECK(t->optimizer().steps_taken() == 2);
}

TEST_CASE("after one LoRA step only the adapters changed and the optimizer holds only them", "[lora]") {
  Data d;
  auto t = make_lora(d, "only");
  for (int i = 0; i < 5; ++i) t->train_step();
  t->transition_to_lora();
  auto base = snapshot(base_params(*t->model()));
  auto A = snapshot(t->lora_params().named());
  t->train_step();
  test::check_base_frozen_as(base, base_params(*t->model()));
  auto after = t->lora_params().named();
  for (size_t i = 0; i < after.size(); i += 2) CHECK(torch::equal(A[i].second, after[i].second));  // B was 0: dA = 0
  for (size_t i = 1; i < after.size(); i += 2) CHECK_FALSE(torch::equal(A[i].second, after[i].second));  // B moved
  t->train_step();
  CHECK_FALSE(torch::equal(A[0].second, t->lora_params().A[0]));  // and now A moves too
  std::vector<std::string> adapter_names;
  for (auto& [n, x] : t->lora_params().named()) adapter_names.push_back(n);
  CHECK(t->optimizer().param_names() == adapter_names);
  CHECK(t->optimizer().state().size() == 2 * adapter_names.size() + 1);
}

TEST_CASE("modules_to_save train in f32 at their own lr beside the adapters, and every other base tensor stays bit-identical", "[lora]") {
  Data d;
  auto t = make_lora(d, "saved", {R"(optimization/lora/modules_to_save=["wte","ln_f"])",
                                  "optimization/lora/modules_to_save_lr_ratio=0.5"});
  for (int i = 0; i < 5; ++i) t->train_step();
  auto f32_before = snapshot(named_params(*t->model()));
  t->transition_to_lora();
  CHECK(t->saved_modules() == std::vector<std::string>{"wte.weight", "ln_f.weight", "ln_f.bias"});
  auto base = snapshot(base_params(*t->model()));
  t->train_step();
  t->train_step();
  auto after = base_params(*t->model());
  for (size_t i = 0; i < base.size(); ++i) {
    const auto& name = base[i].first;
    INFO(name);
    const bool saved = name == "wte.weight" || name.rfind("ln_f.", 0) == 0;
    CHECK(after[i].second.requires_grad() == saved);
    CHECK(after[i].second.scalar_type() == (saved ? torch::kFloat32 : torch::kBFloat16));
    if (saved) {
      CHECK(torch::equal(base[i].second, f32_before[i].second));  // the transition kept their f32 values
      CHECK_FALSE(torch::equal(base[i].second, after[i].second));  // and they trained
    } else {
      CHECK(torch::equal(base[i].second, after[i].second));
    }
  }
  std::vector<std::string> want;
  for (auto& [n, x] : t->lora_params().named()) want.push_back(n);
  for (const char* n : {"wte.weight", "ln_f.weight", "ln_f.bias"}) want.push_back(n);
  CHECK(t->optimizer().param_names() == want);
  // The step is taken and checkpointed like any other: the saved modules are in the state with their moments.
  t->save("ntoks/896");
  auto meta = read_checkpoint_metadata(t->job_dir() + "/ntoks/896");
  CHECK(meta["lora"]["modules_to_save"] == nlohmann::json::array({"wte.weight", "ln_f.weight", "ln_f.bias"}));
  CHECK(meta["lora"]["modules_to_save_lr_ratio"] == 0.5);
  CHECK(meta["lora"]["init"] == "gaussian");
  std::map<std::string, torch::Tensor> stored;
  for (auto& [n, x] : read_checkpoint_tensors(t->job_dir() + "/ntoks/896")) stored[n] = x;
  CHECK(stored.at("params/wte.weight").scalar_type() == torch::kFloat32);
  CHECK(stored.count("optim/exp_avg/wte.weight") == 1);
  CHECK(stored.count("optim/exp_avg/h.0.mlp.c_fc.weight") == 0);
  // A job that names other modules cannot take this state over silently.
  auto other = make_lora(d, "saved", {R"(optimization/lora/modules_to_save=["wte"])"});
  CHECK_THROWS_WITH(other->restore_from_path("ntoks/896"),
                    Contains("trained the modules_to_save") && Contains("optimization/lora/modules_to_save selects"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {R"(optimization/lora/modules_to_save=["lm_head"])"}),
                    Contains("optimization/lora/modules_to_save: \"lm_head\" matches no module or parameter"));
}

TEST_CASE("the lr ratio of the modules_to_save is applied: a tiny ratio barely moves them", "[lora]") {
  Data d;
  auto moved = [&](const std::string& ratio) {
    auto t = make_lora(d, "ratio" + ratio, {R"(optimization/lora/modules_to_save=["ln_f"])",
                                             "optimization/lora/modules_to_save_lr_ratio=" + ratio});
    for (int i = 0; i < 5; ++i) t->train_step();
    t->transition_to_lora();
    auto before = snapshot(named_params(*t->model()));
    for (int i = 0; i < 3; ++i) t->train_step();
    for (size_t i = 0; i < before.size(); ++i)
      if (before[i].first == "ln_f.weight")
        return (named_params(*t->model())[i].second - before[i].second).abs().max().item<double>();
    return -1.0;
  };
  const double full = moved("1"), tiny = moved("0.001");
  CHECK(full > 0);
  CHECK(tiny > 0);
  CHECK(tiny < full / 100);
}

TEST_CASE("a run crosses the boundary, and resume in phase 1, at the boundary and in phase 2 is bit-identical", "[lora]") {
  Data d;
  auto straight = make_lora(d, "straight");
  REQUIRE(straight->total_steps() == 10);
  REQUIRE(straight->boundary_step() == 5);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  CHECK(straight->in_lora_phase());
  CHECK(is_checkpoint(straight->job_dir() + "/pre_lora_checkpoint"));

  auto resume_from = [&](const std::string& name, int steps_before, const std::string& suffix) {
    {
      auto first = make_lora(d, name);
      for (int i = 0; i < steps_before; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
      if (suffix.rfind("ntoks/", 0) == 0) first->save(suffix);
    }
    auto resumed = make_lora(d, name);
    resumed->restore_from_path(suffix);
    for (int64_t i = resumed->step(); i < 10; ++i) {
      INFO(name << " step " << i);
      REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
    }
    test::require_same_state(*straight, *resumed);
  };
  SECTION("mid phase 1") { resume_from("p1", 3, "ntoks/384"); }
  SECTION("pre_lora_checkpoint restores as plain, then transitions") { resume_from("boundary", 6, "pre_lora_checkpoint"); }
  SECTION("mid phase 2") { resume_from("p2", 8, "ntoks/1024"); }
}

using test::check_resume_mid_phase2_and_final;

TEST_CASE("with modules_to_save and PEFT's init, resume mid phase 2 and from final is bit-identical", "[lora]") {
  Data d;
  const std::vector<std::string> opts = {R"(optimization/lora/modules_to_save=["wte","ln_1"])",
                                         "optimization/lora/modules_to_save_lr_ratio=0.1",
                                         "optimization/lora/init=kaiming_uniform"};
  check_resume_mid_phase2_and_final(d, opts);
}

TEST_CASE("restoring final gives the finished state", "[lora]") {
  Data d;
  auto a = make_lora(d, "fin");
  a->run();
  auto b = make_lora(d, "fin");
  CHECK(b->restore_latest() == "final/1280");
  CHECK(b->done());
  CHECK(b->in_lora_phase());
  test::require_same_state(*a, *b);
}

TEST_CASE("restore refuses checkpoints of the wrong phase with a clear reason", "[lora]") {
  Data d;
  auto a = make_lora(d, "src");
  for (int i = 0; i < 4; ++i) a->train_step();
  a->save("ntoks/512");
  auto later = make_lora(d, "dst", {"training/pre_lora_tokens=[256]"});  // boundary at step 2
  CHECK_THROWS_WITH(later->restore_from_path(a->job_dir() + "/ntoks/512"),
                    Contains("plain state at step 4, past this job's LoRA boundary (step 2)"));
  CHECK_THROWS_WITH(make_lora(d, "emb", {R"(optimization/lora/target_modules=["wte"])"}),
                    Contains("optimization/lora/target_modules: selects wte.weight, which is not a linear layer's weight") &&
                        Contains("h.0.mlp.c_fc.weight"));
  CHECK_THROWS_WITH(make_lora(d, "rank", {"optimization/lora/rank=64"}),
                    Contains("optimization/lora/rank: 64 exceeds the smaller side of h.0.attn.c_attn.weight (96 x 32)"));
  auto nodata = make_lora(d, "nodata", {R"(training/post_lora_dataset=[[{"name":"absent","rate":1}]])"});
  CHECK_THROWS_WITH(nodata->run(), Contains("absent/meta.json"));  // before the first step, not at the boundary
  CHECK(nodata->step() == 0);
  auto mismatch = [&] { make_lora(d, "bad", {R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}],[{"name":"gen","rate":1}]])"}); };
  CHECK_THROWS_WITH(mismatch(), Contains("training/pre_lora_tokens has 1 stages but training/pre_lora_dataset has 2"));
}

TEST_CASE("skip phase one: a plain checkpoint of another job becomes the frozen base", "[lora]") {
  Data d;
  auto pre = make_lora(d, "pretrain");
  for (int i = 0; i < 6; ++i) pre->train_step();  // writes pre_lora_checkpoint at step 5
  auto ft = make_lora(d, "finetune", {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]"});
  CHECK(ft->boundary_step() == 0);
  CHECK(ft->total_steps() == 5);
  ft->restore_from_path(pre->job_dir() + "/pre_lora_checkpoint");
  CHECK(ft->step() == 0);
  CHECK(ft->tokens() == 0);
  auto base = read_checkpoint_tensors(pre->job_dir() + "/pre_lora_checkpoint");
  ft->run();
  CHECK(ft->step() == 5);
  CHECK(ft->in_lora_phase());
  std::map<std::string, torch::Tensor> stored(base.begin(), base.end());
  for (auto& [n, t] : base_params(*ft->model())) {
    INFO(n);
    CHECK(torch::equal(t.cpu(), stored.at("params/" + n).to(torch::kBFloat16)));
  }
}

TEST_CASE("export merges the adapters: the exported model computes what base + adapters compute", "[lora]") {
  Data d;
  std::vector<std::string> opts = {"runtime/precision=f32"};
  SECTION("LoRA") {}
  // rsLoRA scales by alpha/sqrt(r), LoRA+ trains B faster, and the token embedding trains in full:
  // the export must merge with the scale that was trained and carry the trained embedding.
  SECTION("rsLoRA, LoRA+ and modules_to_save") {
    for (const char* o : {"optimization/lora/rslora=true", "optimization/lora/lr_ratio=16", R"(optimization/lora/modules_to_save=["wte"])"})
      opts.push_back(o);
  }
  auto a = make_lora(d, "exp", opts);
  a->run();
  std::string out = d.dir / "exported";
  export_merged(a->job_dir() + "/final/1280", out);
  auto meta = read_checkpoint_metadata(out);
  CHECK(meta["weights_only"] == true);
  CHECK(meta["merged_adapters"] == 8);
  // The export initialises a plain job (and would equally be the base of a LoRA job).
  Trainer plain(test::job_spec("from_export"),
                    test::tiny_config(Trainer::schema(), d.dir / "data", test::kPlainF32), d.dir / "out");
  plain.restore_from_path(out);
  CHECK(plain.step() == 0);
  auto idx = torch::randint(0, 257, {2, 32}, torch::kLong);
  CHECK((logits_of(*plain.model(), idx) - logits_of(*a->model(), idx)).abs().max().item<double>() < 1e-4);
}

TEST_CASE("rsLoRA scales by alpha/sqrt(r) and LoRA+ gives every B its lr ratio", "[lora]") {
  CHECK(lora_scale(32, 16) == 2.0);
  CHECK(lora_scale(32, 16, true) == 8.0);
  CHECK(lora_scale(8, 4, true) == 4.0);
  Data d;
  auto t = make_lora(d, "plus", {"optimization/lora/rslora=true", "optimization/lora/lr_ratio=16", "optimization/lora/alpha=8"});
  for (int i = 0; i < 6; ++i) t->train_step();
  REQUIRE(t->in_lora_phase());
  const auto names = t->optimizer().param_names();
  const auto& scale = t->optimizer().lr_scale();
  REQUIRE(names.size() == 16);
  for (size_t i = 0; i < names.size(); ++i) {
    INFO(names[i]);
    CHECK(scale[i] == (names[i].find("lora_B") != std::string::npos ? 16.0 : 1.0));
  }
  // The adapted layer computes x W^T + b + (alpha / sqrt(r)) (x A) B: with B set by hand, the output
  // moves by that scale exactly.
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  auto lora = inject_lora_params(params, param_filter(params, {"mlp.c_fc"}), 4, at::detail::createCPUGenerator(1));
  for (auto& b : lora.B) b.normal_(0, 0.1);
  auto idx = torch::randint(0, 257, {2, 16}, torch::kLong);
  auto base = logits_of(*m, idx);
  attach_lora(*m, lora, 8.0, 4, true);
  auto ours = logits_of(*m, idx);
  detach_lora(*m);
  GPT merged = tiny_gpt();
  {
    torch::NoGradGuard ng;
    auto into = named_params(*merged);
    auto from = merge_lora_params(named_params(*m), lora, 8.0, 4, true);
    for (size_t i = 0; i < into.size(); ++i) into[i].second.copy_(from[i].second);
  }
  CHECK((logits_of(*merged, idx) - ours).abs().max().item<double>() < 1e-4);
  CHECK((ours - base).abs().max().item<double>() > 1e-3);
  t->save("ntoks/768");
  auto meta = read_checkpoint_metadata(t->job_dir() + "/ntoks/768");
  CHECK(meta["lora"]["rslora"] == true);
  CHECK(meta["lora"]["lr_ratio"] == 16.0);
}

TEST_CASE("export never replaces what it did not write, nor its own source", "[lora]") {
  Data d;
  auto a = make_lora(d, "exp2", {"runtime/precision=f32"});
  a->run();
  const std::string ck = a->job_dir() + "/final/1280";
  const auto digest_before = inspect_checkpoint(ck).dump();
  // The checkpoint itself, a directory inside it, and a directory holding it.
  CHECK_THROWS_WITH(export_merged(ck, ck), Contains("is the checkpoint being exported") && Contains("Nothing was written"));
  CHECK_THROWS_WITH(export_merged(ck, ck + "/sub"), Contains("is inside the checkpoint being exported"));
  CHECK_THROWS_WITH(export_merged(ck, a->job_dir()), Contains("holds the checkpoint being exported"));
  CHECK(inspect_checkpoint(ck).dump() == digest_before);
  CHECK_FALSE(std::filesystem::exists(ck + "/sub"));
  // Somebody's directory, and a training checkpoint, are refused and left as they were.
  const std::string mine = d.dir / "mine";
  std::filesystem::create_directories(mine);
  write_file_atomic(mine + "/notes.txt", "keep me");
  CHECK_THROWS_WITH(export_merged(ck, mine), Contains("already exists and is not an earlier export"));
  CHECK(read_file(mine + "/notes.txt") == "keep me");
  CHECK_THROWS_WITH(export_merged(ck, a->job_dir() + "/pre_lora_checkpoint"), Contains("already exists and is not an earlier export"));
  // An earlier export is replaced.
  const std::string out = d.dir / "exported";
  export_merged(ck, out);
  CHECK_NOTHROW(export_merged(ck, out));
  CHECK(read_checkpoint_metadata(out)["weights_only"] == true);
}

TEST_CASE("an empty `latest` is an error that says what to do, not a silent restart from step 0", "[lora]") {
  Data d;
  {
    auto a = make_lora(d, "lat");
    for (int i = 0; i < 3; ++i) a->train_step();
    a->save("ntoks/384");
  }
  auto b = make_lora(d, "lat");
  write_file_atomic(b->job_dir() + "/latest", "\n");
  CHECK_THROWS_WITH(b->restore_latest(), Contains("latest is empty") && Contains("lora_trainer checkpoints"));
  write_file_atomic(b->job_dir() + "/latest", "ntoks/999\n");
  CHECK_THROWS_WITH(b->restore_latest(), Contains("not a complete checkpoint"));
  // Garbled: another job's checkpoint, an absolute path, several lines.
  for (std::string bad : {"../other/ntoks/384\n", "/tmp\n", "ntoks/../../x\n", "ntoks/384\nntoks/512\n"}) {
    write_file_atomic(b->job_dir() + "/latest", bad);
    CHECK_THROWS_WITH(b->restore_latest(), Contains("not a checkpoint inside the job directory"));
  }
  write_file_atomic(b->job_dir() + "/latest", "ntoks/384\n");
  CHECK(b->restore_latest() == "ntoks/384");
  CHECK(b->step() == 3);
}


namespace {
extern "C" void sentinel_handler(int) {}
}  // namespace

TEST_CASE("run() puts the previous SIGINT and SIGTERM handlers back however it ends", "[lora]") {
  Data d;
  auto before_int = std::signal(SIGINT, sentinel_handler);
  auto before_term = std::signal(SIGTERM, sentinel_handler);
  {
    auto ok = make_lora(d, "sig_ok");
    ok->run();
  }
  CHECK(std::signal(SIGINT, sentinel_handler) == sentinel_handler);
  CHECK(std::signal(SIGTERM, sentinel_handler) == sentinel_handler);
  {
    auto boom = make_lora(d, "sig_boom", {"optimization/lr=1e30"});
    CHECK_THROWS_AS(boom->run(), TrainingDiverged);
  }
  CHECK(std::signal(SIGINT, before_int) == sentinel_handler);
  CHECK(std::signal(SIGTERM, before_term) == sentinel_handler);
}
