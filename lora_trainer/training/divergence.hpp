// Divergence: what a run does when training produces NaN or infinite values (training/on_nonfinite).
//
// With "stop" the first step whose loss or gradient norm is not finite throws TrainingDiverged before
// the weights are updated; with "skip" that step's update is dropped, printed and logged as a
// "nonfinite" event, and kMaxSkippedInARow such steps in a row throw. A checkpoint holding a
// non-finite tensor is never written (check_finite). Every message says which step, what was kept and
// what to change; the launcher exits with kExitDiverged.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "lora_trainer/training/metrics_log.hpp"
#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

// Training produced a non-finite loss, gradient norm or state (training/on_nonfinite). Nothing
// non-finite was saved; the launcher exits with kExitDiverged.
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
constexpr int kExitDiverged = 4;
constexpr int kMaxSkippedInARow = 10;

// training/on_nonfinite: what a step with a non-finite loss or gradient norm does.
enum class OnNonfinite { Stop, Skip };
OnNonfinite parse_on_nonfinite(const std::string& name);  // "stop" | "skip"
const std::vector<std::string>& on_nonfinite_names();

// The training/on_nonfinite policy of one job, and the count of steps it skipped in a row.
class DivergenceGuard {
 public:
  // `job` and `job_dir` name the job in messages.
  DivergenceGuard(OnNonfinite policy, std::string job, std::string job_dir);
  // Step `step` (1-based) had a non-finite loss or gradient norm: throws TrainingDiverged, or (skip)
  // prints a warning and logs the "nonfinite" event to `log`.
  void on_nonfinite(int64_t step, double loss, double grad_norm, double lr, const MetricsLog& log);
  // A finite step ends a run of skipped ones.
  void on_finite() { skipped_in_a_row_ = 0; }

 private:
  bool skip_;
  std::string job_, job_dir_;
  int skipped_in_a_row_ = 0;
};

// Throws TrainingDiverged naming the first floating-point tensor of `tensors` that holds NaN or
// infinite values (after step `step` of job `job`), saying that `what` was not saved.
void check_finite(const NamedTensors& tensors, int64_t step, const std::string& job, const std::string& what);
// What to do after a divergence: the sentence every message that stops a run for one ends with.
const char* divergence_advice();

}  // namespace lt
