// Chat data (chat_template.hpp, `tokenize --format chat`): a conversation is rendered with the model
// directory's chat template and tokenized as a whole; the loss mask covers exactly the assistant turns
// with their end-of-turn token (every turn, the last, or everything); the prefix method and a template's
// own {% generation %} tags agree; bad records are refused naming FILE:LINE and the reason, with nothing
// written.
#include "catch.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/data/tokenizer.hpp"

namespace fs = std::filesystem;
using lt::test::Contains;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kSrc = LT_SOURCE_DIR;

// A model directory: the small Qwen2-layout tokenizer (ChatML's <|im_start|>/<|im_end|> as added tokens)
// with `template_file` of tests/data/chat_templates as its chat template.
std::string model_dir(const lt::test::TempDir& tmp, const std::string& template_file, const std::string& name = "model") {
  const fs::path dir = tmp / name;
  fs::create_directories(dir);
  fs::copy_file(kSrc + "/tests/data/hf_tokenizers/qwen2/tokenizer.json", dir / "tokenizer.json");
  ojson config = {{"eos_token", "<|im_end|>"}, {"chat_template", lt::read_file(kSrc + "/tests/data/chat_templates/" + template_file)}};
  lt::write_file_atomic((dir / "tokenizer_config.json").string(), config.dump(1));
  return dir.string();
}

const ojson kConversation = ojson::parse(R"({"messages": [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is 2 + 2?"},
  {"role": "assistant", "content": "4."},
  {"role": "user", "content": "And 3 + 3? Ünïcode 東京"},
  {"role": "assistant", "content": "Six, café."}]})");

// The text of the masked tokens, run by run.
std::vector<std::string> masked_runs(const lt::Tokenizer& tok, const lt::MaskedIds& m) {
  std::vector<std::string> runs;
  bool in = false;
  for (size_t k = 0; k < m.ids.size(); ++k) {
    if (m.mask[k] && !in) runs.emplace_back();
    if (m.mask[k]) runs.back() += tok.decode({m.ids[k]});
    in = m.mask[k];
  }
  return runs;
}

}  // namespace

TEST_CASE("chat: the loss mask is the assistant turns with their end-of-turn token (ChatML, Qwen2.5's template)", "[chat]") {
  lt::test::TempDir tmp;
  const std::string dir = model_dir(tmp, "qwen2_5.jinja");
  const auto tmpl = lt::ChatTemplate::from_model_dir(dir);
  const auto tok = lt::make_tokenizer("hf:" + dir);
  const lt::ChatText chat = tmpl.for_training(kConversation, lt::ChatLoss::Assistant, ojson::object(), "x.jsonl:1");
  CHECK(chat.text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                     "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3 + 3? Ünïcode 東京<|im_end|>\n"
                     "<|im_start|>assistant\nSix, café.<|im_end|>\n");
  const lt::MaskedIds m = lt::tokenize_chat(*tok, chat, "x.jsonl:1");
  CHECK(m.ids == tok->encode(chat.text));  // tokenized as a whole
  CHECK(masked_runs(*tok, m) == std::vector<std::string>{"4.<|im_end|>", "Six, café.<|im_end|>"});
  const auto last = lt::tokenize_chat(*tok, tmpl.for_training(kConversation, lt::ChatLoss::LastAssistant, ojson::object(), "x"), "x");
  CHECK(masked_runs(*tok, last) == std::vector<std::string>{"Six, café.<|im_end|>"});
  const auto all = lt::tokenize_chat(*tok, tmpl.for_training(kConversation, lt::ChatLoss::All, ojson::object(), "x"), "x");
  CHECK(std::count(all.mask.begin(), all.mask.end(), 1) == static_cast<long>(all.ids.size()));
  // A prompt/completion record is a user turn and an assistant turn.
  const auto pc = tmpl.for_training(ojson{{"prompt", "Hi"}, {"completion", "Hello!"}}, lt::ChatLoss::Assistant, ojson::object(), "x");
  CHECK(masked_runs(*tok, lt::tokenize_chat(*tok, pc, "x")) == std::vector<std::string>{"Hello!<|im_end|>"});
}

