// Every reader against thousands of seeded mutations of a valid file: bit flips, truncations, inserted
// bytes, huge, negative and fractional numbers, wrong types, deep nesting and keys given twice. Each
// mutation must end in a valid result or a UserError (the launcher's exit 2 with a message naming the
// file): never a crash, a raw library exception (json, c10, HDF5) or std::bad_alloc. A failure prints
// the reader, the seed and the exception, so that it can be replayed alone (LT_FUZZ_SEED=N).
// LT_FUZZ_SCALE=K runs K times as many mutations (a longer run, e.g. under AddressSanitizer).
#include "catch.hpp"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include <nlohmann/json.hpp>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/data/data.hpp"
#include "lora_trainer/data/packing.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/gguf.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/jinja/jinja.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {


// The seeds a reader runs: LT_FUZZ_SEED alone when set, else `n` x LT_FUZZ_SCALE of them.
std::vector<uint64_t> seeds(uint64_t n) {
  if (const char* one = std::getenv("LT_FUZZ_SEED")) return {std::strtoull(one, nullptr, 10)};
  const char* scale = std::getenv("LT_FUZZ_SCALE");
  n *= scale ? std::max<uint64_t>(1, std::strtoull(scale, nullptr, 10)) : 1;
  std::vector<uint64_t> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = i + 1;
  return out;
}

// Mutations of one input, all drawn from one seed.
class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed * 0x9E3779B97F4A7C15ull + 1) {}

  size_t below(size_t n) { return n ? static_cast<size_t>(rng_() % n) : 0; }
  bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }

  // Byte-level damage: flipped bits, a truncation, inserted or overwritten bytes, a copied range.
  std::string bytes(std::string s, size_t from = 0, size_t to = std::string::npos) {
    to = std::min(to, s.size());
    if (from >= to) return s;
    const size_t kinds = 5, times = 1 + below(4);
    for (size_t t = 0; t < times && from < s.size(); ++t) {
      to = std::min(to, s.size());
      const size_t at = from + below(to - from);
      switch (below(kinds)) {
        case 0: s[at] = static_cast<char>(s[at] ^ (1 << below(8))); break;
        case 1: s.resize(at); return s;
        case 2: s.insert(at, std::string(1 + below(8), static_cast<char>(below(256)))); break;
        case 3: s[at] = "0123456789-.eE\"{}[],: \\x\xff\x00"[below(23)]; break;
        default: {
          const size_t src = from + below(to - from), len = std::min<size_t>(1 + below(64), s.size() - src);
          s.insert(at, s.substr(src, len));
        }
      }
    }
    return s;
  }

  // A value no reader should take on trust.
  json hostile_value() {
    switch (below(22)) {
      case 0: return json(UINT64_MAX);
      case 1: return json(INT64_MAX);
      case 2: return json(INT64_MIN);
      case 3: return json(-1);
      case 4: return json(0);
      case 5: return json(uint64_t{1} << 32);
      case 6: return json(int64_t{1000000000000});
      case 7: return json(1e308);
      case 8: return json(-1e308);
      case 9: return json(0.5);
      case 10: return json(-0.0);
      case 11: return json("");
      case 12: return json(std::string(20000, 'x'));
      case 13: return json(std::string("a\0b", 3));  // a NUL inside (cut-off UTF-8 comes from bytes())
      case 14: return json::array();
      case 15: return json::object();
      case 16: return json(nullptr);
      case 17: return json(true);
      case 18: return json::array({-1, UINT64_MAX, 1e308});
      case 19: return json({{"a", nullptr}});
      case 20: return json(1);
      default: return json("a string");
    }
  }

  // Structural damage of a JSON document, written out as text: a value replaced by a hostile one, a
  // key removed or renamed, a key given twice, nesting far past any limit, or byte damage.
  std::string json_text(const json& doc) {
    json j = doc;
    const size_t kind = below(10);
    if (kind <= 4) {
      std::vector<json::json_pointer> paths;
      collect(j, json::json_pointer(), paths);
      const auto& p = paths[below(paths.size())];
      if (kind <= 2) {
        j[p] = hostile_value();
      } else if (kind == 3 && !p.empty()) {
        json& parent = j[p.parent_pointer()];
        if (parent.is_object()) parent.erase(p.back());
        else if (parent.is_array() && !parent.empty()) parent.erase(parent.size() - 1);
      } else if (!p.empty()) {
        json& parent = j[p.parent_pointer()];
        if (parent.is_object()) {
          json v = parent[p.back()];
          parent.erase(p.back());
          parent[p.back() + (chance(50) ? "x" : "")] = v;
        }
      }
      return j.dump(-1, ' ', false, json::error_handler_t::replace);
    }
    std::string text = doc.dump(-1, ' ', false, json::error_handler_t::replace);
    if (kind == 5) {  // a key given twice: the first object's first member, repeated
      const size_t brace = text.find('{');
      const size_t colon = text.find(':', brace);
      if (brace != std::string::npos && colon != std::string::npos && text[brace + 1] == '"')
        text.insert(brace + 1, text.substr(brace + 1, colon - brace) + "0,");
      return text;
    }
    if (kind == 6) {  // nesting: 100,000 levels, or just past the limit
      const size_t depth = chance(50) ? 100000 : kMaxJsonDepth + 1;
      const size_t at = text.find(':');
      const std::string deep = std::string(depth, '[') + std::string(depth, ']');
      if (at == std::string::npos) return deep;
      size_t end = at + 1;
      while (end < text.size() && text[end] != ',' && text[end] != '}' && text[end] != '{' && text[end] != '[') ++end;
      return text.substr(0, at + 1) + deep + text.substr(end);
    }
    if (kind == 7) {  // a number out of every range, as text
      const size_t digit = text.find_first_of("0123456789");
      if (digit != std::string::npos) text.insert(digit, chance(50) ? "1e999" : "99999999999999999999999");
      return text;
    }
    return bytes(text);
  }

 private:
  static void collect(const json& j, const json::json_pointer& at, std::vector<json::json_pointer>& out) {
    out.push_back(at);
    if (j.is_object())
      for (auto it = j.begin(); it != j.end(); ++it) collect(*it, at / it.key(), out);
    else if (j.is_array())
      for (size_t i = 0; i < j.size(); ++i) collect(j[i], at / i, out);
  }

  std::mt19937_64 rng_;
};

