// Provenance: where a job's model and its text come from, as its checkpoints record them and its
// commands need them. Three sources: the weights it loaded (an import's or a Hugging Face directory's
// `base_model` record), the checkpoint it restored (the tokenizer and chat format that one records, and
// whether its model was trained), and the job's own datasets (the tokenizer and chat format their
// meta.json record, read once, at the first question). From them it answers which tokenizer reads this
// model's text (`--tokenizer auto`, tokenizer_choice.hpp) and what a checkpoint records as
// "base_model", "tokenizer" and "chat" (checkpoints/README.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

struct CheckpointMeta;  // formats/checkpoint.hpp

class Provenance {
 public:
  // The job's datasets (the names its stages sample from, under data_dir) and its model's vocabulary;
  // `model` names the model in messages ("the model of job NAME").
  Provenance(std::string data_dir, std::vector<std::string> datasets, int64_t vocab_size, std::string model);

  // A checkpoint was loaded, whole or as weights: its tokenizer, chat format and base are the clues of a
  // model that has not trained on this job's data yet.
  void restored(const CheckpointMeta& ck);
  // Weights were loaded from an import or a model directory: its base_model record (null: none).
  void loaded(const nlohmann::json& base_model) { base_model_ = base_model; }
  // Where the weights came from when imported (family, hf_dir, ...), else null.
  const nlohmann::json& base_model() const { return base_model_; }

  // The tokenizer this model reads text with, `--tokenizer auto` for `command`: the restored
  // checkpoint's record, else for trained weights (`trained_here`: the job took a step) the datasets',
  // else an imported model's own tokenizer.json, else byte or gpt2 by the vocabulary; a UserError
  // naming `command` when nothing tells.
  std::string tokenizer_name(const std::string& command, bool trained_here) const;
  // The chat format (data/chat_template.hpp's ChatFormat, as JSON) the model was trained to chat in: its
  // datasets' of conversations, else the restored checkpoint's; null when none, or the datasets disagree.
  nlohmann::json chat_format() const;
  // The chat format the model chats in (sample --chat, chat): the restored checkpoint's record (what its
  // weights were trained with), else chat_format().
  nlohmann::json model_chat_format() const { return restored_chat_.is_null() ? chat_format() : restored_chat_; }
  // A checkpoint's "base_model", "tokenizer" (the datasets', else the restored one's) and "chat" (the
  // datasets' chat format, else the restored one's; none when the datasets disagree), those known.
  void add_metadata(nlohmann::json& meta) const;
  // Why the checkpoints record no chat format although the datasets are conversations (they were
  // rendered with different templates); "" when nothing is wrong.
  const std::string& chat_conflict() const { return records().chat_conflict; }

 private:
  struct Records {                // what the datasets' meta.json files say
    std::string tokenizer;        // "" none, or they disagree
    nlohmann::json chat;          // null none, or they disagree
    std::string chat_conflict;    // the disagreement, for chat_conflict()
  };
  const Records& records() const;

  std::string data_dir_;
  std::vector<std::string> datasets_;
  int64_t vocab_size_;
  std::string model_;
  nlohmann::json base_model_;
  std::string restored_dir_, restored_tokenizer_;  // the restored checkpoint and its "tokenizer" ("" none)
  nlohmann::json restored_chat_;                    // its "chat" (null none)
  bool restored_trained_ = false;                   // its step > 0
  mutable std::optional<Records> records_;          // read at the first question
};

}  // namespace lt
