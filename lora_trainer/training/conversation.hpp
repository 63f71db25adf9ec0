// Conversation: a chat with a trained model through the chat template it was trained with
// (`sample --chat`, `chat`). The conversation keeps its messages; each reply is generated from the
// whole conversation rendered with the generation prompt, passed on as whole UTF-8 characters while
// it is generated, ended at an end-of-turn id (the chat format's stop ids) or after the token limit,
// and joins the conversation as the assistant's message. A reply's draws depend only on the
// conversation so far and the seed, so `sample --chat --messages FILE` reproduces any turn of a chat.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

// The template and end-of-turn ids a model chats with, and where they came from (for messages).
struct ChatSetup {
  ChatTemplate tmpl;
  std::vector<uint32_t> stop_ids;
  std::string from;
};

// `recorded`: the checkpoint's chat format (metadata.json's "chat": the template its job's conversations
// were rendered with, and their stop ids), used when not null. Else the model directory of the
// tokenizer `tokenizer_name` (hf:DIR: its chat template, and its eos_token's and generation_config.json's
// ids). A UserError for `command` when neither gives a template.
ChatSetup chat_setup(const nlohmann::json& recorded, const std::string& tokenizer_name, const Tokenizer& tok,
                     const std::string& command);

class Conversation {
 public:
  // `gen`: the reply's limit and sampling (its stop ids are the setup's).
  Conversation(CausalLM model, const Runtime& rt, const Tokenizer& tok, ChatSetup setup, GenerateOptions gen);

  // The conversation so far: the system message (when set) first, then the turns.
  nlohmann::ordered_json messages() const;
  // Replaces the conversation by `record` (a chat record, chat_template.hpp's chat_messages: a leading
  // system message becomes the system message); a UserError prefixed by `where` for a malformed one.
  void set_messages(const nlohmann::ordered_json& record, const std::string& where);
  // Appends a user's message.
  void add_user(const std::string& text);
  // The system message ("" none); it stays through reset().
  void set_system(const std::string& text) { system_ = text; }
  const std::string& system() const { return system_; }
  // Drops every turn.
  void reset() { turns_ = nlohmann::ordered_json::array(); }
  // Drops the last turn (a message the template refused).
  void drop_last() {
    if (!turns_.empty()) turns_.erase(turns_.size() - 1);
  }

  // The assistant's reply to the conversation so far, without its end-of-turn token, as text (bytes that
  // are no UTF-8 made U+FFFD): `on_text` gets it piece by piece as it is generated (every piece whole
  // UTF-8 characters; together, the reply). It joins the conversation. `ended` tells whether an end-of-turn id ended it (else the limit did).
  std::string reply(const std::function<void(const std::string&)>& on_text = nullptr, bool* ended = nullptr);
  // The number of tokens the conversation renders to with the generation prompt (the next reply's
  // prompt); past the model's block size, the model sees only its last block.
  size_t prompt_tokens() const;
  int64_t block_size() const { return model_->options().block_size; }
  const std::string& from() const { return setup_.from; }

 private:
  std::string render() const;

  CausalLM model_;
  const Runtime& rt_;
  const Tokenizer& tok_;
  ChatSetup setup_;
  GenerateOptions gen_;
  std::string system_;
  nlohmann::ordered_json turns_ = nlohmann::ordered_json::array();
};

}  // namespace lt
