// The llama family (Llama, Qwen2, Mistral): import from transformers' files gives transformers'
// logits, export writes what transformers and PEFT read, and a llama-family job trains both phases
// with bit-identical resume. The golden models (tests/data/hf_llama: grouped-query attention, an
// untied head; tests/data/hf_qwen2: q/k/v biases, one key/value head, a tied head, rope_theta 1e6)
// were made by scripts/hf_golden.py make --family with transformers 5.12.
#include <filesystem>
#include <map>

#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
using lt::test::max_diff;
namespace fs = std::filesystem;

namespace {

bool has(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

std::map<std::string, torch::Tensor> by_name(const NamedTensors& t) { return {t.begin(), t.end()}; }

// A tiny llama-family model for jobs on the byte dataset (vocab 257).
const std::vector<std::string> kTinyLlama = {
    "architecture/family=llama",      "architecture/activation=silu", "architecture/n_heads=4",
    "architecture/n_kv_heads=2",      "architecture/d_ff=48",         "architecture/tie_embeddings=false",
    "architecture/qkv_bias=true",     "architecture/rope_theta=500"};

}  // namespace

TEST_CASE("import-hf of transformers' Llama (GQA, untied head) and Qwen2 (q/k/v biases, tied head) gives their logits", "[huggingface][llama][numerics]") {
  for (const std::string family : {"llama", "qwen2"}) {
    INFO(family);
    const std::string g = test::hf_golden(family);
    test::TempDir d;
    auto arch = import_hf(g + "/model", d / "imported");
    CHECK(has(arch, "architecture/family=llama"));
    CHECK(has(arch, "architecture/activation=silu"));
    CHECK(has(arch, "architecture/d_ff=80"));
    if (family == "llama") {
      CHECK(has(arch, "architecture/n_kv_heads=2"));
      CHECK(has(arch, "architecture/tie_embeddings=false"));
      CHECK(has(arch, "architecture/qkv_bias=false"));
      CHECK(has(arch, "architecture/rope_theta=10000"));
    } else {
      CHECK(has(arch, "architecture/n_kv_heads=1"));
      CHECK(has(arch, "architecture/tie_embeddings=true"));
      CHECK(has(arch, "architecture/qkv_bias=true"));
      CHECK(has(arch, "architecture/rope_theta=1e+06"));
      CHECK(has(arch, "architecture/norm_eps=1e-06"));
    }
    auto meta = read_checkpoint_metadata(d / "imported");
    CHECK(meta["base_model"]["family"] == "llama");
    CHECK(meta["config"]["architecture"]["block_size"] == 64);
    // f32 on both sides; the differences are summation order.
    // A job on it adapts every projection at step 0 (empty pre-LoRA lists); these tiny k_proj have 8 rows.
    test::Loaded l = test::load(d / "imported", {"optimization/lora/rank=4"});
    auto ours = l.logits(test::golden_ids(g)), ref = test::golden_logits(g);
    REQUIRE(ours.sizes() == ref.sizes());
    CHECK(max_diff(ours, ref) < 1e-4);
    CHECK(ref.std().item<double>() > 1.0);

    // transformers' bf16 shards import as those values.
    import_hf(g + "/model_bf16_sharded", d / "imported_bf16");
    auto a = read_checkpoint_tensors(d / "imported"), b = read_checkpoint_tensors(d / "imported_bf16");
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(b[i].second, a[i].second.to(torch::kBFloat16).to(torch::kFloat32)));

    // export --format hf writes transformers' tensors bit for bit, under the model's own class.
    export_hf(d / "imported", d / "hf");
    auto theirs = by_name(read_safetensors(g + "/model/model.safetensors"));
    auto exported = by_name(read_safetensors(d / "hf/model.safetensors"));
    REQUIRE(exported.size() == theirs.size());
    for (auto& [n, t] : theirs) {
      INFO(n);
      REQUIRE(exported.count(n));
      CHECK(torch::equal(exported.at(n), t));
    }
    auto config = nlohmann::json::parse(read_file(d / "hf/config.json"));
    CHECK(config["architectures"][0] == (family == "llama" ? "LlamaForCausalLM" : "Qwen2ForCausalLM"));
    CHECK(config["model_type"] == family);
    CHECK(config["num_key_value_heads"] == (family == "llama" ? 2 : 1));
    CHECK(config["rope_parameters"]["rope_theta"] == (family == "llama" ? 10000.0 : 1000000.0));
    CHECK(config["bos_token_id"] == nlohmann::json::parse(read_file(g + "/model/config.json"))["bos_token_id"]);
  }
}

