// Hostile and broken files, one class of defect at a time, as a user (or an attacker) meets them
// through the launcher: sizes that overflow or would exhaust memory, nesting deep enough to crash a
// recursive parser, fields that would change the math if ignored, metadata that contradicts its
// tensors or itself, type errors in every file read, and valid text that a pattern engine's limits
// refused. Each ends in exit 2 with a message naming the file, key path or field and what to do;
// none crashes or prints a raw library error.
#include "catch.hpp"

#include <hdf5.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
using lt::test::kTestData;
using lt::test::refused;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {



// DIR/tokenizer.json: the test tokenizer of `style` (tests/data/hf_tokenizers) with `edit` applied,
// written as text by `dump` (so that a test can write what nlohmann would not).
std::string tokenizer_dir(const test::TempDir& tmp, const std::string& name, const std::function<void(json&)>& edit,
                          const std::string& style = "gpt2") {
  json j = read_json_file(kTestData + "/hf_tokenizers/" + style + "/tokenizer.json");
  edit(j);
  const std::string dir = tmp / name;
  fs::create_directories(dir);
  write_file_atomic(dir + "/tokenizer.json", j.dump());
  return dir;
}

// A copy of the tiny Llama of tests/data with its config.json edited.
std::string hf_model(const test::TempDir& tmp, const std::string& name, const std::function<void(json&)>& edit) {
  const std::string dir = tmp / name;
  fs::create_directories(dir);
  fs::copy_file(kTestData + "/hf_llama/model/model.safetensors", dir + "/model.safetensors");
  json c = read_json_file(kTestData + "/hf_llama/model/config.json");
  edit(c);
  write_file_atomic(dir + "/config.json", c.dump(2));
  return dir;
}

// A safetensors file of a raw header and `data` bytes.
void write_raw_safetensors(const std::string& path, const std::string& header, const std::string& data = "") {
  const uint64_t n = header.size();
  write_file_atomic(path, std::string(reinterpret_cast<const char*>(&n), 8) + header + data);
}

// A trained LoRA job's final checkpoint (the tiny GPT, 5 + 5 steps) and its config, shared by the
// metadata cases; each case edits a fresh copy.
struct LoraCheckpoint {
  test::TwoDatasets d;
  std::string src;
  LoraCheckpoint() {
    auto t = test::make_lora(d, "src");
    t->run();
    src = t->job_dir() + "/final/1280";
    REQUIRE(is_checkpoint(src));
  }
  std::string copy(const std::string& name, const std::function<void(json&)>& edit) const {
    const std::string dst = d.dir / name;
    remove_tree(dst);
    REQUIRE(test::shell("cp -r " + test::quote(src) + " " + test::quote(dst)).code == 0);
    json meta = read_json_file(dst + "/metadata.json");
    edit(meta);
    write_file_atomic(dst + "/metadata.json", meta.dump(2));
    return dst;
  }
};

}  // namespace

