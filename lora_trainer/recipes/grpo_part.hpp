// GRPO (grpo.hpp) on PROMPTS datasets (prompts.hpp), as the LoRA phase's objective: a part of a trainer
// (GrpoPart, a TrainerPart: training/trainer_part.hpp) in two jobs, as DPO's is:
//
//   grpo/train                 from a pretrained base (`run ... --restore CHECKPOINT|HF_DIR`): one phase of
//                              adapters from step 0; the reference is the base with the adapters off.
//   lora/train, its post-LoRA  phase 1 next-token training on the pre-LoRA datasets (the skill), then
//   datasets prompts           GRPO on the adapters (the rewards sharpen it).
//
// A step's global batch is training/batch_size completions: batch_size / G prompts of the stage's mixture,
// G = optimization/grpo/num_generations completions each (a group), each rank drawing its share's
// prompts. A batch of rollouts is made every optimization/grpo/num_iterations steps (RolloutSource, the
// phase's BatchSource), with the current policy in eval mode and without gradients:
//   1. each prompt's G completions in one batch through the KV cache (generate_batch), at
//      optimization/grpo/temperature, top_k and top_p, up to max_completion_length new tokens or the
//      first stop id (the dataset's end-of-text, and its chat format's end of turn), each then cut after
//      the token that completes its first stop string (optimization/grpo/stop); the draws seeded by
//      (training/seed, step, prompt): a resumed run draws the same completions;
//   2. the rewards of optimization/grpo/rewards on each completion's text, the prompt's record beside it
//      (grpo_rewards.hpp); the advantages of the groups (group_advantages, over the global batch);
//   3. with num_iterations > 1, the policy's log-probabilities now (the "old" ones the ratio divides by);
//      with beta > 0, the reference's (AdaptersOff).
// A row is the prompt then the completion then padding (targets only on the completion's tokens, its
// stop id included), at position 0 as generation read it, cut to the batch's longest row: prompt length
// + max_completion_length must fit in architecture/block_size. The step's loss (RolloutLoss, the phase's
// StepLoss) is grpo_loss over the micro-batches of per_device_batch_size completions, each its share of
// the step's. A step's tokens are counted as batch_size x block_size, as for every job.
//
// The step line adds (averaged over the steps since the last line) reward, reward_std, each reward's mean
// (reward/NAME), completion_tokens (mean), kl (with beta > 0), clip_ratio (the completion tokens whose
// ratio was clipped) and rollout_tok_per_s. Validation (and `eval --dataset NAME:prompts`) measures a
// prompts dataset by one greedy completion of each of its first training/validation_steps held-out
// prompts: the rewards' means (its loss is minus the total reward's mean, so that lower is better).
//
// Restorable as every job: the rollouts of a batch still being trained on (num_iterations > 1) are saved
// in the checkpoint (grpo/rollouts/*); the draws depend only on the seed, the step and the prompt; a reward
// program is started again by the resumed run.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/recipes/grpo.hpp"
#include "lora_trainer/recipes/grpo_rewards.hpp"
#include "lora_trainer/training/step_loss.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/training/trainer_part.hpp"

namespace lt {

class PromptsDataset;

class GrpoPart : public TrainerPart {
 public:
  // The part of `trainer` (which must outlive it): the last phase of its plan trains with GRPO.
  // `after_next_token_phase`: lora/train's form (phase 1 trains on text), else grpo/train's.
  GrpoPart(Trainer& trainer, GrpoOptions options, bool after_next_token_phase);
  ~GrpoPart() override;

  void plan(std::vector<Phase>& phases) override;
  // A UserError when the job cannot start: grpo/train without a base (unless allow_random_base), a batch
  // that is not whole groups on every rank, a sharded base (its forwards are collectives, which ranks
  // generating different lengths cannot keep in step).
  void before_run() override;
  void add_state(NamedTensors& tensors) override;  // num_iterations > 1: the rollouts being trained on
  void add_metadata(nlohmann::json& meta) const override;
  void restored(const CheckpointMeta& ck) override;
  void add_window_metrics(nlohmann::json& metrics) override;
  bool measures(DatasetStyle style) const override { return style == DatasetStyle::PROMPTS; }
  std::vector<DatasetEval> measure(const std::vector<Sampling>& datasets, int64_t rows) override;
  void check_training_datasets(const std::vector<Sampling>& datasets) const override;

