// GGUF for llama.cpp, checked with the real llama.cpp: node-llama-cpp's prebuilt one, which
// scripts/fetch_llama_cpp.sh installs (tests/tools/llama_cpp_logits.mjs runs it). Without it the
// checks that need it are skipped with a note; the refusals are checked either way.
//   - imported transformers GPT-2, Llama and Qwen2 models, exported as model.gguf: llama.cpp's logits
//     are transformers' (tests/data/hf_*/logits.safetensors);
//   - a LoRA job on each: the base's model.gguf with our adapter.gguf loaded over it, and the merged
//     model.gguf, give our LoRA model's logits in llama.cpp;
//   - model.gguf carrying the GPT-2, Llama 3 and Qwen2 layouts' tokenizers: llama.cpp tokenizes the
//     golden strings into the tokenizers library's ids (Qwen2's after NFC, which llama.cpp does not apply).
#include <utf8proc.h>

#include <cstdlib>
#include <filesystem>
#include <optional>

#include "catch.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/formats/gguf_export.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using namespace lt;
using namespace lt::test;
using nlohmann::json;

namespace {

// llama.cpp computes with an f16 KV cache: its logits differ from f32 ones by up to ~1e-2 here.
constexpr double kLlamaCppTolerance = 0.03;

// What llama.cpp computes for `request` (llama_cpp_logits.mjs), or nothing, with a note, where
// node-llama-cpp is not installed.
std::optional<json> llama_cpp(const TempDir& d, const json& request) {
  static int n = 0;
  const std::string file = d / ("request" + std::to_string(n++) + ".json");
  write_file_atomic(file, request.dump());
  const Result r = shell("node " + quote(std::string(LT_SOURCE_DIR) + "/tests/tools/llama_cpp_logits.mjs") + " " + quote(file));
  if (r.code == 3 || r.code == 127) {
    WARN("skipped the llama.cpp check: " << r.out << "(bash scripts/fetch_llama_cpp.sh installs node-llama-cpp)");
    return std::nullopt;
  }
  INFO(r.out.substr(0, 2000));
  REQUIRE(r.code == 0);
  return json::parse(r.out);
}

json id_rows(const torch::Tensor& ids) {
  json rows = json::array();
  for (int64_t r = 0; r < ids.size(0); ++r)
    rows.push_back(std::vector<int64_t>(ids[r].data_ptr<int64_t>(), ids[r].data_ptr<int64_t>() + ids.size(1)));
  return rows;
}

torch::Tensor logits_of(const json& response) {
  std::vector<float> flat;
  const auto& l = response["logits"];
  for (const auto& seq : l)
    for (const auto& row : seq)
      for (const auto& v : row) flat.push_back(v.get<float>());
  return torch::tensor(flat).reshape({(int64_t)l.size(), (int64_t)l[0].size(), (int64_t)l[0][0].size()});
}

std::optional<torch::Tensor> llama_cpp_logits(const TempDir& d, const std::string& model, const torch::Tensor& ids,
                                              const std::string& adapter = "") {
  json request = {{"model", model}, {"sequences", id_rows(ids)}};
  if (!adapter.empty()) request["adapter"] = adapter;
  auto r = llama_cpp(d, request);
  if (!r) return std::nullopt;
  return logits_of(*r);
}

std::string nfc_of(const std::string& text) {
  utf8proc_uint8_t* out = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
  REQUIRE(out);
  std::string s(reinterpret_cast<const char*>(out));
  std::free(out);
  return s;
}

GgufExportOptions with(const std::string& tokenizer, const std::string& dtype = "source") {
  GgufExportOptions o;
  o.tokenizer = tokenizer;
  o.dtype = dtype;
  return o;
}

}  // namespace

