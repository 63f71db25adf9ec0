// JobData: the data a training job draws from. Its plan's stages as whole steps (split_stages), the
// datasets they name (opened once each through one catalog, their vocabulary checked against the
// model's), and each stage's sampler, made when first asked for: at the cursor a restore gave, else at
// the one the step count implies. A checkpoint records the cursors (cursors()), so a resumed job draws
// the rows an uninterrupted one would have.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/data/data.hpp"
#include "lora_trainer/data/stage_plan.hpp"

namespace lt {

class JobData {
 public:
  // A UserError when something cannot train on these datasets (the trainer's check, with its parts').
  using DatasetCheck = std::function<void(const std::vector<Sampling>&)>;

  // Stages of `batch_size` rows of `block_size` tokens a step over `data_dir`'s datasets (data/pack:
  // padded ones open packed); `check` is called with a stage's datasets before its sampler is made.
  JobData(const std::string& data_dir, int64_t vocab_size, bool pack, const StagePlan& plan, int64_t batch_size,
          int64_t block_size, uint64_t seed, DatasetCheck check);

  const std::vector<Stage>& stages() const { return stages_; }
  // The end step of the last stage (0 for a plan without stages).
  int64_t total_steps() const { return stages_.empty() ? 0 : stages_.back().end_step; }
  // The stage that `step` (0-based) belongs to; steps past the end belong to the last stage.
  int stage_of(int64_t step) const { return lt::stage_of(stages_, step); }
  // Every distinct dataset of the stages, in order of first use.
  std::vector<Sampling> datasets() const { return plan_datasets(stages_); }
  // Opens a dataset; a UserError when its vocabulary is larger than the model's (architecture/vocab_size).
  const Dataset& open(const Sampling& smp);
  // Checks and opens every dataset of the plan now (a missing one is found at the start, not at its stage).
  void open_all();
  // The sampler of `stage`'s mixture, made when first asked for with the job at `step`.
  MixtureSampler& sampler(int stage, int64_t step);
  // Each stage's cursor, as a checkpoint records it: a made sampler's, or one a restore gave and no
  // sampler has taken yet.
  std::map<int, uint64_t> cursors() const;
  // After a restore: every sampler made again when next asked for, at these cursors.
  void restore(std::map<int, uint64_t> cursors);

 private:
  DataCatalog catalog_;
  std::vector<Stage> stages_;
  std::vector<std::unique_ptr<MixtureSampler>> samplers_;
  std::map<int, uint64_t> restored_cursors_;  // from a checkpoint, applied when the sampler is made
  int64_t batch_size_, block_size_, vocab_size_;
  uint64_t seed_;
  DatasetCheck check_;
};

}  // namespace lt
