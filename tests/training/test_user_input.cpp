// User input that once crashed, was accepted as nonsense, or was refused with a message about
// something else (issue 58): stop strings of a task file; a re-run whose base moved or changed; token
// ids past the model's vocabulary; shapes in a checkpoint's metadata; tensors stored transposed. Each is
// a UserError (exit 2) that names the file, key or path at fault and what to do.
#include <filesystem>
#include <functional>
#include <tuple>

#include "catch.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"
#include "launch.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/tasks.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using namespace lt;
using namespace lt::test;
using nlohmann::json;

namespace {

const std::string kTokenizers = std::string(LT_SOURCE_DIR) + "/tests/data/hf_tokenizers";


std::string copy_of(const std::string& src, const std::string& dst) {
  REQUIRE(shell("cp -r " + quote(src) + " " + quote(dst)).code == 0);
  return dst;
}

void edit_metadata(const std::string& ck, const std::function<void(json&)>& edit) {
  json m = read_checkpoint_metadata(ck);
  edit(m);
  write_file_atomic(ck + "/metadata.json", m.dump(2));
}

torch::Tensor& tensor(NamedTensors& all, const std::string& name) {
  for (auto& [n, t] : all)
    if (n == name) return t;
  FAIL("no tensor " << name);
  static torch::Tensor none;
  return none;
}

// A copy of the golden Hugging Face model of `family` with its tensors edited (and renamed).
std::string edited_hf(const std::string& family, const std::string& dst,
                      const std::function<void(NamedTensors&)>& edit) {
  fs::create_directories(dst);
  fs::copy_file(hf_golden(family) + "/model/config.json", dst + "/config.json");
  NamedTensors t = read_safetensors(hf_golden(family) + "/model/model.safetensors");
  edit(t);
  write_safetensors(dst + "/model.safetensors", t, {{"format", "pt"}});
  return dst;
}

}  // namespace

TEST_CASE("tasks: an empty stop string and other nonsense in \"stop\" are refused naming the file, line and key", "[tasks]") {
  TempDir d;
  auto read = [&](const std::string& record) {
    write_file_atomic(d / "t.jsonl", R"({"prompt": "p", "answer": "x"})" "\n" + record + "\n");
    try {
      const Task t = read_task(d / "t.jsonl");
      return std::string("accepted, stop ") + json(t.examples.back().stop).dump();
    } catch (const UserError& e) {
      return std::string(e.what());
    }
  };
  const std::string where = d / "t.jsonl" + " line 2";
  for (const auto& [record, words] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {R"({"prompt": "p", "answer": "x", "stop": [""]})", {"\"stop\"[0] is an empty string"}},
           {R"({"prompt": "p", "answer": "x", "stop": ""})", {"\"stop\" is an empty string"}},
           {R"({"prompt": "p", "answer": "x", "stop": ["\n", ""]})", {"\"stop\"[1] is an empty string"}},
           {R"({"prompt": "p", "answer": "x", "stop": [7]})", {"\"stop\" must be a string or a non-empty list of strings"}},
           {R"({"prompt": "p", "answer": "x", "stop": {"a": "b"}})", {"\"stop\" must be a string"}},
           {R"({"prompt": "p", "answer": "x", "stop": null})", {"\"stop\" must be a string"}},
           {R"({"prompt": "p", "answer": "x", "stop": []})", {"non-empty list"}},
       }) {
    INFO(record);
    const std::string said = read(record);
    CHECK_THAT(said, Contains(where));
    for (const auto& w : words) CHECK_THAT(said, Contains(w));
  }
  // Stop strings that mean something are kept, a repeated one as it is.
  CHECK(read(R"({"prompt": "p", "answer": "x", "stop": ["\n", "\n", "."]})") == R"(accepted, stop ["\n","\n","."])");
  CHECK(read(R"({"prompt": "p", "answer": "x", "stop": " "})") == R"(accepted, stop [" "])");
}

