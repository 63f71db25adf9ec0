#include "lora_trainer/data/chat_template.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/tokenizer.hpp"

namespace fs = std::filesystem;

namespace lt {

using ojson = nlohmann::ordered_json;

const std::vector<std::string>& chat_loss_names() {
  static const std::vector<std::string> names = {"assistant", "last", "all"};  // in ChatLoss's order
  return names;
}

ChatLoss parse_chat_loss(const std::string& s) {
  if (auto value = enum_from_name<ChatLoss>(chat_loss_names(), s)) return *value;
  throw UserError("--loss-on " + s + ": expected one of " + join(chat_loss_names()) +
                  " (every assistant turn, the last one, or every token)");
}

namespace {

ojson read_ordered_json(const std::string& path) { return parse_ordered_json(read_file(path), path); }

const char* const kRoles[] = {"system", "user", "assistant", "tool", "developer", "ipython"};

ojson head(const ojson& messages, size_t n) {
  ojson out = ojson::array();
  for (size_t i = 0; i < n; ++i) out.push_back(messages[i]);
  return out;
}

// Drops whitespace at the end of a range (after the end-of-turn token, e.g. ChatML's "\n").
std::pair<size_t, size_t> trimmed(const std::string& text, size_t b, size_t e) {
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
  return {b, e};
}

}  // namespace

ojson chat_messages(const ojson& record, const std::string& where) {
  ojson messages;
  if (record.contains("messages")) {
    messages = record["messages"];
    if (!messages.is_array() || messages.empty())
      throw UserError(where + ": \"messages\" must be a non-empty array of {\"role\", \"content\"} objects");
  } else if (record.contains("prompt") && record.contains("completion")) {
    if (!record["prompt"].is_string() || !record["completion"].is_string())
      throw UserError(where + ": \"prompt\" and \"completion\" must be strings");
    messages = ojson::array({{{"role", "user"}, {"content", record["prompt"]}}, {{"role", "assistant"}, {"content", record["completion"]}}});
  } else {
    throw UserError(where + ": a chat record needs \"messages\" (a list of {\"role\", \"content\"}), or \"prompt\" and \"completion\"");
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = where + ": message " + std::to_string(i + 1);
    if (!m.is_object()) throw UserError(at + " is not an object");
    if (!m.contains("role")) throw UserError(at + " has no \"role\"");
    if (!m["role"].is_string()) throw UserError(at + ": \"role\" must be a string");
    const std::string role = m["role"];
    if (std::none_of(std::begin(kRoles), std::end(kRoles), [&](const char* r) { return role == r; }))
      throw UserError(at + " has an unknown role \"" + role + "\" (known: system, user, assistant, tool, developer, ipython)");
    const bool tool_call = role == "assistant" && m.contains("tool_calls");
    if (!m.contains("content") && !tool_call) throw UserError(at + " (" + role + ") has no \"content\"");
    if (m.contains("content") && !m["content"].is_string() && !(tool_call && m["content"].is_null()))
      throw UserError(at + " (" + role + "): \"content\" must be a string" +
                      (m["content"].is_array() ? " (lists of typed parts, as for images, are not supported)" : ""));
  }
  return messages;
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir, const std::string& which) {
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  ojson config = fs::exists(config_path) ? read_ordered_json(config_path.string()) : ojson::object();
  ojson special = ojson::object();
  for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (!config.contains(k)) continue;
    const ojson& v = config[k];
    if (v.is_string()) special[k] = v;
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) special[k] = v["content"];
  }
  if (ends_with(which, ".jinja") || which.find('/') != std::string::npos) {
    if (!fs::is_regular_file(which))
      throw UserError("--chat-template " + which + ": no such template file (a path names a Jinja file; a bare name picks one "
                      "of tokenizer_config.json's named templates)");
    return ChatTemplate(read_file(which), which, special);
  }
  const fs::path jinja_file = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja_file) && which.empty()) return ChatTemplate(read_file(jinja_file.string()), jinja_file.string(), special);
  const std::string where = config_path.string() + ": chat_template";
  if (!config.contains("chat_template"))
    throw UserError(dir + " has no chat template (neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json); "
                    "a base model's tokenizer often has none: take the instruct model's");
  const ojson& t = config["chat_template"];
  if (t.is_string()) {
    if (!which.empty()) throw UserError(where + " is a single template; --chat-template " + which + " names one of a list");
    return ChatTemplate(t.get<std::string>(), where, special);
  }
  if (t.is_array()) {
    const std::string want = which.empty() ? "default" : which;
    std::vector<std::string> names;
    for (const auto& e : t) {
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") || !e["template"].is_string())
        throw UserError(where + ": a list of templates must hold {\"name\", \"template\"} objects");
      names.push_back(e["name"]);
      if (e["name"] == want) return ChatTemplate(e["template"].get<std::string>(), where + " \"" + want + "\"", special);
    }
    throw UserError(where + " has no template named \"" + want + "\" (it has: " + join(names) + "); choose with --chat-template NAME");
  }
  throw UserError(where + " must be a string or a list of {\"name\", \"template\"}");
}