// What the mutations of one reader came to.
struct Tally {
  std::string reader;
  int valid = 0, refused = 0;
  std::vector<std::string> wrong;  // anything but a valid result or a UserError, with its seed

  // Runs one mutation's read.
  void run(uint64_t seed, const std::function<void()>& read) {
    try {
      read();
      ++valid;
    } catch (const UserError& e) {
      ++refused;
      if (std::string(e.what()).find("[json.exception") != std::string::npos)
        wrong.push_back("seed " + std::to_string(seed) + ": a raw JSON error in a UserError: " + e.what());
    } catch (const std::exception& e) {
      wrong.push_back("seed " + std::to_string(seed) + ": " + typeid(e).name() + ": " + std::string(e.what()).substr(0, 300));
    }
  }

  // Every mutation ended cleanly, and the mutations were damaging enough to be refused most often.
  void check() const {
    INFO(reader << ": " << valid << " valid, " << refused << " refused, " << wrong.size() << " wrong");
    for (size_t i = 0; i < std::min<size_t>(wrong.size(), 8); ++i) UNSCOPED_INFO(wrong[i]);
    CHECK(wrong.empty());
    CHECK(refused > 0);
  }
};

// A short text that exercises a tokenizer's patterns: words, numbers, runs of spaces, newlines,
// contractions, punctuation and multi-byte characters.
const std::string kSample = "Hello world's  3.14159 \n\n\t  naïve café 東京 <|endoftext|> ok!!   x";

}  // namespace

TEST_CASE("fuzz: safetensors files, header and bytes", "[fuzz]") {
  test::TempDir d;
  const std::string base = d / "base.safetensors", path = d / "m.safetensors";
  write_safetensors(base,
                    {{"a", torch::arange(12, torch::kFloat32).reshape({3, 4})},
                     {"b", torch::ones({5}, torch::kBFloat16)},
                     {"c", torch::arange(4, torch::kInt64).reshape({2, 2})},
                     {"d", torch::zeros({0, 3})}},
                    {{"format", "pt"}});
  const std::string valid = read_file(base);
  uint64_t n = 0;
  std::memcpy(&n, valid.data(), 8);
  const json header = json::parse(valid.substr(8, n));
  const std::string buffer = valid.substr(8 + n);
  Tally t{"safetensors"};
  for (uint64_t seed : seeds(1500)) {
    Mutator m(seed);
    std::string file;
    if (m.chance(60)) {  // a damaged header with a consistent length
      std::string h = m.json_text(header);
      const uint64_t len = m.chance(90) ? h.size() : m.below(1u << 20) + (m.chance(50) ? 0 : UINT64_MAX - (1u << 20));
      file = std::string(reinterpret_cast<const char*>(&len), 8) + h + buffer;
    } else {
      file = m.bytes(valid, 0, m.chance(70) ? 8 + n : valid.size());
    }
    write_file_atomic(path, file);
    t.run(seed, [&] {
      for (auto& [name, tensor] : read_safetensors(path)) (void)tensor.sum().item<double>();
    });
  }
  t.check();
}

