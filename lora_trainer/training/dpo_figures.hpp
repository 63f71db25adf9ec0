// DPO's figures of preference pairs, as one value: the mean DPO loss per pair, reward margin,
// accuracy and implicit rewards (recipes/dpo.hpp computes them, DpoStats::figures). Each figure's key
// in metrics.jsonl and `eval --json`, and its printed precision, is defined here once, for every place
// that writes or prints them: the step line and its train event, the validation line and its val
// event, `eval`'s JSON and line, and the LoRA job's report (lora_report.cpp).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace lt {

struct DpoFigures {
  double loss = 0.0;           // the mean DPO loss per pair
  double reward_margin = 0.0;  // the mean of the chosen reward minus the rejected one
  double accuracy = 0.0;       // the share of pairs whose chosen reward is the larger
  double chosen_reward = 0.0, rejected_reward = 0.0;  // the mean implicit rewards, beta (log pi - log ref)
  int64_t pairs = 0;

  // The figures' keys. A train event's loss is its own "loss", a val event's its per_dataset entry;
  // a val event holds reward_margin and accuracy as maps by dataset name.
  static constexpr const char* kLoss = "dpo_loss";  // `eval --json`
  static constexpr const char* kRewardMargin = "reward_margin";
  static constexpr const char* kAccuracy = "accuracy";
  static constexpr const char* kChosenReward = "chosen_reward";
  static constexpr const char* kRejectedReward = "rejected_reward";
  static constexpr const char* kPairs = "pairs";  // `eval --json`
  // Printed digits after the point.
  static constexpr int kLossDigits = 4, kRewardDigits = 4, kAccuracyDigits = 3;

  // A dataset's figures as `eval --json` writes them: {dpo_loss, reward_margin, accuracy, pairs}.
  nlohmann::json to_json() const;
  // The figures of to_json's form; a figure absent is 0, one written as null (not finite) NaN.
  static DpoFigures from_json(const nlohmann::json& j);
  // A train event's figures besides its loss (means over the steps since the line before):
  // {reward_margin, accuracy, chosen_reward, rejected_reward}.
  nlohmann::json step_json() const;
  // The figures of a train event: its "loss" and step_json's keys (absent: 0; null: NaN).
  static DpoFigures from_step_json(const nlohmann::json& train_event);
  // A val event's: dataset `name`'s reward margin and accuracy put into the event's maps (its loss is
  // per_dataset's, which the event holds for every dataset).
  void add_to_val_event(nlohmann::json& val_event, const std::string& name) const;
  // Whether a val event has DPO's figures of any dataset; the dataset names they are given for.
  static bool in_val_event(const nlohmann::json& val_event);
  // Dataset `name`'s figures of a val event (a figure absent or null: NaN).
  static DpoFigures from_val_event(const nlohmann::json& val_event, const std::string& name);

  // The step line's text after the grad norm: " | accuracy A | chosen_reward C | rejected_reward R |
  // reward_margin M".
  std::string step_text() const;
  // The validation line's text of dataset `name`: " NAME dpo loss L (margin M, accuracy A)".
  std::string validation_text(const std::string& name) const;
  // `eval`'s line of dataset `name`: "NAME  L (DPO loss over P pairs; reward margin M, accuracy A)".
  std::string eval_line(const std::string& name) const;
  // The report's table of validation figures: its header, and a row labelled `label`.
  static std::string report_header();
  std::string report_row(const std::string& label) const;
  // The report's line of the first and last step lines' figures (at steps first_step and last_step).
  static std::string report_steps_line(int64_t first_step, const DpoFigures& first, int64_t last_step,
                                       const DpoFigures& last);
};

}  // namespace lt
