// Hugging Face tokenizer.json (`--tokenizer hf:DIR`): ids equal those of the real `tokenizers` library
// on the golden strings and files of three small byte-level BPE tokenizers trained with it (GPT-2,
// Llama 3 and Qwen2 layouts, and one with out-of-order merges; scripts/hf_tokenizer_golden.py made tests/data/hf_tokenizers/), decode
// inverts encode (up to the normalizer), Qwen2's NFC and the NFD, NFKC, NFKD and Sequence normalizers
// give the library's ids on text they change, unsupported tokenizers are refused naming what is
// unsupported, and `tokenize` writes a dataset that names the tokenizer and ends documents with its
// end-of-text id.
#include "catch.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using lt::test::Contains;
using nlohmann::json;

namespace {

const std::string kTokenizers = std::string(LT_SOURCE_DIR) + "/tests/data/hf_tokenizers";
// order/: merges out of order, where merging one pair at a time (the library) differs from merging
// every occurrence at once (Encoder.js, the gpt2 tokenizer); it has golden strings only.
const std::vector<std::string> kStyles = {"gpt2", "llama3", "qwen2", "order"};

json golden(const std::string& style) { return lt::read_json_file(kTokenizers + "/" + style + "/golden.json"); }

std::vector<uint32_t> read_ids(const std::string& path) {
  const std::string bytes = lt::read_file(path);
  std::vector<uint32_t> ids(bytes.size() / 4);
  std::memcpy(ids.data(), bytes.data(), ids.size() * 4);
  return ids;
}

// Writes DIR/tokenizer.json: the golden tokenizer of `style` with `edit` applied.
std::string edited_tokenizer(const lt::test::TempDir& tmp, const std::string& name,
                             const std::function<void(json&)>& edit, const std::string& style = "gpt2") {
  json j = lt::read_json_file(kTokenizers + "/" + style + "/tokenizer.json");
  edit(j);
  const std::string dir = tmp / name;
  fs::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  return dir;
}

}  // namespace

TEST_CASE("hf tokenizer ids equal the tokenizers library's on the golden strings and files", "[tokenizer][hf]") {
  for (const auto& style : kStyles) {
    INFO("style " << style);
    const json g = golden(style);
    auto tok = lt::make_tokenizer("hf:" + kTokenizers + "/" + style);
    CHECK(tok->name() == "hf:" + kTokenizers + "/" + style);
    CHECK(tok->vocab_size() == g["vocab_size"].get<uint32_t>());
    CHECK(tok->eot_id() == g["eot_id"].get<uint32_t>());
    REQUIRE(g["strings"].size() >= 40);
    for (const auto& s : g["strings"]) {
      INFO("text " << s["text"].dump());
      CHECK(tok->encode(s["text"].get<std::string>()) == s["ids"].get<std::vector<uint32_t>>());
    }
    REQUIRE(g["files"].size() == (style == "order" ? 0 : 3));
    for (const auto& f : g["files"]) {
      INFO("file " << f["path"].get<std::string>());
      const std::string text = lt::read_file(kTokenizers + "/" + f["path"].get<std::string>());
      CHECK(tok->encode(text) == f["ids"].get<std::vector<uint32_t>>());
    }
  }
}

TEST_CASE("hf tokenizer decode inverts encode, added tokens included", "[tokenizer][hf]") {
  for (const auto& style : kStyles) {
    INFO("style " << style);
    auto tok = lt::make_tokenizer("hf:" + kTokenizers + "/" + style);
    const json g = golden(style);  // a named value: a range-for over golden(style)[...] would dangle
    REQUIRE(g["strings"].size() >= 10);
    for (const auto& s : g["strings"]) {
      const std::string text = s["text"];
      INFO("text " << s["text"].dump());
      // "normalized": the library's normalizer changes the text (qwen2's NFC).
      CHECK(tok->decode(tok->encode(text)) == s.value("normalized", text));
    }
    for (const auto& f : g["files"]) {
      const std::string text = lt::read_file(kTokenizers + "/" + f["path"].get<std::string>());
      CHECK(tok->decode(tok->encode(text)) == text);
    }
    // An added token in the text is that token, as in the library.
    const auto eot = tok->eot_id();
    const std::string eot_text = tok->decode({eot});
    CHECK(tok->encode(eot_text) == std::vector<uint32_t>{eot});
  }
}

