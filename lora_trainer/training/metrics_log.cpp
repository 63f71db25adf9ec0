#include "lora_trainer/training/metrics_log.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace lt {

MetricsLog::MetricsLog(std::string run_dir, bool writer, bool tensorboard)
    : path_((fs::path(run_dir) / "metrics.jsonl").string()), run_dir_(std::move(run_dir)), writer_(writer) {
  if (writer_ && tensorboard) tensorboard_ = std::make_unique<EventFileWriter>(run_dir_);
}

// The numbers under `v`, tagged `tag`, `tag/<key>`, `tag/<key>/<key>`, ... Lists are not measurements
// (the transition's adapted weights, its trainable token ids): a chart a list item would be noise.
static void add_numbers(const json& v, const std::string& tag, std::vector<ScalarValue>& out) {
  if (v.is_number()) {
    out.push_back({tag, v.get<float>()});
  } else if (v.is_object()) {
    for (const auto& [key, x] : v.items()) add_numbers(x, tag + "/" + key, out);
  }
}

std::vector<ScalarValue> scalars_of(const json& e) {
  std::vector<ScalarValue> out;
  const std::string kind = e.value("event", std::string("event"));
  for (const auto& [field, v] : e.items()) {
    if (field == "event" || field == "step") continue;  // the record's name and its x
    // One name the charts have always had: the validation losses per dataset beside the score val/loss.
    const std::string name = kind == "val" && field == "per_dataset" ? "loss" : field;
    add_numbers(v, kind + "/" + name, out);
  }
  return out;
}

void MetricsLog::write_config(const json& config) const {
  if (!writer_) return;
  fs::create_directories(run_dir_);
  write_file_atomic((fs::path(run_dir_) / "config.json").string(), config.dump(2) + "\n");
}

void MetricsLog::event(const json& e) const {
  if (!writer_) return;
  fs::create_directories(run_dir_);
  // A figure lost is a run's record silently wrong: a failed write stops the run (exit 2), naming the file.
  append_file(path_, e.dump() + "\n",
              "the run stopped: free space (or raise the file size limit) and run the same command again, which "
              "continues from the job's latest checkpoint if it has one");
  if (tensorboard_) tensorboard_->add_scalars(e.value("step", int64_t(0)), scalars_of(e));
}

void MetricsLog::truncate_after(int64_t step) const {
  if (tensorboard_) tensorboard_->truncate_after(step);
  if (!writer_ || !fs::exists(path_)) return;
  // The lines of steps up to `step`, as they were. A line that is not a JSON object is damaged: its step
  // is unknown, so it is dropped, said (but for a torn last line, what a kill leaves), and the lines
  // after it are kept.
  const std::string text = read_file(path_);
  std::string kept;
  size_t at = 0;
  for (int64_t line_no = 1; at < text.size(); ++line_no) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json e = json::parse(line, nullptr, false);
    if (e.is_object() && (!e.contains("step") || e["step"].is_number_integer())) {
      if (e.value("step", int64_t(0)) <= step) kept += line + "\n";
    } else if (end < text.size()) {
      std::printf("warning: %s: dropped line %lld (%zu bytes), which is damaged: not a JSON object with an integer step; "
                  "the lines after it are kept\n", path_.c_str(), static_cast<long long>(line_no), line.size());
    }
  }
  write_file_atomic(path_, kept);
}

