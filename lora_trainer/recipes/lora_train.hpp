// The lora/train job (the mission's two-phase job): full-parameter training on the pre-LoRA stages,
// transition_to_lora at the boundary, then the adapters on the post-LoRA stages (training/trainer.hpp,
// training/lora_phase.hpp). Its LoRA phase trains with next-token loss on text, or with DPO's loss when
// its post-LoRA datasets are preference pairs (a DpoPart, dpo_part.hpp).
#pragma once

#include <memory>
#include <string>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/data/stage_plan.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

// Whether lora/train's LoRA phase trains with DPO: true when every post-LoRA dataset of `plan` (the
// stages after the first `pre_lora_stages`) is contrastive, false when none is. A UserError naming the
// datasets and their styles for a mix, and for preference pairs among the pre-LoRA datasets (phase 1
// is next-token training).
bool lora_phase_is_dpo(const StagePlan& plan, size_t pre_lora_stages);
// lora/train's schema: Trainer::lora_schema and optimization/dpo/{beta, label_smoothing} for a DPO phase 2.
ConfigSchema lora_train_schema();
// The lora/train job: a trainer of its two phases, with a DpoPart when lora_phase_is_dpo.
std::unique_ptr<Trainer> make_lora_train(JobSpec spec, Config cfg, std::string out_dir);

}  // namespace lt
