// What an export (and sample, eval) takes from a checkpoint must be what the checkpoint holds, or a
// refusal that says so (issue 58): `--tokenizer auto` is the tokenizer the job's data was tokenized
// with, never GPT-2's by default; a dtype that cannot hold a value is refused, never written as inf;
// `gguf-adapter` refuses what llama.cpp cannot apply as an adapter, as docs/llama_cpp.md says.
#include <cmath>
#include <filesystem>
#include <functional>
#include <tuple>

#include "catch.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "launch.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/data/tokenizer_choice.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using namespace lt;
using namespace lt::test;
using nlohmann::json;

namespace {

const std::string kTokenizers = std::string(LT_SOURCE_DIR) + "/tests/data/hf_tokenizers";


// `src`'s tensors, edited, saved with its metadata as the checkpoint `dst`.
std::string rewritten(const std::string& src, const std::string& dst, const std::function<void(NamedTensors&)>& edit) {
  NamedTensors t = read_checkpoint_tensors(src);
  edit(t);
  save_checkpoint(dst, t, read_checkpoint_metadata(src));
  return dst;
}

torch::Tensor& tensor(NamedTensors& all, const std::string& name) {
  for (auto& [n, t] : all)
    if (n == name) return t;
  FAIL("no tensor " << name);
  static torch::Tensor none;
  return none;
}

// Generated text tokenized with `tokenizer` as the PMD dataset `name` under `data`.
void make_dataset(const std::string& data, const std::string& name, const std::string& tokenizer) {
  const fs::path src = fs::path(data) / ("src-" + name);
  fs::create_directories(src);
  for (int i = 0; i < 4; ++i) write_file_atomic((src / ("doc" + std::to_string(i) + ".txt")).string(), generated_text(i, 300));
  TokenizeOptions o;
  o.inputs = {src.string()};
  o.out_dir = (fs::path(data) / name).string();
  o.tokenizer = tokenizer;
  o.val_fraction = 0.25;
  tokenize_to_pmd(o);
}

}  // namespace