TEST_CASE("hostile: a size read from a file is checked before anything is allocated or indexed", "[hostile]") {
  test::TempDir tmp;
  SECTION("token ids in tokenizer.json: 2^64 - 1, negative, fractional, or far past the vocabulary") {
    const auto last_vocab_key = [](json& j) { return j["model"]["vocab"].begin().key(); };
    for (const auto& [what, edit] : std::vector<std::pair<std::string, std::function<void(json&)>>>{
             {"/model/vocab", [&](json& j) { j["model"]["vocab"][last_vocab_key(j)] = UINT64_MAX; }},
             {"/model/vocab", [&](json& j) { j["model"]["vocab"][last_vocab_key(j)] = -3; }},
             {"/model/vocab", [&](json& j) { j["model"]["vocab"][last_vocab_key(j)] = 2.5; }},
             {"/model/vocab", [&](json& j) { j["model"]["vocab"][last_vocab_key(j)] = 2000000000; }},
             {"/added_tokens/0/id", [](json& j) { j["added_tokens"][0]["id"] = UINT64_MAX; }},
         }) {
      const std::string dir = tokenizer_dir(tmp, "ids", edit);
      write_file_atomic(tmp / "t.txt", "some text");
      auto r = test::launch({"tokenize", "--name", "t", "--tokenizer", "hf:" + dir, "--data-dir", tmp / "data", tmp / "t.txt"});
      refused(r, {dir + "/tokenizer.json", what});
    }
  }
  SECTION("tensor shapes in a safetensors header whose byte count wraps past 2^64") {
    const std::string path = tmp / "m.safetensors";
    // 2^32 x 2^32 x 16 floats: 2^70 bytes, which wraps to 0 in 64 bits, like the empty data range.
    write_raw_safetensors(path, R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})");
    CHECK_THROWS_WITH(read_safetensors(path), Contains(path) && Contains("larger than 2^64 bytes"));
    write_raw_safetensors(path, R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", "abcd");
    CHECK_THROWS_WITH(read_safetensors(path), Contains(path) && Contains("tensor w"));
    write_raw_safetensors(path, R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd");
    CHECK_THROWS_WITH(read_safetensors(path), Contains("negative"));
  }
  SECTION("an HDF5 dataset whose dimensions state 4 TB the file does not hold") {
    const std::string ck = tmp / "ck";
    REQUIRE(test::launch({"import-hf", kTestData + "/hf_gpt2/model", ck}).code == 0);
    {  // a dataset of 10^6 x 10^6 floats, never written: its storage is never allocated
      hid_t f = H5Fopen((ck + "/state.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      hsize_t dims[2] = {1000000, 1000000};
      hid_t space = H5Screate_simple(2, dims, nullptr);
      hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
      H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_LATE);
      hid_t ds = H5Dcreate2(f, "params/huge", H5T_NATIVE_FLOAT, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
      REQUIRE(ds >= 0);
      hid_t type = H5Tcopy(H5T_C_S1);
      H5Tset_size(type, 7);
      hid_t scalar = H5Screate(H5S_SCALAR);
      hid_t attr = H5Acreate2(ds, "dtype", type, scalar, H5P_DEFAULT, H5P_DEFAULT);
      H5Awrite(attr, type, "float32");
      for (hid_t id : {attr}) H5Aclose(id);
      H5Sclose(scalar);
      H5Tclose(type);
      H5Dclose(ds);
      H5Pclose(dcpl);
      H5Sclose(space);
      H5Fclose(f);
    }
    // The structure check (state_h5) refuses the changed file first; without it (a checkpoint saved
    // before state_h5, or a file crafted with a matching checksum) the shape check still holds.
    refused(test::launch({"inspect", "--verify", ck}), {"state_h5"});
    json meta = read_json_file(ck + "/metadata.json");
    meta.erase("state_h5");
    write_file_atomic(ck + "/metadata.json", meta.dump(2));
    for (const auto& args : std::vector<std::vector<std::string>>{{"inspect", "--verify", ck}, {"export", ck, tmp / "out"}})
      refused(test::launch(args), {"params/huge", "(1000000, 1000000)", "the file stores 0"});
  }
  SECTION("a Hugging Face config.json with a vocabulary of 10^12") {
    const std::string model = hf_model(tmp, "huge", [](json& c) { c["vocab_size"] = int64_t{1000000000000}; });
    refused(test::launch({"import-hf", model, tmp / "out"}), {"vocab_size 1000000000000", "memory"});
    CHECK_FALSE(fs::exists(tmp / "out"));
  }
}

TEST_CASE("hostile: JSON nested 100,000 levels deep is refused, not a stack overflow", "[hostile]") {
  test::TempDir tmp;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  // A config file, as `run` reads it.
  write_file_atomic(tmp / "deep.json", R"({"job": {"kind": "train"}, "training": {"batch_size": )" + deep + "}}");
  refused(test::launch({"run", "x", tmp / "deep.json", tmp / "out"}), {tmp / "deep.json", "nested more than 512 levels"});
  // An override (a command line argument holds 128 KiB at most: 60,000 levels).
  const std::string arg = "training/batch_size=" + std::string(60000, '[') + std::string(60000, ']');
  refused(test::launch({"configure", "train", tmp / "c.json", arg}), {"override training/batch_size", "nested more than 512"});
  CHECK_FALSE(fs::exists(tmp / "c.json"));
  // A tokenizer.json and a safetensors header.
  const std::string tok = tmp / "tok";
  fs::create_directories(tok);
  write_file_atomic(tok + "/tokenizer.json", R"({"model": )" + deep + "}");
  write_file_atomic(tmp / "t.txt", "text");
  refused(test::launch({"tokenize", "--name", "t", "--tokenizer", "hf:" + tok, "--data-dir", tmp / "data", tmp / "t.txt"}),
          {tok + "/tokenizer.json", "nested more than 512"});
  write_raw_safetensors(tmp / "m.safetensors", R"({"w": )" + deep + "}");
  CHECK_THROWS_WITH(read_safetensors(tmp / "m.safetensors"), Contains("nested more than 512"));
  // 512 levels are still read.
  CHECK_NOTHROW(parse_json(std::string(512, '[') + std::string(512, ']'), "x"));
}

TEST_CASE("hostile: a key given twice in one JSON object is refused, naming it", "[hostile]") {
  test::TempDir tmp;
  write_file_atomic(tmp / "dup.json", R"({"job": {"kind": "train"}, "training": {"batch_size": 4, "batch_size": 64}})");
  refused(test::launch({"run", "x", tmp / "dup.json", tmp / "out"}), {tmp / "dup.json", "/training/batch_size", "twice"});
  refused(test::launch({"configure", "train", tmp / "c.json", R"(data/dir={"a": 1, "a": 2})"}), {"/a", "twice"});
  // In a model's config.json too: which of the two values a library takes is its own choice.
  const std::string model = hf_model(tmp, "dup", [](json&) {});
  std::string text = read_file(model + "/config.json");
  text.insert(text.find('{') + 1, R"("hidden_size": 4096,)");
  write_file_atomic(model + "/config.json", text);
  refused(test::launch({"import-hf", model, tmp / "out"}), {model + "/config.json", "/hidden_size", "twice"});
}

TEST_CASE("hostile: a type error or missing key in any file read names the file and the key path", "[hostile]") {
  test::TempDir tmp;
  SECTION("a model's config.json") {
    const std::string model = hf_model(tmp, "m", [](json& c) { c["num_attention_heads"] = "eight"; });
    refused(test::launch({"import-hf", model, tmp / "out"}), {model + "/config.json", "num_attention_heads"});
  }
  SECTION("tokenizer.json") {
    for (const auto& edit : std::vector<std::function<void(json&)>>{
             [](json& j) { j["model"]["merges"][0] = 17; },
             [](json& j) { j["added_tokens"][0]["content"] = json::array(); },
             [](json& j) { j["pre_tokenizer"] = json{{"type", 5}}; },
             [](json& j) { j["normalizer"] = json{{"type", "Sequence"}, {"normalizers", "NFC"}}; },
         }) {
      const std::string dir = tokenizer_dir(tmp, "bad", edit);
      write_file_atomic(tmp / "t.txt", "text");
      refused(test::launch({"tokenize", "--name", "t", "--tokenizer", "hf:" + dir, "--data-dir", tmp / "data", tmp / "t.txt"}),
              {dir + "/tokenizer.json"});
    }
  }
  SECTION("a safetensors header") {
    write_raw_safetensors(tmp / "m.safetensors", R"({"w":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", "abcd");
    CHECK_THROWS_WITH(read_safetensors(tmp / "m.safetensors"), Contains(tmp / "m.safetensors") && Contains("tensor w"));
    write_raw_safetensors(tmp / "m.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":"0-4"}})", "abcd");
    CHECK_THROWS_WITH(read_safetensors(tmp / "m.safetensors"), Contains(tmp / "m.safetensors") && Contains("tensor w"));
  }
}

TEST_CASE("hostile: metadata that contradicts its tensors or itself is refused by every reader", "[hostile]") {
  LoraCheckpoint ck;
  const std::string out = ck.d.dir / "out2";
  auto all_refuse = [&](const std::string& dir, const std::vector<std::string>& words) {
    for (const auto& args : std::vector<std::vector<std::string>>{{"export", dir, ck.d.dir / "exp"},
                                                                   {"export", "--format", "peft", dir, ck.d.dir / "peft"},
                                                                   {"eval", dir},
                                                                   {"restore", "r", dir, out}}) {
      INFO(args[0] << " " << args[1]);
      refused(test::launch(args), words);
      CHECK_FALSE(fs::exists(ck.d.dir / "exp"));
    }
  };
  // The rank in both places the metadata states it, against adapters of rank 4: merging would scale
  // them by alpha / 8 instead of alpha / 4.
  all_refuse(ck.copy("rank8", [](json& m) {
    m["lora"]["rank"] = 8;
    m["config"]["optimization"]["lora"]["rank"] = 8;
  }), {"(32, 4)", "(32, 8)"});
  // The rank in one place only: the metadata contradicts itself.
  all_refuse(ck.copy("rank_one", [](json& m) { m["lora"]["alpha"] = 64; }), {"lora.alpha", "contradicts itself"});
  // A step past its own schedule (10 steps), and a LoRA phase that starts after its step.
  all_refuse(ck.copy("step", [](json& m) { m["step"] = 50; }), {"metadata.json", "step 50"});
  all_refuse(ck.copy("phase", [](json& m) { m["lora"]["boundary_step"] = 11; }),
             {"metadata.json", "boundary_step"});
  // Data cursors past what the steps drew.
  const std::string cursors = ck.copy("cursors", [](json& m) {
    for (auto& [stage, c] : m["data"]["cursors"].items()) c = 1000000;
  });
  refused(test::launch({"restore", "r", cursors, out}), {"data.cursors", "1000000"});
  // Trainable token ids past the vocabulary (an index out of range in the merge).
  test::TwoDatasets d;
  auto t = test::make_lora(d, "tok", {"optimization/lora/trainable_token_indices=[3, 7]"});
  t->run();
  const std::string tok_ck = d.dir / "tok_ck";
  REQUIRE(test::shell("cp -r " + test::quote(t->job_dir() + "/final/1280") + " " + test::quote(tok_ck)).code == 0);
  json meta = read_json_file(tok_ck + "/metadata.json");
  for (auto& [name, ids] : meta["lora"]["trainable_tokens"].items()) ids = json::array({3, 9999});
  write_file_atomic(tok_ck + "/metadata.json", meta.dump(2));
  refused(test::launch({"export", tok_ck, d.dir / "exp"}), {"9999"});
}

TEST_CASE("hostile: PEFT adapter_config.json fields that change the math are refused by name", "[hostile][lora]") {
  test::TwoDatasets d;
  auto src = test::make_lora(d, "src");
  src->run();
  const std::string peft = d.dir / "peft";
  export_peft(src->job_dir() + "/final/1280", peft);
  const json config = read_json_file(peft + "/adapter_config.json");
  auto init_from = [&](const std::string& key, const json& value) {
    json c = config;
    c[key] = value;
    write_file_atomic(peft + "/adapter_config.json", c.dump(2));
    auto t = test::make_lora(d, "from", {"optimization/lora/init_from=\"" + peft + "\""});
    for (int i = 0; i < 5; ++i) t->train_step();
    t->transition_to_lora();
  };
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"alpha_pattern", {{"attn.c_attn", 64}}},
           {"rank_pattern", {{"mlp.c_fc", 2}}},
           {"layers_to_transform", {0}},
           {"layers_pattern", "h"},
           {"bias", "all"},
           {"lora_bias", true},
           {"use_dora", true},
           {"init_lora_weights", "pissa"},
           {"a_field_of_a_future_peft", {{"x", 1}}},
       }) {
    INFO(key);
    // use_dora true where the files hold no magnitudes: the safetensors file is named with it.
    if (key == "use_dora") CHECK_THROWS_WITH(init_from(key, value), Contains(peft) && Contains("DoRA adapter"));
    else CHECK_THROWS_WITH(init_from(key, value), Contains(peft + "/adapter_config.json") && Contains(key));
  }
  // At PEFT's defaults (as PEFT writes them) the same fields are read.
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"alpha_pattern", json::object()}, {"rank_pattern", json::object()}, {"layers_to_transform", nullptr},
           {"bias", "none"}, {"init_lora_weights", true}, {"a_field_of_a_future_peft", nullptr}}) {
    INFO(key);
    CHECK_NOTHROW(init_from(key, value));
  }
}

