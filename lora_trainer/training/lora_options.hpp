// The options of a LoRA phase (optimization/lora/*), and how lora.cpp's setting errors get their key.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/training/training_options.hpp"

namespace lt {

// The LoRA phase's options: optimization/lora/* (the adapters, their recipe and the LoRA phase's
// optimizer) and training/allow_random_base, each key declared once bound to the field it sets
// (lora_options.cpp's OptionGroup, with its default and doc): add_lora_options adds them to a schema
// (Trainer::lora_schema, dpo/train's), from_config reads them once (by a trainer whose plan has a LoRA
// phase).
struct LoraOptions {
  int64_t rank{};                         // optimization/lora/rank
  double alpha{};                         // optimization/lora/alpha
  std::vector<std::string> target_modules;  // optimization/lora/target_modules (as given: "all-linear" unexpanded)
  LoraInit init{};                        // optimization/lora/init
  bool rslora{};                          // optimization/lora/rslora: scale alpha / sqrt(r) instead of alpha / r
  bool dora{};                            // optimization/lora/dora: a trained magnitude per output feature (DoRA)
  double lr_ratio{};                      // optimization/lora/lr_ratio (LoRA+): B's learning rate over A's
  std::vector<std::string> modules_to_save;  // optimization/lora/modules_to_save, entries as given (module or
                                             // parameter names, or suffixes)
  double modules_to_save_lr_ratio{};      // optimization/lora/modules_to_save_lr_ratio
  // optimization/lora/trainable_token_indices: the embedding module named by PEFT's dict form ("" for
  // a plain list: the token embedding) and the ids whose rows train; no ids = off.
  std::string token_module;
  std::vector<int64_t> token_ids;
  std::string init_from;                  // optimization/lora/init_from: an earlier run's adapters to start from
                                          // (adapter_source.hpp); "" = drawn by init
  // Phase 2's optimizer: AdamW with phase 1's betas and epsilon (TrainingOptions) and these.
  ScheduleOptions schedule;  // optimization/lora/{schedule, lr, warmup_pct, decay_pct}, optimization/min_lr_ratio
  double weight_decay{};     // optimization/lora/weight_decay
  bool allow_random_base{};  // training/allow_random_base: with no phase 1, the adapters may train on random weights
  // logging/save_frozen_base: LoRA-phase checkpoints copy the frozen base instead of referring to it
  // (frozen_base.hpp); training/frozen_base_path: where the base they refer to is now, when it moved.
  bool save_frozen_base{};
  std::string frozen_base_path;
  // optimization/lora/quantize_base: how the frozen linear weights of the blocks are stored (bf16, or
  // QLoRA's nf4: a storage of frozen_storage.hpp's registry, by its name); the embeddings, norms and
  // output head stay bf16.
  FrozenFormat quantize_base = FrozenFormat::Bf16;
  static LoraOptions from_config(const Config& cfg);
};

void add_lora_options(ConfigSchema& s);

// lora.cpp knows its settings, not the config: its errors get their key (optimization/lora/...) here.
template <class F>
auto with_lora_keys(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const LoraSettingError& e) {
    throw UserError("optimization/lora/" + e.setting() + ": " + e.what());
  }
}

}  // namespace lt
