// Continual-learning benchmarks: several stages (A, B, C, ...) of different data, trained one after
// another, measuring forgetting. Two jobs, each a trainer with a ContinualPart (a TrainerPart:
// training/trainer_part.hpp):
//
//   continual/train/benchmark       stages from training/tokens + training/dataset (lists), on the
//                                   base trainer (make_continual).
//   continual/train/benchmark_lora  the pre-LoRA stages, then transition_to_lora, then the post-LoRA
//                                   stages (lora/train's lists and phases; make_continual_lora).
//
// The part adds:
//   - an optional fade: over the last training/fade/overlap tokens before a boundary, each batch's
//     rows are split between the stage being left and the next by the fade weight w (curve linear,
//     cosine or sigmoid; largest-remainder rounding, so the parts sum to the batch). No fade crosses
//     the LoRA switch. It is the batch source of every phase.
//   - an optional optimizer reset at each boundary (training/reset_optimizer).
//   - at every stage end: held-out loss on the data of every stage (a row of the forgetting matrix:
//     stage trained so far x dataset evaluated), saved as `boundary_<i>_<j>` (`lora_boundary_<i>_<j>`
//     at the LoRA switch, `boundary_<i>_end` after the last stage). The matrix is kept in checkpoint
//     metadata, so a resumed run keeps its rows.
//   - at the end: the matrix as a table and forgetting.svg, and loss.svg with the boundaries marked.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/training/trainer_part.hpp"

namespace lt {

void add_continual_options(ConfigSchema& s);

// training/fade/curve: how the share of the next stage's rows grows across a fade window.
enum class FadeCurve { Linear, Cosine, Sigmoid };
FadeCurve parse_fade_curve(const std::string& name);  // "linear" | "cosine" | "sigmoid"
const std::vector<std::string>& fade_curve_names();

// The keys add_continual_options declares, each bound to its field (continual.cpp's OptionGroup, with
// its default and doc), read once by make_continual and make_continual_lora: training/fade/overlap,
// training/fade/curve, training/reset_optimizer and eval/boundary_rows.
struct ContinualOptions {
  int64_t fade_overlap{};   // training/fade/overlap, in tokens (whole steps of it fade); 0 = no fade
  FadeCurve fade_curve{};   // training/fade/curve
  bool reset_optimizer{};   // training/reset_optimizer: fresh moments at every stage boundary
  int64_t boundary_rows{};  // eval/boundary_rows: held-out rows per dataset in each row of the forgetting matrix
  static ContinualOptions from_config(const Config& cfg);
};

// w in [0, 1] for p in [0, 1]: the share of the next stage's rows.
double fade_curve(double p, FadeCurve curve);

// The fade weight of the step about to be taken, and the two stages it mixes; w = 0 outside a window.
// A window covers the last `overlap_steps` steps before the end of `stages[i]` (i + 1 < count):
// for the k-th of them (k = 1..n), w = curve(k / (n + 1)).
struct FadeAt {
  int from = 0, to = 0;
  double weight = 0.0;
};
FadeAt fade_at(const std::vector<Stage>& stages, int64_t step, int64_t overlap_steps, FadeCurve curve,
               int no_fade_after_stage = -1);

class ContinualPart : public TrainerPart {
 public:
  // The part of `trainer`, which must outlive it. `lora_switch_stage`: the stage whose end is the LoRA
  // switch (no fade crosses it; its checkpoint is `lora_boundary_*`), -1 for none.
  ContinualPart(Trainer& trainer, ContinualOptions options, int lora_switch_stage);

  void plan(std::vector<Phase>& phases) override;  // every phase's rows come through the fades
  void on_stage_end(int stage) override;
  void add_metadata(nlohmann::json& meta) const override;
  // A full restore continues the checkpoint's run and its matrix (also under a new name); weights taken
  // as a pretrained base leave the job's counters at zero and bring no matrix.
  void restored(const CheckpointMeta& ck) override;
  void after_run() override;

  // Rows of the forgetting matrix: {"after_stage": i, "step": s, "loss": {dataset: nats}}.
  const nlohmann::json& forgetting() const { return matrix_; }
  std::string forgetting_table() const;

 private:
  // The rows of a step: the stage's mixture, or in a fade window the old stage's rows then the new's.
  class Fades : public BatchSource {
   public:
    explicit Fades(ContinualPart& part) : part_(part) {}
    Batch next_share(int64_t first, int64_t count) override;

   private:
    ContinualPart& part_;
  };

  Trainer& trainer_;
  ContinualOptions continual_;
  int lora_switch_stage_;
  int64_t overlap_steps_ = 0;  // continual_.fade_overlap in whole steps
  nlohmann::json matrix_ = nlohmann::json::array();
  Fades fades_{*this};
};

// continual/train/benchmark: its schema, and a Trainer over its stages with a ContinualPart.
ConfigSchema continual_schema();
std::unique_ptr<Trainer> make_continual(JobSpec spec, Config cfg, std::string out_dir);
// continual/train/benchmark_lora: its schema, and a trainer of lora/train's plan with a ContinualPart.
ConfigSchema continual_lora_schema();
std::unique_ptr<Trainer> make_continual_lora(JobSpec spec, Config cfg, std::string out_dir);

}  // namespace lt
