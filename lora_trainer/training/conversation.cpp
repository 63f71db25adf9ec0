#include "lora_trainer/training/conversation.hpp"

#include <algorithm>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/byte_level_bpe.hpp"

namespace lt {

namespace {

using ojson = nlohmann::ordered_json;

// The length of `text`'s longest prefix that ends on a UTF-8 character's boundary: a character whose
// bytes have not all come yet (a lead byte and valid continuations up to the end) is held back; bytes
// that can never be a character are left to sanitize_utf8.
size_t complete_utf8(const std::string& text) {
  const size_t n = text.size();
  for (size_t i = n > 3 ? n - 3 : 0; i < n; ++i) {
    size_t valid = 0;
    if (static_cast<unsigned char>(text[i]) >= 0xC2 && bpe::utf8_sequence_length(text, i, &valid) == 0 && i + valid == n) return i;
  }
  return n;
}

}  // namespace

ChatSetup chat_setup(const nlohmann::json& recorded, const std::string& tokenizer_name, const Tokenizer& tok,
                     const std::string& command) {
  if (!recorded.is_null()) {
    const ChatFormat f = ChatFormat::from_json(recorded, "the checkpoint's metadata.json: chat");
    ojson special = ojson::object();
    if (!f.bos_token.empty()) special["bos_token"] = f.bos_token;
    if (!f.eos_token.empty()) special["eos_token"] = f.eos_token;
    for (uint32_t id : f.stop_ids)
      if (id >= tok.vocab_size())
        throw UserError("the checkpoint's metadata.json: chat.stop_ids holds " + std::to_string(id) + ", outside the tokenizer " +
                        tok.name() + "'s vocabulary of " + std::to_string(tok.vocab_size()) +
                        ": give the tokenizer the model was trained with (--tokenizer)");
    return {ChatTemplate(f.template_source, f.from.empty() ? "the checkpoint's chat template" : f.from, special), f.stop_ids,
            "the template its training conversations were rendered with (" + f.from + ")"};
  }
  if (tokenizer_name.rfind("hf:", 0) != 0)
    throw UserError(command + " renders the conversation with the model's chat template, and this checkpoint records none "
                    "(its job was not trained on `tokenize --format chat` data): give --tokenizer hf:DIR (the model "
                    "directory holding tokenizer.json and tokenizer_config.json with its chat template)");
  const std::string dir = tokenizer_name.substr(3);
  ChatTemplate tmpl = ChatTemplate::from_model_dir(dir);
  std::vector<uint32_t> stops = chat_format_of(tmpl, dir, tok).stop_ids;
  return {std::move(tmpl), std::move(stops), "the model directory's template (" + dir + ")"};
}

Conversation::Conversation(CausalLM model, const Runtime& rt, const Tokenizer& tok, ChatSetup setup, GenerateOptions gen)
    : model_(std::move(model)), rt_(rt), tok_(tok), setup_(std::move(setup)), gen_(std::move(gen)) {
  gen_.stop_ids = setup_.stop_ids;
}

ojson Conversation::messages() const {
  ojson out = ojson::array();
  if (!system_.empty()) out.push_back({{"role", "system"}, {"content", system_}});
  for (const auto& m : turns_) out.push_back(m);
  return out;
}

void Conversation::set_messages(const ojson& record, const std::string& where) {
  const ojson checked = chat_messages(record, where);
  system_.clear();
  reset();
  for (size_t i = 0; i < checked.size(); ++i) {
    if (i == 0 && checked[i]["role"] == "system" && checked[i]["content"].is_string())
      system_ = checked[i]["content"].get<std::string>();
    else
      turns_.push_back(checked[i]);
  }
}

void Conversation::add_user(const std::string& text) { turns_.push_back({{"role", "user"}, {"content", text}}); }

size_t Conversation::prompt_tokens() const { return tok_.encode(render()).size(); }

std::string Conversation::render() const { return setup_.tmpl.render(messages(), true).text; }

std::string Conversation::reply(const std::function<void(const std::string&)>& on_text, bool* ended) {
  std::vector<uint32_t> ids;
  std::string shown;  // the reply's text passed to on_text so far
  const auto is_stop = [&](uint32_t id) { return std::count(gen_.stop_ids.begin(), gen_.stop_ids.end(), id) > 0; };
  // Passes on what `text` adds to what was shown. A decoder may write a prefix differently once more
  // tokens follow (a byte-level one does not); what was shown stays, and only an extension of it is added.
  const auto show = [&](const std::string& text, size_t ready) {
    if (ready > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      on_text(text.substr(shown.size(), ready - shown.size()));
      shown = text.substr(0, ready);
    }
  };
  GenerateOptions o = gen_;
  o.vocab_limit = tok_.vocab_size();
  o.tokenizer = tok_.name();
  if (on_text)
    o.on_token = [&](uint32_t id) {
      if (is_stop(id)) return;
      ids.push_back(id);
      const std::string raw = tok_.decode(ids);
      const std::string text = bpe::sanitize_utf8(std::string_view(raw).substr(0, complete_utf8(raw)));
      show(text, text.size());
    };
  std::vector<uint32_t> out = generate(model_, rt_, tok_.encode(render()), o);
  const bool stopped = !out.empty() && is_stop(out.back());
  if (stopped) out.pop_back();
  if (ended) *ended = stopped;
  // Bytes that are no UTF-8 (a reply cut inside a character, a model's stray byte tokens) become U+FFFD,
  // as transformers' decode gives them: the reply is text, and so is the conversation it joins.
  const std::string text = bpe::sanitize_utf8(tok_.decode(out));
  if (on_text) show(text, text.size());
  turns_.push_back({{"role", "assistant"}, {"content", text}});
  return text;
}

}  // namespace lt