TEST_CASE("ids past the model's vocabulary from the tokenizer of eval --task or sample are refused naming the "
          "tokenizer, the id and the vocabulary", "[tasks][launcher]") {
  TwoDatasets d;
  Trainer t(job_spec("byte"), tiny_config(Trainer::schema(), d.dir / "data",
                                          std::vector<std::string>{"training/tokens=128", R"(training/dataset=[{"name":"gen","rate":1}])"}),
            d.dir / "out");
  t.run();
  const std::string ck = d.dir / "out/checkpoints/general/default/byte/final/128";  // vocabulary 257
  const std::string hf = "hf:" + kTokenizers + "/gpt2";                               // 600 tokens
  write_file_atomic(d.dir / "mc.jsonl", R"({"question": "the cat", "choices": ["sat", "ran"], "answer": 0})" "\n");
  write_file_atomic(d.dir / "empty.jsonl", "\n" R"({"question": "", "choices": ["sat", "ran"], "answer": 0})" "\n");
  write_file_atomic(d.dir / "gen.jsonl", R"({"prompt": "the cat", "answer": "sat"})" "\n");
  for (const auto& [tokenizer, file, words] : std::vector<std::tuple<std::string, std::string, std::vector<std::string>>>{
           {"gpt2", "mc.jsonl", {"mc.jsonl line 1 (choice 0)", "of the tokenizer gpt2", "vocabulary of 257"}},
           {hf, "mc.jsonl", {"mc.jsonl line 1", "of the tokenizer " + hf, "vocabulary of 257"}},
           {"gpt2", "empty.jsonl", {"empty.jsonl line 2", "token id 50256", "vocabulary of 257"}},
           {"gpt2", "gen.jsonl", {"gen.jsonl line 1 (its prompt)", "of the tokenizer gpt2", "vocabulary of 257"}},
       }) {
    INFO(tokenizer << " " << file);
    refused(launch({"eval", ck, "--task", d.dir / file, "--tokenizer", tokenizer}), words);
  }
  for (const auto& tokenizer : {std::string("gpt2"), hf})
    refused(launch({"sample", ck, "--prompt", "the cat sat", "--tokenizer", tokenizer}),
            {"sample: the prompt has token id", "of the tokenizer " + tokenizer, "vocabulary of 257", "--tokenizer"});
  // The model's own tokenizer reads them.
  succeeded(launch({"eval", ck, "--task", d.dir / "mc.jsonl", "--task", d.dir / "gen.jsonl"}));
}

TEST_CASE("shapes in a checkpoint's metadata are checked before anything is allocated: NF4 weights, the frozen base",
          "[hostile][qlora]") {
  TwoDatasets d;
  auto t = make_lora(d, "q", {"optimization/lora/quantize_base=nf4", "logging/save_frozen_base=true"});
  t->run();
  const std::string ck = t->job_dir() + "/final/1280";
  REQUIRE(read_checkpoint_metadata(ck)["lora"]["quantized"].contains("h.0.attn.c_attn.weight"));
  const std::string out = d.dir / "restored";
  int n = 0;
  for (const json& shape : {json{-96, 32}, json{0, 32}, json{96}, json{96, 32, 1}, json{int64_t(1) << 40, int64_t(1) << 40},
                            json{96, -1}, json("x")}) {
    INFO(shape.dump());
    const std::string bad = copy_of(ck, d.dir / ("nf4-" + std::to_string(n++)));
    edit_metadata(bad, [&](json& m) { m["lora"]["quantized"]["h.0.attn.c_attn.weight"] = shape; });
    // Every reader reads the metadata through one parser: all of them for the first shape.
    std::vector<std::vector<std::string>> readers = {{"export", bad, d.dir / "exp", "--format", "peft"}};
    if (n == 1) readers.insert(readers.end(), {{"export", bad, d.dir / "exp"}, {"eval", bad}, {"restore", "r", bad, out}});
    for (const auto& args : readers) {
      INFO(args[0] << " " << args.size());
      refused(launch(args), {"lora.quantized", "h.0.attn.c_attn.weight"});
      CHECK_FALSE(fs::exists(d.dir / "exp"));
    }
  }
  // A LoRA checkpoint that refers to its frozen base: the base's shapes as it lists them.
  auto r = make_lora(d, "ref");
  r->run();
  const std::string refers = r->job_dir() + "/final/1280";
  REQUIRE(read_checkpoint_metadata(refers).contains("frozen_base"));
  for (const json& shape : {json{-1, 32}, json{0}, json::array(), json{1 << 30, 1 << 30, 1 << 30, 1 << 30}}) {
    INFO(shape.dump());
    const std::string bad = copy_of(refers, d.dir / ("base-" + std::to_string(n++)));
    edit_metadata(bad, [&](json& m) { m["frozen_base"]["tensors"]["wte.weight"] = shape; });
    std::vector<std::vector<std::string>> readers = {{"export", bad, d.dir / "exp", "--format", "peft"}};
    if (shape.empty()) readers.insert(readers.end(), {{"export", bad, d.dir / "exp"}, {"eval", bad}});
    for (const auto& args : readers) {
      INFO(args[0] << " " << args.size());
      refused(launch(args), {"frozen_base.tensors[\"wte.weight\"]", "not a tensor's shape"});
    }
  }
}

