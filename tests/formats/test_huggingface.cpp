// Hugging Face in and out: import-hf of a transformers GPT-2 against transformers' own logits
// (tests/data/hf_gpt2, made by scripts/hf_golden.py with transformers 5.12 / torch 2.14), the merged
// export's round trip, and the PEFT adapter's layout and effect.
//
// With LT_HF_CHECK_DIR set, the LoRA test leaves its exports and our logits there for
// scripts/hf_golden.py to check with transformers / safetensors / peft (docs/huggingface.md).
#include <cstdlib>
#include <filesystem>

#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kGolden = std::string(LT_SOURCE_DIR) + "/tests/data/hf_gpt2";

torch::Tensor golden_ids() { return test::golden_ids(kGolden); }
torch::Tensor golden_logits() { return test::golden_logits(kGolden); }
using test::Loaded;
using test::load;
using test::max_diff;

// A copy of the golden model directory with its tensors changed by `edit` (and config.json by `cfg`).
std::string edited_model(const test::TempDir& d, const std::string& name, const std::function<void(NamedTensors&)>& edit,
                         const std::function<void(nlohmann::json&)>& cfg = nullptr) {
  const std::string dir = d / name;
  fs::create_directories(dir);
  NamedTensors t = read_safetensors(kGolden + "/model/model.safetensors");
  edit(t);
  write_safetensors(dir + "/model.safetensors", t);
  auto c = nlohmann::json::parse(read_file(kGolden + "/model/config.json"));
  if (cfg) cfg(c);
  write_file_atomic(dir + "/config.json", c.dump(2));
  return dir;
}

}  // namespace

TEST_CASE("import-hf of a transformers GPT-2 gives transformers' logits", "[huggingface]") {
  test::TempDir d;
  const std::string out = d / "imported";
  auto arch = import_hf(kGolden + "/model", out);
  CHECK(std::find(arch.begin(), arch.end(), "architecture/activation=gelu_tanh") != arch.end());
  auto meta = read_checkpoint_metadata(out);
  CHECK(meta["weights_only"] == true);
  CHECK(meta["kind"] == "plain");
  CHECK(meta["config"]["architecture"]["block_size"] == 32);
  CHECK(meta["config"]["training"]["pre_lora_tokens"] == nlohmann::json::array());
  CHECK(meta["base_model"]["family"] == "gpt2");
  // f32 weights, f32 arithmetic on both sides; the differences are summation order (measured ~1e-6).
  Loaded l = load(out);
  auto ours = l.logits(golden_ids());
  auto ref = golden_logits();
  REQUIRE(ours.sizes() == ref.sizes());
  CHECK(max_diff(ours, ref) < 1e-4);
  CHECK(ref.std().item<double>() > 1.0);  // the reference is far from uniform, so the check means something

  // The same model saved by transformers in bf16 over two shards imports as those values, in bf16 (the
  // source's dtype: the checkpoint is the size of the files), or converted with --dtype.
  const std::string out16 = d / "imported_bf16", out32 = d / "imported_bf16_as_f32";
  import_hf(kGolden + "/model_bf16_sharded", out16);
  import_hf(kGolden + "/model_bf16_sharded", out32, false, "float32");
  auto a = read_checkpoint_tensors(out), b = read_checkpoint_tensors(out16), c = read_checkpoint_tensors(out32);
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() == c.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK(a[i].second.scalar_type() == torch::kFloat32);
    CHECK(b[i].second.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(b[i].second, a[i].second.to(torch::kBFloat16)));
    CHECK(torch::equal(c[i].second, b[i].second.to(torch::kFloat32)));
  }
  // A job loads the bf16 import as it loads the f32 one, cast once: the same model up to the bf16 rounding.
  Loaded l16 = load(out16);
  CHECK(torch::equal(l16.logits(golden_ids()), load(out32).logits(golden_ids())));
}