  const GrpoOptions& options() const { return opts_; }
  // The figures of the last step (all ranks): reward, reward_std, reward/NAME, completion_tokens, kl,
  // clip_ratio, rollout_tok_per_s.
  const nlohmann::json& last_step() const { return last_; }

 private:
  // One batch of rollouts: the global batch's rows (the same on every rank).
  struct Rollouts {
    torch::Tensor inputs, targets;  // (batch_size, block_size) int64; targets -1 off the completions
    torch::Tensor old_logps, ref_logps;  // (batch_size, block_size) f32, or undefined
    torch::Tensor advantages;            // (batch_size) f64
    int64_t width = 0;                   // the longest row: the columns a step computes
    int64_t step = -1;                   // the step (0-based) it was made for; -1: none
  };
  class RolloutSource : public BatchSource {
   public:
    explicit RolloutSource(GrpoPart& part) : part_(part) {}
    Batch next_share(int64_t first, int64_t count) override;

   private:
    GrpoPart& part_;
  };
  class RolloutLoss : public StepLoss {
   public:
    explicit RolloutLoss(GrpoPart& part) : part_(part) {}
    void begin_step(const Batch& rows, int64_t step) override;
    torch::Tensor forward_backward(const Batch& micro) override;
    void end_step() override;

   private:
    GrpoPart& part_;
    GrpoStepSize size_;
    int64_t next_row_ = 0;  // the global row of the next micro-batch's first
    double tokens_ = 0, clipped_ = 0, kl_ = 0;  // this rank's, over the step's micro-batches
    int64_t step_ = 0;
  };

  // Makes the rollouts of step `step` (0-based) from this rank's prompts of the global batch's rows
  // [first, first + count).
  void make_rollouts(int64_t first, int64_t count);
  // The completions of `prompt` (G, or 1 greedy with `greedy`), seeded by `seed`.
  std::vector<std::vector<uint32_t>> complete(const std::vector<uint32_t>& prompt, int64_t n, bool greedy, uint64_t seed);
  // `completion` up to the token that completes its first stop string (optimization/grpo/stop), that
  // token kept; the whole of it when none occurs.
  std::vector<uint32_t> cut_at_stop(const std::vector<uint32_t>& completion) const;
  // The reward inputs of one prompt's completions.
  std::vector<RewardInput> reward_inputs(const PromptsDataset& ds, Split split, uint64_t row,
                                         const std::vector<uint32_t>& prompt,
                                         const std::vector<std::vector<uint32_t>>& completions);
  // The log-probabilities of the rows [first, first + n) of the rollouts under the policy (`reference`:
  // its adapters off), without gradients, in eval mode -> (n, block_size) f32 on the CPU.
  torch::Tensor logps_of(int64_t first, int64_t n, bool reference);
  // The tokenizer that decodes the completions and the ids that stop them (of the first prompts dataset
  // met), read once.
  void read_text_format(const PromptsDataset& ds);
  // A dataset of style prompts as opened (opened_prompts), and with its text format read (prompts).
  const PromptsDataset& opened_prompts(const Sampling& s) const;
  const PromptsDataset& prompts(const Sampling& s);
  // The rewards, made when first asked for (a reward program starts then).
  RewardSet& reward_set();
  nlohmann::json reward_figures(const std::vector<std::vector<double>>& per, const std::vector<double>& total) const;

  Trainer& trainer_;
  GrpoOptions opts_;
  bool lora_train_;
  std::unique_ptr<RewardSet> rewards_;  // made at the first rollouts (a reward program started then)
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<uint32_t> stop_ids_;
  Rollouts rollouts_;
  RolloutSource source_{*this};
  RolloutLoss loss_{*this};
  nlohmann::json rollout_figures_;  // of the rollouts being trained on
  nlohmann::json last_;
  nlohmann::json window_sums_ = nlohmann::json::object();  // the step line's: sums of each figure
  int64_t window_steps_ = 0;
  bool has_base_ = false;
};

// grpo/train's schema, and its job: a trainer of adapters from step 0 with a GrpoPart.
ConfigSchema grpo_train_schema();
std::unique_ptr<Trainer> make_grpo_train(JobSpec spec, Config cfg, std::string out_dir);

}  // namespace lt
