// LoRATrainer's report of a finished job (report.md and loss.svg in the run directory): per-phase speed,
// parameter counts, validation perplexity per dataset before and after the LoRA phase, DPO's figures.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/training/lora_trainer.hpp"
#include "lora_trainer/training/report.hpp"

namespace fs = std::filesystem;

namespace lt {

void LoRATrainer::report_finished() {
  std::string text = report();
  if (text.empty()) {  // no training was logged under this name (e.g. `restore` of a finished job)
    std::printf("no report: no training steps were logged in %s (the report of the run that trained this job is in "
                "that run's directory)\n", run_dir().c_str());
    return;
  }
  std::printf("%s", text.c_str());
  std::fflush(stdout);
}

std::string LoRATrainer::report() {
  auto metrics = read_metrics(run_dir());
  double tps[2] = {0, 0};
  int n_tps[2] = {0, 0};
  const json* before = nullptr;
  const json* after = nullptr;
  const json* transition = nullptr;
  const json* first_dpo = nullptr;  // the first and last phase-2 step lines with DPO's figures
  const json* last_dpo = nullptr;
  for (const auto& e : metrics) {
    std::string ev = e.value("event", std::string());
    int64_t step = e.value("step", int64_t(0));
    if (ev == "train") {
      int phase = step > boundary_step_ ? 1 : 0;
      tps[phase] += e.value("tok_per_s", 0.0);
      ++n_tps[phase];
      if (phase == 1 && e.contains("reward_margin")) {
        if (!first_dpo) first_dpo = &e;
        last_dpo = &e;
      }
    } else if (ev == "val") {
      if (step <= boundary_step_) before = &e;
      after = &e;
    } else if (ev == "transition") {
      transition = &e;
    }
  }
  if (n_tps[0] + n_tps[1] == 0) return "";
  std::string svg = (fs::path(run_dir()) / "loss.svg").string();
  write_loss_plot(metrics, {{boundary_step_, "LoRA from here"}}, "job " + spec_.name + ": loss", svg);

  std::ostringstream r;
  char line[256];
  r << "\n== report: job " << spec_.name << " (" << spec_.kind << ") ==\n";
  if (boundary_step_ == 0) {
    if (base_.is_object())
      r << "phase 1: skipped; the frozen base is " << base_.value("path", std::string("?")) << " (job "
        << base_.value("job", std::string("?")) << ", step " << base_.value("step", int64_t(0)) << ")\n";
    else
      r << "phase 1: skipped; the base is randomly initialised (training/allow_random_base)\n";
  } else {
    // Phase 1 may have run in another run (this one restored past it): then there is no speed to report.
    std::snprintf(line, sizeof line, "phase 1 (full parameters): steps 1-%lld, %lld tokens, ", (long long)boundary_step_,
                  (long long)(boundary_step_ * tokens_per_step()));
    r << line;
    if (n_tps[0] == 0) {
      r << "not run by this run (restored from a later checkpoint)\n";
    } else {
      std::snprintf(line, sizeof line, "%.0f tok/s\n", tps[0] / n_tps[0]);
      r << line;
    }
  }
  std::snprintf(line, sizeof line, "phase 2 (LoRA): steps %lld-%lld, %lld tokens, %.0f tok/s\n", (long long)boundary_step_ + 1,
                (long long)total_steps_, (long long)((total_steps_ - boundary_step_) * tokens_per_step()),
                n_tps[1] ? tps[1] / n_tps[1] : 0.0);
  r << line;
  if (transition) {
    int64_t tr = transition->value("trainable_params", int64_t(0)), fr = transition->value("frozen_params", int64_t(0));
    const int64_t sv = transition->value("saved_params", int64_t(0)), tk = transition->value("token_params", int64_t(0));
    std::snprintf(line, sizeof line, "parameters in phase 2: %lld trainable (%.2f%%: %lld in adapters", (long long)tr,
                  100.0 * tr / std::max<int64_t>(1, tr + fr), (long long)(tr - sv - tk));
    r << line;
    if (sv > 0) {
      std::vector<std::string> names = transition->value("modules_to_save", std::vector<std::string>());
      r << " + " << sv << " in the modules_to_save: " << join(names);
    }
    const json token_rows = transition->value("trainable_tokens", json::object());
    if (tk > 0)
      for (auto& [name, ids] : token_rows.items())
        r << " + " << tk << " in the trainable token rows of " << name << ": " << ids.dump();
    std::snprintf(line, sizeof line, "), %lld frozen (bf16 base)\n", (long long)fr);
    r << line;
  }
  // Perplexity, one column per text dataset measured before or after LoRA (as wide as its name, at least
  // 10), numbers right-aligned under it; "-" where a validation did not measure it (without
  // eval/evaluations "perplexity" it measures only the stage just trained).
  std::vector<std::pair<std::string, int>> cols;
  for (const json* e : {before, after}) {
    if (!e || !e->contains("perplexity")) continue;
    for (auto& [name, ppl] : (*e)["perplexity"].items())
      if (std::none_of(cols.begin(), cols.end(), [&](const auto& c) { return c.first == name; }))
        cols.emplace_back(name, std::max<int>(10, static_cast<int>(name.size())));
  }
  auto label = [](const char* what, const json* e) {
    return std::string(what) + " (step " + std::to_string(e->value("step", 0)) + ")";
  };
  if (!cols.empty()) {
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
    if (boundary_step_ > 0) row("before LoRA", before);
    row("after LoRA", after);
  }
  // Preference pairs (dpo/train, or lora/train's phase 2): the val events' DPO loss, margin and accuracy;
  // before LoRA (with eval/evaluations "perplexity") the model is its reference: log 2, 0, 0.
  auto has_dpo = [](const json* e) { return e && e->contains("reward_margin") && !(*e)["reward_margin"].empty(); };
  if (has_dpo(after)) {
    std::snprintf(line, sizeof line, "%-36s  %10s  %13s  %8s\n", "validation DPO", "dpo loss", "reward margin", "accuracy");
    r << line;
    for (auto& [name, unused] : (*after)["reward_margin"].items())
      for (const auto& [what, e] : {std::pair<const char*, const json*>{"before LoRA", before}, {"after LoRA", after}}) {
        if (!has_dpo(e) || !(*e)["reward_margin"].contains(name)) continue;
        std::snprintf(line, sizeof line, "  %-34s  %10.4f  %13.4f  %8.3f\n", (name + ", " + label(what, e)).c_str(),
                      metric_value((*e)["per_dataset"].value(name, json())), metric_value((*e)["reward_margin"][name]),
                      metric_value((*e)["accuracy"].value(name, json())));
        r << line;
      }
  }
  if (first_dpo && last_dpo) {  // the step lines' figures: averages over the steps since the line before
    std::snprintf(line, sizeof line,
                  "DPO steps (step lines %lld -> %lld): loss %.4f -> %.4f, reward margin %.4f -> %.4f, accuracy %.3f -> "
                  "%.3f\n",
                  (long long)first_dpo->value("step", int64_t(0)), (long long)last_dpo->value("step", int64_t(0)),
                  first_dpo->value("loss", 0.0), last_dpo->value("loss", 0.0), first_dpo->value("reward_margin", 0.0),
                  last_dpo->value("reward_margin", 0.0), first_dpo->value("accuracy", 0.0),
                  last_dpo->value("accuracy", 0.0));
    r << line;
  }
  if (!before && !after) r << "validation: none recorded (training/validation is off)\n";
  r << "unigram baseline perplexity (validation under the training split's token frequencies):";
  for (const auto& smp : plan_datasets()) {
    if (smp.style != DatasetStyle::PMD) continue;
    const auto& ds = dynamic_cast<const PmdDataset&>(catalog_->get(smp));
    std::snprintf(line, sizeof line, "  %s %.1f", smp.name.c_str(), std::exp(unigram_val_loss(ds, model_->options().vocab_size)));
    r << line;
  }
  r << "\ncheckpoints: " << job_dir() << "\n";
  r << "metrics: " << (fs::path(run_dir()) / "metrics.jsonl").string() << "\nplot: " << svg << "\n";
  write_file_atomic((fs::path(run_dir()) / "report.md").string(), r.str());
  return r.str();
}

}  // namespace lt
