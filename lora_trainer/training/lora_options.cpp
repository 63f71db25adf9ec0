#include "lora_trainer/training/lora_options.hpp"

#include "lora_trainer/core/options.hpp"

namespace lt {

// optimization/lora/* and training/allow_random_base, each bound to the LoraOptions field it sets.
// optimization/min_lr_ratio, phase 1's key (TrainingOptions), is taken by from_config: both phases decay to it.
static void read_token_indices(LoraOptions& c, const json& tokens) {
  if (tokens.is_object() && tokens.size() > 1)
    throw UserError("optimization/lora/trainable_token_indices: " + tokens.dump() + " names " + std::to_string(tokens.size()) +
                    " modules; these models have one token embedding (a head tied to it follows it): name it once");
  if (tokens.is_object() && tokens.size() == 1) {
    c.token_module = tokens.begin().key();
    c.token_ids = tokens.begin().value().get<std::vector<int64_t>>();
  } else if (tokens.is_array()) {
    c.token_ids = tokens.get<std::vector<int64_t>>();
  }
}

static const OptionGroup<LoraOptions>& lora_options() {
  using O = LoraOptions;
  static const auto g =
      OptionGroup<O>()
          .add("logging/save_frozen_base", OptType::Bool, false,
               "LoRA-phase checkpoints hold a copy of the frozen base (self-contained, each the base's size); false: "
               "they refer to it (where the job loaded it from, or its pre_lora_checkpoint) with a digest of its bf16 "
               "values that every restore, eval, sample and export checks",
               &O::save_frozen_base)
          .add("training/frozen_base_path", OptType::String, "",
               "where the frozen base that LoRA-phase checkpoints refer to is now, when it has moved from the place "
               "they record (a Hugging Face model directory or a checkpoint); \"\" = where they record",
               &O::frozen_base_path)
          .add("training/allow_random_base", OptType::Bool, false,
               "with no pre-LoRA stages: let the adapters train on randomly initialised base weights (a study of LoRA "
               "alone). Otherwise such a job needs a pretrained base: `run ... --restore CHECKPOINT`",
               &O::allow_random_base)
          .add("optimization/lora/rank", OptType::Int, 16, "adapter rank r",
               &O::rank, check_positive())
          .add("optimization/lora/alpha", OptType::Float, 16.0, "adapter scale numerator: W + (alpha/r) A B",
               &O::alpha, check_positive())
          .add("optimization/lora/target_modules", OptType::StringList,
               json::array({kAllLinear}),
               "substrings of parameter names whose 2-D weights get adapters, or \"all-linear\" (PEFT's value, the default): "
               "every linear layer of the blocks (gpt2: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; llama: q/k/v/o_proj, "
               "gate/up/down_proj), not the output head",
               &O::target_modules)
          .add("optimization/lora/init", OptType::String, "gaussian",
               "how adapter A is drawn (B starts at zero): gaussian, normal(0, 1/r) as in the reference framework and PEFT's "
               "\"gaussian\"; or kaiming_uniform, uniform(+-1/sqrt(in)) as PEFT's default",
               [](O& o, const json& v) { o.init = with_lora_keys([&] { return parse_lora_init(v.get<std::string>()); }); },
               check_one_of(lora_init_names()))
          .add("optimization/lora/modules_to_save", OptType::StringList, json::array(),
               "base modules or parameters that train in full beside the adapters, as PEFT's modules_to_save (e.g. [\"wte\"]: "
               "the token embedding, tied to the output head; [\"ln_1\", \"ln_2\", \"ln_f\"]: every layer norm). Names or "
               "suffixes after a '.'; they stay f32 with their own AdamW moments. Default: none, the whole base frozen in bf16",
               &O::modules_to_save)
          .add("optimization/lora/modules_to_save_lr_ratio", OptType::Float, 1.0,
               "learning rate of the modules_to_save as a fraction of optimization/lora/lr (e.g. 0.1 for an embedding)",
               &O::modules_to_save_lr_ratio,
               check_positive())
          .add("optimization/lora/trainable_token_indices", OptType::TokenIndices, json::array(),
               "token ids whose rows of the token embedding train beside the adapters, as PEFT's trainable_token_indices: a "
               "list (e.g. [50256]) applies to the token embedding and a head tied to it; PEFT's dict form names the module "
               "({\"wte\": [50256]}). The rows keep f32 values that replace the frozen ones, with their own AdamW moments at "
               "optimization/lora/lr. Not with modules_to_save of the same embedding. Default []: none",
               read_token_indices)
          .add("optimization/lora/init_from", OptType::String, "",
               "start the adapters from an earlier run's instead of drawing them: one of our LoRA checkpoints or a PEFT adapter "
               "directory (adapter_config.json + adapter_model.safetensors) with the same targets, rank and scale. Applied at "
               "the transition; \"\" = drawn by optimization/lora/init",
               &O::init_from)
          .add("optimization/lora/quantize_base", OptType::String, "bf16",
               "QLoRA: \"nf4\" stores the frozen linear weights of the blocks as 4-bit NormalFloat, exactly as bitsandbytes "
               "(blocks of 64, double-quantized scales: about 0.52 bytes a parameter instead of 2), each dequantized to bf16 "
               "for its matmul; the embeddings, norms and output head stay bf16. Quantized when the job loads its base (no "
               "pre-LoRA stages) or at the transition. \"bf16\" (or its older name \"none\"): the whole base in bf16",
               [](O& o, const json& v) { o.quantize_base = parse_frozen_format(v.get<std::string>()); },
               [](const json& v) {
                 try {
                   parse_frozen_format(v.get<std::string>());
                   return std::string();
                 } catch (const std::invalid_argument&) {
                   return "must be one of: " + join(frozen_format_names()) + " (or none, bf16's older name)";
                 }
               })
          .add("optimization/lora/rslora", OptType::Bool, false,
               "rank-stabilised LoRA: scale the adapters by alpha/sqrt(r) instead of alpha/r (PEFT's use_rslora)",
               &O::rslora)
          .add("optimization/lora/dora", OptType::Bool, false,
               "DoRA (PEFT's use_dora): each adapted weight also trains a magnitude per output feature, W' = m (W + s A B) / "
               "||W + s A B|| row by row; m starts at the base's row norms and trains at B's lr without weight decay",
               &O::dora)
          .add("optimization/lora/lr_ratio", OptType::Float, 1.0,
               "LoRA+: the learning rate of every B over that of A (the LoRA+ paper suggests 16); 1 trains both alike",
               &O::lr_ratio,
               check_positive())
          .add("optimization/lora/lr", OptType::Float, 1e-3, "peak learning rate of the LoRA phase",
               [](O& o, const json& v) { o.schedule.lr = v.get<double>(); }, check_positive())
          .add("optimization/lora/schedule", OptType::String, "wsd", "LoRA-phase schedule: constant, wsd or cosine",
               [](O& o, const json& v) { o.schedule.kind = parse_schedule_kind(v.get<std::string>()); },
               check_one_of(schedule_kind_names()))
          .add("optimization/lora/warmup_pct", OptType::Float, 0.05, "LoRA-phase warmup fraction",
               [](O& o, const json& v) { o.schedule.warmup_pct = v.get<double>(); }, check_range(0, 1))
          .add("optimization/lora/decay_pct", OptType::Float, 0.1, "LoRA-phase final decay fraction (wsd)",
               [](O& o, const json& v) { o.schedule.decay_pct = v.get<double>(); }, check_range(0, 1))
          .add("optimization/lora/weight_decay", OptType::Float, 0.0, "AdamW weight decay on the adapters",
               &O::weight_decay, check_nonnegative());
  return g;
}

void add_lora_options(ConfigSchema& s) { lora_options().declare(s); }

LoraOptions LoraOptions::from_config(const Config& cfg) {
  LoraOptions c = lora_options().read(cfg);
  c.schedule.min_lr_ratio = TrainingOptions::from_config(cfg).optimizer.schedule.min_lr_ratio;  // shared with phase 1
  return c;
}

}  // namespace lt