TEST_CASE("GGUF: imported GPT-2, Llama, Llama 3.1 and Qwen2 models give transformers' logits in llama.cpp", "[gguf]") {
  // llama3: Llama 3.1's frequency scaling, which llama.cpp takes as rope_freqs.weight.
  for (const std::string family : {"gpt2", "llama", "qwen2", "llama3"}) {
    INFO(family);
    TempDir d;
    import_hf(hf_golden(family) + "/model", d / "imported");
    // Vocabulary 300: the byte tokenizer's 257 tokens, then "[PADn]" tokens.
    export_gguf(d / "imported", d / "gguf", with("byte"));
    const torch::Tensor ids = golden_ids(hf_golden(family));
    auto got = llama_cpp_logits(d, d / "gguf/model.gguf", ids);
    if (!got) return;
    const torch::Tensor expected = golden_logits(hf_golden(family));
    REQUIRE(got->sizes() == expected.sizes());
    const double f32 = max_diff(*got, expected);
    CHECK(f32 < kLlamaCppTolerance);
    // Half-precision weights: the same model within their rounding.
    export_gguf(d / "imported", d / "gguf16", with("byte", "float16"));
    export_gguf(d / "imported", d / "gguf_bf16", with("byte", "bfloat16"));
    const double f16 = max_diff(*llama_cpp_logits(d, d / "gguf16/model.gguf", ids), expected);
    const double bf16 = max_diff(*llama_cpp_logits(d, d / "gguf_bf16/model.gguf", ids), expected);
    CHECK(f16 < 0.1);
    CHECK(bf16 < 0.3);
    std::printf("GGUF %s: llama.cpp against transformers, largest logit difference: float32 %.4f, float16 %.4f, "
                "bfloat16 %.4f (logits up to %.1f)\n",
                family.c_str(), f32, f16, bf16, expected.abs().max().item<double>());
  }
}

TEST_CASE("GGUF: our LoRA adapter over the base in llama.cpp, and the merged model, give our LoRA model's logits", "[gguf]") {
  struct Case {
    std::string family;
    std::vector<std::string> settings;
  };
  const std::vector<Case> cases = {
      // q and k: their rows, and their adapters' B, are permuted for llama.cpp's rotation; rsLoRA's scale
      // goes into alpha.
      {"llama", {R"(optimization/lora/target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"])",
                 "optimization/lora/rslora=true"}},
      {"qwen2", {R"(optimization/lora/target_modules=["q_proj","k_proj","v_proj","o_proj","down_proj"])"}},
      {"gpt2", {R"(optimization/lora/target_modules=["attn.c_attn","attn.c_proj","mlp.c_fc","mlp.c_proj"])"}}};
  for (const auto& c : cases) {
    INFO(c.family);
    TempDir d;
    auto settings = c.settings;
    settings.push_back("optimization/lora/lr=0.05");  // adapters that move the logits well past llama.cpp's rounding
    // Imported in bf16, as the LoRA phase freezes it: the base's GGUF below holds the frozen values in
    // float32 (llama.cpp rounds the activations to bf16 against bf16 weights, which we do not).
    make_byte_dataset(d / "data", "gen", 1);
    import_hf(hf_golden(c.family) + "/model", d / "imported", false, "bfloat16");
    const std::string ck = run_imported_lora(imported_lora_config(d / "imported", d / "data", settings), d / "imported", d / "out");
    const torch::Tensor ids = golden_ids(hf_golden(c.family));
    const torch::Tensor ours = load(ck).logits(ids);
    const double moved = max_diff(ours, load(d / "imported", {"optimization/lora/rank=4"}).logits(ids));
    REQUIRE(moved > 10 * kLlamaCppTolerance);

    // The base as the LoRA phase froze it, our adapter over it.
    export_gguf(d / "imported", d / "base", with("byte", "float32"));
    export_gguf_adapter(ck, d / "adapter", with("auto"));
    export_gguf(ck, d / "merged", with("byte", "float32"));
    auto base_only = llama_cpp_logits(d, d / "base/model.gguf", ids);
    if (!base_only) return;
    CHECK(max_diff(*base_only, ours) > 10 * kLlamaCppTolerance);  // the adapter is what closes the gap below
    const double adapter = max_diff(*llama_cpp_logits(d, d / "base/model.gguf", ids, d / "adapter/adapter.gguf"), ours);
    const double merged = max_diff(*llama_cpp_logits(d, d / "merged/model.gguf", ids), ours);
    CHECK(adapter < kLlamaCppTolerance);
    CHECK(merged < kLlamaCppTolerance);
    std::printf("GGUF %s LoRA: llama.cpp against our LoRA model, largest logit difference: base + adapter.gguf %.4f, "
                "merged %.4f; the adapters moved the logits by up to %.3f\n",
                c.family.c_str(), adapter, merged, moved);
  }
}

