// The lora/train job (the mission's two-phase job): full-parameter training on the pre-LoRA stages,
// transition_to_lora at the boundary, then the adapters on the post-LoRA stages (training/trainer.hpp,
// training/lora_phase.hpp). Its LoRA phase trains with next-token loss on text, with DPO's loss when its
// post-LoRA datasets are preference pairs (a DpoPart, dpo_part.hpp), or with GRPO when they are prompts
// (a GrpoPart, grpo_part.hpp).
#pragma once

#include <memory>
#include <string>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/data/stage_plan.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

// What lora/train's LoRA phase minimises, by the style of its datasets.
enum class LoraObjective { NextToken, Dpo, Grpo };

// The LoRA phase's objective from the post-LoRA datasets of `plan` (the stages after the first
// `pre_lora_stages`): DPO when every one is contrastive, GRPO when every one is prompts, else next-token.
// A UserError naming the datasets and their styles for a mix, and for pairs or prompts among the pre-LoRA
// datasets (phase 1 is next-token training).
LoraObjective lora_phase_objective(const StagePlan& plan, size_t pre_lora_stages);
// lora/train's schema: Trainer::lora_schema, optimization/dpo/{beta, label_smoothing} for a DPO phase 2
// and optimization/grpo/* for a GRPO one.
ConfigSchema lora_train_schema();
// The lora/train job: a trainer of its two phases, with the part of its LoRA phase's objective.
std::unique_ptr<Trainer> make_lora_train(JobSpec spec, Config cfg, std::string out_dir);

}  // namespace lt