TEST_CASE("import-hf of a Llama 3.1-style model (rope_type llama3) gives transformers' logits, and exports its rope_parameters", "[huggingface][llama][numerics]") {
  const std::string g = test::hf_golden("llama3");
  test::TempDir d;
  auto arch = import_hf(g + "/model", d / "imported");
  CHECK(has(arch, "architecture/rope_scaling=llama3"));
  CHECK(has(arch, "architecture/rope_factor=8"));
  CHECK(has(arch, "architecture/rope_original_context=64"));
  CHECK(has(arch, "architecture/block_size=512"));
  const torch::Tensor ids = test::golden_ids(g), ref = test::golden_logits(g);
  CHECK(max_diff(test::load(d / "imported", {"optimization/lora/rank=4"}).logits(ids), ref) < 1e-4);
  // Its four frequencies fall in the three regimes: wavelength 6.3 < 64/4 kept, 19.9 and 62.8 smoothed,
  // 198.7 > 64/1 divided by the factor.
  RopeScaling s;
  s.kind = RopeScaling::Kind::Llama3;
  s.factor = 8;
  s.original_context = 64;
  auto scaled = rope_inv_freq(8, 100.0, s, torch::kCPU), plain = rope_inv_freq(8, 100.0, {}, torch::kCPU);
  CHECK(scaled[0].item<double>() == plain[0].item<double>());
  for (int i : {1, 2}) {
    CHECK(scaled[i].item<double>() < plain[i].item<double>());
    CHECK(scaled[i].item<double>() > plain[i].item<double>() / 8);
  }
  CHECK(scaled[3].item<double>() == Approx(plain[3].item<double>() / 8));
  // Loading the weights into a model with plain rotary frequencies is refused (the shapes would agree).
  CHECK_THROWS_WITH(test::load(d / "imported", {"optimization/lora/rank=4", "architecture/rope_scaling=none"}),
                    Contains("architecture/rope_scaling=llama3; this job has none"));
  export_hf(d / "imported", d / "hf");
  auto config = nlohmann::json::parse(read_file(d / "hf/config.json"));
  CHECK(config["rope_parameters"]["rope_type"] == "llama3");
  CHECK(config["rope_parameters"]["original_max_position_embeddings"] == 64);
  CHECK(config["rope_parameters"]["low_freq_factor"] == 1.0);
  import_hf(d / "hf", d / "again");
  CHECK(max_diff(test::load(d / "again", {"optimization/lora/rank=4"}).logits(ids), ref) < 1e-4);
}

