// A prompts dataset (style PROMPTS, data.hpp): what GRPO's rollouts start from. `tokenize --format
// prompts` writes it from JSONL records {"prompt": str, ...} or {"messages": [...], ...} (rendered with the
// model's chat template and its generation prompt): each prompt a left-padded row of PADDED's files (every
// mask 0: a prompt is read, never learned), and the record itself, every field kept, a line each of
// {train,val}.records.jsonl in the rows' order, for the rewards (the "answer" exact match compares, the
// fields a reward program reads).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/data/data.hpp"

namespace lt {

class PromptsDataset : public PaddedDataset {
 public:
  // A UserError naming the file when a records file is missing, is not a JSON object a line, or holds
  // another number of records than the split has rows.
  PromptsDataset(const std::string& dir, const std::string& name);
  // Row `row`'s prompt: its tokens without the padding.
  std::vector<uint32_t> prompt(Split split, uint64_t row) const;
  // Row `row`'s record, as tokenize read it.
  const nlohmann::json& record(Split split, uint64_t row) const;
  // Where the record came from, for messages: "prompts dataset NAME, train record 12".
  std::string where(Split split, uint64_t row) const;
  // The longest prompt (the rows' length).
  uint64_t longest_prompt() const;

 private:
  std::vector<nlohmann::json> train_records_, val_records_;
};

}  // namespace lt