TEST_CASE("a tensor stored transposed is named by its own key with both shapes, not blamed on another setting",
          "[hostile][lora]") {
  TwoDatasets d;
  auto trained = [&] {  // the sections on adapters' (the import's needs none)
    auto t = make_lora(d, "src");
    t->run();
    return t->job_dir() + "/final/1280";
  };
  SECTION("an adapter in a checkpoint") {
    const std::string ck = trained();
    NamedTensors all = read_checkpoint_tensors(ck);
    tensor(all, "params/h.0.attn.c_attn.lora_A") = tensor(all, "params/h.0.attn.c_attn.lora_A").t().contiguous();
    const std::string bad = d.dir / "transposed";
    save_checkpoint(bad, all, read_checkpoint_metadata(ck));
    const std::string says = "params/h.0.attn.c_attn.lora_A has shape (4, 32), expected (32, 4) (transposed)";
    for (const auto& args : std::vector<std::vector<std::string>>{{"export", bad, d.dir / "x"},
                                                                   {"export", bad, d.dir / "x", "--format", "hf"},
                                                                   {"export", bad, d.dir / "x", "--format", "peft"},
                                                                   {"export", bad, d.dir / "x", "--format", "gguf-adapter"}}) {
      INFO(args.back());
      const Result r = launch(args);
      refused(r, {says});
      CHECK(r.out.find("lora.rank") == std::string::npos);
    }
    refused(launch({"eval", bad}), {"params/h.0.attn.c_attn.lora_A: shape (4, 32) in the checkpoint, (32, 4) expected"});
  }
  SECTION("an adapter in a PEFT directory given to init_from") {
    const std::string ck = trained();
    const std::string peft = d.dir / "peft";
    export_peft(ck, peft);
    const std::string file = peft + "/adapter_model.safetensors";
    const std::string a = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight";
    const std::string b = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight";
    const NamedTensors original = read_safetensors(file);
    auto init_from = [&](const std::function<void(NamedTensors&)>& edit) {
      NamedTensors tensors = original;
      edit(tensors);
      write_safetensors(file, tensors, {{"format", "pt"}});
      auto j = make_lora(d, "from", {"optimization/lora/init_from=\"" + peft + "\""});
      for (int i = 0; i < 5; ++i) j->train_step();
      j->transition_to_lora();
    };
    CHECK_THROWS_WITH(init_from([&](NamedTensors& x) { tensor(x, a) = tensor(x, a).t().contiguous(); }),
                      Contains(a + " has shape (32, 4), expected (4, 32): it is stored transposed") &&
                          !Contains("adapter_config.json"));
    CHECK_THROWS_WITH(init_from([&](NamedTensors& x) { tensor(x, b) = tensor(x, b).t().contiguous(); }),
                      Contains(b + " has shape (4, 96), expected (96, 4): it is stored transposed"));
    // Another model's size: named with both shapes.
    CHECK_THROWS_WITH(init_from([&](NamedTensors& x) { tensor(x, b) = torch::zeros({97, 4}); }),
                      Contains(b + " has shape (97, 4), this model's needs (96, 4)"));
    // Adapters of another rank than adapter_config.json's r: that, and not a transpose.
    CHECK_THROWS_WITH(init_from([&](NamedTensors& x) {
                        tensor(x, a) = torch::zeros({3, 32});
                        tensor(x, b) = torch::zeros({96, 3});
                      }),
                      Contains("are of rank 3") || Contains("not those of rank 4 (r in adapter_config.json)"));
  }
  SECTION("a weight of a Hugging Face model, named by the file's own key") {
    // GPT-2 saved without "transformer." (as some files are), its fused attention as (out, in).
    const std::string gpt2 = edited_hf("gpt2", d.dir / "gpt2", [](NamedTensors& x) {
      for (auto& [n, v] : x) {
        if (n.rfind("transformer.", 0) == 0) n = n.substr(12);
        if (n == "h.0.attn.c_attn.weight") v = v.t().contiguous();
      }
    });
    Result r = launch({"import-hf", gpt2, d.dir / "g"});
    refused(r, {"h.0.attn.c_attn.weight: shape (96, 32), expected (32, 96) (Conv1D: (in, out)), its transpose"});
    CHECK(r.out.find("transformer.h.0.attn.c_attn.weight") == std::string::npos);
    const std::string llama = edited_hf("llama", d.dir / "llama", [](NamedTensors& x) {
      for (auto& [n, v] : x)
        if (n == "model.layers.1.self_attn.k_proj.weight") v = v.t().contiguous();
    });
    refused(launch({"import-hf", llama, d.dir / "l"}),
            {"model.layers.1.self_attn.k_proj.weight: shape (32, 16), expected (16, 32) ((out, in)), its transpose"});
  }
}

