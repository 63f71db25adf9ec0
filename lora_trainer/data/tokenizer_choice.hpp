// Which tokenizer a model reads text with, for every `--tokenizer auto` (sample, eval --task, a job's
// task evaluations, export --format gguf): the one its training data was tokenized with, as the
// checkpoint records it or its datasets' meta.json say; never a guess that may be another tokenizer
// (a model trained on hf:DIR ids given GPT-2's). Where nothing tells, a UserError asks for --tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace lt {

// What is known of a checkpoint's tokenizer.
struct TokenizerClues {
  std::string checkpoint;             // for messages
  std::string recorded;               // its metadata's "tokenizer" (what its job's data was tokenized with); "" = none
  bool trained = false;               // its model was trained on its job's datasets (step > 0)
  std::string data_dir;               // the job's data/dir
  std::vector<std::string> datasets;  // the job's datasets
  std::string hf_dir;                 // an imported model's directory (base_model.hf_dir); "" = none
  int64_t vocab_size = 0;             // architecture/vocab_size
};

// The clues a checkpoint's metadata gives, read without building its job (formats/checkpoint.hpp's
// CheckpointMeta, which checked their types: this area is below it): its "tokenizer" (`recorded`, ""
// none), step, data/dir and the datasets of the saved config's training/*dataset* keys, base_model.hf_dir.
TokenizerClues checkpoint_tokenizer_clues(const std::string& checkpoint, const std::string& recorded, int64_t step,
                                         const nlohmann::json& config, const std::string& hf_dir, int64_t vocab_size);

// The tokenizer the datasets `names` under `data_dir` were tokenized with (their meta.json), "" when
// none of them is there or says; a UserError naming two datasets that say different tokenizers.
std::string datasets_tokenizer(const std::string& data_dir, const std::vector<std::string>& names);

// The chat format (chat_template.hpp's ChatFormat, as JSON) the datasets of conversations among
// `names` were rendered with (their meta.json's "chat"), or null when none is; a UserError naming two
// of them when they differ.
nlohmann::json datasets_chat_format(const std::string& data_dir, const std::vector<std::string>& names);

// `--tokenizer auto` for `command` (its name, for messages): the recorded tokenizer; else, for a trained
// model, its datasets'; else an imported model's own tokenizer.json where its directory still has one;
// else byte for a vocabulary of 257, gpt2 for GPT-2's 50257 (or padded to 50304). An hf:DIR without
// tokenizer.json, or a model none of these tells of, is a UserError saying to pass --tokenizer hf:DIR.
std::string auto_tokenizer(const TokenizerClues& clues, const std::string& command);

}  // namespace lt
