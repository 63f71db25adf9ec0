// `lora_trainer eval CHECKPOINT [--dataset NAME ...] [--task FILE ...] [--rows N] [--json] [key=value ...]`:
// held-out loss and perplexity (DPO's figures for preference pairs) of a checkpoint on its job's datasets
// or on others, and its accuracy on task files (training/tasks.hpp).
#include <cmath>
#include <cstdio>
#include <iostream>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {
namespace {

nlohmann::json per_example_json(const std::vector<TaskResult>& results, const std::vector<std::string>& paths) {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const TaskResult& r = results[i];
    nlohmann::json examples = nlohmann::json::array();
    for (const auto& x : r.per_example) {
      nlohmann::json e = {{"correct", x.correct}};
      if (r.generation) {
        e["generated"] = x.generated;
      } else {
        e["predicted"] = x.predicted;
        e["predicted_norm"] = x.predicted_norm;
        e["correct_norm"] = x.correct_norm;
        for (const auto& c : x.choices)
          e["choices"].push_back({{"context", c.tokens.context}, {"continuation", c.tokens.continuation},
                                  {"logprobs", c.logprobs}, {"loglikelihood", c.loglikelihood}});
      }
      examples.push_back(e);
    }
    out.push_back({{"task", r.name}, {"file", paths[i]}, {"generation", r.generation}, {"examples", examples},
                   {"accuracy", r.accuracy}, {"accuracy_norm", r.accuracy_norm}, {"exact_match", r.exact_match}});
  }
  return out;
}

struct EvalArgs {
  std::string checkpoint;
  std::vector<std::string> datasets, tasks;
  std::string tokenizer = "auto", per_example;
  int64_t rows = 0;
  bool json = false;
  std::vector<std::string> overrides;
};

int eval(const EvalArgs& a) {
  Trainer* t = nullptr;
  auto job = load_for_reading(a.checkpoint, a.overrides, &t);
  // The tasks and their tokenizer first: a bad file or an unknown tokenizer is said before any measuring.
  std::vector<Task> read;
  for (const auto& path : a.tasks) read.push_back(read_task(path));
  const std::string tokenizer = read.empty() ? "" : a.tokenizer == "auto" ? t->tokenizer_name("eval") : a.tokenizer;
  std::unique_ptr<Tokenizer> tok = read.empty() ? nullptr : make_tokenizer(tokenizer);
  std::vector<Sampling> datasets;
  // With --task alone, the tasks alone; else the datasets given, or every dataset of the job.
  if (a.datasets.empty() && a.tasks.empty()) datasets = t->data().datasets();
  for (const auto& n : a.datasets) datasets.push_back(parse_dataset_spec(n));
  std::vector<DatasetEval> results;
  if (!datasets.empty()) results = t->evaluate(datasets, a.rows > 0 ? a.rows : t->options().validation_steps);
  std::vector<TaskResult> tasks;
  if (!read.empty()) {
    auto ema = t->ema_weights();
    for (const auto& task : read) tasks.push_back(run_task(t->model(), t->runtime(), *tok, task));
  }
  nlohmann::json out = {{"checkpoint", a.checkpoint}, {"step", t->step()}, {"kind", state_kind_name(t->state_kind())}};
  for (const auto& r : tasks)
    out["tasks"][r.name] = r.generation ? nlohmann::json{{"exact_match", r.exact_match}, {"examples", r.examples}}
                                        : nlohmann::json{{"accuracy", r.accuracy}, {"accuracy_norm", r.accuracy_norm},
                                                         {"examples", r.examples}};
  if (!tasks.empty()) out["tokenizer"] = tokenizer;
  if (!a.per_example.empty()) write_file_atomic(a.per_example, per_example_json(tasks, a.tasks).dump() + "\n");
  for (const auto& e : results) {
    nlohmann::json& d = out["datasets"][e.name];
    if (e.style == DatasetStyle::CONTRASTIVE) d = e.dpo.to_json();  // preference pairs: DPO's figures
    else if (e.style == DatasetStyle::PROMPTS) d = e.figures, d["prompts"] = e.tokens;  // GRPO's rewards
    else d = nlohmann::json{{"loss", e.loss}, {"perplexity", std::exp(e.loss)}, {"tokens", e.tokens}};
  }
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("%s (step %lld, %s state)\n%-20s %10s %12s %10s\n", a.checkpoint.c_str(), (long long)t->step(),
              state_kind_name(t->state_kind()).c_str(), "dataset", "loss", "perplexity", "tokens");
  for (const auto& e : results) {
    if (e.style == DatasetStyle::CONTRASTIVE) {
      std::fputs(e.dpo.eval_line(e.name).c_str(), stdout);
    } else if (e.style == DatasetStyle::PROMPTS) {  // the rewards of a greedy completion of each prompt
      std::printf("%-20s %lld prompts, greedy:", e.name.c_str(), (long long)e.tokens);
      for (const auto& [k, v] : e.figures.items()) std::printf(" %s %.4f", k.c_str(), v.is_number() ? v.get<double>() : NAN);
      std::printf("\n");
    } else
      std::printf("%-20s %10.4f %12.2f %10lld\n", e.name.c_str(), e.loss, std::exp(e.loss), (long long)e.tokens);
  }
  if (!tasks.empty()) std::printf("%-20s %10s %10s %10s %12s   (tokenizer %s)\n", "task", "examples", "accuracy", "acc_norm",
                                  "exact_match", tokenizer.c_str());
  for (const auto& r : tasks) {
    if (r.generation)
      std::printf("%-20s %10lld %10s %10s %12.4f\n", r.name.c_str(), (long long)r.examples, "", "", r.exact_match);
    else
      std::printf("%-20s %10lld %10.4f %10.4f\n", r.name.c_str(), (long long)r.examples, r.accuracy, r.accuracy_norm);
  }
  return 0;
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  auto* sub = app.add_subcommand("eval", "held-out loss and perplexity of a checkpoint (plain or LoRA) on datasets");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  // One value per --dataset (or a comma-separated list), so that key=value overrides after it stay overrides.
  sub->add_option("--dataset", a->datasets,
                  "dataset name under data/dir, NAME:padded for a PADDED one, NAME:contrastive for preference pairs, NAME:prompts for GRPO prompts (the rewards of greedy completions); repeat it or give a comma-separated "
                  "list (default: every dataset of the job)")
      ->allow_extra_args(false)->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--task", a->tasks,
                  "a JSONL task file: multiple choice ({\"question\", \"choices\", \"answer\"}: accuracy and "
                  "length-normalised accuracy by log-likelihood, as lm-evaluation-harness scores them) or exact match "
                  "({\"prompt\", \"answer\"}: greedy generation); repeat it for several (docs/cli.md)")
      ->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--tokenizer", a->tokenizer,
                  "the tokenizer of --task: auto (the one the model's training data was tokenized with, as sample "
                  "chooses), byte, gpt2 or hf:DIR")
      ->capture_default_str();
  sub->add_option("--per-example", a->per_example,
                  "write each --task example's scores to this JSON file: per choice its context and continuation token "
                  "ids and each continuation token's log-probability; per generation the text compared");
  sub->add_option("--rows", a->rows, "validation rows per dataset (default: training/validation_steps)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  sub->add_flag("--json", a->json, "print JSON");
  sub->add_option("overrides", a->overrides, "key=value settings over the saved config (e.g. data/dir=...)");
  return {sub, [a] { return eval(*a); }};
}

}  // namespace lt
