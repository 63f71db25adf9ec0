// The report of a finished LoRA job (report.md beside loss.svg in its run directory, also printed):
// per-phase steps, tokens and speed, the parameter counts of the transition, validation perplexity per
// dataset before and after the LoRA phase, task figures, DPO's figures, the unigram baselines. Read from
// the run's metrics.jsonl: what the run logged is what it reports.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lt {

// What the report needs beyond metrics.jsonl, from the trainer and its LoRA phase.
struct LoraReportFacts {
  std::string job, kind;         // the job's name and kind
  std::string run_dir, job_dir;  // where metrics.jsonl is; where the checkpoints are
  int64_t boundary_step = 0, total_steps = 0, tokens_per_step = 0;
  std::string skipped_phase_one;  // without phase one: where the base came from (LoraPhase::skipped_phase_one_text)
  std::vector<std::pair<std::string, double>> unigram_perplexity;  // per text dataset of the plan
};

// Writes report.md and loss.svg (the loss curves with the boundary marked) in facts.run_dir and returns
// the report; "" when no training was logged in that run directory.
std::string write_lora_report(const LoraReportFacts& facts);

}  // namespace lt
