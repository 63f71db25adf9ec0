// A model's chat template, applied as transformers' apply_chat_template applies it, and the parts of a
// conversation that count in the loss (docs/chat.md).
//
// The template comes from a Hugging Face model directory: `chat_template.jinja`, else the
// `chat_template` of `tokenizer_config.json` (a string, or a list of named templates: "default"
// unless another is asked for), or a template file given instead (a path: a training copy of the
// model's template with {% generation %} tags, as TRL ships for Qwen3). The render's variables are transformers': `messages`,
// `add_generation_prompt`, `tools` and `documents` when the record has them, the special tokens of
// tokenizer_config.json (`bos_token`, `eos_token`, `unk_token`, `pad_token`; an AddedToken object's
// `content`), and the caller's extra variables (e.g. `enable_thinking`).
//
// Which bytes count in the loss: a template with {% generation %} marks them itself; otherwise each
// assistant turn is found as transformers' users find it, by rendering the conversation up to the turn
// with the generation prompt and up to its end: the difference is what the model writes, its
// end-of-turn token included (whitespace after it is not). Where a template renders an earlier turn
// differently once later turns follow (Qwen3 drops earlier turns' reasoning), the prefixes do not line up
// and only the last assistant turn can be found; that is refused with a message saying so.
//
// Rendering every prefix costs the square of the conversation's length (20,000 messages: minutes). So
// the turns are read from one render of the whole conversation instead, where the template's loop began
// each message (jinja::Rendered::message_starts), and the prefix rule is applied to the first, second,
// fourth, eighth... and last assistant turns only: their spans must agree with the positions, which
// makes the work linear in the conversation's length. A template whose loop cannot be followed that
// way (no loop over the messages, or one inside a macro) gets the prefix rule for every turn.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/jinja/jinja.hpp"

namespace lt {

class Tokenizer;

// Which tokens of a conversation count in the loss.
enum class ChatLoss {
  Assistant,      // every assistant turn (the default)
  LastAssistant,  // the last assistant turn only
  All,            // every token
};
const std::vector<std::string>& chat_loss_names();  // "assistant", "last", "all": --loss-on's values, in ChatLoss's order
ChatLoss parse_chat_loss(const std::string& s);      // UserError naming --loss-on and the names for another

// A conversation rendered for training: its text and the byte ranges [begin, end) that count.
struct ChatText {
  std::string text;
  std::vector<std::pair<size_t, size_t>> loss;
  int64_t steps = 0;  // the template's work for it, over all its renders (jinja::Limits::steps)
};

// A chat record's messages, checked: {"messages": [...]} (objects with a known role and string content;
// null content for an assistant turn that calls tools) or {"prompt", "completion"} (a user turn and an
// assistant turn). A UserError prefixed by `where` (e.g. FILE:LINE) names the message and what is wrong.
nlohmann::ordered_json chat_messages(const nlohmann::ordered_json& record, const std::string& where);

// Token ids and a mask (1 = counts in the loss) of equal length.
struct MaskedIds {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> mask;
};

class ChatTemplate {
 public:
  // From DIR (see above); `which`: a name of the list, or a template file (a path ending in .jinja or
  // holding a '/'), whose special tokens are still DIR's. A UserError names the file and what is missing.
  static ChatTemplate from_model_dir(const std::string& dir, const std::string& which = "");
  ChatTemplate(const std::string& source, std::string name, nlohmann::ordered_json special_tokens);

  // The bounds of every render (--chat-limit NAME=N); jinja::Limits' defaults until set.
  void set_limits(const jinja::Limits& limits) { limits_ = limits; }

  // The render of `messages` (a JSON array of {"role", "content", ...}) with `variables` (an object:
  // tools, documents, enable_thinking, ...) added to the template's; `steps_spent` by earlier renders
  // of the same conversation count against the limit.
  jinja::Rendered render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                         const nlohmann::ordered_json& variables = nlohmann::ordered_json::object(),
                         int64_t steps_spent = 0) const;

  // A record {"messages": [...], "tools"?, "documents"?} or {"prompt", "completion"} (a user turn and an
  // assistant turn), rendered without the generation prompt, with its loss ranges. Throws UserError
  // (prefixed by `where`, e.g. FILE:LINE) for a malformed record or a template error.
  ChatText for_training(const nlohmann::ordered_json& record, ChatLoss loss, const nlohmann::ordered_json& variables,
                        const std::string& where) const;

  const std::string& name() const { return name_; }
  // tokenizer_config.json's eos_token (an instruct model's end-of-turn token, e.g. <|im_end|>), or "".
  std::string eos_token() const { return special_.value("eos_token", std::string()); }
  std::string bos_token() const { return special_.value("bos_token", std::string()); }
  // The template as other renderers take it: jinja::without_generation_tags of its source.
  std::string shipped_source() const;

 private:
  std::string source_;
  jinja::Template template_;
  std::string name_;
  nlohmann::ordered_json special_;
  bool has_generation_;
  jinja::Limits limits_;
};

// What a model trained on chat data needs to chat elsewhere: the template it was trained with, as other
// renderers take it (shipped_source: transformers' apply_chat_template, llama.cpp's, ollama's), where it
// came from, the special tokens it renders with, and the ids that end the assistant's turn (the
// eos_token's, then generation_config.json's eos_token_id). `tokenize --format chat` records it in the
// dataset's meta.json ("chat"), a job in its checkpoints' metadata.json ("chat"), and the exports write
// it as transformers and llama.cpp read it (docs/chat.md, "Shipping a chat model").
struct ChatFormat {
  std::string template_source, from, bos_token, eos_token;
  std::vector<uint32_t> stop_ids;

  nlohmann::json to_json() const;
  // A UserError naming `where` for a missing or mistyped field.
  static ChatFormat from_json(const nlohmann::json& j, const std::string& where);
  bool operator==(const ChatFormat& o) const {
    return template_source == o.template_source && bos_token == o.bos_token && eos_token == o.eos_token && stop_ids == o.stop_ids;
  }
  bool operator!=(const ChatFormat& o) const { return !(*this == o); }
};

// `t`'s format, read from the model directory `dir` (generation_config.json) with `tok`'s ids: a
// UserError when the eos_token is not one token of it.
ChatFormat chat_format_of(const ChatTemplate& t, const std::string& dir, const Tokenizer& tok);

// Tokenizes `chat.text` as a whole (so that ids equal the tokenizer's on that text) and marks the
// tokens with a byte in a loss range. A UserError when the tokenizer's pieces do not spell the text
// back byte for byte (a normalizer that changes it), since the ranges could not be placed.
MaskedIds tokenize_chat(const Tokenizer& tok, const ChatText& chat, const std::string& where);

}  // namespace lt