TEST_CASE("GGUF: the tokenizer in model.gguf tokenizes in llama.cpp as the tokenizers library does", "[gguf]") {
  // A model of each tokenizer's vocabulary size (its weights do not matter here), llama family.
  for (const std::string style : {"gpt2", "llama3", "qwen2"}) {
    INFO(style);
    const std::string dir = std::string(LT_SOURCE_DIR) + "/tests/data/hf_tokenizers/" + style;
    const json golden = read_json_file(dir + "/golden.json");
    TempDir d;
    make_byte_dataset(d / "data", "gen", 1, 2, 200);
    JobSpec s;
    s.name = "vocab";
    Trainer t(s, tiny_config(Trainer::schema(), d / "data",
                             std::vector<std::string>{"architecture/family=llama", "architecture/activation=silu",
                                                      "architecture/vocab_size=" + std::to_string(golden["vocab_size"].get<int>()),
                                                      "training/tokens=128", R"(training/dataset=[{"name":"gen","rate":1}])",
                                                      "runtime/precision=f32"}),
              d / "out");
    t.run();
    const std::string ck = d / "out/checkpoints/general/default/vocab/final/128";
    export_gguf(ck, d / "gguf", with("hf:" + dir));
    // llama.cpp applies no Unicode normalization: text that Qwen2's NFC changes is given to it as NFC
    // already (as the library normalizes it before splitting), every other text as it is.
    json texts = json::array();
    int normalized = 0;
    for (const auto& e : golden["strings"]) {
      const std::string text = e["text"];
      const std::string nfc = style == "qwen2" ? nfc_of(text) : text;
      normalized += nfc != text;
      texts.push_back(nfc);
    }
    if (style == "qwen2") CHECK(normalized > 3);
    auto r = llama_cpp(d, {{"model", d / "gguf/model.gguf"}, {"texts", texts}});
    if (!r) return;
    int same = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      INFO("text " << texts[i].dump());
      CHECK((*r)["tokens"][i] == golden["strings"][i]["ids"]);
      same += (*r)["tokens"][i] == golden["strings"][i]["ids"];
    }
    CHECK(same > 10);
  }
}

TEST_CASE("GGUF: exports llama.cpp cannot take are refused with exit 2, naming why, and write nothing", "[gguf][launcher]") {
  TempDir d;
  import_hf(hf_golden("llama") + "/model", d / "imported");
  // The project's GPT-2 tokenizer (50,257 tokens) on a model of 300.
  Result r = launch({"export", d / "imported", d / "x", "--format", "gguf", "--tokenizer", "gpt2"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("has 50257 tokens, more than the model's vocabulary (300)"));
  CHECK_FALSE(fs::exists(d / "x"));
  // An adapter of a checkpoint without adapters.
  r = launch({"export", d / "imported", d / "x", "--format", "gguf-adapter"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("without adapters"));
  CHECK_FALSE(fs::exists(d / "x"));
  // DoRA has no llama.cpp adapter form.
  make_byte_dataset(d / "data", "gen", 1);
  const std::string ck = run_imported_lora(
      imported_lora_config(d / "imported", d / "data", {"optimization/lora/dora=true"}), d / "imported", d / "out");
  r = launch({"export", ck, d / "x", "--format", "gguf-adapter"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("DoRA (optimization/lora/dora), which a llama.cpp LoRA adapter cannot hold"));
  CHECK_FALSE(fs::exists(d / "x"));
  // --tokenizer belongs to --format gguf; float16 to gguf.
  r = launch({"export", ck, d / "x", "--format", "hf", "--tokenizer", "byte"});
  CHECK(r.code == 2);
  r = launch({"export", ck, d / "x", "--format", "hf", "--dtype", "float16"});
  CHECK(r.code == 2);
  CHECK_FALSE(fs::exists(d / "x"));
  // The merged model of the DoRA checkpoint is fine.
  r = launch({"export", ck, d / "x", "--format", "gguf", "--tokenizer", "byte"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(fs::exists(d / "x/model.gguf"));
}