TEST_CASE("fuzz: a GGUF file's structure, as check-export reads it before llama.cpp", "[fuzz]") {
  test::TempDir d;
  const std::string base = d / "base.gguf", path = d / "m.gguf";
  GgufWriter g;
  g.set_string("general.architecture", "llama");
  g.set_u32("general.file_type", 0);
  g.set_strings("tokenizer.ggml.tokens", {"a", "b", "<|im_end|>"});
  g.set_i32s("tokenizer.ggml.token_type", {1, 1, 3});
  g.set_f32s("x.scores", {0.5f, -1.0f});
  g.set_bool("tokenizer.ggml.add_bos_token", false);
  g.set_string("tokenizer.chat_template", "{{ messages }}");
  g.add_tensor("token_embd.weight", torch::arange(12, torch::kFloat32).reshape({3, 4}));
  g.add_tensor("output_norm.weight", torch::ones({4}, torch::kBFloat16));
  g.write(base);
  const std::string valid = read_file(base);
  const GgufFileInfo info = read_gguf_info(base);
  CHECK(info.version == 3);
  CHECK(info.tensor_count == 2);
  CHECK(info.file_type == 0);
  CHECK(info.has_chat_template);
  // Every truncation is named.
  for (size_t n = 0; n < valid.size(); n += 7) {
    write_file_atomic(path, valid.substr(0, n));
    CHECK_THROWS_AS(read_gguf_info(path), UserError);
  }
  Tally t{"gguf"};
  for (uint64_t seed : seeds(1500)) {
    Mutator m(seed);
    write_file_atomic(path, m.bytes(valid, 0, m.chance(80) ? valid.size() - 64 : valid.size()));
    t.run(seed, [&] { (void)read_gguf_info(path); });
  }
  t.check();
}

TEST_CASE("fuzz: tokenizer.json and tokenizer_config.json", "[fuzz]") {
  test::TempDir d;
  const std::string dir = d / "tok";
  fs::create_directories(dir);
  for (const std::string style : {"gpt2", "llama3"}) {
    const json tokenizer = read_json_file(lt::test::kTestData + "/hf_tokenizers/" + style + "/tokenizer.json");
    const json config = {{"eos_token", style == "gpt2" ? "<|endoftext|>" : "<|eot_id|>"}, {"add_bos_token", false}};
    Tally t{style + " tokenizer.json"};
    for (uint64_t seed : seeds(style == "gpt2" ? 700 : 500)) {
      Mutator m(seed);
      const bool config_only = m.chance(10);
      write_file_atomic(dir + "/tokenizer.json", config_only ? tokenizer.dump() : m.json_text(tokenizer));
      write_file_atomic(dir + "/tokenizer_config.json", config_only ? m.json_text(config) : config.dump());
      t.run(seed, [&] {
        auto tok = make_tokenizer("hf:" + dir);
        const auto ids = tok->encode(kSample);
        for (uint32_t id : ids) CHECK(id < tok->vocab_size());
        (void)tok->decode(ids);
      });
    }
    t.check();
  }
}