TEST_CASE("hf tokenizer normalizers give the library's ids on text that NFC, NFD, NFKC and NFKD change", "[tokenizer][hf]") {
  const json g = golden("qwen2");
  auto qwen = lt::make_tokenizer("hf:" + kTokenizers + "/qwen2");
  // Qwen2's NFC: decomposed and composed text are the same ids, and the golden strings include text
  // NFC changes (decomposed accents, Hangul jamo, A + ring, Greek with combining accents).
  CHECK(qwen->encode("cafe\xcc\x81 A\xcc\x8a") == qwen->encode("caf\xc3\xa9 \xc3\x85"));
  size_t changed = 0;
  for (const auto& s : g["strings"]) changed += s.contains("normalized");
  CHECK(changed >= 10);

  // qwen2's tokenizer.json with other normalizers, and with added tokens matched before (normalized
  // false) and after (normalized true) normalization; ids from the library on the same files.
  lt::test::TempDir tmp;
  REQUIRE(g["normalizer_variants"].size() >= 5);
  std::vector<std::string> forms;
  for (const auto& v : g["normalizer_variants"]) {
    const std::string name = v["name"];
    INFO("variant " << name << ": " << v["normalizer"].dump());
    forms.push_back(v["normalizer"].dump());
    const std::string dir = edited_tokenizer(tmp, name, [&](json& j) {
      j["normalizer"] = v["normalizer"];
      for (const auto& t : v["extra_added_tokens"]) j["added_tokens"].push_back(t);
    }, "qwen2");
    auto tok = lt::make_tokenizer("hf:" + dir);
    REQUIRE(v["strings"].size() >= 50);
    size_t normalized = 0;
    for (const auto& s : v["strings"]) {
      const std::string text = s["text"];
      INFO("text " << s["text"].dump());
      CHECK(tok->encode(text) == s["ids"].get<std::vector<uint32_t>>());
      normalized += s.contains("normalized");
      // Added tokens decode to their content, which need not be the normalized text.
      if (v["extra_added_tokens"].empty()) CHECK(tok->decode(tok->encode(text)) == s.value("normalized", text));
    }
    CHECK(normalized >= 10);
  }
  for (const char* form : {"NFD", "NFKC", "NFKD", "Sequence"}) {
    INFO("form " << form);
    CHECK(std::any_of(forms.begin(), forms.end(),
                      [&](const std::string& f) { return f.find(std::string("\"") + form + "\"") != std::string::npos; }));
  }
}

TEST_CASE("hf tokenizer reads a BPE model that leaves out its type, as older files do", "[tokenizer][hf]") {
  lt::test::TempDir tmp;
  const std::string dir = edited_tokenizer(tmp, "untyped", [](json& j) { j["model"].erase("type"); });
  auto tok = lt::make_tokenizer("hf:" + dir);
  const json g = golden("gpt2");
  REQUIRE(g["strings"].size() >= 40);
  for (const auto& s : g["strings"])
    CHECK(tok->encode(s["text"].get<std::string>()) == s["ids"].get<std::vector<uint32_t>>());
}

TEST_CASE("hf tokenizer end-of-text comes from tokenizer_config.json, else the known names", "[tokenizer][hf]") {
  // llama3/tokenizer_config.json names <|eot_id|> (2) although <|end_of_text|> (1) is also a token.
  CHECK(lt::make_tokenizer("hf:" + kTokenizers + "/llama3")->eot_id() == 2);
  CHECK(lt::make_tokenizer("hf:" + kTokenizers + "/gpt2")->eot_id() == 0);  // <|endoftext|>, no config
  lt::test::TempDir tmp;
  const std::string dir = edited_tokenizer(tmp, "no_eot", [](json& j) { j["added_tokens"] = json::array(); j["model"]["vocab"].erase("<|endoftext|>"); });
  REQUIRE_THROWS_WITH(lt::make_tokenizer("hf:" + dir), Contains("no end-of-text token"));
}

TEST_CASE("hf tokenizer refuses what it does not support, naming it", "[tokenizer][hf]") {
  lt::test::TempDir tmp;
  struct Case {
    std::string name, expected;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"lowercase", "normalizer \"Lowercase\"", [](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }},
      {"sequence", "normalizer \"Replace\"",
       [](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Replace"}}}}};
       }},
      {"whitespace", "pre_tokenizer \"Whitespace\"", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }},
      {"byte_fallback", "byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"prefix_space", "add_prefix_space", [](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; }},
      {"removed", "behavior \"Removed\"",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
       }},
      {"lstrip", "lstrip", [](json& j) { j["added_tokens"][0]["lstrip"] = true; }},
      {"decoder", "decoder \"WordPiece\"", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }},
      {"no_type", "no \"type\"", [](json& j) { j["model"].erase("type"); j["model"].erase("merges"); }},
  };
  for (const auto& c : cases) {
    INFO("case " << c.name);
    const std::string dir = edited_tokenizer(tmp, c.name, c.edit);
    REQUIRE_THROWS_WITH(lt::make_tokenizer("hf:" + dir), Contains(c.expected) && Contains("not supported"));
  }
  REQUIRE_THROWS_WITH(lt::make_tokenizer("hf:" + tmp / "nowhere"), Contains("not a directory"));
  REQUIRE_THROWS_WITH(lt::make_tokenizer("hf:" + tmp.str()), Contains("has no tokenizer.json"));
}