TEST_CASE("import-hf refuses a llama-family model it cannot represent, naming the setting or tensor", "[huggingface][llama]") {
  test::TempDir d;
  const std::string g = test::hf_golden("llama");
  auto edited = [&](const std::string& name, const std::function<void(NamedTensors&)>& edit,
                    const std::function<void(nlohmann::json&)>& cfg) {
    const std::string dir = d / name;
    fs::create_directories(dir);
    NamedTensors t = read_safetensors(g + "/model/model.safetensors");
    edit(t);
    write_safetensors(dir + "/model.safetensors", t);
    auto c = nlohmann::json::parse(read_file(g + "/model/config.json"));
    cfg(c);
    write_file_atomic(dir + "/config.json", c.dump(2));
    return dir;
  };
  auto same = [](NamedTensors&) {};
  auto keep = [](nlohmann::json&) {};
  auto refused = [&](const std::string& dir, const std::string& text) {
    INFO(text);
    CHECK_THROWS_WITH(import_hf(dir, d / "out"), Contains(text));
    CHECK_FALSE(fs::exists(d / "out"));
  };
  refused(edited("yarn", same, [](auto& c) { c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 5e5}, {"factor", 32.0}}; }),
          "rope_parameters rope_type \"yarn\": the rotary embeddings read are default, linear and llama3");
  refused(edited("llama3_incomplete", same, [](auto& c) { c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 5e5}, {"factor", 32.0}}; }),
          "rope_parameters (rope_type llama3) has no number low_freq_factor");
  refused(edited("head_dim", same, [](auto& c) { c["head_dim"] = 16; }), "head_dim 16: ours is hidden_size / num_attention_heads = 8");
  refused(edited("o_bias", same, [](auto& c) { c["attention_bias"] = true; }), "attention_bias true");
  refused(edited("gqa", same, [](auto& c) { c["num_key_value_heads"] = 3; }), "num_key_value_heads 3 does not divide num_attention_heads 4");
  refused(edited("missing",
                 [](NamedTensors& t) {
                   t.erase(std::remove_if(t.begin(), t.end(), [](auto& p) { return p.first == "model.layers.1.mlp.up_proj.weight"; }), t.end());
                 },
                 keep),
          "missing model.layers.1.mlp.up_proj.weight (80, 32)");
  refused(edited("tied", same, [](auto& c) { c["tie_word_embeddings"] = true; }),
          "lm_head.weight differs from model.embed_tokens.weight");
  refused(edited("kv_shape", same, [](auto& c) { c["num_key_value_heads"] = 4; }),
          "model.layers.0.self_attn.k_proj.weight: shape (16, 32), expected (32, 32)");
}

TEST_CASE("LoRA on an imported Llama: PEFT's files and rule (nn.Linear, untied head) and the merged export reproduce our model", "[huggingface][llama]") {
  test::TempDir d;
  const std::string g = test::hf_golden("llama");
  const std::string ck = test::adapt_imported(d, g,
                                              {R"(optimization/lora/target_modules=["q_proj","v_proj","down_proj","lm_head"])",
                                               // model.norm, not the layers' norms
                                               R"(optimization/lora/modules_to_save=["norm"])"});
  test::Loaded lora = test::load(ck);
  const torch::Tensor ids = test::golden_ids(g);
  const torch::Tensor ours = lora.logits(ids);
  REQUIRE(max_diff(ours, test::load(d / "imported").logits(ids)) > 1e-2);  // the adapters changed the model

  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["fan_in_fan_out"] == false);  // nn.Linear layers
  CHECK(cfg["target_modules"] == nlohmann::json::array({"down_proj", "lm_head", "q_proj", "v_proj"}));
  CHECK(cfg["modules_to_save"] == nlohmann::json::array({"model.norm"}));
  CHECK(cfg["ensure_weight_tying"] == false);  // an untied head: nothing to tie
  auto adapter = by_name(read_safetensors(d / "peft/adapter_model.safetensors"));
  CHECK(adapter.size() == 2 * 3 * 2 + 2 + 1);
  CHECK(adapter.at("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").sizes() == at::IntArrayRef({4, 32}));
  CHECK(adapter.at("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight").sizes() == at::IntArrayRef({16, 4}));
  CHECK(adapter.at("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight").sizes() == at::IntArrayRef({4, 80}));
  CHECK(adapter.at("base_model.model.lm_head.lora_B.weight").sizes() == at::IntArrayRef({300, 4}));

  // PEFT's rule for nn.Linear on transformers' own weights: W (out, in) += (lora_alpha / r) lora_B @ lora_A;
  // the saved module replaces the base's.
  // On the base the job trained against: its bf16 copy of the imported weights, in f32.
  NamedTensors params;
  for (auto& [n, t] : test::checkpoint_tensors(ck))
    if (n.rfind("params/", 0) == 0 && !is_adapter_param(n.substr(7))) params.emplace_back(n.substr(7), t.to(torch::kFloat32));
  NamedTensors hf = to_hf(ModelFamily::Llama, params);
  const double scaling = cfg["lora_alpha"].get<double>() / cfg["r"].get<double>();
  int applied = 0, replaced = 0;
  for (auto& [n, w] : hf) {
    const std::string mod = "base_model.model." + n.substr(0, n.size() - std::string(".weight").size());
    if (adapter.count(mod + ".lora_A.weight")) {
      w = w + scaling * torch::mm(adapter.at(mod + ".lora_B.weight"), adapter.at(mod + ".lora_A.weight"));
      ++applied;
    }
    if (adapter.count("base_model.model." + n)) {
      w = adapter.at("base_model.model." + n);
      ++replaced;
    }
  }
  CHECK(applied == 7);
  CHECK(replaced == 1);
  CausalLM m = make_model(lora.trainer->model()->options());
  {
    torch::NoGradGuard ng;
    auto merged = by_name(from_hf(ModelFamily::Llama, hf, named_params(*m), "peft-merged"));
    for (auto& [n, t] : named_params(*m)) t.copy_(merged.at(n));
    m->eval();
    CHECK(max_diff(m->forward(ids), ours) < 1e-4);
  }
  // The merged export is a LlamaForCausalLM that re-imports as the same model.
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  CHECK(nlohmann::json::parse(read_file(d / "hf/config.json"))["architectures"][0] == "LlamaForCausalLM");
  import_hf(d / "hf", d / "hf_again");
  CHECK(max_diff(test::load(d / "hf_again").logits(ids), ours) < 1e-4);
  test::keep_for_hf_check("llama", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}

