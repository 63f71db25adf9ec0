#include "lora_trainer/training/dpo_figures.hpp"

#include <cmath>
#include <cstdio>

#include "lora_trainer/training/report.hpp"

using json = nlohmann::json;

namespace lt {

// j[key] as a number: `absent` when j has no such key, NaN when it is not a number (a non-finite value
// is written as null).
static double figure(const json& j, const char* key, double absent) {
  return j.is_object() && j.contains(key) ? metric_value(j[key]) : absent;
}

json DpoFigures::to_json() const {
  return {{kLoss, loss}, {kRewardMargin, reward_margin}, {kAccuracy, accuracy}, {kPairs, pairs}};
}

DpoFigures DpoFigures::from_json(const json& j) {
  DpoFigures f;
  f.loss = figure(j, kLoss, 0.0);
  f.reward_margin = figure(j, kRewardMargin, 0.0);
  f.accuracy = figure(j, kAccuracy, 0.0);
  f.chosen_reward = figure(j, kChosenReward, 0.0);
  f.rejected_reward = figure(j, kRejectedReward, 0.0);
  f.pairs = j.is_object() && j.contains(kPairs) && j[kPairs].is_number() ? j[kPairs].get<int64_t>() : 0;
  return f;
}

json DpoFigures::step_json() const {
  return {{kRewardMargin, reward_margin}, {kAccuracy, accuracy}, {kChosenReward, chosen_reward},
          {kRejectedReward, rejected_reward}};
}

DpoFigures DpoFigures::from_step_json(const json& train_event) {
  DpoFigures f = from_json(train_event);
  f.loss = figure(train_event, "loss", 0.0);
  return f;
}

void DpoFigures::add_to_val_event(json& val_event, const std::string& name) const {
  val_event[kRewardMargin][name] = reward_margin;
  val_event[kAccuracy][name] = accuracy;
}

bool DpoFigures::in_val_event(const json& val_event) {
  return val_event.contains(kRewardMargin) && !val_event[kRewardMargin].empty();
}

DpoFigures DpoFigures::from_val_event(const json& val_event, const std::string& name) {
  const double nan = std::nan("");
  DpoFigures f;
  f.loss = figure(val_event.value("per_dataset", json()), name.c_str(), nan);
  f.reward_margin = figure(val_event.value(kRewardMargin, json()), name.c_str(), nan);
  f.accuracy = figure(val_event.value(kAccuracy, json()), name.c_str(), nan);
  return f;
}

std::string DpoFigures::step_text() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, " | %s %.*f | %s %.*f | %s %.*f | %s %.*f", kAccuracy, kAccuracyDigits, accuracy,
                kChosenReward, kRewardDigits, chosen_reward, kRejectedReward, kRewardDigits, rejected_reward,
                kRewardMargin, kRewardDigits, reward_margin);
  return buf;
}

std::string DpoFigures::validation_text(const std::string& name) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, " %s dpo loss %.*f (margin %.*f, accuracy %.*f)", name.c_str(), kLossDigits, loss,
                kRewardDigits, reward_margin, kAccuracyDigits, accuracy);
  return buf;
}

std::string DpoFigures::eval_line(const std::string& name) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-20s %10.*f (DPO loss over %lld pairs; reward margin %.*f, accuracy %.*f)\n",
                name.c_str(), kLossDigits, loss, (long long)pairs, kRewardDigits, reward_margin, kAccuracyDigits,
                accuracy);
  return buf;
}

std::string DpoFigures::report_header() {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%-36s  %10s  %13s  %8s\n", "validation DPO", "dpo loss", "reward margin", "accuracy");
  return buf;
}

std::string DpoFigures::report_row(const std::string& label) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "  %-34s  %10.*f  %13.*f  %8.*f\n", label.c_str(), kLossDigits, loss, kRewardDigits,
                reward_margin, kAccuracyDigits, accuracy);
  return buf;
}

std::string DpoFigures::report_steps_line(int64_t first_step, const DpoFigures& first, int64_t last_step,
                                          const DpoFigures& last) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "DPO steps (step lines %lld -> %lld): loss %.*f -> %.*f, reward margin %.*f -> %.*f, accuracy %.*f -> "
                "%.*f\n",
                (long long)first_step, (long long)last_step, kLossDigits, first.loss, kLossDigits, last.loss,
                kRewardDigits, first.reward_margin, kRewardDigits, last.reward_margin, kAccuracyDigits, first.accuracy,
                kAccuracyDigits, last.accuracy);
  return buf;
}

}  // namespace lt
