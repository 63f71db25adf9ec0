// Chat data (chat_template.hpp, `tokenize --format chat`): a conversation is rendered with the model
// directory's chat template and tokenized as a whole; the loss mask covers exactly the assistant turns
// with their end-of-turn token (every turn, the last, or everything); the prefix method and a template's
// own {% generation %} tags agree; bad records are refused naming FILE:LINE and the reason, with nothing
// written.
#include "catch.hpp"

#include <nlohmann/json.hpp>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/data/tokenizer.hpp"

namespace fs = std::filesystem;
using lt::test::Contains;
using lt::test::kSourceDir;
using ojson = nlohmann::ordered_json;

namespace {


// A model directory: the small Qwen2-layout tokenizer (ChatML's <|im_start|>/<|im_end|> as added tokens)
// with `template_file` of tests/data/chat_templates as its chat template.
std::string model_dir(const lt::test::TempDir& tmp, const std::string& template_file, const std::string& name = "model") {
  const fs::path dir = tmp / name;
  fs::create_directories(dir);
  fs::copy_file(kSourceDir + "/tests/data/hf_tokenizers/qwen2/tokenizer.json", dir / "tokenizer.json");
  ojson config = {{"eos_token", "<|im_end|>"}, {"chat_template", lt::read_file(kSourceDir + "/tests/data/chat_templates/" + template_file)}};
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
  std::string source = lt::read_file(kSourceDir + "/tests/data/chat_templates/with_generation.jinja");
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
  const std::string tagged_file = kSourceDir + "/tests/data/chat_templates/with_generation.jinja";
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
  REQUIRE(lt::test::launch({"import-hf", kSourceDir + "/tests/data/hf_gpt2/model", tmp / "base"}).code == 0);
  const fs::path dir = tmp / "chat_model";
  fs::create_directories(dir);
  fs::copy_file(kSourceDir + "/tests/data/hf_tokenizers/order/tokenizer.json", dir / "tokenizer.json");
  const ojson config = {{"eos_token", "<|endoftext|>"},
                        {"chat_template", lt::read_file(kSourceDir + "/tests/data/chat_templates/with_generation.jinja")}};
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

namespace {

// A record: a system message (or none), then `pairs` user/assistant turns.
ojson long_conversation(size_t pairs, bool system = true) {
  ojson m = ojson::array();
  if (system) m.push_back({{"role", "system"}, {"content", "Be brief."}});
  for (size_t k = 0; k < pairs; ++k) {
    m.push_back({{"role", "user"}, {"content", "Question " + std::to_string(k) + "?"}});
    m.push_back({{"role", "assistant"}, {"content", "Answer " + std::to_string(k) + (k % 3 ? "." : " \n")}});
  }
  return ojson{{"messages", m}};
}

// The prefix rule as for_training applied it to every turn before (one render up to each turn with the
// generation prompt and one through it); throws when the renders do not line up.
std::vector<std::pair<size_t, size_t>> prefix_spans(const lt::ChatTemplate& t, const ojson& record) {
  const ojson& msgs = record["messages"];
  const std::string full = t.render(msgs, false).text;
  std::vector<std::pair<size_t, size_t>> out;
  ojson head = ojson::array();
  for (size_t i = 0; i < msgs.size(); head.push_back(msgs[i]), ++i) {
    if (msgs[i]["role"] != "assistant") continue;
    const std::string before = i == 0 ? "" : t.render(head, true).text;
    ojson through_msgs = head;
    through_msgs.push_back(msgs[i]);
    const std::string through = t.render(through_msgs, false).text;
    if (through.compare(0, before.size(), before) != 0 || full.compare(0, through.size(), through) != 0)
      throw std::runtime_error("the prefixes do not line up at message " + std::to_string(i + 1));
    size_t e = through.size();
    while (e > before.size() && std::isspace(static_cast<unsigned char>(through[e - 1]))) --e;
    if (e > before.size()) out.emplace_back(before.size(), e);
  }
  return out;
}

lt::ChatTemplate chat_template(const std::string& name) {
  const ojson special = ojson::parse(lt::read_file(kSourceDir + "/tests/data/chat_templates/special_tokens.json"));
  return lt::ChatTemplate(lt::read_file(kSourceDir + "/tests/data/chat_templates/" + name + ".jinja"), name,
                          special.contains(name) ? special[name] : ojson::object());
}

}  // namespace

TEST_CASE("chat: a long conversation's turns are read from one render, as the prefix rule finds them, in linear work", "[chat]") {
  // Every real template: the spans of 20 turns equal the prefix rule's (the 1st, 2nd, 4th, 8th, 16th and
  // 20th are found by it; the rest from the one render), or both refuse the conversation.
  int compared = 0;
  for (const std::string name : {"qwen2_5", "qwen3", "llama3", "llama3_1", "llama3_2", "mistral_nemo", "gemma3", "deepseek_v3",
                                 "command_r_plus", "with_generation"}) {
    for (bool system : {true, false}) {
      INFO(name << (system ? " with" : " without") << " a system message");
      const lt::ChatTemplate t = chat_template(name);
      const ojson record = long_conversation(20, system);
      std::vector<std::pair<size_t, size_t>> want;
      bool refused = false;
      try {
        want = prefix_spans(t, record);
      } catch (const std::exception&) {
        refused = true;
      }
      if (name == "with_generation") {  // its own tags: one render in any case
        CHECK(t.for_training(record, lt::ChatLoss::Assistant, ojson::object(), "x").loss.size() == 20);
        continue;
      }
      if (refused) {
        CHECK_THROWS_AS(t.for_training(record, lt::ChatLoss::Assistant, ojson::object(), "x"), lt::UserError);
        continue;
      }
      const lt::ChatText got = t.for_training(record, lt::ChatLoss::Assistant, ojson::object(), "x");
      CHECK(got.loss == want);
      CHECK(got.loss.size() == 20);
      ++compared;
    }
  }
  CHECK(compared >= 8);

  // The work of 2N messages is twice that of N (rendering every prefix made it four times), and a few
  // full renders' worth.
  for (const std::string name : {"qwen2_5", "llama3_2"}) {
    INFO(name);
    const lt::ChatTemplate t = chat_template(name);
    const ojson n = long_conversation(1000), two_n = long_conversation(2000);
    const int64_t steps_n = t.for_training(n, lt::ChatLoss::Assistant, ojson::object(), "x").steps;
    const lt::ChatText c = t.for_training(two_n, lt::ChatLoss::Assistant, ojson::object(), "x");
    CHECK(c.loss.size() == 2000);
    const double ratio = static_cast<double>(c.steps) / static_cast<double>(steps_n);
    INFO("steps " << steps_n << " -> " << c.steps);
    CHECK(ratio > 1.6);
    CHECK(ratio < 2.4);
    CHECK(c.steps < 8 * t.render(two_n["messages"], false).steps);
  }
}

TEST_CASE("chat: a template whose loop cannot be followed gets the prefix rule for every turn", "[chat]") {
  // Messages taken by index, rendered inside a macro, or looped over again at the end: the one render's
  // positions are missing or wrong, the checked turns disagree with them, and every turn is rendered.
  for (const std::string source : {
           "{% for i in range(messages|length) %}{% set m = messages[i] %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}",
           "{% macro turn(m) %}<{{ m.role }}>{{ m.content }}</s>\n{% endmacro %}{% for m in messages %}{{ turn(m) }}{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}",
           "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}{% for m in messages %}{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}"}) {
    INFO(source);
    const lt::ChatTemplate t(source, "t.jinja", ojson::object());
    const ojson record = long_conversation(12);
    const lt::ChatText got = t.for_training(record, lt::ChatLoss::Assistant, ojson::object(), "x");
    CHECK(got.loss == prefix_spans(t, record));
    CHECK(got.loss.size() == 12);
    CHECK(got.text.substr(got.loss[5].first, got.loss[5].second - got.loss[5].first) == "Answer 5.</s>");
  }
}

TEST_CASE("tokenize --format chat: --chat-limit bounds the template, --chat-var is read with JSON's bounds", "[chat][launcher]") {
  lt::test::TempDir tmp;
  const std::string dir = model_dir(tmp, "qwen2_5.jinja");
  const std::string data = tmp / "data", in = tmp / "in.jsonl";
  lt::write_file_atomic(in, kConversation.dump() + "\n" + kConversation.dump() + "\n");
  // A template that loops without end (a copy given as a file): stopped, naming the record, the template
  // file, its line and the limit; a raised limit is taken.
  const std::string looping = tmp / "looping.jinja";
  lt::write_file_atomic(looping, "{% for m in messages %}{{ m.content }}\n{% for i in range(100000) %}{% for j in range(100000) %}"
                                 "{% endfor %}{% endfor %}{% endfor %}");
  const std::vector<std::string> base = {"tokenize", in,     "--format",   "chat", "--tokenizer",    "hf:" + dir,
                                         "--name",   "c",    "--data-dir", data,   "--val-fraction", "0.5"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return lt::test::launch(args);
  };
  auto r = with({"--chat-template", looping, "--chat-limit", "steps=100000"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(in + ":1: " + looping + " line 2: the template did more than 100000 steps") &&
                        Contains("--chat-limit steps=N"));
  r = with({"--chat-limit", "steps=1000", "--chat-limit", "output=100000000"});  // too low for the real template
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("more than 1000 steps"));
  r = with({"--chat-limit", "time=5"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--chat-limit time=5") && Contains("steps, output, string, list, depth"));

  // --chat-var: JSON nested 60,000 deep (an argument's most) is refused naming the variable; a value
  // nested 100 deep reaches the template, and a raised limit is taken.
  r = with({"--chat-var", "x=" + std::string(60000, '[') + std::string(60000, ']')});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--chat-var x: nested more than 512 levels deep"));
  r = with({"--chat-var", "x=" + std::string(100, '[') + std::string(100, ']'), "--chat-var", "y=[not json", "--chat-limit",
            "steps=10000000"});
  INFO(r.out);
  CHECK(r.code == 0);
}
