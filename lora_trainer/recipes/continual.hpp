// Continual-learning benchmark trainers: several stages (A, B, C, ...) of different data, trained one
// after another, measuring forgetting.
//
//   continual/train/benchmark       stages from training/tokens + training/dataset (lists), on the
//                                   base trainer.
//   continual/train/benchmark_lora  the pre-LoRA stages, then transition_to_lora, then the post-LoRA
//                                   stages (the LoRA trainer's lists and phases).
//
// Both add, through one mixin (ContinualTrainer<Base>):
//   - an optional fade: over the last training/fade/overlap tokens before a boundary, each batch's
//     rows are split between the stage being left and the next by the fade weight w (curve linear,
//     cosine or sigmoid; largest-remainder rounding, so the parts sum to the batch). No fade crosses
//     the LoRA switch.
//   - an optional optimizer reset at each boundary (training/reset_optimizer).
//   - at every stage end: held-out loss on the data of every stage (a row of the forgetting matrix:
//     stage trained so far x dataset evaluated), saved as `boundary_<i>_<j>` (`lora_boundary_<i>_<j>`
//     at the LoRA switch, `boundary_<i>_end` after the last stage). The matrix is kept in checkpoint
//     metadata, so a resumed run keeps its rows.
//   - at the end: the matrix as a table and forgetting.svg, and loss.svg with the boundaries marked.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/training/lora_trainer.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

void add_continual_options(ConfigSchema& s);

// The keys add_continual_options declares (their defaults and docs are there), read once by
// ContinualTrainer's constructor: training/fade/overlap, training/fade/curve,
// training/reset_optimizer and eval/boundary_rows. from_config sets every field.
struct ContinualOptions {
  int64_t fade_overlap{};   // training/fade/overlap, in tokens (whole steps of it fade); 0 = no fade
  std::string fade_curve;   // training/fade/curve: linear, cosine or sigmoid (fade_curve)
  bool reset_optimizer{};   // training/reset_optimizer: fresh moments at every stage boundary
  int64_t boundary_rows{};  // eval/boundary_rows: held-out rows per dataset in each row of the forgetting matrix
  static ContinualOptions from_config(const Config& cfg);
};

// w in [0, 1] for p in [0, 1]: the share of the next stage's rows.
double fade_curve(double p, const std::string& curve);

// The fade weight of the step about to be taken, and the two stages it mixes; w = 0 outside a window.
// A window covers the last `overlap_steps` steps before the end of `stages[i]` (i + 1 < count):
// for the k-th of them (k = 1..n), w = curve(k / (n + 1)).
struct FadeAt {
  int from = 0, to = 0;
  double weight = 0.0;
};
FadeAt fade_at(const std::vector<Stage>& stages, int64_t step, int64_t overlap_steps, const std::string& curve,
               int no_fade_after_stage = -1);

template <class Base>
class ContinualTrainer : public Base {
 public:
  static ConfigSchema schema();
  ContinualTrainer(JobSpec spec, Config cfg, std::string out_dir);

  void run() override;
  void restore_from_checkpoint(const CheckpointMeta& ck) override;
  // Rows of the forgetting matrix: {"after_stage": i, "step": s, "loss": {dataset: nats}}.
  const nlohmann::json& forgetting() const { return matrix_; }
  std::string forgetting_table() const;

 protected:
  Batch next_batch(int64_t first, int64_t count) override;
  void on_stage_end(int stage) override;
  nlohmann::json extra_metadata() const override;
  // Over the LoRA base's: its report draws no loss.svg, since run() draws one with every stage
  // boundary marked afterwards (a member the plain base does not call).
  void draw_loss_plot(const std::vector<nlohmann::json>&, const std::string&) const {}

 private:
  void read_continual_options();
  int no_fade_after() const;
  ContinualOptions continual_;
  int64_t overlap_steps_ = 0;  // continual_.fade_overlap in whole steps
  nlohmann::json matrix_ = nlohmann::json::array();
};

using BenchmarkTrainer = ContinualTrainer<BaseTrainer>;
using BenchmarkLoRABaseTrainer = ContinualTrainer<LoRATrainer>;

}  // namespace lt