TEST_CASE("trainable_token_indices on an imported Llama (untied head): PEFT's files, and the merged export reproduces our model", "[huggingface][llama][tokens]") {
  test::TempDir d;
  const std::string g = test::hf_golden("llama");
  const std::vector<int64_t> rows = {32, 101};  // ' ' and 'e': in the data, so their input rows train
  const std::string ck = test::adapt_imported(d, g,
                                              {R"(optimization/lora/target_modules=["q_proj","v_proj"])",
                                               R"(optimization/lora/trainable_token_indices={"embed_tokens":[32,101]})"});
  test::Loaded lora = test::load(ck);
  // The golden ids with the trained tokens among them: an untied head leaves them the input rows alone.
  torch::Tensor ids = test::golden_ids(g).contiguous();
  ids[0][3] = 32;
  ids[1][5] = 101;
  ids[1][9] = 32;
  const torch::Tensor ours = lora.logits(ids);
  const auto& trained = dynamic_cast<Trainer&>(*lora.trainer).trainable_tokens();
  REQUIRE(trained.name == "model.embed_tokens.weight");

  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["trainable_token_indices"] == nlohmann::json(rows));
  auto adapter = by_name(read_safetensors(d / "peft/adapter_model.safetensors"));
  CHECK(adapter.size() == 2 * 2 * 2 + 1);
  const torch::Tensor delta = adapter.at("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta");
  CHECK(torch::equal(delta, trained.values.cpu()));  // the job's on its device
  auto imported = by_name(read_checkpoint_tensors(d / "imported"));
  for (int64_t r = 0; r < 2; ++r)  // trained
    CHECK_FALSE(torch::equal(delta[r], imported.at("params/model.embed_tokens.weight")[rows[r]].to(torch::kFloat32)));
  // The untied lm_head keeps its (frozen bf16) weights: only the input rows are replaced, as in PEFT's list form.
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  auto hf = by_name(read_safetensors(d / "hf/model.safetensors"));
  auto base = by_name(read_safetensors(g + "/model/model.safetensors"));
  CHECK(torch::equal(hf.at("model.embed_tokens.weight").index_select(0, torch::tensor(rows)), delta));
  CHECK(torch::equal(hf.at("lm_head.weight"), base.at("lm_head.weight").to(torch::kBFloat16).to(torch::kFloat32)));
  import_hf(d / "hf", d / "hf_again");
  CHECK(max_diff(test::load(d / "hf_again").logits(ids), ours) < 1e-4);
  test::keep_for_hf_check("tokens_llama", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}

