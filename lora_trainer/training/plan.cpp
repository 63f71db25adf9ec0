#include "lora_trainer/training/plan.hpp"

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

static const json kDefaultDataset = json::array({{{"name", "english"}, {"rate", 1}, {"style", "pmd"}}});

// train's plan, one stage: training/tokens over training/dataset. dpo/train gives the mixture its own
// default and doc.
static OptionGroup<StagePlan> train_plan_options(json default_dataset, std::string dataset_doc) {
  return OptionGroup<StagePlan>()
      .add("training/tokens", OptType::Int, 4194304, "token budget of the run",
           [](StagePlan& p, const json& v) { p.tokens = {v.get<int64_t>()}; }, check_positive())
      .add("training/dataset", OptType::Samplings, std::move(default_dataset), std::move(dataset_doc),
           [](StagePlan& p, const json& v) { p.datasets = {parse_samplings(v)}; });
}
static const OptionGroup<StagePlan>& train_plan_options() {
  static const auto g = train_plan_options(
      kDefaultDataset, "datasets of the run with sampling rates (summing to 1); names are directories under data/dir");
  return g;
}

static void parse_stages(std::vector<std::vector<Sampling>>& out, const json& v) {
  for (const auto& d : v) out.push_back(parse_samplings(d));
}

static json one_stage(const char* name) {
  return json::array({json::array({{{"name", name}, {"rate", 1}, {"style", "pmd"}}})});
}

// continual/train/benchmark's stages (A, B, C, ...): a budget and a mixture each.
static const OptionGroup<StagePlan>& stage_lists_plan_options() {
  static const auto g =
      OptionGroup<StagePlan>()
          .add("training/tokens", OptType::IntList, json::array({262144, 262144, 262144}),
               "token budget of each stage (A, B, C, ...)", &StagePlan::tokens, check_positive_list())
          .add("training/dataset", OptType::SamplingStages,
               json::parse(R"([[{"name":"english","rate":1,"style":"pmd"}],[{"name":"code","rate":1,"style":"pmd"}],
                        [{"name":"english","rate":1,"style":"pmd"}]])"),
               "dataset mixture of each stage (one list of samplings per budget)",
               [](StagePlan& p, const json& v) { parse_stages(p.datasets, v); });
  return g;
}

// lora/train's phases: the pre-LoRA (full-parameter) stages, then the post-LoRA (adapter) stages.
struct LoraPlanOptions {
  StagePlan pre, post;
};
static const OptionGroup<LoraPlanOptions>& lora_plan_options() {
  using O = LoraPlanOptions;
  static const auto g =
      OptionGroup<O>()
          .add("training/pre_lora_tokens", OptType::IntList, json::array({2097152}),
               "token budget of each pre-LoRA (full-parameter) stage; [] starts in the LoRA phase",
               [](O& o, const json& v) { o.pre.tokens = v.get<std::vector<int64_t>>(); }, check_positive_list())
          .add("training/pre_lora_dataset", OptType::SamplingStages, one_stage("english"),
               "dataset mixture of each pre-LoRA stage (one list of samplings per budget)",
               [](O& o, const json& v) { parse_stages(o.pre.datasets, v); })
          .add("training/post_lora_tokens", OptType::IntList, json::array({524288}),
               "token budget of each post-LoRA (adapter) stage",
               [](O& o, const json& v) { o.post.tokens = v.get<std::vector<int64_t>>(); }, check_positive_list())
          .add("training/post_lora_dataset", OptType::SamplingStages, one_stage("code"),
               "dataset mixture of each post-LoRA stage (one list of samplings per budget)",
               [](O& o, const json& v) { parse_stages(o.post.datasets, v); });
  return g;
}

void add_train_plan_options(ConfigSchema& s) { train_plan_options().declare(s); }
void add_train_plan_options(ConfigSchema& s, json default_dataset, std::string dataset_doc) {
  train_plan_options(std::move(default_dataset), std::move(dataset_doc)).declare(s);
}
void add_stage_lists_plan_options(ConfigSchema& s) { stage_lists_plan_options().declare(s); }
void add_lora_plan_options(ConfigSchema& s) { lora_plan_options().declare(s); }

TrainingPlan TrainingPlan::full(StagePlan stages) {
  const size_t n = stages.tokens.size();
  return {std::move(stages), n};
}

TrainingPlan TrainingPlan::from_train_config(const Config& cfg) { return full(train_plan_options().read(cfg)); }

TrainingPlan TrainingPlan::from_stage_lists_config(const Config& cfg) {
  StagePlan plan = stage_lists_plan_options().read(cfg);
  plan.check_one_mixture_per_budget("training/tokens", "training/dataset");
  return full(std::move(plan));
}

TrainingPlan TrainingPlan::from_lora_config(const Config& cfg) {
  LoraPlanOptions o = lora_plan_options().read(cfg);
  o.pre.check_one_mixture_per_budget("training/pre_lora_tokens", "training/pre_lora_dataset",
                                     " (both [] to skip phase one)");
  o.post.check_one_mixture_per_budget("training/post_lora_tokens", "training/post_lora_dataset");
  if (o.post.tokens.empty())
    throw UserError("training/post_lora_tokens is empty: a LoRA job needs at least one post-LoRA stage "
                    "(for full-parameter training alone use the `train` job)");
  const size_t n_pre = o.pre.tokens.size();
  return {o.pre.append(o.post), n_pre};
}

}  // namespace lt