TEST_CASE("hostile: valid text tokenizes whatever its runs of whitespace, and a runaway pattern is named", "[hostile][tokenizer]") {
  const std::string llama3 = kTestData + "/hf_tokenizers/llama3";
  auto tok = make_tokenizer("hf:" + llama3);
  // 12 million spaces exceeded PCRE2's default match limit under Llama 3's \s*[\r\n]+ alternative.
  for (const std::string& text : {std::string(12'000'000, ' '), "a" + std::string(3'000'000, ' ') + "\n\nb",
                                  std::string(2'000'000, '\n') + "x", "x" + std::string(2'000'000, '\t')}) {
    std::vector<uint32_t> ids;
    REQUIRE_NOTHROW(ids = tok->encode(text));
    CHECK(tok->decode(ids) == text);
  }
  // A pattern that backtracks catastrophically stops at the limit with an error naming the file and
  // the pattern, instead of running for ever or being mistaken for valid text's limit.
  test::TempDir tmp;
  const std::string dir = tokenizer_dir(tmp, "runaway", [](json& j) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "(a+)+$"}}}, {"behavior", "Isolated"},
                                              {"invert", false}},
                                             {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                                              {"use_regex", true}}}}};
  });
  auto runaway = make_tokenizer("hf:" + dir);
  CHECK_THROWS_WITH(runaway->encode(std::string(40, 'a') + "b"),
                    Contains(dir + "/tokenizer.json") && Contains("(a+)+$") && Contains("could not be run"));
  // A pattern that does not compile names itself too.
  const std::string bad = tokenizer_dir(tmp, "bad", [](json& j) {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}, {"invert", false}};
  });
  CHECK_THROWS_WITH(make_tokenizer("hf:" + bad), Contains(bad + "/tokenizer.json") && Contains("(unclosed"));
}