TEST_CASE("a llama-family job crosses the LoRA boundary, and resume in either phase is bit-identical", "[lora][llama]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  auto make = [&](const std::string& name, const std::vector<std::string>& extra = {}) {
    return make_lora_train(
        test::job_spec(name),
        test::tiny_config(Trainer::lora_schema(), dir / "data", kTinyLlama, test::two_phase_overrides(), extra), dir / "out");
  };
  auto straight = make("straight");
  REQUIRE(straight->total_steps() == 10);
  CHECK(straight->model()->named_parameters().contains("lm_head.weight"));
  CHECK(straight->model()->named_parameters().contains("model.layers.1.self_attn.k_proj.bias"));
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  CHECK(straight->in_lora_phase());
  CHECK(losses[4] < losses[0]);  // phase one learns
  // The default target_modules, PEFT's "all-linear": the seven projections of each layer, not lm_head.
  CHECK(straight->lora_params().names.size() == 2 * 7);
  CHECK(straight->lora_params().names[0] == "model.layers.0.self_attn.q_proj.weight");
  CHECK(straight->lora_params().names.back() == "model.layers.1.mlp.down_proj.weight");
  for (auto [name, k] : std::vector<std::pair<std::string, int>>{{"p1", 3}, {"p2", 8}}) {
    INFO(name);
    {
      auto first = make(name);
      for (int i = 0; i < k; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
      first->save("ntoks/" + std::to_string(first->tokens()));
    }
    auto resumed = make(name);
    resumed->restore_from_path("ntoks/" + std::to_string(k * 128));
    for (int64_t i = resumed->step(); i < 10; ++i) REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
    test::require_same_state(*straight, *resumed);
  }
  // A checkpoint of this model does not load into one with another rotary base, whose shapes agree.
  auto other = make("other", {"architecture/rope_theta=10000"});
  CHECK_THROWS_WITH(other->restore_from_path(straight->job_dir() + "/pre_lora_checkpoint"),
                    Contains("holds weights of a model with architecture/rope_theta=500.0; this job has 10000.0"));
}

TEST_CASE("sample draws only ids its tokenizer can decode when the model's vocabulary is larger", "[llama]") {
  // Qwen2 pads its vocabulary past the tokenizer's; so does this test model (300) for the byte tokenizer (257).
  test::TempDir d;
  import_hf(test::hf_golden("llama") + "/model", d / "imported");
  test::Loaded l = test::load(d / "imported");
  GenerateOptions o;
  o.max_new_tokens = 200;
  o.temperature = 1.5;
  o.top_k = 0;
  const std::vector<uint32_t> prompt = {1, 2, 3};
  auto unlimited = generate(l.trainer->model(), l.trainer->runtime(), prompt, o);
  CHECK(*std::max_element(unlimited.begin(), unlimited.end()) >= 257);  // the model does put weight there
  o.vocab_limit = 257;
  auto limited = generate(l.trainer->model(), l.trainer->runtime(), prompt, o);
  CHECK(*std::max_element(limited.begin(), limited.end()) < 257);
}

