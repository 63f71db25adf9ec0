// The report of a finished LoRA job (lora_report.hpp), from its run's metrics.jsonl.
#include "lora_trainer/training/lora_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/training/dpo_figures.hpp"
#include "lora_trainer/training/report.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {

// What the report reads from a run's metrics.jsonl.
struct RunEvents {
  double tps[2] = {0, 0};  // the step lines' tokens/s summed, per phase (0: full, 1: LoRA), and their count
  int n_tps[2] = {0, 0};
  const json* before = nullptr;      // the last validation at or before the boundary
  const json* after = nullptr;       // the last validation
  const json* transition = nullptr;  // the transition event
  const json* first_dpo = nullptr;   // the first and last phase-2 step lines with DPO's figures
  const json* last_dpo = nullptr;
  const json* first_grpo = nullptr;  // and with GRPO's (their rollouts' rewards)
  const json* last_grpo = nullptr;
};

RunEvents scan(const std::vector<json>& metrics, int64_t boundary_step) {
  RunEvents r;
  for (const auto& e : metrics) {
    std::string ev = e.value("event", std::string());
    int64_t step = e.value("step", int64_t(0));
    if (ev == "train") {
      int phase = step > boundary_step ? 1 : 0;
      r.tps[phase] += e.value("tok_per_s", 0.0);
      ++r.n_tps[phase];
      if (phase == 1 && e.contains(DpoFigures::kRewardMargin)) {
        if (!r.first_dpo) r.first_dpo = &e;
        r.last_dpo = &e;
      }
      if (phase == 1 && e.contains("rollout_tok_per_s")) {
        if (!r.first_grpo) r.first_grpo = &e;
        r.last_grpo = &e;
      }
    } else if (ev == "val") {
      if (step <= boundary_step) r.before = &e;
      r.after = &e;
    } else if (ev == "transition") {
      r.transition = &e;
    }
  }
  return r;
}

// "parameters in phase 2: ..." from the transition event.
std::string parameters_text(const json& transition) {
  std::ostringstream r;
  char line[256];
  int64_t tr = transition.value("trainable_params", int64_t(0)), fr = transition.value("frozen_params", int64_t(0));
  const int64_t sv = transition.value("saved_params", int64_t(0)), tk = transition.value("token_params", int64_t(0));
  std::snprintf(line, sizeof line, "parameters in phase 2: %lld trainable (%.2f%%: %lld in adapters", (long long)tr,
                100.0 * tr / std::max<int64_t>(1, tr + fr), (long long)(tr - sv - tk));
  r << line;
  if (sv > 0) {
    std::vector<std::string> names = transition.value("modules_to_save", std::vector<std::string>());
    r << " + " << sv << " in the modules_to_save: " << join(names);
  }
  const json token_rows = transition.value("trainable_tokens", json::object());
  if (tk > 0)
    for (auto& [name, ids] : token_rows.items())
      r << " + " << tk << " in the trainable token rows of " << name << ": " << ids.dump();
  const int64_t quantized = transition.value("quantized_params", int64_t(0));
  if (quantized > 0)
    std::snprintf(line, sizeof line, "), %lld frozen (%lld of them %s: a %.3f GB base)\n", (long long)fr, (long long)quantized,
                  transition.value("quantized_as", std::string("NF4")).c_str(),  // NF4 in events before the storage registry
                  transition.value("frozen_bytes", int64_t(0)) / 1e9);
  else
    std::snprintf(line, sizeof line, "), %lld frozen (bf16 base)\n", (long long)fr);
  r << line;
  return r.str();
}

std::string label(const char* what, const json* e) {
  return std::string(what) + " (step " + std::to_string(e->value("step", 0)) + ")";
}