TEST_CASE("tokenize refuses WordPiece and Unigram tokenizers with exit 2 naming the type", "[tokenizer][hf][launcher]") {
  lt::test::TempDir tmp;
  for (const auto& [dir, type] : std::vector<std::pair<std::string, std::string>>{
           {"wordpiece", "model type \"WordPiece\""}, {"unigram", "model type \"Unigram\""}}) {
    auto r = lt::test::launch({"tokenize", kTokenizers + "/corpus", "--name", "x", "--data-dir", tmp.str(),
                               "--tokenizer", "hf:" + kTokenizers + "/unsupported/" + dir});
    INFO(r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains(type) && Contains("not supported"));
  }
  auto r = lt::test::launch({"tokenize", kTokenizers + "/corpus", "--name", "x", "--data-dir", tmp.str(), "--tokenizer", "hf"});
  CHECK(r.code != 0);
  CHECK_THAT(r.out, Contains("hf:DIR"));
}

TEST_CASE("tokenize --tokenizer hf:DIR writes the library's ids, the tokenizer's name and end-of-text", "[tokenizer][hf][launcher]") {
  lt::test::TempDir tmp;
  for (const auto& style : {"gpt2", "llama3"}) {
    INFO("style " << style);
    const json g = golden(style);
    const std::string tok_dir = kTokenizers + "/" + style;
    // One document, so the split is by tokens: train.bin + val.bin = its ids and the end-of-text.
    const json& file = g["files"][1];
    auto r = lt::test::launch({"tokenize", kTokenizers + "/" + file["path"].get<std::string>(), "--name", style,
                               "--data-dir", tmp.str(), "--tokenizer", "hf:" + tok_dir, "--val-fraction", "0.1"});
    INFO(r.out);
    REQUIRE(r.code == 0);
    const json meta = lt::read_json_file(tmp / (std::string(style) + "/meta.json"));
    CHECK(meta["tokenizer"] == "hf:" + tok_dir);
    CHECK(meta["vocab_size"] == g["vocab_size"]);
    CHECK(meta["eot_id"] == g["eot_id"]);
    std::vector<uint32_t> ids = read_ids(tmp / (std::string(style) + "/train.bin"));
    const auto val = read_ids(tmp / (std::string(style) + "/val.bin"));
    ids.insert(ids.end(), val.begin(), val.end());
    std::vector<uint32_t> expected = file["ids"].get<std::vector<uint32_t>>();
    expected.push_back(g["eot_id"].get<uint32_t>());
    CHECK(ids == expected);
  }
}

TEST_CASE("hf tokenizer encodes a word of 300,000 letters in well under a minute", "[tokenizer][hf]") {
  // Merging one pair per scan of the word would take about 10^10 steps here.
  auto tok = lt::make_tokenizer("hf:" + kTokenizers + "/llama3");
  std::string text;
  for (int i = 0; i < 100000; ++i) text += "the";
  const auto start = std::chrono::steady_clock::now();
  const auto ids = tok->encode(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 20);
  CHECK(ids.size() < text.size() / 2);
  CHECK(tok->decode(ids) == text);
}

TEST_CASE("sample --tokenizer hf:DIR reads the prompt with that tokenizer", "[tokenizer][hf][launcher]") {
  lt::test::TempDir tmp;
  // The imported test model has a vocabulary of 300: order/ (259) fits, llama3/ (701) does not.
  REQUIRE(lt::test::launch({"import-hf", std::string(LT_SOURCE_DIR) + "/tests/data/hf_gpt2/model", tmp / "base"}).code == 0);
  auto r = lt::test::launch({"sample", tmp / "base", "--prompt", "abab <|endoftext|>x", "--tokens", "5", "--temperature",
                             "0", "--tokenizer", "hf:" + kTokenizers + "/order"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains("abab <|endoftext|>x"));
  r = lt::test::launch({"sample", tmp / "base", "--prompt", "ab", "--tokenizer", "hf:" + kTokenizers + "/llama3"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("outside the model's vocabulary of 300") && Contains("--tokenizer"));
}