TEST_CASE("import-hf refuses a GPT-2 our gpt2 family cannot represent, naming it, and writes nothing", "[huggingface]") {
  test::TempDir d;
  const std::string out = d / "out";
  auto refused = [&](const std::string& dir, const std::string& text) {
    INFO(text);
    CHECK_THROWS_WITH(import_hf(dir, out), Contains(text));
    CHECK_FALSE(fs::exists(out));
    for (auto& e : fs::directory_iterator(d.path)) CHECK(e.path().filename().string().find(".tmp-") == std::string::npos);
  };
  auto same = [](NamedTensors&) {};
  refused(edited_model(d, "qwen3", same, [](auto& c) { c["model_type"] = "qwen3"; }),
          "model_type \"qwen3\" is not supported; import-hf reads gpt2 (GPT2LMHeadModel) and the llama family");
  refused(edited_model(d, "relu", same, [](auto& c) { c["activation_function"] = "relu"; }), "activation_function \"relu\"");
  refused(edited_model(d, "inverse", same, [](auto& c) { c["scale_attn_by_inverse_layer_idx"] = true; }),
          "scale_attn_by_inverse_layer_idx true");
  refused(edited_model(d, "untied", same, [](auto& c) { c["tie_word_embeddings"] = false; }), "tie_word_embeddings false");
  refused(edited_model(d, "missing",
                       [](NamedTensors& t) {
                         t.erase(std::remove_if(t.begin(), t.end(), [](auto& p) { return p.first == "transformer.h.1.mlp.c_fc.bias"; }),
                                 t.end());
                       }),
          "missing transformer.h.1.mlp.c_fc.bias (128)");
  refused(edited_model(d, "shape",
                       [](NamedTensors& t) {
                         for (auto& [n, x] : t)
                           if (n == "transformer.h.0.attn.c_proj.weight") x = torch::zeros({32, 31});
                       }),
          "transformer.h.0.attn.c_proj.weight: shape (32, 31), expected (32, 32) (Conv1D: (in, out))");
  refused(edited_model(d, "extra", [](NamedTensors& t) { t.emplace_back("transformer.h.2.ln_1.weight", torch::ones({32})); }),
          "unexpected tensor transformer.h.2.ln_1.weight (32)");  // the file's own key
  refused(edited_model(d, "lm_head", [](NamedTensors& t) { t.emplace_back("lm_head.weight", torch::ones({300, 32})); }),
          "lm_head.weight differs from transformer.wte.weight");
  refused(d / "nowhere", "is not a directory");
  // Older files (no "transformer." prefix, the causal-mask buffers, a tied lm_head.weight) are read.
  const std::string old = edited_model(d, "old", [](NamedTensors& t) {
    NamedTensors renamed;
    torch::Tensor wte;
    for (auto& [n, x] : t) {
      renamed.emplace_back(n.substr(std::string("transformer.").size()), x);
      if (n == "transformer.wte.weight") wte = x;
    }
    renamed.emplace_back("h.0.attn.bias", torch::ones({1, 1, 32, 32}));
    renamed.emplace_back("lm_head.weight", wte.clone());
    t = renamed;
  });
  CHECK_NOTHROW(import_hf(old, out));
  // A second import replaces the first (an earlier import); somebody's directory is refused.
  CHECK_NOTHROW(import_hf(kGolden + "/model", out));
  fs::create_directories(d / "mine");
  write_file_atomic(d / "mine/notes.txt", "keep me");
  CHECK_THROWS_WITH(import_hf(kGolden + "/model", d / "mine"), Contains("is not an earlier export or import"));
}

TEST_CASE("export --format hf writes transformers' files, and re-importing them is bit-exact", "[huggingface]") {
  test::TempDir d;
  import_hf(kGolden + "/model", d / "imported");
  export_hf(d / "imported", d / "hf");
  // The same tensors, names and layouts transformers wrote: bit for bit.
  NamedTensors theirs = read_safetensors(kGolden + "/model/model.safetensors");
  NamedTensors ours = read_safetensors(d / "hf/model.safetensors");
  REQUIRE(ours.size() == theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    INFO(theirs[i].first);
    CHECK(ours[i].first == theirs[i].first);
    CHECK(torch::equal(ours[i].second, theirs[i].second));
  }
  auto config = nlohmann::json::parse(read_file(d / "hf/config.json"));
  CHECK(config["architectures"] == nlohmann::json::array({"GPT2LMHeadModel"}));
  CHECK(config["model_type"] == "gpt2");
  CHECK(config["activation_function"] == "gelu_new");
  CHECK(config["n_positions"] == 32);
  CHECK(config["eos_token_id"] == 299);  // the imported model's own config is carried over
  // Re-import: the same checkpoint tensors.
  import_hf(d / "hf", d / "again");
  auto a = read_checkpoint_tensors(d / "imported"), b = read_checkpoint_tensors(d / "again");
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i].second, b[i].second));
  // Export's rule for OUT: an earlier export is replaced, anything else is refused.
  CHECK_NOTHROW(export_hf(d / "imported", d / "hf"));
  fs::create_directories(d / "mine");
  write_file_atomic(d / "mine/notes.txt", "keep me");
  CHECK_THROWS_WITH(export_hf(d / "imported", d / "mine"), Contains("is not an earlier export or import"));
  CHECK_THROWS_WITH(export_hf(d / "imported", d / "imported"), Contains("is the checkpoint being exported"));
  CHECK_THROWS_WITH(export_peft(d / "imported", d / "peft"), Contains("without adapters"));
  CHECK_FALSE(fs::exists(d / "peft"));
}