ChatTemplate::ChatTemplate(const std::string& source, std::string name, ojson special_tokens)
    : source_(source), template_(source, name), name_(std::move(name)), special_(std::move(special_tokens)),
      has_generation_(template_.has_generation()) {}

std::string ChatTemplate::shipped_source() const { return jinja::without_generation_tags(source_, name_); }

nlohmann::json ChatFormat::to_json() const {
  return {{"template", template_source}, {"from", from}, {"bos_token", bos_token}, {"eos_token", eos_token}, {"stop_ids", stop_ids}};
}

ChatFormat ChatFormat::from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw UserError(where + " must be an object (a chat format: template, from, bos_token, eos_token, stop_ids)");
  ChatFormat f;
  auto text = [&](const char* key, std::string& out) {
    if (!j.contains(key) || !j[key].is_string()) throw UserError(where + "." + key + " must be a string");
    out = j[key].get<std::string>();
  };
  text("template", f.template_source);
  text("from", f.from);
  text("bos_token", f.bos_token);
  text("eos_token", f.eos_token);
  if (!j.contains("stop_ids") || !j["stop_ids"].is_array() || j["stop_ids"].empty())
    throw UserError(where + ".stop_ids must be a non-empty list of token ids");
  for (const auto& id : j["stop_ids"]) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() > UINT32_MAX) throw UserError(where + ".stop_ids must hold token ids");
    f.stop_ids.push_back(id.get<uint32_t>());
  }
  return f;
}

ChatFormat chat_format_of(const ChatTemplate& t, const std::string& dir, const Tokenizer& tok) {
  ChatFormat f;
  f.template_source = t.shipped_source();
  f.from = t.name();
  f.bos_token = t.bos_token();
  f.eos_token = t.eos_token();
  auto add = [&](uint32_t id) {
    if (std::find(f.stop_ids.begin(), f.stop_ids.end(), id) == f.stop_ids.end()) f.stop_ids.push_back(id);
  };
  if (!f.eos_token.empty()) {
    const std::vector<uint32_t> ids = tok.encode(f.eos_token);
    if (ids.size() != 1)
      throw UserError(dir + "/tokenizer_config.json: eos_token " + f.eos_token + " is " + std::to_string(ids.size()) +
                      " tokens of " + tok.name() + ", not one; a chat model's end of turn must be a single token");
    add(ids[0]);
  }
  // generation_config.json's eos_token_id: what transformers' generate stops at (Llama 3.1 Instruct:
  // <|end_of_text|>, <|eom_id|> and <|eot_id|>).
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen)) {
    const ojson g = read_ordered_json(gen.string());
    const ojson eos = g.is_object() && g.contains("eos_token_id") ? g["eos_token_id"] : ojson();
    for (const auto& id : eos.is_array() ? eos : ojson::array({eos}))
      if (id.is_number_unsigned() && id.get<uint64_t>() < tok.vocab_size()) add(id.get<uint32_t>());
  }
  if (f.stop_ids.empty()) add(tok.eot_id());
  return f;
}

jinja::Rendered ChatTemplate::render(const ojson& messages, bool add_generation_prompt, const ojson& variables,
                                     int64_t steps_spent) const {
  ojson ctx = special_;
  for (auto it = variables.begin(); it != variables.end(); ++it) ctx[it.key()] = it.value();
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = add_generation_prompt;
  jinja::RenderOptions options;
  options.limits = limits_;
  options.steps_spent = steps_spent;
  return template_.render(ctx, nullptr, options);
}

