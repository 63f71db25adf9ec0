// What `sample` and `chat` share: the checkpoint, how its model generates (--tokens, --temperature,
// --top-k, --top-p, --seed), the tokenizer that reads it (--tokenizer), the bounds of its chat template's renders
// (--chat-limit) and key=value settings over its saved config; the model loaded for reading, and a
// conversation with it (training/conversation.hpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/training/conversation.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

struct GenerationArgs {
  std::string checkpoint, tokenizer = "auto";
  std::vector<std::string> chat_limits, overrides;
  CLI::Option* limit_opt = nullptr;
  GenerateOptions gen;

  // CHECKPOINT and the options above, on `sub`; `reply` says what --tokens bounds ("tokens to generate").
  void add_options(CLI::App* sub, const std::string& tokens_help);
  // The options that end the command line (the overrides).
  void add_overrides(CLI::App* sub);
};

// A checkpoint's model loaded for generating: the job, its trainer, the tokenizer (`auto` resolved) and
// the EMA weights swapped in while it lives (with eval/use_ema).
struct GeneratingModel {
  std::unique_ptr<RestorableJob> job;
  Trainer* trainer = nullptr;
  std::string tokenizer_name;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Ema::Swap> ema;
};
GeneratingModel load_generating_model(const GenerationArgs& a, const std::string& command);

// Writes `text` to standard output at once (a reply as it comes).
void print(const std::string& text);

// A conversation with `m` through the chat template it was trained with (chat_setup: the checkpoint's
// record, else the tokenizer's model directory), its renders bounded by --chat-limit.
Conversation conversation_with(const GeneratingModel& m, const GenerationArgs& a, const std::string& command);

}  // namespace lt