TEST_CASE("LoRA on an imported GPT-2: the PEFT adapter (with modules_to_save) and the merged export reproduce our model", "[huggingface]") {
  test::TempDir d;
  // A LoRA job without phase one on the imported base (vocab 300 holds the byte tokenizer's 257 ids).
  const std::string ck = test::adapt_imported(
      d, kGolden,
      {R"(optimization/lora/target_modules=["attn.c_attn","mlp.c_fc","mlp.c_proj"])",
       // The token embedding (tied to the output head) and the final norm train in full beside the adapters.
       R"(optimization/lora/modules_to_save=["wte","ln_f"])", "optimization/lora/modules_to_save_lr_ratio=0.5",
       "optimization/lora/rslora=true"});  // scaling lora_alpha / sqrt(r), PEFT's use_rslora
  REQUIRE(read_checkpoint_metadata(ck)["kind"] == "lora");
  CHECK(read_checkpoint_metadata(ck)["base_model"]["family"] == "gpt2");
  Loaded lora = load(ck);
  const torch::Tensor ids = golden_ids();
  const torch::Tensor ours = lora.logits(ids);
  auto base = load(d / "imported").logits(ids);
  REQUIRE(max_diff(ours, base) > 1e-2);  // the adapters changed the model

  // PEFT's files: the documented config and keys, lora_A (r, in), lora_B (out, r).
  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["peft_type"] == "LORA");
  CHECK(cfg["task_type"] == "CAUSAL_LM");
  CHECK(cfg["r"] == 4);
  CHECK(cfg["lora_alpha"] == 8.0);
  CHECK(cfg["fan_in_fan_out"] == true);
  CHECK(cfg["bias"] == "none");
  // "c_proj" alone would make PEFT adapt attn.c_proj too, so the names keep their parent module.
  CHECK(cfg["target_modules"] == nlohmann::json::array({"attn.c_attn", "mlp.c_fc", "mlp.c_proj"}));
  CHECK(cfg["base_model_name_or_path"] == fs::absolute(kGolden + "/model").lexically_normal().string());
  // PEFT lists whole modules; the tied head is listed beside the embedding so that both get the trained tensor.
  CHECK(cfg["modules_to_save"] == nlohmann::json::array({"transformer.ln_f", "transformer.wte", "lm_head"}));
  CHECK(cfg["ensure_weight_tying"] == true);  // the tied wte and lm_head copies stay one tensor in PEFT
  CHECK(cfg["init_lora_weights"] == "gaussian");
  CHECK(cfg["use_rslora"] == true);
  NamedTensors adapter = read_safetensors(d / "peft/adapter_model.safetensors");
  CHECK(adapter.size() == 2 * 3 * 2 + 4);  // + ln_f weight and bias, wte, lm_head
  std::map<std::string, torch::Tensor> by_name(adapter.begin(), adapter.end());
  CHECK(by_name.at("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight").sizes() == at::IntArrayRef({4, 32}));
  CHECK(by_name.at("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight").sizes() == at::IntArrayRef({96, 4}));
  CHECK(by_name.at("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight").sizes() == at::IntArrayRef({4, 128}));
  CHECK(by_name.at("base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight").sizes() == at::IntArrayRef({32, 4}));

  // Applied as PEFT applies them to the Hugging Face weights (Conv1D, fan_in_fan_out):
  // W (in, out) += (lora_alpha / r) (lora_B @ lora_A)^T, on the base our LoRA job trained against.
  // The saved modules start from the imported values, as in the base PEFT loads.
  std::map<std::string, torch::Tensor> imported;
  for (auto& [n, t] : read_checkpoint_tensors(d / "imported")) imported[n] = t.to(torch::kFloat32);
  NamedTensors params;
  for (auto& [n, t] : test::checkpoint_tensors(ck)) {
    if (n.rfind("params/", 0) != 0 || is_adapter_param(n.substr(7))) continue;  // the base: not the adapters
    const bool saved = n == "params/wte.weight" || n.rfind("params/ln_f.", 0) == 0;
    params.emplace_back(n.substr(7), saved ? imported.at(n) : t.to(torch::kFloat32));
  }
  NamedTensors hf = to_hf(ModelFamily::Gpt2, params);
  const double scaling = cfg["lora_alpha"].get<double>() / std::sqrt(cfg["r"].get<double>());  // use_rslora
  int applied = 0;
  for (auto& [n, w] : hf) {
    const std::string mod = "base_model.model." + n.substr(0, n.size() - std::string(".weight").size());
    auto a = by_name.find(mod + ".lora_A.weight");
    if (a == by_name.end()) continue;
    w = w + scaling * torch::mm(by_name.at(mod + ".lora_B.weight"), a->second).t();
    ++applied;
  }
  CHECK(applied == 6);
  // modules_to_save replace their modules' weights (base_model.model.<module>.<param>) in the base as
  // PEFT loads it: the imported model, whose embedding and final norm this job then trained.
  int replaced = 0;
  for (auto& [n, w] : hf) {
    auto saved = by_name.find("base_model.model." + n);
    if (saved == by_name.end()) continue;
    const std::string ours_name = "params/" + n.substr(std::string("transformer.").size());
    CHECK_FALSE(torch::equal(saved->second, imported.at(ours_name)));  // trained
    w = saved->second;
    ++replaced;
  }
  CHECK(replaced == 3);
  CHECK(torch::equal(by_name.at("base_model.model.lm_head.weight"), by_name.at("base_model.model.transformer.wte.weight")));
  auto merged_params = from_hf(ModelFamily::Gpt2, hf, params, "peft-merged");
  CausalLM m = make_model(lora.trainer->model()->options());
  {
    torch::NoGradGuard ng;
    std::map<std::string, torch::Tensor> merged_by_name(merged_params.begin(), merged_params.end());
    for (auto& [n, t] : named_params(*m)) t.copy_(merged_by_name.at(n));
    m->eval();
    CHECK(max_diff(m->forward(ids), ours) < 1e-4);
  }

  // The merged Hugging Face export, re-imported, is the same model too.
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  import_hf(d / "hf", d / "hf_again");
  CHECK(max_diff(load(d / "hf_again").logits(ids), ours) < 1e-4);

  test::keep_for_hf_check("", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}