// Perplexity, one column per text dataset measured before or after LoRA (as wide as its name, at least
// 10), numbers right-aligned under it; "-" where a validation did not measure it (without
// eval/evaluations "perplexity" it measures only the stage just trained). "" when none was measured.
std::string perplexity_table(const json* before, const json* after, bool with_before) {
  std::vector<std::pair<std::string, int>> cols;
  for (const json* e : {before, after}) {
    if (!e || !e->contains("perplexity")) continue;
    for (auto& [name, ppl] : (*e)["perplexity"].items())
      if (std::none_of(cols.begin(), cols.end(), [&](const auto& c) { return c.first == name; }))
        cols.emplace_back(name, std::max<int>(10, static_cast<int>(name.size())));
  }
  if (cols.empty()) return "";
  std::ostringstream r;
  char line[256];
  std::snprintf(line, sizeof line, "%-28s", "validation perplexity");
  r << line;
  for (const auto& [name, w] : cols) {
    std::snprintf(line, sizeof line, "  %*s", w, name.c_str());
    r << line;
  }
  r << "\n";
  auto row = [&](const char* what, const json* e) {
    if (!e || !e->contains("perplexity") || (*e)["perplexity"].empty()) return;
    std::snprintf(line, sizeof line, "  %-26s", label(what, e).c_str());
    r << line;
    for (const auto& [name, w] : cols) {
      const json& p = (*e)["perplexity"];
      if (p.contains(name)) std::snprintf(line, sizeof line, "  %*.1f", w, metric_value(p[name]));
      else std::snprintf(line, sizeof line, "  %*s", w, "-");
      r << line;
    }
    r << "\n";
  };
  if (with_before) row("before LoRA", before);
  row("after LoRA", after);
  return r.str();
}

// Preference pairs (dpo/train, or lora/train's phase 2): the val events' DPO loss, margin and accuracy;
// before LoRA (with eval/evaluations "perplexity") the model is its reference: log 2, 0, 0. Then the
// step lines' figures (averages over the steps since the line before), first and last.
std::string dpo_text(const RunEvents& ev) {
  std::ostringstream r;
  auto has_dpo = [](const json* e) { return e && DpoFigures::in_val_event(*e); };
  if (has_dpo(ev.after)) {
    r << DpoFigures::report_header();
    for (auto& [name, unused] : (*ev.after)[DpoFigures::kRewardMargin].items())
      for (const auto& [what, e] : {std::pair<const char*, const json*>{"before LoRA", ev.before}, {"after LoRA", ev.after}}) {
        if (!has_dpo(e) || !(*e)[DpoFigures::kRewardMargin].contains(name)) continue;
        r << DpoFigures::from_val_event(*e, name).report_row(name + ", " + label(what, e));
      }
  }
  if (ev.first_dpo && ev.last_dpo) {
    const json &a = *ev.first_dpo, &b = *ev.last_dpo;
    r << DpoFigures::report_steps_line(a.value("step", int64_t(0)), DpoFigures::from_step_json(a),
                                       b.value("step", int64_t(0)), DpoFigures::from_step_json(b));
  }
  return r.str();
}

// Task figures (eval/evaluations "task:FILE") at the last validation before LoRA and the last one, a
// line each: "task NAME accuracy" (and "acc_norm") or "task NAME exact match". "" when none were measured.
std::string tasks_table(const json* before, const json* after, bool with_before) {
  std::ostringstream r;
  char line[256];
  const std::vector<std::pair<const char*, const char*>> figures = {
      {"task_accuracy", "accuracy"}, {"task_accuracy_norm", "acc_norm"}, {"task_exact_match", "exact match"}};
  for (const auto& [key, what] : figures) {
    if (!after || !after->contains(key)) continue;
    for (auto& [name, unused] : (*after)[key].items()) {
      std::snprintf(line, sizeof line, "task %s %s:", name.c_str(), what);
      r << line;
      if (with_before && before && before->contains(key) && (*before)[key].contains(name)) {
        std::snprintf(line, sizeof line, " %.3f %s ->", metric_value((*before)[key][name]), label("before LoRA", before).c_str());
        r << line;
      }
      std::snprintf(line, sizeof line, " %.3f %s\n", metric_value((*after)[key][name]), label("after LoRA", after).c_str());
      r << line;
    }
  }
  return r.str();
}