TEST_CASE("fuzz: GPT-2 tokenizer files (encoder.json, vocab.bpe)", "[fuzz]") {
  test::TempDir d;
  const std::string dir = d / "gpt2";
  fs::create_directories(dir);
  // A small GPT-2-format tokenizer: the first 300 ids of the real files and the merges that make them.
  const json full = read_json_file(default_gpt2_dir() + "/encoder.json");
  json encoder = json::object();
  for (auto it = full.begin(); it != full.end(); ++it)
    if (it.value().get<uint64_t>() < 300) encoder[it.key()] = it.value();
  encoder["<|endoftext|>"] = 300;
  std::string merges = "#version: 0.2\n", line;
  std::istringstream in(read_file(default_gpt2_dir() + "/vocab.bpe"));
  std::getline(in, line);
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    if (space != std::string::npos && encoder.contains(line.substr(0, space) + line.substr(space + 1))) merges += line + "\n";
  }
  write_file_atomic(dir + "/encoder.json", encoder.dump());
  write_file_atomic(dir + "/vocab.bpe", merges);
  REQUIRE_NOTHROW(make_gpt2_tokenizer(dir)->encode(kSample));
  Tally t{"gpt2 encoder.json / vocab.bpe"};
  for (uint64_t seed : seeds(400)) {
    Mutator m(seed);
    const bool vocab = m.chance(30);
    write_file_atomic(dir + "/encoder.json", vocab ? encoder.dump() : m.json_text(encoder));
    write_file_atomic(dir + "/vocab.bpe", vocab ? m.bytes(merges) : merges);
    t.run(seed, [&] {
      auto tok = make_gpt2_tokenizer(dir);
      (void)tok->decode(tok->encode(kSample));
    });
  }
  t.check();
}

TEST_CASE("fuzz: job config files and key=value overrides", "[fuzz]") {
  test::TempDir d;
  const std::string path = d / "c.json";
  Tally files{"config file"}, overrides{"override"};
  for (const std::string name : {"demo.json", "continual/prose_code_prose_lora.json", "bench_gpt2_124m.json"}) {
    const json cfg = read_json_file(std::string(LT_SOURCE_DIR) + "/configs/" + name);
    for (uint64_t seed : seeds(400)) {
      Mutator m(seed);
      write_file_atomic(path, m.json_text(cfg));
      files.run(seed, [&] { (void)make_config(path, {}).to_json(); });
    }
  }
  // Overrides: every key of the lora/train schema, given hostile values as JSON text or bare words.
  const json defaults = make_config(std::string(LT_SOURCE_DIR) + "/configs/demo.json", {}).to_json();
  std::vector<std::string> keys;
  std::function<void(const json&, const std::string&)> walk = [&](const json& j, const std::string& at) {
    if (!j.is_object()) return keys.push_back(at);
    for (auto it = j.begin(); it != j.end(); ++it) walk(*it, at.empty() ? it.key() : at + "/" + it.key());
  };
  walk(defaults, "");
  REQUIRE(keys.size() > 40);
  for (uint64_t seed : seeds(2000)) {
    Mutator m(seed);
    const std::string key = keys[m.below(keys.size())];
    std::string value = m.chance(70) ? m.hostile_value().dump() : m.json_text(json::parse(R"({"a": [1, {"b": "c"}]})"));
    if (m.chance(10)) value = m.bytes(value);
    overrides.run(seed, [&] {
      (void)make_config(std::string(LT_SOURCE_DIR) + "/configs/demo.json", {key + "=" + value}).to_json();
    });
  }
  files.check();
  overrides.check();
}