TEST_CASE("trainable_token_indices on an imported GPT-2 (tied head): PEFT's files, and the merged export reproduces our model", "[huggingface][tokens]") {
  test::TempDir d;
  // 32 (' ') and 101 ('e') occur in the data; 299 lies past the byte ids and trains through the tied head alone.
  const std::vector<int64_t> rows = {32, 101, 299};
  const std::string ck = test::adapt_imported(d, kGolden,
                                              {R"(optimization/lora/target_modules=["attn.c_attn"])",
                                               R"(optimization/lora/trainable_token_indices=[32,101,299])"});
  Loaded lora = load(ck);
  torch::Tensor ids = golden_ids().contiguous();  // with the trained tokens among them
  ids[0][3] = 101;
  ids[1][5] = 299;
  const torch::Tensor ours = lora.logits(ids);
  const auto& trained = dynamic_cast<Trainer&>(*lora.trainer).trainable_tokens();
  REQUIRE(trained.ids == rows);

  // PEFT's layout: the ids in adapter_config.json (the list form: the input embedding, which PEFT ties
  // to the output head), the rows' values under the embedding's token_adapter, nothing for lm_head.
  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["trainable_token_indices"] == nlohmann::json(rows));
  CHECK(cfg["modules_to_save"].is_null());
  std::map<std::string, torch::Tensor> adapter;
  for (auto& [n, t] : read_safetensors(d / "peft/adapter_model.safetensors")) adapter[n] = t;
  CHECK(adapter.size() == 2 * 2 + 1);
  const torch::Tensor delta = adapter.at("base_model.model.transformer.wte.token_adapter.trainable_tokens_delta");
  CHECK(delta.sizes() == at::IntArrayRef({3, 32}));
  CHECK(torch::equal(delta, trained.values.cpu()));  // the job's on its device (CUDA where there is one)
  std::map<std::string, torch::Tensor> imported;
  for (auto& [n, t] : read_checkpoint_tensors(d / "imported")) imported[n] = t.to(torch::kFloat32);
  for (int64_t r = 0; r < 3; ++r) CHECK_FALSE(torch::equal(delta[r], imported.at("params/wte.weight")[rows[r]]));

  // The merged export (rows replaced in wte, which the head shares) re-imports as the same model.
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  import_hf(d / "hf", d / "hf_again");
  CHECK(max_diff(load(d / "hf_again").logits(ids), ours) < 1e-4);
  test::keep_for_hf_check("tokens", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}

