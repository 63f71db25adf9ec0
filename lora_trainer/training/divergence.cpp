#include "lora_trainer/training/divergence.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/util.hpp"

using nlohmann::json;

namespace lt {

static std::string figure(double v) {  // 4 significant digits
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", v);
  return b;
}

// What to do after a divergence: said by every message that stops a run for one.
static const char* const kDivergenceAdvice =
    "Lower optimization/lr (or optimization/lora/lr in the LoRA phase), raise training/warmup_pct, or check the data, "
    "then run the same command again (it continues from the job's `latest` checkpoint, when there is one)";

const char* divergence_advice() { return kDivergenceAdvice; }

const std::vector<std::string>& on_nonfinite_names() {
  static const std::vector<std::string> names = {"stop", "skip"};  // in OnNonfinite's order
  return names;
}

OnNonfinite parse_on_nonfinite(const std::string& name) {
  return enum_named<OnNonfinite>(on_nonfinite_names(), name, "training/on_nonfinite");
}

DivergenceGuard::DivergenceGuard(OnNonfinite policy, std::string job, std::string job_dir)
    : skip_(policy == OnNonfinite::Skip), job_(std::move(job)), job_dir_(std::move(job_dir)) {}

void DivergenceGuard::on_nonfinite(int64_t step, double loss, double grad_norm, double lr, const MetricsLog& log) {
  const std::string what = "step " + std::to_string(step) + " of job " + job_ + ": loss " + figure(loss) +
                           ", gradient norm " + figure(grad_norm) + " at lr " + figure(lr);
  std::optional<std::string> latest;  // every rank sees OUT_DIR (run() checks), so every rank's message is true
  try {
    latest = read_latest(job_dir_);
  } catch (const UserError&) {
  }
  const std::string kept = latest ? "the job's checkpoints are all finite (latest: " + job_dir_ + "/" + *latest + ")"
                                  : "no checkpoint of this job was saved yet";
  const std::string advice = kDivergenceAdvice;
  if (!skip_)
    throw TrainingDiverged("training diverged at " + what + ". Stopped without updating the weights; " + kept + ". " +
                           advice + " (training/on_nonfinite=skip drops such steps instead)");
  ++skipped_in_a_row_;
  std::printf("warning: skipped the update of %s (training/on_nonfinite=skip; %d in a row)\n", what.c_str(),
              skipped_in_a_row_);
  std::fflush(stdout);
  log.event({{"event", "nonfinite"}, {"step", step}, {"loss", std::isfinite(loss) ? json(loss) : json(figure(loss))},
             {"grad_norm", std::isfinite(grad_norm) ? json(grad_norm) : json(figure(grad_norm))}, {"lr", lr},
             {"action", "skipped"}});
  if (skipped_in_a_row_ >= kMaxSkippedInARow)
    throw TrainingDiverged("training diverged: " + std::to_string(skipped_in_a_row_) + " steps in a row had a non-finite "
                           "loss or gradient norm, the last " + what + "; " + kept + ". " + advice);
}

void check_finite(const NamedTensors& tensors, int64_t step, const std::string& job, const std::string& what) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> flags;
  std::vector<const std::string*> names;
  for (const auto& [name, t] : tensors)
    if (t.is_floating_point() && t.numel() > 0) {
      flags.push_back(torch::isfinite(t).all().reshape({1}));
      names.push_back(&name);
    }
  if (flags.empty()) return;
  auto ok = torch::cat(flags).cpu();  // one read-back
  if (ok.all().item<bool>()) return;
  for (size_t i = 0; i < names.size(); ++i)
    if (!ok[static_cast<int64_t>(i)].item<bool>())
      throw TrainingDiverged("training diverged: after step " + std::to_string(step) + " of job " + job + ", " +
                             *names[i] + " holds NaN or infinite values, so " + what + " was not saved. " +
                             kDivergenceAdvice);
}

}  // namespace lt
