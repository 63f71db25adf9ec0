// TrainerPart: a recipe's part of a job (DPO, continual learning), composed into a trainer instead of
// derived from it; and BatchSource, where a phase's rows come from. The trainer
// owns its parts and calls each, in the order they were added, at the points below; every call has a
// default that does nothing, so a part says only what it changes. A part keeps a reference to the
// trainer it was made for and works through its public interface.
//
//   plan                  the plan of phases: a part may give a phase its loss (DPO's on preference
//                         pairs) or its batch source (continual learning's fades). The trainer asks for
//                         the plan at every step, so plan must give the same result each time.
//   before_run            a run may start (a UserError when it may not)
//   after_run             on rank 0, the job is finished: reports and plots
//   on_stage_end          a stage's last step was taken (before its validation and periodic checkpoint)
//   add_state             tensors a checkpoint holds besides the trainer's own (loaded back in place)
//   add_metadata          keys of metadata.json besides the trainer's own
//   restore               the checkpoint becomes the state in the part's own way (true: no later part
//                         nor the trainer restores it), or the trainer's (false)
//   restored              after any restore, whoever did it
//   add_window_metrics    figures of the step line besides the loss
//   measures, measure     a dataset style the part evaluates and trains on (DPO: contrastive); the
//                         trainer refuses contrastive datasets when no part measures them
//   check_training_datasets  the datasets the job trains on suit the part
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/data/data.hpp"
#include "lora_trainer/training/evaluation.hpp"

namespace lt {

struct CheckpointMeta;  // checkpoint.hpp
struct Phase;           // plan.hpp

class TrainerPart {
 public:
  virtual ~TrainerPart() = default;
  virtual void plan(std::vector<Phase>& phases) {}
  virtual void before_run() {}
  virtual void after_run() {}
  virtual void on_stage_end(int stage) {}
  virtual void add_state(NamedTensors& tensors) {}
  virtual void add_metadata(nlohmann::json& meta) const {}
  virtual bool restore(const CheckpointMeta& ck) { return false; }
  virtual void restored(const CheckpointMeta& ck) {}
  // Figures of the steps since the last step line (name: number), added to it; the window starts again.
  virtual void add_window_metrics(nlohmann::json& metrics) {}
  virtual bool measures(DatasetStyle style) const { return false; }
  // The held-out figures, on their first `rows` rows, of those of `datasets` whose style this part
  // measures, in their order. `datasets` is the whole list being evaluated, the same on every rank, so
  // that a part reduces its sums over the ranks in the same shape whatever the list's mix of styles.
  virtual std::vector<DatasetEval> measure(const std::vector<Sampling>& datasets, int64_t rows) { return {}; }
  // A UserError when the datasets the job trains on do not suit the part (after the trainer's own check).
  virtual void check_training_datasets(const std::vector<Sampling>& datasets) const {}
};

using TrainerParts = std::vector<std::unique_ptr<TrainerPart>>;

// Whether a part of `parts` measures datasets of `style`.
bool some_part_measures(const TrainerParts& parts, DatasetStyle style);
// The figures of `datasets` on their first `rows` rows, in their order: each dataset measured by the
// first part that measures its style, the others by `text` (called with them, in order, when there are
// any). Every part's measure is called with the whole list (its collectives the same on every rank).
std::vector<DatasetEval> measure_datasets(const TrainerParts& parts, const std::vector<Sampling>& datasets, int64_t rows,
                                          const std::function<std::vector<DatasetEval>(const std::vector<Sampling>&)>& text);

// Where a phase's rows come from: this rank's rows [first, first + count) of the next global batch,
// moving the data cursors past the whole batch. Null in a Phase: the current stage's mixture.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next_share(int64_t first, int64_t count) = 0;
};

}  // namespace lt