TEST_CASE("fuzz: checkpoint metadata.json and state.h5, and a PEFT adapter_config.json", "[fuzz]") {
  test::TempDir d;
  // A LoRA checkpoint of the tiny model (2 + 2 steps), trained as the launcher does.
  test::make_byte_dataset(d / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "lora/train", d / "lora.json"};
  for (const auto& o : test::tiny_overrides(d / "data")) args.push_back(o);
  for (const auto& o : {"training/pre_lora_tokens=[256]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                        "training/post_lora_tokens=[256]", R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])",
                        "optimization/lora/rank=4"})
    args.push_back(o);
  REQUIRE(test::launch(args).code == 0);
  REQUIRE(test::launch({"run", "m", d / "lora.json", d / "out"}).code == 0);
  const std::string src = d / "out/checkpoints/general/default/m/final/512";
  REQUIRE(is_checkpoint(src));
  const json meta = read_json_file(src + "/metadata.json");
  const std::string state = read_file(src + "/state.h5");
  const std::string ck = d / "ck";
  REQUIRE(test::shell("cp -r " + test::quote(src) + " " + test::quote(ck)).code == 0);

  Tally metadata{"metadata.json"}, h5{"state.h5"};
  for (uint64_t seed : seeds(600)) {
    Mutator m(seed);
    write_file_atomic(ck + "/metadata.json", m.json_text(meta));
    metadata.run(seed, [&] {
      (void)CheckpointMeta::read(ck);
      (void)inspect_checkpoint(ck);
      if (seed % 4 == 0) export_merged(ck, d / "exported", false, true);
      if (seed % 4 == 1) (void)from_checkpoint_path(ck, "", d / ("restored" + std::to_string(seed)), {});
    });
  }
  write_file_atomic(ck + "/metadata.json", meta.dump(2));
  for (uint64_t seed : seeds(600)) {
    Mutator m(seed);
    write_file_atomic(ck + "/state.h5", m.bytes(state));
    h5.run(seed, [&] {
      for (auto& [name, t] : read_checkpoint_tensors(ck)) (void)t.sum().item<double>();
    });
  }
  metadata.check();
  h5.check();

  // The same adapters as a PEFT directory, read as optimization/lora/init_from reads it.
  write_file_atomic(ck + "/state.h5", state);
  const std::string peft = d / "peft";
  export_peft(ck, peft);
  const json adapter_config = read_json_file(peft + "/adapter_config.json");
  const auto targets = meta["lora"]["targets"].get<std::vector<std::string>>();
  const double alpha = meta["lora"]["alpha"].get<double>();
  auto read_peft = [&] { (void)read_adapter_source(peft, ModelFamily::Gpt2, targets, 4, alpha, false, false, "wte.weight", {}); };
  REQUIRE_NOTHROW(read_peft());
  Tally peft_config{"adapter_config.json"};
  for (uint64_t seed : seeds(600)) {
    Mutator m(seed);
    write_file_atomic(peft + "/adapter_config.json", m.json_text(adapter_config));
    peft_config.run(seed, read_peft);
  }
  peft_config.check();
}

TEST_CASE("fuzz: JSONL records for tokenize --format jsonl and pairs", "[fuzz]") {
  test::TempDir d;
  std::string records;
  for (int i = 0; i < 6; ++i)
    records += json({{"prompt", "Question " + std::to_string(i) + "?"}, {"completion", " answer"}, {"chosen", " yes"},
                     {"rejected", " no"}}).dump() + "\n";
  const json one = json::parse(records.substr(0, records.find('\n')));
  Tally t{"jsonl"};
  for (uint64_t seed : seeds(300)) {
    Mutator m(seed);
    std::string text = records;
    if (m.chance(50)) text = m.bytes(text);
    else text.replace(0, text.find('\n'), m.json_text(one));
    write_file_atomic(d / "in.jsonl", text);
    TokenizeOptions o;
    o.inputs = {d / "in.jsonl"};
    o.out_dir = d / "data/set";
    o.tokenizer = "byte";
    o.val_fraction = 0.3;
    t.run(seed, [&] {
      if (seed % 2) tokenize_jsonl_to_padded(o);
      else tokenize_jsonl_to_contrastive(o);
    });
  }
  t.check();
}

TEST_CASE("fuzz: conversations and chat templates for tokenize --format chat", "[fuzz]") {
  test::TempDir d;
  const std::string model = d / "model";
  std::filesystem::create_directories(model);
  std::filesystem::copy_file(lt::test::kTestData + "/hf_tokenizers/qwen2/tokenizer.json", model + "/tokenizer.json");
  const std::string source = read_file(lt::test::kTestData + "/chat_templates/qwen3.jinja");
  const json conversation = json::parse(R"({"messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "<think>x</think>Hello."},
      {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})");
  Tally records{"chat records"}, templates{"chat templates"};
  for (uint64_t seed : seeds(300)) {
    Mutator m(seed);
    // Half the runs damage a record, half the template (bytes or JSON of the tokenizer config).
    const bool damage_template = seed % 2;
    std::string text = conversation.dump() + "\n" + conversation.dump() + "\n" + conversation.dump() + "\n";
    json config = {{"eos_token", "<|im_end|>"}, {"chat_template", source}};
    if (damage_template) config["chat_template"] = m.bytes(source);
    else if (m.chance(50)) text = m.bytes(text);
    else text.replace(0, text.find('\n'), m.json_text(conversation));
    write_file_atomic(model + "/tokenizer_config.json", config.dump(-1, ' ', false, json::error_handler_t::replace));
    write_file_atomic(d / "in.jsonl", text);
    TokenizeOptions o;
    o.inputs = {d / "in.jsonl"};
    o.out_dir = d / "data/chat";
    o.tokenizer = "hf:" + model;
    o.val_fraction = 0.4;
    o.loss_on = "last";
    (damage_template ? templates : records).run(seed, [&] { tokenize_jsonl_to_chat(o); });
  }
  records.check();
  templates.check();
}