TEST_CASE("hostile: a damaged state.h5 is refused before HDF5 parses it, and one saved before that check still loads", "[hostile][checkpoint]") {
  test::TempDir tmp;
  const std::string ck = tmp / "ck";
  REQUIRE(test::launch({"import-hf", kTestData + "/hf_gpt2/model", ck}).code == 0);
  const json meta = read_json_file(ck + "/metadata.json");
  REQUIRE(meta.contains("state_h5"));
  const std::string state = read_file(ck + "/state.h5");
  CHECK(meta["state_h5"]["bytes"] == state.size());
  // Byte 8 (the superblock's version), the byte before the first tensor's data, and the first byte of
  // the first gap between two tensors' data: HDF5's own structures, which HDF5 1.10 reads past its
  // buffers on some damaged files.
  const json& data = meta["state_h5"]["data"];
  uint64_t gap = 0;
  for (size_t i = 0; i + 1 < data.size() && !gap; ++i) {
    const uint64_t end = data[i][0].get<uint64_t>() + data[i][1].get<uint64_t>();
    if (end < data[i + 1][0].get<uint64_t>()) gap = end;
  }
  REQUIRE(gap > 0);
  for (uint64_t at : {uint64_t{8}, data[0][0].get<uint64_t>() - 1, gap}) {
    std::string damaged = state;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    write_file_atomic(ck + "/state.h5", damaged);
    for (const auto& args : std::vector<std::vector<std::string>>{{"inspect", "--verify", ck}, {"export", ck, tmp / "out"}}) {
      INFO(at << " " << args[0]);
      refused(test::launch(args), {ck + "/state.h5", "HDF5 structures", "state_h5.structure_crc32"});
    }
  }
  // A truncated file: the size is checked first.
  write_file_atomic(ck + "/state.h5", state.substr(0, state.size() / 2));
  refused(test::launch({"inspect", "--verify", ck}), {"state_h5.bytes"});
  // A checkpoint from before state_h5 (the same file, the field removed) is read as before.
  write_file_atomic(ck + "/state.h5", state);
  json old = meta;
  old.erase("state_h5");
  write_file_atomic(ck + "/metadata.json", old.dump(2));
  auto r = test::launch({"inspect", "--verify", ck});
  INFO(r.out);
  CHECK(r.code == 0);
}
