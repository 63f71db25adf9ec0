#include "lora_trainer/recipes/continual.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/report.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

static const OptionGroup<ContinualOptions>& continual_options() {
  using O = ContinualOptions;
  static const auto g =
      OptionGroup<O>()
          .add("training/fade/overlap", OptType::Int, 0,
               "tokens before each stage boundary over which batches fade from the old stage's data to the new; 0 = none",
               &O::fade_overlap, check_nonnegative())
          .add("training/fade/curve", OptType::String, "linear", "fade curve: linear, cosine or sigmoid",
               [](O& o, const json& v) { o.fade_curve = parse_fade_curve(v.get<std::string>()); },
               check_one_of(fade_curve_names()))
          .add("training/reset_optimizer", OptType::Bool, false, "reset the optimizer's moments at every stage boundary",
               &O::reset_optimizer)
          .add("eval/boundary_rows", OptType::Int, 32, "held-out rows per dataset for the forgetting matrix",
               &O::boundary_rows, check_positive());
  return g;
}

void add_continual_options(ConfigSchema& s) { continual_options().declare(s); }

ContinualOptions ContinualOptions::from_config(const Config& cfg) { return continual_options().read(cfg); }

const std::vector<std::string>& fade_curve_names() {
  static const std::vector<std::string> names = {"linear", "cosine", "sigmoid"};  // in FadeCurve's order
  return names;
}

FadeCurve parse_fade_curve(const std::string& name) {
  return enum_named<FadeCurve>(fade_curve_names(), name, "training/fade/curve");
}

double fade_curve(double p, FadeCurve curve) {
  p = std::min(1.0, std::max(0.0, p));
  if (curve == FadeCurve::Cosine) return 0.5 * (1.0 - std::cos(M_PI * p));
  if (curve == FadeCurve::Sigmoid) {
    // A logistic of slope 12 centred at 1/2, rescaled so that 0 -> 0 and 1 -> 1.
    auto f = [](double x) { return 1.0 / (1.0 + std::exp(-12.0 * (x - 0.5))); };
    return (f(p) - f(0.0)) / (f(1.0) - f(0.0));
  }
  return p;
}

FadeAt fade_at(const std::vector<Stage>& stages, int64_t step, int64_t overlap_steps, FadeCurve curve,
               int no_fade_after_stage) {
  FadeAt f;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (step >= stages[i].end_step) continue;
    f.from = f.to = static_cast<int>(i);
    if (overlap_steps <= 0 || i + 1 == stages.size() || static_cast<int>(i) == no_fade_after_stage) return f;
    int64_t n = std::min(overlap_steps, stages[i].end_step - stages[i].first_step);
    int64_t k = step - (stages[i].end_step - n) + 1;  // 1..n inside the window
    if (k >= 1) {
      f.to = static_cast<int>(i) + 1;
      f.weight = fade_curve(static_cast<double>(k) / static_cast<double>(n + 1), curve);
    }
    return f;
  }
  f.from = f.to = static_cast<int>(stages.size()) - 1;
  return f;
}

static TrainingPlan benchmark_plan(const Config& cfg) {
  TrainingPlan plan = TrainingPlan::from_stage_lists_config(cfg);
  if (plan.stages.tokens.empty()) throw UserError("training/tokens is empty: a benchmark needs at least one stage");
  return plan;
}

ConfigSchema continual_schema() {
  ConfigSchema s = Trainer::schema();
  s.add("job/kind", OptType::String, "continual/train/benchmark", "the registered job class that runs this config");
  add_stage_lists_plan_options(s);  // training/tokens and training/dataset as lists, one stage each
  add_continual_options(s);
  return s;
}

ConfigSchema continual_lora_schema() {
  ConfigSchema s = Trainer::lora_schema();
  s.add("job/kind", OptType::String, "continual/train/benchmark_lora", "the registered job class that runs this config");
  add_continual_options(s);
  return s;
}

std::unique_ptr<Trainer> make_continual(JobSpec spec, Config cfg, std::string out_dir) {
  const TrainingPlan plan = benchmark_plan(cfg);
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), plan);
  t->add_part(std::make_unique<ContinualPart>(*t, ContinualOptions::from_config(cfg), -1));
  return t;
}

std::unique_ptr<Trainer> make_continual_lora(JobSpec spec, Config cfg, std::string out_dir) {
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), TrainingPlan::from_lora_config(cfg));
  const int64_t boundary = t->boundary_step();
  t->add_part(std::make_unique<ContinualPart>(*t, ContinualOptions::from_config(cfg), boundary > 0 ? t->data().stage_of(boundary - 1) : -1));
  return t;
}

ContinualPart::ContinualPart(Trainer& trainer, ContinualOptions options, int lora_switch_stage)
    : trainer_(trainer),
      continual_(std::move(options)),
      lora_switch_stage_(lora_switch_stage),
      overlap_steps_(continual_.fade_overlap / trainer.tokens_per_step()) {}

void ContinualPart::plan(std::vector<Phase>& phases) {
  for (Phase& phase : phases) phase.batches = &fades_;
}

