// A model trained on conversations ships with the chat template and stop tokens it was trained with
// (chat_template.hpp's ChatFormat): `tokenize --format chat` records them in the dataset's meta.json,
// the job in its checkpoints' metadata.json, and `export` writes them as transformers (tokenizer files,
// chat_template.jinja, generation_config.json) and llama.cpp (tokenizer.chat_template, the end of turn
// as eos) read them. The template loses transformers' {% generation %} tags, which other renderers do
// not know, and renders the same text: in our engine over every template of tests/data/chat_templates,
// and in Python's jinja2 without transformers' extension over the job's own conversations.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "chat_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/jinja/jinja.hpp"

namespace fs = std::filesystem;
using namespace lt;
using lt::test::Contains;
using lt::test::kSourceDir;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {


std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t e; (e = text.find('\n', b)) != std::string::npos; b = e + 1) out.push_back(text.substr(b, e - b));
  if (b < text.size()) out.push_back(text.substr(b));
  return out;
}
const std::string kTemplates = kSourceDir + "/tests/data/chat_templates/";

// A GGUF file's string and u32 metadata (ggml/docs/gguf.md); the other values are skipped.
struct GgufKv {
  std::map<std::string, std::string> strings;
  std::map<std::string, uint32_t> u32s;
};

GgufKv read_gguf_kv(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f);
  auto get = [&](auto& v) { f.read(reinterpret_cast<char*>(&v), sizeof v); };
  auto str = [&]() {
    uint64_t n = 0;
    get(n);
    std::string s(n, '\0');
    f.read(s.data(), static_cast<std::streamsize>(n));
    return s;
  };
  const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};  // by value type; 8 string, 9 array
  std::function<void(uint32_t)> skip = [&](uint32_t type) {
    if (type == 8) {
      str();
    } else if (type == 9) {
      uint32_t inner = 0;
      uint64_t n = 0;
      get(inner);
      get(n);
      for (uint64_t i = 0; i < n; ++i) skip(inner);
    } else {
      f.seekg(static_cast<std::streamoff>(sizes[type]), std::ios::cur);
    }
  };
  char magic[4];
  f.read(magic, 4);
  REQUIRE(std::memcmp(magic, "GGUF", 4) == 0);
  uint32_t version = 0;
  uint64_t tensors = 0, kvs = 0;
  get(version);
  get(tensors);
  get(kvs);
  GgufKv out;
  for (uint64_t i = 0; i < kvs; ++i) {
    const std::string key = str();
    uint32_t type = 0;
    get(type);
    REQUIRE(out.strings.count(key) + out.u32s.count(key) == 0);  // every key once
    if (type == 8) out.strings[key] = str();
    else if (type == 4) get(out.u32s[key]);
    else skip(type);
  }
  return out;
}

}  // namespace

TEST_CASE("chat export: a template without its {% generation %} tags renders the same text as with them", "[chat]") {
  // Every template of the engine's golden set over its 60 conversations: each render's text (or error)
  // is the same; the tags are gone (outside raw text and comments, which keep them).
  std::vector<ojson> conversations;
  for (const auto& line : split_lines(read_file(kTemplates + "conversations.jsonl"))) conversations.push_back(ojson::parse(line));
  REQUIRE(conversations.size() >= 60);
  const ojson special = ojson::parse(read_file(kTemplates + "special_tokens.json"));
  int templates = 0;
  for (const auto& entry : fs::directory_iterator(kTemplates)) {
    if (entry.path().extension() != ".jinja") continue;
    const std::string name = entry.path().stem().string(), source = read_file(entry.path().string());
    INFO(name);
    const std::string shipped = jinja::without_generation_tags(source, name);
    const jinja::Template before(source, name), after(shipped, name);  // one name: errors name it
    CHECK_FALSE(after.has_generation());
    if (name == "with_generation") CHECK(before.has_generation());
    for (const auto& c : conversations) {
      ojson ctx = special.contains(name) ? special[name] : ojson::object();
      for (auto it = c.begin(); it != c.end(); ++it) ctx[it.key()] = it.value();
      auto render = [&](const jinja::Template& t) {
        try {
          return t.render(ctx, [](const std::string&) { return std::string("26 Nov 2026"); }).text;
        } catch (const jinja::TemplateError& e) {
          return std::string("error: ") + e.what();
        }
      };
      const std::string a = render(before), b = render(after);
      CHECK(a == b);
    }
    ++templates;
  }
  CHECK(templates >= 10);
  // Whitespace control on the tags is kept; "\r\n" is read as jinja2 reads it; raw text is left alone.
  const std::string src = "A{%- generation -%}\r\n  B  \r\n{%+ endgeneration %}C{% raw %}{% generation %}{% endraw %}\r\n\r\n";
  const std::string shipped = jinja::without_generation_tags(src, "inline");
  CHECK(shipped == "A{%- if true -%}\n  B  \n{%+ endif %}C{% raw %}{% generation %}{% endraw %}\n\n");
  CHECK(jinja::Template(src, "a").render(ojson::object()).text == jinja::Template(shipped, "b").render(ojson::object()).text);
}