TEST_CASE("chat: {% generation %} tags and the prefix method mark the same tokens", "[chat]") {
  lt::test::TempDir tmp;
  const auto tagged = lt::ChatTemplate::from_model_dir(model_dir(tmp, "with_generation.jinja", "tagged"));
  std::string source = lt::read_file(kSrc + "/tests/data/chat_templates/with_generation.jinja");
  for (const std::string tag : {"{%- generation %}", "{%- endgeneration %}"}) source.replace(source.find(tag), tag.size(), "");
  const lt::ChatTemplate untagged(source, "untagged", ojson::object());
  for (auto loss : {lt::ChatLoss::Assistant, lt::ChatLoss::LastAssistant}) {
    const auto a = tagged.for_training(kConversation, loss, ojson::object(), "x");
    const auto b = untagged.for_training(kConversation, loss, ojson::object(), "x");
    CHECK(a.text == b.text);
    CHECK(a.loss == b.loss);
    CHECK(!a.loss.empty());
  }
}

TEST_CASE("chat: a template that rewrites earlier turns is refused for every turn, and works for the last", "[chat]") {
  lt::test::TempDir tmp;
  const auto tmpl = lt::ChatTemplate::from_model_dir(model_dir(tmp, "qwen3.jinja"));
  ojson conv = kConversation;
  conv["messages"][2]["reasoning_content"] = "Add them.";  // Qwen3 shows it only after the last user turn
  REQUIRE_THROWS_WITH(tmpl.for_training(conv, lt::ChatLoss::Assistant, ojson::object(), "c.jsonl:3"),
                      Contains("c.jsonl:3") && Contains("assistant turn 3") && Contains("--loss-on last"));
  const auto tok = lt::make_tokenizer("hf:" + tmp.str() + "/model");
  const auto last = lt::tokenize_chat(*tok, tmpl.for_training(conv, lt::ChatLoss::LastAssistant, ojson::object(), "x"), "x");
  // The template writes an empty think block before the last answer: it is the model's to learn.
  CHECK(masked_runs(*tok, last) == std::vector<std::string>{"<think>\n\n</think>\n\nSix, café.<|im_end|>"});

  // A training copy of a template with {% generation %} tags, given as a file, marks every turn.
  const std::string tagged_file = kSrc + "/tests/data/chat_templates/with_generation.jinja";
  const auto tagged = lt::ChatTemplate::from_model_dir(tmp.str() + "/model", tagged_file);
  const auto every = lt::tokenize_chat(*tok, tagged.for_training(conv, lt::ChatLoss::Assistant, ojson::object(), "x"), "x");
  CHECK(masked_runs(*tok, every) == std::vector<std::string>{"4.<|im_end|>", "Six, café.<|im_end|>"});
  CHECK_THROWS_WITH(lt::ChatTemplate::from_model_dir(tmp.str() + "/model", tmp.str() + "/missing.jinja"),
                    Contains("--chat-template") && Contains("missing.jinja") && Contains("no such template file"));
}

TEST_CASE("tokenize --format chat writes a PADDED dataset of the masks, and bad records exit 2 naming FILE:LINE", "[chat][launcher]") {
  lt::test::TempDir tmp;
  const std::string dir = model_dir(tmp, "qwen2_5.jinja");
  const std::string data = tmp / "data";
  auto write = [&](const std::string& name, const std::vector<std::string>& lines) {
    std::string text;
    for (const auto& l : lines) text += l + "\n";
    lt::write_file_atomic(tmp / name, text);
    return tmp / name;
  };
  const std::string good = write("good.jsonl", {kConversation.dump(), R"({"prompt": "Hi", "completion": "Hello!"})",
                                                R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})"});
  auto r = lt::test::launch({"tokenize", good, "--format", "chat", "--tokenizer", "hf:" + dir, "--name", "conv", "--data-dir", data,
                             "--val-fraction", "0.34"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const auto meta = lt::read_json_file(data + "/conv/meta.json");
  CHECK(meta["style"] == "padded");
  CHECK(meta["records"] == 3);
  // --show: each record's text, ids and mask; nothing written.
  r = lt::test::launch({"tokenize", good, "--format", "chat", "--tokenizer", "hf:" + dir, "--name", "shown", "--data-dir", data, "--show"});
  REQUIRE(r.code == 0);
  CHECK_FALSE(fs::exists(data + "/shown"));
  const auto tok = lt::make_tokenizer("hf:" + dir);
  const ojson first = ojson::parse(r.out.substr(0, r.out.find('\n')));
  CHECK(first["where"] == good + ":1");
  CHECK(first["ids"].get<std::vector<uint32_t>>() == tok->encode(first["text"].get<std::string>()));
  CHECK(first["mask"].size() == first["ids"].size());

  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"messages": [{"content": "no role"}]})", "message 1 has no \"role\""},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "unknown role \"robot\""},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})", "\"content\" must be a string"},
      {R"({"messages": []})", "non-empty array"},
      {R"({"text": "no messages"})", "needs \"messages\""},
      {R"({"messages": [{"role": "user", "content": "only a question"}]})", "no token to learn"},
  };
  for (const auto& [line, why] : bad) {
    const std::string file = write("bad.jsonl", {kConversation.dump(), line});
    r = lt::test::launch({"tokenize", file, "--format", "chat", "--tokenizer", "hf:" + dir, "--name", "conv", "--data-dir", data});
    INFO(line << "\n" << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains(file + ":2") && Contains(why));
    CHECK(lt::read_json_file(data + "/conv/meta.json")["records"] == 3);  // the earlier dataset is kept
  }
  r = lt::test::launch({"tokenize", good, "--format", "chat", "--tokenizer", "hf:" + dir, "--name", "conv", "--data-dir", data,
                        "--length", "8"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(good + ":1") && Contains("longer than a row (--length 8)"));
  // The template's own refusal (Gemma 3: roles must alternate) names the record.
  const std::string gemma = model_dir(tmp, "gemma3.jinja", "gemma");
  const std::string twice = write("twice.jsonl", {R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})"});
  r = lt::test::launch({"tokenize", twice, "--format", "chat", "--tokenizer", "hf:" + gemma, "--name", "g", "--data-dir", data});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(twice + ":1") && Contains("the chat template refused this conversation") && Contains("alternate"));
  r = lt::test::launch({"tokenize", good, "--format", "chat", "--tokenizer", "gpt2", "--name", "c", "--data-dir", data});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("needs --tokenizer hf:DIR"));
  r = lt::test::launch({"tokenize", good, "--format", "jsonl", "--loss-on", "last", "--name", "c", "--data-dir", data});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--loss-on belongs to --format chat"));
}