// Prompts (GRPO): each figure of the val events' "rewards" (a greedy completion of each held-out prompt)
// at the last validation before LoRA and the last one; then the step lines' mean reward of the rollouts,
// first and last. "" when there are no prompts.
std::string rewards_text(const RunEvents& ev, bool with_before) {
  std::ostringstream r;
  char line[256];
  if (ev.after && ev.after->contains("rewards"))
    for (auto& [name, figures] : (*ev.after)["rewards"].items())
      for (auto& [what, value] : figures.items()) {
        std::snprintf(line, sizeof line, "prompts %s %s (greedy):", name.c_str(), what.c_str());
        r << line;
        const json* b = ev.before;
        if (with_before && b && b->contains("rewards") && (*b)["rewards"].contains(name) && (*b)["rewards"][name].contains(what)) {
          std::snprintf(line, sizeof line, " %.3f %s ->", metric_value((*b)["rewards"][name][what]), label("before LoRA", b).c_str());
          r << line;
        }
        std::snprintf(line, sizeof line, " %.3f %s\n", metric_value(value), label("after LoRA", ev.after).c_str());
        r << line;
      }
  if (ev.first_grpo && ev.last_grpo) {
    std::snprintf(line, sizeof line, "GRPO rollouts' mean reward: %.3f (step %lld) -> %.3f (step %lld)\n",
                  metric_value((*ev.first_grpo)["reward"]), (long long)ev.first_grpo->value("step", int64_t(0)),
                  metric_value((*ev.last_grpo)["reward"]), (long long)ev.last_grpo->value("step", int64_t(0)));
    r << line;
  }
  return r.str();
}

}  // namespace

// The two phases' lines: their steps, tokens and speed (phase 1: skipped, with where the base came from).
static std::string phases_text(const LoraReportFacts& f, const double tps[2], const int n_tps[2]) {
  std::ostringstream r;
  char line[256];
  if (f.boundary_step == 0) {
    r << f.skipped_phase_one;
  } else {
    // Phase 1 may have run in another run (this one restored past it): then there is no speed to report.
    std::snprintf(line, sizeof line, "phase 1 (full parameters): steps 1-%lld, %lld tokens, ", (long long)f.boundary_step,
                  (long long)(f.boundary_step * f.tokens_per_step));
    r << line;
    if (n_tps[0] == 0) {
      r << "not run by this run (restored from a later checkpoint)\n";
    } else {
      std::snprintf(line, sizeof line, "%.0f tok/s\n", tps[0] / n_tps[0]);
      r << line;
    }
  }
  std::snprintf(line, sizeof line, "phase 2 (LoRA): steps %lld-%lld, %lld tokens, %.0f tok/s\n", (long long)f.boundary_step + 1,
                (long long)f.total_steps, (long long)((f.total_steps - f.boundary_step) * f.tokens_per_step),
                n_tps[1] ? tps[1] / n_tps[1] : 0.0);
  r << line;
  return r.str();
}

std::string write_lora_report(const LoraReportFacts& f) {
  auto metrics = read_metrics(f.run_dir);
  const RunEvents ev = scan(metrics, f.boundary_step);
  if (ev.n_tps[0] + ev.n_tps[1] == 0) return "";
  std::string svg = (fs::path(f.run_dir) / "loss.svg").string();
  write_loss_plot(metrics, {{f.boundary_step, "LoRA from here"}}, "job " + f.job + ": loss", svg);

  std::ostringstream r;
  r << "\n== report: job " << f.job << " (" << f.kind << ") ==\n";
  r << phases_text(f, ev.tps, ev.n_tps);
  if (ev.transition) r << parameters_text(*ev.transition);
  r << perplexity_table(ev.before, ev.after, f.boundary_step > 0);
  r << tasks_table(ev.before, ev.after, f.boundary_step > 0);
  r << dpo_text(ev);
  r << rewards_text(ev, f.boundary_step > 0);
  if (!ev.before && !ev.after) r << "validation: none recorded (training/validation is off)\n";
  r << "unigram baseline perplexity (validation under the training split's token frequencies):";
  char line[256];
  for (const auto& [name, ppl] : f.unigram_perplexity) {
    std::snprintf(line, sizeof line, "  %s %.1f", name.c_str(), ppl);
    r << line;
  }
  r << "\ncheckpoints: " << f.job_dir << "\n";
  r << "metrics: " << (fs::path(f.run_dir) / "metrics.jsonl").string() << "\nplot: " << svg << "\n";
  write_file_atomic((fs::path(f.run_dir) / "report.md").string(), r.str());
  return r.str();
}

}  // namespace lt