TEST_CASE("q/k/v and gate/up adapters read their shared input in one product: the outputs and gradients of each layer's own forward", "[llama][lora][numerics]") {
  const int64_t in = 24, r = 4;
  // A frozen bf16 base (in f32 its plain adapters merge into the weights' casts instead: frozen_lora_linear,
  // each layer on its own), and a base still training in f32 (the shared product in f32).
  for (bool frozen : {true, false}) {
    INFO((frozen ? "frozen bf16 base" : "training f32 base"));
    torch::manual_seed(11);
    // q and v adapted, k not (PEFT's default targets), a fourth with DoRA (its own path).
    std::vector<Linear> layers = {Linear(in, 16, true), Linear(in, 8, true), Linear(in, 8, false), Linear(in, 12, false)};
    for (size_t i = 0; i < layers.size(); ++i) {
      layers[i]->weight.data().normal_(0, 0.2);
      if (frozen) layers[i]->freeze_weight(FrozenFormat::Bf16);
      if (frozen && layers[i]->bias.defined()) layers[i]->bias.requires_grad_(false);  // as transition_to_lora
      if (i == 1) continue;
      const int64_t out = layers[i]->weight.size(0);
      auto A = (torch::randn({in, r}) * 0.3).set_requires_grad(true), B = (torch::randn({r, out}) * 0.3).set_requires_grad(true);
      auto m = i == 3 ? (torch::rand({out}) + 0.5).set_requires_grad(true) : torch::Tensor();
      layers[i]->set_lora(A, B, 0.5 + static_cast<double>(i), m);
    }
    std::vector<LinearImpl*> ptrs;
    for (auto& l : layers) ptrs.push_back(l.get());
    CHECK(layers[0]->plain_lora());
    CHECK_FALSE(layers[1]->plain_lora());
    CHECK_FALSE(layers[3]->plain_lora());
    auto x0 = torch::randn({4, 5, in});  // 20 rows: enough for layer 0's merge to pay (24 x 16: 19.2)
    CHECK(layers[0]->merges_adapter(x0) == frozen);
    // f32, then bf16 autocast as training runs on CPUs with fast bf16.
    for (bool bf16 : {false, true}) {
      INFO((bf16 ? "bf16 autocast" : "f32"));
      auto grads = [&](bool shared) {
        auto x = x0.clone().set_requires_grad(true);
        std::vector<torch::Tensor> ys;
        {
          Runtime rt;
          rt.bf16_autocast = bf16;
          AutocastGuard autocast(rt);
          if (shared) {
            ys = linear_shared_input(x, ptrs);
          } else {
            for (auto& l : layers) ys.push_back(l->forward(x));
          }
        }
        torch::Tensor loss = torch::zeros({});
        for (size_t i = 0; i < ys.size(); ++i) loss = loss + (ys[i].to(torch::kFloat32) * static_cast<double>(i + 1)).sin().sum();
        for (auto& l : layers)
          for (auto& p : l->parameters())
            if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
        loss.backward();
        std::vector<torch::Tensor> out = ys;
        out.push_back(x.grad());
        for (auto& l : layers)
          for (auto& p : l->parameters())
            if (p.requires_grad()) out.push_back(p.grad().clone());
        return out;
      };
      auto own = grads(false), shared = grads(true);
      REQUIRE(own.size() == shared.size());
      const double tol = bf16 ? 2e-2 : 1e-5;
      for (size_t i = 0; i < own.size(); ++i) {
        INFO("tensor " << i);
        CHECK(max_diff(own[i].to(torch::kFloat32), shared[i].to(torch::kFloat32)) <= tol * (1 + own[i].abs().max().item<double>()));
      }
    }
  }
}

TEST_CASE("a trained tied head in bf16 on the CPU: its weight's gradient in blocks of rows is autograd's own", "[llama][lora][numerics]") {
  torch::manual_seed(12);
  const int64_t V = 20001, C = 16;  // more than two blocks of 8192 rows, and a last short one
  auto x0 = torch::randn({2, 3, C}), W0 = torch::randn({V, C}) * 0.1, g = torch::randn({2, 3, V});
  auto run = [&](bool ours) {
    auto x = x0.clone().set_requires_grad(true), W = W0.clone().set_requires_grad(true);
    Runtime rt;
    rt.bf16_autocast = true;
    AutocastGuard autocast(rt);
    auto y = ours ? output_logits(x, W, /*padded=*/false) : torch::linear(x, W);
    (y.to(torch::kFloat32) * g).sum().backward();
    return std::vector<torch::Tensor>{y.to(torch::kFloat32), x.grad(), W.grad()};
  };
  auto ours = run(true), theirs = run(false);
  CHECK(ours[2].scalar_type() == torch::kFloat32);
  for (size_t i = 0; i < ours.size(); ++i) {
    INFO("tensor " << i);
    CHECK(torch::equal(ours[i], theirs[i]));
  }
}