TEST_CASE("tokenizer auto: the tokenizer a job's data was tokenized with, recorded in its checkpoints, else a refusal",
          "[tokenizer][gguf][export]") {
  TempDir d;
  // A copy of the 600-token test tokenizer, to move later; a model of 640 ids, which is neither the
  // byte tokenizer's vocabulary nor GPT-2's, trained two steps on its ids.
  const std::string tok = d / "tok";
  fs::create_directories(tok);
  fs::copy_file(kTokenizers + "/gpt2/tokenizer.json", tok + "/tokenizer.json");
  make_dataset(d / "data", "hfgen", "hf:" + tok);
  Trainer t(job_spec("hf"), tiny_config(Trainer::schema(), d / "data",
                                        std::vector<std::string>{"architecture/vocab_size=640", "training/tokens=256",
                                                                 R"(training/dataset=[{"name":"hfgen","rate":1}])"}),
            d / "out");
  t.run();
  const std::string ck = d / "out/checkpoints/general/default/hf/final/256";
  CHECK(read_checkpoint_metadata(ck)["tokenizer"] == "hf:" + tok);
  write_file_atomic(d / "task.jsonl", R"({"question": "the cat", "choices": ["sat", "ran"], "answer": 0})" "\n");

  Result r = launch({"export", ck, d / "g", "--format", "gguf"});
  succeeded(r);
  CHECK_THAT(r.out, Contains("tokenizer hf:" + tok));
  r = launch({"eval", ck, "--task", d / "task.jsonl"});
  succeeded(r);
  CHECK_THAT(r.out, Contains("(tokenizer hf:" + tok + ")"));
  succeeded(launch({"sample", ck, "--prompt", "the cat", "--tokens", "2"}));
  // An export of it carries the record; with the data moved away the record still says.
  succeeded(launch({"export", ck, d / "merged"}));
  CHECK(read_checkpoint_metadata(d / "merged")["tokenizer"] == "hf:" + tok);
  fs::rename(d / "data", d / "data-moved");
  r = launch({"export", d / "merged", d / "g2", "--format", "gguf"});
  succeeded(r);
  CHECK_THAT(r.out, Contains("tokenizer hf:" + tok));

  // The tokenizer's directory moved: every `auto` refuses, naming it, and writes nothing.
  fs::rename(tok, d / "tok-moved");
  for (const auto& args : std::vector<std::vector<std::string>>{{"export", ck, d / "g3", "--format", "gguf"},
                                                                {"eval", ck, "--task", d / "task.jsonl"},
                                                                {"sample", ck, "--prompt", "the cat"}}) {
    INFO(args[0]);
    refused(launch(args), {"hf:" + tok, "tokenizer.json", "--tokenizer hf:DIR"});
  }
  CHECK_FALSE(fs::exists(d / "g3"));
  succeeded(launch({"export", ck, d / "g3", "--format", "gguf", "--tokenizer", "hf:" + d / "tok-moved"}));

  // A checkpoint that records none (saved before checkpoints did), its datasets gone: a refusal, not
  // GPT-2's tokenizer; with its datasets back, their meta.json tells.
  const std::string old = rewritten(ck, d / "old", [](NamedTensors&) {});
  {
    json m = read_checkpoint_metadata(old);
    m.erase("tokenizer");
    write_file_atomic(old + "/metadata.json", m.dump(2));
  }
  fs::rename(d / "tok-moved", tok);
  r = launch({"export", old, d / "g4", "--format", "gguf"});
  refused(r, {"cannot tell which tokenizer", old, "a vocabulary of 640", "--tokenizer hf:DIR"});
  CHECK(r.out.find("tokenizer gpt2") == std::string::npos);
  CHECK_FALSE(fs::exists(d / "g4"));
  refused(launch({"sample", old, "--prompt", "the cat"}), {"cannot tell which tokenizer", "--tokenizer hf:DIR"});
  fs::rename(d / "data-moved", d / "data");
  r = launch({"export", old, d / "g4", "--format", "gguf"});
  succeeded(r);
  CHECK_THAT(r.out, Contains("tokenizer hf:" + tok));

  // Datasets of two tokenizers: no one of them is the model's.
  make_byte_dataset(d / "data", "gen", 1, 2, 200);
  CHECK_THROWS_WITH(datasets_tokenizer(d / "data", {"hfgen", "gen"}),
                    Contains("different tokenizers") && Contains("hf:" + tok) && Contains("byte"));
  // Where nothing else tells, a vocabulary only one tokenizer has.
  TokenizerClues c;
  c.checkpoint = "ck";
  for (const auto& [vocab, name] : std::vector<std::pair<int64_t, std::string>>{{257, "byte"}, {50257, "gpt2"}, {50304, "gpt2"}}) {
    c.vocab_size = vocab;
    CHECK(auto_tokenizer(c, "x") == name);
  }
  for (int64_t vocab : {300, 32000, 128256}) {
    c.vocab_size = vocab;
    CHECK_THROWS_WITH(auto_tokenizer(c, "x"), Contains("cannot tell which tokenizer"));
  }
}

