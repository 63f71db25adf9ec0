// MetricsLog: a run's record, the files of its run directory and the progress lines printed with them.
//
// metrics.jsonl holds one JSON event a line ("train", "val", "transition", "boundary", "nonfinite",
// ...; report.hpp's read_metrics reads them back), config.json the run's config. With
// logging/tensorboard, every number of every event also goes to a TensorBoard event file beside them, as
// the scalar `<event>/<field>` (`<event>/<field>/<key>` inside an object; scalars_of). A failed write of
// either file stops the run (a UserError naming the file): no figure is lost silently.
// Only the writer (rank 0, or the only process) writes files; every process prints its lines.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/formats/tensorboard.hpp"
#include "lora_trainer/training/evaluation.hpp"

namespace lt {

// What the step line says besides the averaged loss and speed.
struct StepLine {
  int64_t step = 0, total_steps = 0, tokens = 0;
  int stage = 0;  // the stage of the step just taken
  double lr = 0.0, grad_norm = 0.0;
  nlohmann::json extra = nlohmann::json::object();  // more figures (name: number), after the others
};

// The steps since the last step line: their losses and times, summed.
struct StepWindow {
  double loss = 0, seconds = 0;
  int64_t steps = 0;
  void add(double step_loss, double step_seconds) {
    loss += step_loss;
    seconds += step_seconds;
    ++steps;
  }
};

class MetricsLog {
 public:
  MetricsLog(std::string run_dir, bool writer, bool tensorboard = false);

  // Creates the run directory and writes config.json.
  void write_config(const nlohmann::json& config) const;
  // Appends one event to metrics.jsonl (and its numbers to the TensorBoard file); a failed write is a
  // UserError naming the file (the run stops, exit 2), and leaves no part of the line.
  void event(const nlohmann::json& e) const;
  // Drops the events of the steps after `step` (a resumed run redoes them), and a torn last line, from
  // both files; a damaged line or record in the middle is dropped too (a warning says where), and the
  // intact ones after it are kept.
  void truncate_after(int64_t step) const;

  // Prints the step line and logs the "train" event with the loss and the speed (`tokens_per_step`
  // tokens a step) averaged over `window`, which starts again empty.
  void log_train(const StepLine& line, StepWindow& window, int64_t tokens_per_step) const;
  // Prints the validation line (loss and perplexity per dataset) and logs the "val" event.
  void log_validation(int64_t step, int64_t tokens, int stage, const ValResult& v, bool stage_end) const;

 private:
  std::string path_;  // metrics.jsonl
  std::string run_dir_;
  bool writer_;
  std::unique_ptr<EventFileWriter> tensorboard_;  // null without logging/tensorboard, and on other ranks
};

// The TensorBoard scalars of an event: every number of it but its step (the x axis), tagged with the
// path that leads to it, `<event>/<field>`, `<event>/<field>/<key>` inside an object (the "val" event's
// per_dataset as `val/loss/<name>`); strings, booleans and lists (of names, of token ids: not
// measurements) are left out. One rule, no list of fields: a field added to an event is charted with no
// change here.
std::vector<ScalarValue> scalars_of(const nlohmann::json& event);

}  // namespace lt