Batch ContinualPart::Fades::next_share(int64_t first, int64_t count) {
  Trainer& t = part_.trainer_;
  const int64_t batch = t.batch_size();
  FadeAt f = fade_at(t.data().stages(), t.step(), part_.overlap_steps_, part_.continual_.fade_curve, part_.lora_switch_stage_);
  if (f.weight <= 0.0) return t.data().sampler(f.from, t.step()).next_share(batch, first, count);
  // The global batch is the old stage's rows then the new stage's; this rank takes [first, first + count).
  auto rows = largest_remainder({1.0 - f.weight, f.weight}, batch);
  const int64_t end = first + count;
  const int64_t old_first = std::min(first, rows[0]), old_end = std::min(end, rows[0]);
  const int64_t new_first = std::max(first, rows[0]) - rows[0], new_end = std::max(end, rows[0]) - rows[0];
  Batch old_rows = t.data().sampler(f.from, t.step()).next_share(rows[0], old_first, old_end - old_first);
  Batch new_rows = t.data().sampler(f.to, t.step()).next_share(rows[1], new_first, new_end - new_first);
  return concat_rows(old_rows, new_rows);
}

void ContinualPart::on_stage_end(int stage) {
  Trainer& t = trainer_;
  auto evals = t.evaluate(t.data().datasets(), continual_.boundary_rows);
  json losses = json::object();
  for (const auto& e : evals) losses[e.name] = e.loss;
  matrix_.push_back({{"after_stage", stage}, {"step", t.step()}, {"loss", losses}});
  t.log_event({{"event", "boundary"}, {"step", t.step()}, {"tokens", t.tokens()}, {"after_stage", stage}, {"loss", losses}});
  const bool last = stage + 1 == static_cast<int>(t.data().stages().size());
  // Reset before the boundary checkpoint, so that a run resumed from it starts the next stage as the
  // uninterrupted run does.
  if (continual_.reset_optimizer && !last) t.reset_optimizer();
  std::string label = std::to_string(stage) + "_" + (last ? std::string("end") : std::to_string(stage + 1));
  std::string suffix = (!last && stage == lora_switch_stage_ ? "lora_boundary_" : "boundary_") + label;
  t.save(suffix);
  std::printf("  stage %d done at step %lld: held-out loss%s; saved %s\n", stage, (long long)t.step(),
              [&] {
                std::string s;
                char v[32];
                for (const auto& e : evals) {
                  std::snprintf(v, sizeof v, " %.4f", e.loss);  // as the forgetting table rounds it
                  s += " " + e.name + v;
                }
                return s;
              }().c_str(),
              suffix.c_str());
  std::fflush(stdout);
}

void ContinualPart::add_metadata(json& meta) const { meta["forgetting"] = matrix_; }

void ContinualPart::restored(const CheckpointMeta& ck) {
  const bool full_restore = trainer_.step() == ck.step && !ck.weights_only;
  matrix_ = full_restore ? ck.raw.value("forgetting", json::array()) : json::array();
}

std::string ContinualPart::forgetting_table() const {
  std::ostringstream t;
  std::vector<std::string> names;
  for (const auto& s : trainer_.data().datasets()) names.push_back(s.name);
  char cell[64];
  std::snprintf(cell, sizeof cell, "%-22s", "held-out loss after");
  t << cell;
  for (const auto& n : names) {
    std::snprintf(cell, sizeof cell, " %12s", n.c_str());
    t << cell;
  }
  t << "\n";
  for (const auto& row : matrix_) {
    std::string label = "stage " + std::to_string(row["after_stage"].get<int>()) + " (step " +
                        std::to_string(row["step"].get<int64_t>()) + ")";
    std::snprintf(cell, sizeof cell, "%-22s", label.c_str());
    t << cell;
    for (const auto& n : names) {
      std::snprintf(cell, sizeof cell, " %12.4f", row["loss"].contains(n) ? metric_value(row["loss"][n]) : std::nan(""));
      t << cell;
    }
    t << "\n";
  }
  return t.str();
}

void ContinualPart::after_run() {
  if (matrix_.empty()) return;
  const Trainer& t = trainer_;
  std::vector<PlotMarker> markers;
  for (const auto& row : matrix_) {
    int stage = row["after_stage"].get<int>();
    if (stage + 1 < static_cast<int>(t.data().stages().size()))
      markers.push_back({row["step"].get<int64_t>(),
                         (stage == lora_switch_stage_ ? "LoRA, stage " : "stage ") + std::to_string(stage + 1)});
  }
  const std::string& name = t.spec().name;
  const fs::path dir = t.run_dir();
  // Over the trainer's loss.svg (the phase boundary only): every stage boundary marked.
  write_loss_plot(read_metrics(t.run_dir()), markers, "job " + name + ": loss", (dir / "loss.svg").string());
  write_matrix_plot(matrix_, "job " + name + ": held-out loss after each stage", (dir / "forgetting.svg").string());
  std::string table = forgetting_table();
  write_file_atomic((dir / "forgetting.txt").string(), table);
  std::printf("\nforgetting matrix (rows: trained through stage; columns: dataset evaluated)\n%s"
              "plots: %s/loss.svg, %s/forgetting.svg\n",
              table.c_str(), t.run_dir().c_str(), t.run_dir().c_str());
  std::fflush(stdout);
}

}  // namespace lt
