// `lora_trainer export CHECKPOINT OUT [--format native|hf|peft] [--ema] [--force]`: a checkpoint's model
// written for other tools (docs/huggingface.md) or as a weights-only checkpoint with the adapters merged.
#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/huggingface.hpp"

namespace lt {
namespace {

struct ExportArgs {
  std::string checkpoint, out, format = "native", base;
  bool ema = false, force = false;
};

int export_checkpoint(const ExportArgs& a) {
  if (a.format == "hf") export_hf(a.checkpoint, a.out, a.ema, a.force, a.base);
  else if (a.format == "peft") export_peft(a.checkpoint, a.out, a.ema, a.force, a.base);
  else export_merged(a.checkpoint, a.out, a.ema, a.force, a.base);
  return 0;
}

}  // namespace

Command add_export(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  auto* sub = app.add_subcommand("export", "write a checkpoint's model elsewhere: by default a weights-only plain checkpoint "
                                           "with the adapters merged in; or Hugging Face / PEFT files (docs/huggingface.md)");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory (plain or LoRA)")->required()->check(CLI::ExistingDirectory);
  sub->add_option("OUT", a->out, "directory to write (native: usable with `run ... --restore OUT`)")->required();
  sub->add_option("--format", a->format,
                  "native: our weights-only checkpoint, adapters merged; hf: model.safetensors + config.json "
                  "(transformers' GPT2LMHeadModel, or LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM for the llama family), "
                  "adapters merged; peft: adapter_config.json + "
                  "adapter_model.safetensors (the adapters of a LoRA checkpoint only)")
      ->capture_default_str()->check(CLI::IsMember({"native", "hf", "peft"}));
  sub->add_flag("--force", a->force,
                "write into an existing directory that is not an earlier export of lora_trainer: files of the "
                "names this export writes are replaced, every other file is kept");
  sub->add_flag("--ema", a->ema,
                "write the moving average of the trained tensors (optimization/ema/decay) instead of their values");
  sub->add_option("--base", a->base,
                  "where the frozen base of a LoRA checkpoint that refers to it is now, when it moved from the place "
                  "its metadata records (a Hugging Face model directory or a checkpoint); its digest is checked");
  return {sub, [a] { return export_checkpoint(*a); }};
}

}  // namespace lt