TEST_CASE("export: a value the written dtype cannot hold is refused, naming the tensor, its magnitude and the dtype's "
          "limit, and nothing is written", "[export][gguf]") {
  TempDir d;
  import_hf(hf_golden("llama") + "/model", d / "imported");  // float32
  const std::string w = "params/model.layers.0.mlp.down_proj.weight";
  const std::string big = rewritten(d / "imported", d / "big", [&](NamedTensors& t) { tensor(t, w).mul_(1e6); });
  NamedTensors stored = read_checkpoint_tensors(big);
  const double largest = tensor(stored, w).abs().max().item<double>();
  REQUIRE(largest > 65504);
  // float16 overflows: GGUF refuses it and says what holds it.
  refused(launch({"export", big, d / "x", "--format", "gguf", "--dtype", "float16", "--tokenizer", "byte"}),
          {w, "65504", "float16", "--dtype bfloat16 or float32", "Nothing was written"});
  CHECK_FALSE(fs::exists(d / "x"));
  succeeded(launch({"export", big, d / "x", "--format", "gguf", "--dtype", "bfloat16", "--tokenizer", "byte"}));
  succeeded(launch({"export", big, d / "x2", "--format", "hf", "--dtype", "bfloat16"}));
  // Past bfloat16's largest (3.39e38) but within float32's: bfloat16 refused, float32 written.
  const std::string huge = rewritten(d / "imported", d / "huge", [&](NamedTensors& t) { tensor(t, w)[0][0] = 3.4e38f; });
  for (const auto& format : {"hf", "gguf"}) {
    std::vector<std::string> args = {"export", huge, d / "y", "--format", format, "--dtype", "bfloat16"};
    if (std::string(format) == "gguf") args.insert(args.end(), {"--tokenizer", "byte"});
    refused(launch(args), {w, "3.4e+38", "bfloat16", "--dtype float32"});
    CHECK_FALSE(fs::exists(d / "y"));
  }
  succeeded(launch({"export", huge, d / "y", "--format", "hf", "--dtype", "float32"}));
  // Not finite in the checkpoint: no export writes it.
  const std::string nan = rewritten(d / "imported", d / "nan", [&](NamedTensors& t) { tensor(t, w)[1][2] = NAN; });
  for (const auto& format : {"native", "hf"}) {
    refused(launch({"export", nan, d / "z", "--format", format}), {w, "not finite", "Nothing was written"});
    CHECK_FALSE(fs::exists(d / "z"));
  }

  // The adapters of a LoRA checkpoint: in the merged model and alone (gguf-adapter, peft).
  TwoDatasets data;
  auto lora = make_lora(data, "big");
  lora->run();
  const std::string b = "params/h.0.attn.c_attn.lora_B";
  const std::string lora_big = rewritten(lora->job_dir() + "/final/1280", d / "lora_big", [&](NamedTensors& t) {
    tensor(t, b).fill_(1e6);
  });
  refused(launch({"export", lora_big, d / "a", "--format", "gguf-adapter", "--dtype", "float16"}),
          {b, "(blk.0.attn_qkv.weight.lora_b)", "65504", "float16"});
  CHECK_FALSE(fs::exists(d / "a"));
  succeeded(launch({"export", lora_big, d / "a", "--format", "gguf-adapter"}));  // float32
  refused(launch({"export", lora_big, d / "m", "--format", "gguf", "--dtype", "float16", "--tokenizer", "byte"}),
          {"params/h.0.attn.c_attn.weight", "65504"});
  const std::string lora_nan = rewritten(lora->job_dir() + "/final/1280", d / "lora_nan", [&](NamedTensors& t) {
    tensor(t, b)[0][0] = NAN;
  });
  refused(launch({"export", lora_nan, d / "p", "--format", "peft"}), {b, "not finite"});
  CHECK_FALSE(fs::exists(d / "p"));
}

TEST_CASE("export --format gguf-adapter refuses every checkpoint llama.cpp cannot apply as an adapter, as the docs say",
          "[gguf][export]") {
  TempDir d;
  TwoDatasets data;
  auto adapter = [&](const std::string& ck, const std::string& out) {
    return launch({"export", ck, d / out, "--format", "gguf-adapter"});
  };
  struct Case {
    std::string name;
    std::vector<std::string> settings;
    std::vector<std::string> words;
  };
  for (const auto& c : std::vector<Case>{
           // llama.cpp's llama gates its MLP with SiLU: a llama-family model with GELU (as the merged model).
           {"gelu", {"architecture/family=llama", "architecture/activation=gelu"}, {"activation gelu", "computes SiLU"}},
           // What a llama.cpp LoRA adapter has no form for.
           {"dora", {"optimization/lora/dora=true"}, {"DoRA"}},
           {"saved", {R"(optimization/lora/modules_to_save=["ln_f"])"}, {"modules_to_save ("}},
           {"rows", {"optimization/lora/trainable_token_indices=[3, 7]"}, {"trainable token rows"}},
       }) {
    INFO(c.name);
    auto t = make_lora(data, c.name, c.settings);
    t->run();
    const std::string ck = t->job_dir() + "/final/1280";
    refused(adapter(ck, c.name), c.words);
    CHECK_FALSE(fs::exists(d / c.name));
    if (c.name.rfind("gelu", 0) == 0)
      refused(launch({"export", ck, d / c.name, "--format", "gguf", "--tokenizer", "byte"}), c.words);
  }
  auto t = make_lora(data, "plain");
  t->run();
  const std::string ck = t->job_dir() + "/final/1280";
  // Adapters that are not there: a checkpoint before its LoRA phase, or one that lists none.
  refused(adapter(t->job_dir() + "/pre_lora_checkpoint", "before"), {"without adapters"});
  json meta = read_checkpoint_metadata(ck);
  meta["lora"]["targets"] = json::array();
  const std::string none = rewritten(ck, d / "none", [](NamedTensors&) {});
  write_file_atomic(none + "/metadata.json", meta.dump(2));
  refused(adapter(none, "none-out"), {"holds no adapters yet", "lora.targets"});
  // The gpt2 family's exact GELU: written, with the note that llama.cpp computes its tanh form.
  Result r = adapter(ck, "gelu_exact");
  succeeded(r);
  CHECK_THAT(r.out, Contains("exact GELU"));
  CHECK(fs::exists(d / "gelu_exact/adapter.gguf"));
}