void MetricsLog::log_train(const StepLine& l, StepWindow& window, int64_t tokens_per_step) const {
  const double mean_loss = window.loss / window.steps;
  const double tok_per_s = window.steps * tokens_per_step / std::max(1e-9, window.seconds);
  window = StepWindow();
  std::string extra;
  json others = l.extra;
  if (l.extra.contains(DpoFigures::kRewardMargin)) {  // DPO's figures (recipes/dpo_part.cpp), as DpoFigures prints them
    extra = DpoFigures::from_json(l.extra).step_text();
    const json keys = DpoFigures().step_json();  // named: items() of a temporary would dangle in the loop
    for (const auto& k : keys.items()) others.erase(k.key());
  }
  for (const auto& [name, v] : others.items()) {
    char buf[96];
    std::snprintf(buf, sizeof buf, " | %s %.4f", name.c_str(), v.get<double>());
    extra += buf;
  }
  std::printf("step %6lld/%lld | tokens %10lld | loss %.4f | lr %.2e | grad %.3f%s | %.0f tok/s\n", (long long)l.step,
              (long long)l.total_steps, (long long)l.tokens, mean_loss, l.lr, l.grad_norm, extra.c_str(), tok_per_s);
  std::fflush(stdout);
  json e = {{"event", "train"}, {"step", l.step}, {"tokens", l.tokens}, {"loss", mean_loss}, {"lr", l.lr},
            {"grad_norm", l.grad_norm}, {"tok_per_s", tok_per_s}, {"stage", l.stage}};
  e.update(l.extra);
  event(e);
}

void MetricsLog::log_validation(int64_t step, int64_t tokens, int stage, const ValResult& v, bool stage_end) const {
  std::string per;
  json per_json = json::object(), ppl_json = json::object(), dpo_json = json::object(), rewards_json = json::object();
  for (const auto& e : v.per_dataset) {
    per_json[e.name] = e.loss;
    if (e.style == DatasetStyle::CONTRASTIVE) {  // DPO's figures: no perplexity
      per += e.dpo.validation_text(e.name);
      e.dpo.add_to_val_event(dpo_json, e.name);
    } else if (e.style == DatasetStyle::PROMPTS) {  // GRPO's rewards of greedy completions
      per += " " + e.name;
      for (const auto& [k, v] : e.figures.items()) {
        char buf[160];
        std::snprintf(buf, sizeof buf, " %s %.4f", k.c_str(), v.is_number() ? v.get<double>() : NAN);
        per += buf;
        rewards_json[e.name][k] = v;
      }
    } else {
      char buf[160];
      std::snprintf(buf, sizeof buf, " %s %.4f (ppl %.1f)", e.name.c_str(), e.loss, std::exp(e.loss));
      ppl_json[e.name] = std::exp(e.loss);
      per += buf;
    }
  }
  json task_accuracy = json::object(), task_accuracy_norm = json::object(), task_exact_match = json::object();
  for (const auto& t : v.tasks) {
    char buf[200];
    if (t.generation) {
      std::snprintf(buf, sizeof buf, " | task %s exact match %.3f", t.name.c_str(), t.exact_match);
      task_exact_match[t.name] = t.exact_match;
    } else {
      std::snprintf(buf, sizeof buf, " | task %s accuracy %.3f (norm %.3f)", t.name.c_str(), t.accuracy, t.accuracy_norm);
      task_accuracy[t.name] = t.accuracy;
      task_accuracy_norm[t.name] = t.accuracy_norm;
    }
    per += buf;
  }
  std::printf("  validation at step %lld (stage %d): loss %.4f |%s\n", (long long)step, stage, v.loss, per.c_str());
  std::fflush(stdout);
  json ev = {{"event", "val"}, {"step", step}, {"tokens", tokens}, {"stage", stage}, {"loss", v.loss},
             {"per_dataset", per_json}, {"perplexity", ppl_json}, {"stage_end", stage_end}};
  ev.update(dpo_json);  // reward_margin and accuracy by dataset, when there are preference pairs
  if (!rewards_json.empty()) ev["rewards"] = rewards_json;  // GRPO's figures by prompts dataset
  if (!task_accuracy.empty()) {
    ev["task_accuracy"] = task_accuracy;
    ev["task_accuracy_norm"] = task_accuracy_norm;
  }
  if (!task_exact_match.empty()) ev["task_exact_match"] = task_exact_match;
  event(ev);
}

}  // namespace lt