TEST_CASE("launcher: import-hf, LoRA without phase one, eval and sample, export --format peft and hf", "[huggingface][launcher]") {
  using test::launch;
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  test::Result imp = launch({"import-hf", kGolden + "/model", d / "base"});
  INFO(imp.out);
  REQUIRE(imp.code == 0);
  CHECK_THAT(imp.out, Contains("architecture/activation=gelu_tanh"));
  // The overrides import-hf printed, with this test's data and sizes.
  std::vector<std::string> args = {"configure", "lora/train", d / "ft.json"};
  for (std::string o : {"architecture/vocab_size=300", "architecture/block_size=32", "architecture/n_layers=2",
                        "architecture/n_heads=4", "architecture/d_model=32", "architecture/activation=gelu_tanh",
                        "training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[640]",
                        R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "training/batch_size=4",
                        "optimization/lora/rank=4", "runtime/threads=2", "training/validation_steps=4"})
    args.push_back(o);
  args.push_back("data/dir=\"" + (d / "data") + "\"");
  REQUIRE(launch(args).code == 0);
  // A job with the other GELU would load the same shapes: refused, saying which activation to set.
  test::Result wrong = launch({"run", "wrong", d / "ft.json", d / "out", "--restore", d / "base", "architecture/activation=gelu"});
  CHECK(wrong.code == 2);
  CHECK_THAT(wrong.out, Contains("architecture/activation=gelu_tanh; this job has gelu"));
  test::Result run = launch({"run", "ft", d / "ft.json", d / "out", "--restore", d / "base"});
  INFO(run.out);
  REQUIRE(run.code == 0);
  CHECK_THAT(run.out, Contains("transition to LoRA at step 0"));
  const std::string ck = d / "out/checkpoints/general/default/ft/final/640";
  CHECK(launch({"eval", d / "base", "--dataset", "gen", "--rows", "2", "data/dir=\"" + (d / "data") + "\""}).code == 0);
  CHECK(launch({"sample", d / "base", "--prompt", "the cat", "--tokens", "5", "--tokenizer", "byte"}).code == 0);
  test::Result peft = launch({"export", "--format", "peft", ck, d / "peft"});
  INFO(peft.out);
  CHECK(peft.code == 0);
  CHECK(fs::exists(d / "peft/adapter_model.safetensors"));
  CHECK(launch({"export", "--format", "hf", ck, d / "hf"}).code == 0);
  CHECK(fs::exists(d / "hf/config.json"));
  // User errors: exit 2, nothing written.
  CHECK(launch({"export", "--format", "peft", d / "base", d / "peft2"}).code == 2);
  CHECK_FALSE(fs::exists(d / "peft2"));
  CHECK(launch({"export", "--format", "hf", ck, d / "data"}).code == 2);
  CHECK(launch({"import-hf", d / "data", d / "base2"}).code == 2);
  CHECK_FALSE(fs::exists(d / "base2"));
  // The default format is unchanged: a weights-only checkpoint.
  CHECK(launch({"export", ck, d / "merged"}).code == 0);
  CHECK(read_checkpoint_metadata(d / "merged")["weights_only"] == true);
}
