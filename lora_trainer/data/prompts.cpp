#include "lora_trainer/data/prompts.hpp"

#include <filesystem>
#include <fstream>

#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

PromptsDataset::PromptsDataset(const std::string& dir, const std::string& name)
    : PaddedDataset(dir, name, DatasetStyle::PROMPTS) {
  if (!has_lengths())
    throw UserError("prompts dataset \"" + name + "\" has no train.lengths.bin: re-run `lora_trainer tokenize --format prompts`");
  for (auto [split, records] : {std::pair<Split, std::vector<nlohmann::json>*>{Split::Train, &train_records_},
                                {Split::Val, &val_records_}}) {
    const std::string file = (fs::path(dir) / name / (split == Split::Train ? "train.records.jsonl" : "val.records.jsonl")).string();
    std::ifstream in(file);
    if (!in)
      throw UserError("cannot read " + file + ": a prompts dataset keeps each prompt's record there (its answer, for the "
                      "rewards); re-run `lora_trainer tokenize --format prompts`");
    std::string line;
    size_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object())
        throw UserError(file + ":" + std::to_string(n) + " is not a JSON object; re-run `lora_trainer tokenize --format prompts`");
      records->push_back(std::move(j));
    }
    if (records->size() != rows(split))
      throw UserError(file + " holds " + std::to_string(records->size()) + " records, but the split has " +
                      std::to_string(rows(split)) + " prompts (shape.json): the files do not belong together; re-run "
                      "`lora_trainer tokenize --format prompts`");
  }
}

std::vector<uint32_t> PromptsDataset::prompt(Split split, uint64_t row) const {
  const uint64_t L = longest_prompt(), n = example_length(split, row);
  const uint32_t* tok = tokens(split).data() + row * L + (L - n);
  return std::vector<uint32_t>(tok, tok + n);
}

const nlohmann::json& PromptsDataset::record(Split split, uint64_t row) const {
  return (split == Split::Train ? train_records_ : val_records_).at(row);
}

std::string PromptsDataset::where(Split split, uint64_t row) const {
  return "prompts dataset \"" + name() + "\", " + (split == Split::Train ? "train" : "val") + " record " + std::to_string(row);
}

uint64_t PromptsDataset::longest_prompt() const { return row_length(); }

}  // namespace lt