TEST_CASE("chat export: a job on conversations exports its template and stop tokens for transformers and llama.cpp", "[chat][launcher]") {
  lt::test::TempDir tmp;
  const std::string model = lt::test::chat_model_dir(tmp), data = tmp / "data";
  const auto tok = make_tokenizer("hf:" + model);
  const uint32_t im_end = tok->encode("<|im_end|>").at(0);
  REQUIRE(tok->encode("<|im_end|>").size() == 1);
  const std::vector<ojson> records = {
      ojson::parse(R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                       {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"},
                       {"role": "assistant", "content": "Six."}]})"),
      ojson::parse(R"({"prompt": "Hi", "completion": "Hello!"})"),
      ojson::parse(R"({"messages": [{"role": "user", "content": "Q  "}, {"role": "assistant", "content": " A\n"}]})")};
  std::string lines;
  for (const auto& r : records) lines += r.dump() + "\n";
  write_file_atomic(tmp / "conv.jsonl", lines);
  auto r = lt::test::launch({"tokenize", tmp / "conv.jsonl", "--format", "chat", "--tokenizer", "hf:" + model, "--name", "conv",
                             "--data-dir", data, "--val-fraction", "0.34", "--length", "128"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  // The dataset records the template as shipped, its special tokens and the stop ids: the eos_token's,
  // then generation_config.json's (2 is <|im_end|>'s own id again: once).
  const json chat = read_json_file(data + "/conv/meta.json").at("chat");
  const std::string shipped = jinja::without_generation_tags(read_file(kTemplates + "with_generation.jinja"), "t");
  CHECK(chat["template"] == shipped);
  CHECK_FALSE(jinja::Template(shipped, "shipped").has_generation());  // (its comment still names the tag)
  CHECK(chat["eos_token"] == "<|im_end|>");
  std::vector<uint32_t> stops = {im_end};
  for (uint32_t id : {2u, 0u})
    if (id != im_end) stops.push_back(id);
  CHECK(chat["stop_ids"].get<std::vector<uint32_t>>() == stops);
  r = lt::test::launch({"tokenize", tmp / "conv.jsonl", "--format", "chat", "--tokenizer", "hf:" + model, "--name", "shown",
                        "--data-dir", data, "--show"});
  REQUIRE(r.code == 0);
  std::vector<std::string> texts;
  for (const auto& line : split_lines(r.out))
    if (!line.empty() && line[0] == '{') texts.push_back(json::parse(line)["text"].get<std::string>());
  REQUIRE(texts.size() == records.size());

  // A LoRA job on them (a random base: what is checked is what it records), and one on plain text.
  const std::vector<std::string> arch = lt::test::chat_job_overrides(data);
  auto configure = [&](const std::string& file, const std::string& dataset) {
    std::vector<std::string> args = {"configure", "lora/train", tmp / file};
    args.insert(args.end(), arch.begin(), arch.end());
    args.push_back("training/post_lora_dataset=[[" + dataset + "]]");
    REQUIRE(lt::test::launch(args).code == 0);
  };
  configure("chat.json", R"({"name":"conv","rate":1,"style":"padded"})");
  r = lt::test::launch({"run", "chat", tmp / "chat.json", tmp / "out"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const std::string ck = tmp / "out/checkpoints/general/default/chat/final/1024";
  CHECK(read_json_file(ck + "/metadata.json").at("chat") == chat);

  // Hugging Face: the tokenizer's files, the template in tokenizer_config.json and chat_template.jinja,
  // generation_config.json with the stop ids (its other settings kept).
  r = lt::test::launch({"export", ck, tmp / "hf", "--format", "hf"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("chat_template.jinja"));
  CHECK(read_file(tmp / "hf/tokenizer.json") == read_file(model + "/tokenizer.json"));
  CHECK(read_file(tmp / "hf/chat_template.jinja") == shipped);
  const json tc = read_json_file(tmp / "hf/tokenizer_config.json");
  CHECK(tc["chat_template"] == shipped);
  CHECK(tc["eos_token"] == "<|im_end|>");
  const json gen = read_json_file(tmp / "hf/generation_config.json");
  CHECK(gen["eos_token_id"].get<std::vector<uint32_t>>() == stops);
  CHECK(gen["temperature"] == 0.7);
  // Python's jinja2, without transformers' {% generation %} extension, renders the exported template
  // into the text the job trained on.
  json request = {{"template", tmp / "hf/chat_template.jinja"}, {"variables", {{"eos_token", "<|im_end|>"}}},
                  {"conversations", json::array()}};
  for (const auto& rec : records)
    request["conversations"].push_back(rec.contains("messages") ? json::parse(rec["messages"].dump())
                                                                : json::array({{{"role", "user"}, {"content", rec["prompt"]}},
                                                                               {{"role", "assistant"}, {"content", rec["completion"]}}}));
  write_file_atomic(tmp / "request.json", request.dump());
  const lt::test::Result py = lt::test::shell("python3 " + lt::test::quote(kSourceDir + "/tests/tools/render_chat_template.py") + " " +
                                              lt::test::quote(tmp / "request.json"));
  if (py.code == 3) {
    WARN("skipped the jinja2 check: " << py.out);
  } else {
    INFO(py.out);
    REQUIRE(py.code == 0);
    CHECK(json::parse(py.out).get<std::vector<std::string>>() == texts);
  }

  // GGUF: tokenizer.chat_template, and the end of turn as eos.
  r = lt::test::launch({"export", ck, tmp / "gguf", "--format", "gguf"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("the chat template it was trained with"));
  const GgufKv kv = read_gguf_kv(tmp / "gguf/model.gguf");
  CHECK(kv.strings.at("tokenizer.chat_template") == shipped);
  CHECK(kv.u32s.at("tokenizer.ggml.eos_token_id") == im_end);

  // A job on plain text exports as before: no template, the tokenizer's own eos.
  fs::create_directories(tmp / "text");
  for (int i = 0; i < 4; ++i) {
    std::string text;
    for (int k = 0; k < 200; ++k) text += "Plain text " + std::to_string(i * 1000 + k) + ", not a conversation. ";
    write_file_atomic(tmp / ("text/" + std::to_string(i) + ".txt"), text + "\n");
  }
  REQUIRE(lt::test::launch({"tokenize", tmp / "text", "--tokenizer", "hf:" + model, "--name", "plain", "--data-dir", data}).code == 0);
  configure("plain.json", R"({"name":"plain","rate":1})");
  REQUIRE(lt::test::launch({"run", "plain", tmp / "plain.json", tmp / "out"}).code == 0);
  const std::string plain = tmp / "out/checkpoints/general/default/plain/final/1024";
  CHECK_FALSE(read_json_file(plain + "/metadata.json").contains("chat"));
  REQUIRE(lt::test::launch({"export", plain, tmp / "hf_plain", "--format", "hf"}).code == 0);
  CHECK_FALSE(fs::exists(tmp / "hf_plain/chat_template.jinja"));
  CHECK_FALSE(fs::exists(tmp / "hf_plain/generation_config.json"));
  REQUIRE(lt::test::launch({"export", plain, tmp / "gguf_plain", "--format", "gguf"}).code == 0);
  const GgufKv plain_kv = read_gguf_kv(tmp / "gguf_plain/model.gguf");
  CHECK(plain_kv.strings.count("tokenizer.chat_template") == 0);
  CHECK(plain_kv.u32s.at("tokenizer.ggml.eos_token_id") == tok->eot_id());
}