ChatText ChatTemplate::for_training(const ojson& record, ChatLoss loss, const ojson& variables, const std::string& where) const {
  if (!record.is_object()) throw UserError(where + ": not a JSON object");
  const ojson messages = chat_messages(record, where);
  ojson vars = variables;
  for (const char* k : {"tools", "documents"})
    if (record.contains(k)) vars[k] = record[k];
  int64_t steps = 0;          // the renders of one conversation share one budget of steps
  bool every_prefix = false;  // the prefix rule for every turn (the renders grow with the square of the length)
  auto run = [&](const ojson& msgs, bool gen_prompt) {
    try {
      jinja::Rendered r = render(msgs, gen_prompt, vars, steps);
      steps = r.steps;
      return r;
    } catch (const jinja::TemplateError& e) {
      std::string why = e.raised ? "the chat template refused this conversation: " + e.message : std::string(e.what());
      if (e.limit == "steps" && every_prefix)
        why += " (this template's assistant turns cannot be read from one render, so the conversation is rendered "
               "up to each of them: the work grows with the square of its length)";
      throw UserError(where + ": " + why);
    }
  };
  const jinja::Rendered full = run(messages, false);
  ChatText out{full.text, {}, 0};
  if (loss == ChatLoss::All) {
    out.loss.emplace_back(0, full.text.size());
    out.steps = steps;
    return out;
  }
  if (has_generation_) {
    auto spans = full.generation;
    if (loss == ChatLoss::LastAssistant && !spans.empty()) spans.erase(spans.begin(), spans.end() - 1);
    out.loss = spans;
    out.steps = steps;
    return out;
  }
  std::vector<size_t> turns;
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i]["role"] == "assistant") turns.push_back(i);
  if (loss == ChatLoss::LastAssistant && !turns.empty()) turns.erase(turns.begin(), turns.end() - 1);

  // The prefix rule for turn i: [length of the render up to it with the generation prompt, length of the
  // render through it), when each render begins the next and the full one. Returns the first render too.
  auto by_prefixes = [&](size_t i, std::string* before_text) -> std::pair<size_t, size_t> {
    const std::string before = i == 0 ? std::string() : run(head(messages, i), true).text;
    const std::string through = run(head(messages, i + 1), false).text;
    if (through.compare(0, before.size(), before) != 0 || full.text.compare(0, through.size(), through) != 0)
      throw UserError(where + ": " + name_ + " renders the conversation before assistant turn " + std::to_string(i + 1) +
                      " differently once that turn follows, or the turn differently once later turns follow, so the turn's "
                      "text cannot be found by rendering prefixes (e.g. Qwen3, which keeps reasoning only after the last "
                      "user turn); " +
                      (loss == ChatLoss::LastAssistant
                           ? "end the conversation with its last assistant turn, or give a copy of the template with "
                             "{% generation %} tags around what the assistant writes: --chat-template FILE.jinja"
                           : "use --loss-on last (only the final assistant turn is learned), or give a copy of the template "
                             "with {% generation %} tags around what the assistant writes: --chat-template FILE.jinja"));
    if (before_text) *before_text = before;
    return {before.size(), through.size()};
  };

  // Turn i read from the full render: from where the template's loop began message i, past the
  // generation prompt `gen`, to where it began message i + 1 (or the end).
  const std::vector<int64_t>& starts = full.message_starts;
  std::string gen;
  bool have_gen = false;
  auto by_position = [&](size_t i) -> std::pair<size_t, size_t> {
    const std::pair<size_t, size_t> none{1, 0};  // no span: the positions do not give one
    if (starts.size() != messages.size()) return none;
    size_t b = 0, e = full.text.size();
    if (i > 0) {
      if (starts[i] < 0 || !have_gen) return none;
      const auto p = static_cast<size_t>(starts[i]);
      if (full.text.compare(p, gen.size(), gen) != 0) return none;
      b = p + gen.size();
    }
    if (i + 1 < messages.size()) {
      if (starts[i + 1] < 0) return none;
      e = static_cast<size_t>(starts[i + 1]);
    }
    return b <= e ? std::make_pair(b, e) : none;
  };

  // The prefix rule on the 1st, 2nd, 4th, 8th... and last turn: their renders add up to a few full ones.
  std::vector<std::pair<size_t, size_t>> spans(turns.size(), {1, 0});
  std::vector<bool> checked(turns.size(), false);
  bool positions_hold = true;
  for (size_t t = 0; t < turns.size(); t = 2 * t + 1) checked[t] = true;
  if (!turns.empty()) checked.back() = true;
  for (size_t t = 0; t < turns.size(); ++t) {
    if (!checked[t]) continue;
    const size_t i = turns[t];
    std::string before;
    spans[t] = by_prefixes(i, &before);
    if (i > 0 && !have_gen && starts.size() == messages.size() && starts[i] >= 0 &&
        static_cast<size_t>(starts[i]) <= before.size()) {
      gen = before.substr(static_cast<size_t>(starts[i]));  // what the generation prompt adds
      have_gen = true;
    }
    positions_hold = positions_hold && by_position(i) == spans[t];
  }
  for (size_t t = 0; t < turns.size() && positions_hold; ++t) {
    if (checked[t]) continue;
    spans[t] = by_position(turns[t]);
    positions_hold = spans[t].first <= spans[t].second;
  }
  if (!positions_hold) {  // the loop could not be followed: the prefix rule for every turn
    every_prefix = true;
    for (size_t t = 0; t < turns.size(); ++t)
      if (!checked[t]) spans[t] = by_prefixes(turns[t], nullptr);
  }
  for (const auto& [b, e] : spans) {
    const auto span = trimmed(full.text, b, e);
    if (span.second > span.first) out.loss.push_back(span);
  }
  out.steps = steps;
  return out;
}

MaskedIds tokenize_chat(const Tokenizer& tok, const ChatText& chat, const std::string& where) {
  MaskedIds out;
  out.ids = tok.encode(chat.text);
  out.mask.assign(out.ids.size(), 0);
  size_t pos = 0, span = 0;
  for (size_t k = 0; k < out.ids.size(); ++k) {
    const size_t b = pos, e = pos + tok.decode({out.ids[k]}).size();
    while (span < chat.loss.size() && chat.loss[span].second <= b) ++span;
    if (span < chat.loss.size() && chat.loss[span].first < e && b < chat.loss[span].second) out.mask[k] = 1;
    pos = e;
  }
  if (pos != chat.text.size())
    throw UserError(where + ": the tokenizer " + tok.name() + " does not spell the rendered text back byte for byte (" +
                    std::to_string(pos) + " bytes from " + std::to_string(chat.text.size()) +
                    "; a normalizer changes it), so the loss cannot be placed on its tokens");
  return out;
}

}  // namespace lt