TEST_CASE("fuzz: generated and damaged chat templates render, or fail naming the template and line, within the limits", "[fuzz]") {
  // Templates put together from pieces that loop, recurse, multiply strings and lists, nest and print,
  // with hostile numbers, then sometimes damaged byte by byte. Low limits keep each render to
  // milliseconds; whatever stops it must be a TemplateError naming the template and the line.
  const char* pieces[] = {
      "{% for i in range(N) %}B{% endfor %}", "{% for m in messages %}{{ m.role }}: {{ m.content|trim }}\n{% endfor %}",
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(N) }}",
      "{% macro g(n) %}B{{ g(n + 1) }}{% endmacro %}{{ g(N) }}", "{{ 'x' * N }}", "{{ [1, 'a'] * N }}", "{{ 2 ** N }}",
      "{{ N ** N }}", "{{ -N // -1 }}{{ N % -1 }}{{ N * N }}{{ N + N }}", "{{ messages|tojson(indent=N) }}",
      "{% set ns = namespace(s='ab') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
      "{% set ns = namespace(l=[]) %}{% for i in range(N) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
      "{{ ('ab' * N).replace('a', 'xyz')|length }}", "{{ 'a'|center(N) }}", "{{ ('a\n' * N)|indent(N) }}",
      "{{ range(N)|list|unique|length }}{{ range(N)|list|sort|first }}", "{{ (range(N)|list) == (range(N)|list) }}",
      "{{ raise_exception('no') }}", "{{ undefined_name.x }}", "{% if messages[0].role == 'system' %}S{% endif %}",
      "{{ messages[N] }}{{ 'abc'[N] }}{{ [1, 2, 3][N:N] }}", "{{ ('a' * N).split('a')|length }}", "{{ '{0}{0}'.format('y' * N) }}",
      "{% set x %}{% for i in range(N) %}yy{% endfor %}{% endset %}{{ x|length }}{{ x|wordcount }}", "{{ [[[[N]]]] }}{{ ((((N)))) }}",
      "{% if N %}{% if N %}{% for i in [N] %}B{% endfor %}{% endif %}{% endif %}", "{{ N|int }}{{ N|float }}{{ N|abs }}{{ N|round }}",
      "{{ range(N, -N, -N)|length }}", "{{ (messages * N)|map(attribute='role')|join(',') }}", "{{ '%s%d' % ('a' * N, N) }}",
      "{% filter upper %}{% for i in range(N) %}b{% endfor %}{% endfilter %}", "{% generation %}B{% endgeneration %}",
  };
  const char* numbers[] = {"0", "1", "7", "40", "100", "100000", "1000000000", "9223372036854775807", "-3", "2.5", "1e300"};
  const json context = json::parse(R"({"messages": [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi?"},
      {"role": "assistant", "content": "Hello."}], "add_generation_prompt": true, "bos_token": "<s>"})");
  jinja::Limits limits;
  limits.steps = 200000;
  limits.output = 1 << 20;
  limits.string = 1 << 20;
  limits.list = 100000;
  limits.depth = 50;
  jinja::RenderOptions options;
  options.limits = limits;
  Tally tally{"chat templates"};
  int rendered = 0, stopped = 0;
  std::map<std::string, int> by_limit;
  for (uint64_t seed : seeds(600)) {
    Mutator m(seed);
    std::string source;
    for (size_t k = 0, n = 1 + m.below(4); k < n; ++k) {
      std::string piece = pieces[m.below(sizeof pieces / sizeof *pieces)];
      for (size_t at; (at = piece.find('N')) != std::string::npos;) piece.replace(at, 1, numbers[m.below(sizeof numbers / sizeof *numbers)]);
      for (size_t at; (at = piece.find('B')) != std::string::npos;)  // a body: another piece, or text
        piece.replace(at, 1, m.chance(30) ? std::string(pieces[m.below(4)]) : std::string("t\n"));
      for (size_t at; (at = piece.find('N')) != std::string::npos;) piece.replace(at, 1, "3");
      for (size_t at; (at = piece.find('B')) != std::string::npos;) piece.replace(at, 1, "u");
      source += (m.chance(30) ? "\n" : "") + piece;
    }
    if (m.chance(30)) source = m.bytes(source);
    tally.run(seed, [&] {
      try {
        const jinja::Template t(source, "fuzzed.jinja");
        const jinja::Rendered r = t.render(context, nullptr, options);
        CHECK(r.text.size() <= static_cast<size_t>(limits.output));
        CHECK(r.steps <= limits.steps);
        ++rendered;
      } catch (const jinja::TemplateError& e) {
        const std::string what = e.what();
        if (what.rfind("fuzzed.jinja line ", 0) != 0)
          throw std::runtime_error("seed " + std::to_string(seed) + ": an error without the template's name and line: " + what);
        if (!e.limit.empty()) ++by_limit[e.limit];
        ++stopped;
        throw;
      }
    });
  }
  tally.check();
  INFO(rendered << " rendered, " << stopped << " stopped");
  CHECK(rendered > 50);
  for (const char* limit : {"steps", "string", "depth"}) {
    INFO(limit);
    CHECK(by_limit[limit] > 0);  // the limits were reached, not just the syntax refused
  }
}

