#include "lora_trainer/training/trainer_part.hpp"

#include <algorithm>

namespace lt {

bool some_part_measures(const TrainerParts& parts, DatasetStyle style) {
  return std::any_of(parts.begin(), parts.end(), [&](const auto& part) { return part->measures(style); });
}

std::vector<DatasetEval> measure_datasets(const TrainerParts& parts, const std::vector<Sampling>& datasets, int64_t rows,
                                          const std::function<std::vector<DatasetEval>(const std::vector<Sampling>&)>& text) {
  std::vector<TrainerPart*> by(datasets.size(), nullptr);
  std::vector<Sampling> rest;
  for (size_t i = 0; i < datasets.size(); ++i) {
    for (const auto& part : parts)
      if (!by[i] && part->measures(datasets[i].style)) by[i] = part.get();
    if (!by[i]) rest.push_back(datasets[i]);
  }
  std::vector<DatasetEval> out(datasets.size());
  if (!rest.empty()) {
    const std::vector<DatasetEval> measured = text(rest);
    for (size_t i = 0, next = 0; i < datasets.size(); ++i)
      if (!by[i]) out[i] = measured.at(next++);
  }
  for (const auto& part : parts) {
    const std::vector<DatasetEval> figures = part->measure(datasets, rows);  // those of its styles
    for (size_t i = 0, next = 0; i < datasets.size(); ++i)
      if (by[i] == part.get()) out[i] = figures.at(next++);
  }
  return out;
}

}  // namespace lt