TEST_CASE("a re-run whose base moved or changed names the base and says what to do", "[launcher][lora]") {
  TempDir d;
  make_byte_dataset(d / "data", "gen", 1, 4, 400);
  // A LoRA job without phase one, its config as `configure` writes it: the architecture comes from the
  // Hugging Face model its --restore names.
  const std::string cfg = d / "job.json";
  succeeded(launch({"configure", "lora/train", cfg, "data/dir=\"" + d / "data" + "\"", "training/pre_lora_tokens=[]",
                    "training/pre_lora_dataset=[]", "training/post_lora_tokens=[256]",
                    R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "training/batch_size=4",
                    "architecture/block_size=32", "optimization/lora/rank=4", "runtime/threads=2",
                    "logging/validation_interval=1000", "training/validation_steps=2"}));
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"run", name, cfg, d / "out"};
    args.insert(args.end(), extra.begin(), extra.end());
    return launch(args);
  };
  SECTION("a Hugging Face model") {
    const std::string hf = d / "hf";
    REQUIRE(shell("cp -r " + quote(hf_golden("llama") + "/model") + " " + quote(hf)).code == 0);
    succeeded(run("j", {"--restore", hf}));
    succeeded(run("j", {"--restore", hf}));  // finished: continues from latest, nothing to do
    succeeded(run("j", {}));                  // the architecture from where its checkpoints read the base
    fs::rename(hf, d / "hf-moved");
    for (const auto& extra : std::vector<std::vector<std::string>>{{"--restore", hf}, {}}) {
      const Result r = run("j", extra);
      refused(r, {hf, "no longer there", "--restore NEW_PATH", "put it back at " + hf});
      CHECK(r.out.find("architecture/") == std::string::npos);
    }
    const Result r = run("j", {"--restore", d / "hf-moved", "training/post_lora_tokens=[384]"});
    succeeded(r);
    CHECK_THAT(r.out, Contains("reading it from --restore " + d / "hf-moved"));
    // The same place, another model: its config.json, then its weights.
    const std::string moved = d / "hf-moved";
    json c = read_json_file(moved + "/config.json");
    c["num_attention_heads"] = 8;
    c["head_dim"] = 4;
    write_file_atomic(moved + "/config.json", c.dump(2));
    refused(run("j", {"--restore", moved, "training/post_lora_tokens=[384]"}),
            {"the model at " + moved + " is not the one job j started from", "architecture/n_heads=8"});
    refused(run("j", {"training/post_lora_tokens=[384]"}), {"the model at " + moved + " is not the one", "architecture/n_heads=8"});
    fs::copy_file(hf_golden("llama") + "/model/config.json", moved + "/config.json", fs::copy_options::overwrite_existing);
    edited_hf("llama", d / "other", [](NamedTensors& x) { tensor(x, "model.layers.0.mlp.up_proj.weight").mul_(2); });
    fs::copy_file(d / "other/model.safetensors", moved + "/model.safetensors", fs::copy_options::overwrite_existing);
    refused(run("j", {"--restore", moved, "training/post_lora_tokens=[384]"}),
            {"the frozen base at " + moved + " is not the one", "digest", "--restore DIR"});
  }
  SECTION("a checkpoint") {
    import_hf(hf_golden("llama") + "/model", d / "base");
    // Its architecture is the config's (a checkpoint's is not applied by itself): the import's.
    std::vector<std::string> settings = {"configure", "lora/train", cfg, "--force", "data/dir=\"" + d / "data" + "\"",
                                         "training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]",
                                         "training/post_lora_tokens=[256]", R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])",
                                         "training/batch_size=4", "optimization/lora/rank=4", "runtime/threads=2",
                                         "logging/validation_interval=1000", "training/validation_steps=2"};
    const json imported = read_checkpoint_metadata(d / "base");
    for (const auto& [key, value] : imported["config"]["architecture"].items())
      settings.push_back("architecture/" + key + "=" + (key == "block_size" ? std::string("32") : value.dump()));
    succeeded(launch(settings));
    const Result first = run("k", {"--restore", d / "base"});
    succeeded(first);
    fs::rename(d / "base", d / "base-moved");
    refused(run("k", {"--restore", d / "base"}), {d / "base", "no longer there", "--restore NEW_PATH"});
    succeeded(run("k", {"--restore", d / "base-moved", "training/post_lora_tokens=[384]"}));
    // The same place, other weights: the digest says so, naming the place.
    remove_tree(d / "base-moved");
    edited_hf("llama", d / "other", [](NamedTensors& x) { tensor(x, "model.layers.0.mlp.up_proj.weight").mul_(2); });
    import_hf(d / "other", d / "base-moved");
    refused(run("k", {"--restore", d / "base-moved", "training/post_lora_tokens=[512]"}),
            {"the frozen base at " + d / "base-moved" + " is not the one", "--restore DIR"});
  }
}