TEST_CASE("fuzz: a dataset's meta.json, shape.json and token files, as training opens them", "[fuzz]") {
  test::TempDir d;
  const std::string data = d / "data";
  test::make_byte_dataset(data, "pmd", 1, 4, 200);
  TokenizeOptions o;
  write_file_atomic(d / "in.jsonl", R"({"prompt": "a question?", "completion": " an answer"})" "\n"
                                    R"({"prompt": "another?", "completion": " yes"})" "\n"
                                    R"({"prompt": "third", "completion": " no"})" "\n");
  o.inputs = {d / "in.jsonl"};
  o.out_dir = data + "/padded";
  o.tokenizer = "byte";
  o.val_fraction = 0.4;
  tokenize_jsonl_to_padded(o);
  // Reads a sample of every split, as a sampler does; a padded dataset packed too (data/pack).
  auto read = [](const Dataset& ds) {
    ds.check_vocabulary(257);
    for (Split split : {Split::Train, Split::Val}) {
      const int64_t T = 8;
      if (ds.num_samples(split, T) == 0) continue;
      std::vector<int64_t> in(static_cast<size_t>(T * ds.rows_per_sample())), target(in.size()), segments(in.size());
      ds.sample(split, ds.num_samples(split, T) - 1, T, in.data(), target.data(), segments.data());
    }
  };
  auto open = [&](const std::string& name) {
    if (name == "pmd") return read(PmdDataset(data, name));
    read(PaddedDataset(data, name));
    read(PackedDataset(std::make_unique<PaddedDataset>(data, name)));
  };
  for (const std::string name : {"pmd", "padded"}) {
    const std::string dir = data + "/" + name;
    std::vector<std::string> files = {"meta.json"};
    if (name == "padded") files.insert(files.end(), {"shape.json", "train.tokens.bin", "train.mask.bin", "train.lengths.bin"});
    else files.push_back("train.bin");
    std::map<std::string, std::string> valid;
    for (const auto& f : files) valid[f] = read_file(dir + "/" + f);
    REQUIRE_NOTHROW(open(name));
    Tally t{name + " dataset"};
    for (uint64_t seed : seeds(400)) {
      Mutator m(seed);
      const std::string& f = files[m.below(files.size())];
      const bool is_json = f.size() > 5 && f.compare(f.size() - 5, 5, ".json") == 0;
      write_file_atomic(dir + "/" + f, is_json && m.chance(80) ? m.json_text(json::parse(valid[f])) : m.bytes(valid[f]));
      t.run(seed, [&] { open(name); });
      write_file_atomic(dir + "/" + f, valid[f]);
    }
    t.check();
  }
}

TEST_CASE("fuzz: a Hugging Face model's config.json for import-hf", "[fuzz]") {
  test::TempDir d;
  const std::string model = d / "model";
  fs::create_directories(model);
  fs::copy_file(lt::test::kTestData + "/hf_llama/model/model.safetensors", model + "/model.safetensors");
  const json config = read_json_file(lt::test::kTestData + "/hf_llama/model/config.json");
  Tally t{"config.json (import-hf)"};
  for (uint64_t seed : seeds(300)) {
    Mutator m(seed);
    write_file_atomic(model + "/config.json", m.json_text(config));
    t.run(seed, [&] { (void)import_hf(model, d / ("out" + std::to_string(seed % 2))); });
  }
  t.check();
}