TEST_CASE("sample --chat renders the user message with the chat template and prints the reply alone", "[chat][launcher]") {
  lt::test::TempDir tmp;
  // The imported test model (vocabulary 300) and the 259-token test tokenizer, with a ChatML template.
  REQUIRE(lt::test::launch({"import-hf", kSrc + "/tests/data/hf_gpt2/model", tmp / "base"}).code == 0);
  const fs::path dir = tmp / "chat_model";
  fs::create_directories(dir);
  fs::copy_file(kSrc + "/tests/data/hf_tokenizers/order/tokenizer.json", dir / "tokenizer.json");
  const ojson config = {{"eos_token", "<|endoftext|>"},
                        {"chat_template", lt::read_file(kSrc + "/tests/data/chat_templates/with_generation.jinja")}};
  lt::write_file_atomic((dir / "tokenizer_config.json").string(), config.dump(1));
  const ojson messages = ojson::parse(R"([{"role": "system", "content": "sys"}, {"role": "user", "content": "ab"}])");
  const std::string rendered = lt::ChatTemplate::from_model_dir(dir.string()).render(messages, true).text;
  REQUIRE(rendered == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<std::string> common = {"--tokens", "6", "--temperature", "0", "--tokenizer", "hf:" + dir.string()};
  std::vector<std::string> chat = {"sample", tmp / "base", "--chat", "--system", "sys", "--prompt", "ab"};
  std::vector<std::string> plain = {"sample", tmp / "base", "--prompt", rendered};
  chat.insert(chat.end(), common.begin(), common.end());
  plain.insert(plain.end(), common.begin(), common.end());
  const auto c = lt::test::launch(chat), p = lt::test::launch(plain);
  INFO(c.out << "\n---\n" << p.out);
  REQUIRE(c.code == 0);
  REQUIRE(p.code == 0);
  // Greedy from the same ids: the plain run prints the rendered prompt, the reply and (if it came) the
  // end-of-text; the chat run the reply alone.
  const std::string marker = "this job starts at step 0\n";  // the load's lines come first in both
  REQUIRE(c.out.rfind(marker) != std::string::npos);
  const std::string reply = c.out.substr(c.out.rfind(marker) + marker.size());  // ends with "\n"
  auto ends_with = [&](const std::string& tail) { return p.out.size() >= tail.size() && p.out.compare(p.out.size() - tail.size(), tail.size(), tail) == 0; };
  CHECK(reply.size() > 1);
  CHECK((ends_with(rendered + reply) || ends_with(rendered + reply.substr(0, reply.size() - 1) + "<|endoftext|>\n")));
  auto r = lt::test::launch({"sample", tmp / "base", "--prompt", "ab", "--system", "x", "--tokenizer", "hf:" + dir.string()});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--system belongs to --chat"));
  r = lt::test::launch({"sample", tmp / "base", "--prompt", "ab", "--chat", "--tokenizer", "byte"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--tokenizer hf:DIR"));
}
