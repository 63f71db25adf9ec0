// A job's plan, as data: its stages (data/stage_plan.hpp) grouped into phases. The trainer runs the
// phases in order (Trainer::run); each says what trains, what its steps minimise, where its rows come
// from and its learning-rate schedule.
//
//   train, continual/train/benchmark, dpo/train (full)   one phase: every parameter, over every stage
//   lora/train, continual/.../benchmark_lora             the pre-LoRA stages train every parameter; then
//                                                        transition_to_lora, and the post-LoRA stages train
//                                                        the adapters
//   dpo/train (LoRA)                                     one phase: the adapters, from step 0
//
// A recipe's part (trainer_part.hpp) may change a phase's loss (DPO's) or batch source (the fades).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/data/stage_plan.hpp"
#include "lora_trainer/training/optim.hpp"

namespace lt {

class StepLoss;     // step_loss.hpp
class BatchSource;  // trainer_part.hpp

// What a phase trains: every parameter, or the adapters (LoRA) on a frozen base.
enum class Trainable { AllParameters, Adapters };

// What a trainer trains: the stages of its plan, the first `full_stages` of which train every
// parameter; the rest, if any, are a LoRA phase.
struct TrainingPlan {
  StagePlan stages;
  size_t full_stages = 0;
  bool has_lora_phase() const { return full_stages < stages.tokens.size(); }
  // Every parameter over every stage of `stages`.
  static TrainingPlan full(StagePlan stages);
  // The `train` job's (and dpo/train's): training/tokens over training/dataset, every parameter.
  static TrainingPlan from_train_config(const Config& cfg);
  // continual/train/benchmark's: a stage per budget of training/tokens, over the mixture of
  // training/dataset at its place, every parameter. A UserError when the lists differ in length.
  static TrainingPlan from_stage_lists_config(const Config& cfg);
  // lora/train's: the stages of training/pre_lora_tokens and training/pre_lora_dataset (every parameter),
  // then those of training/post_lora_tokens and training/post_lora_dataset (the adapters). A UserError
  // when a token list and its dataset list differ in length, or when there is no post-LoRA stage.
  static TrainingPlan from_lora_config(const Config& cfg);
};

// The keys of a job's stage plan, declared once for each shape of plan, each bound to the StagePlan
// field it fills (plan.cpp's OptionGroups, core/options.hpp); TrainingPlan's from_*_config read them.
// train's: training/tokens (one budget, an Int) and training/dataset (one mixture, Samplings); dpo/train
// declares them with its own default mixture and its doc.
void add_train_plan_options(ConfigSchema& s);
void add_train_plan_options(ConfigSchema& s, json default_dataset, std::string dataset_doc);
// continual/train/benchmark's: training/tokens (a budget a stage, an IntList) and training/dataset (a
// mixture a stage, SamplingStages).
void add_stage_lists_plan_options(ConfigSchema& s);
// lora/train's (and the LoRA kinds built on it): training/pre_lora_tokens, training/pre_lora_dataset,
// training/post_lora_tokens and training/post_lora_dataset.
void add_lora_plan_options(ConfigSchema& s);

// A phase of a job's plan: its steps, (first_step, end_step] as step counts, all train the same set of
// parameters with the same loss, on rows from the same source, over its stages [first_stage, end_stage)
// of the trainer's stages(). Phases follow each other in the order of their end steps; entering one that
// trains adapters when the base still trains is the transition to LoRA.
struct Phase {
  Trainable trains = Trainable::AllParameters;
  int first_stage = 0, end_stage = 0;
  int64_t first_step = 0, end_step = 0;
  Schedule schedule;             // the learning rate of the step taken after s steps is schedule.at(s - first_step)
  StepLoss* loss = nullptr;      // what its steps minimise: the trainer's next-token loss, or a part's (DPO's)
  BatchSource* batches = nullptr;  // where its rows come from (continual learning's fades); null: the
                                   // current stage's mixture
};

}  // namespace lt
