// `lora_trainer import-hf HF_DIR OUT [--force]`: a Hugging Face model directory as a weights-only checkpoint.
#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/huggingface.hpp"

namespace lt {
namespace {

struct ImportArgs {
  std::string hf_dir, out;
  bool force = false;
  std::string dtype = "source";
};

}  // namespace

Command add_import_hf(CLI::App& app) {
  auto a = std::make_shared<ImportArgs>();
  auto* sub = app.add_subcommand("import-hf", "import a Hugging Face model (config.json + safetensors: GPT-2, "
                                              "Llama, Qwen2, Mistral) as a weights-only checkpoint for `run ... --restore`, "
                                              "`eval` and `sample`");
  sub->add_option("HF_DIR", a->hf_dir, "a transformers model directory (model_type gpt2, llama, qwen2 or mistral)")
      ->required()->check(CLI::ExistingDirectory);
  sub->add_option("OUT", a->out, "checkpoint directory to write (a new or empty directory, or an earlier import "
                  "or export, whose files are replaced; other files in it are kept)")->required();
  sub->add_flag("--force", a->force,
                "write into an existing directory that is not an earlier import or export of lora_trainer: files "
                "of the names it writes are replaced, every other file is kept");
  sub->add_option("--dtype", a->dtype,
                  "the checkpoint's dtype: source (each tensor as the files store it: a bf16 model stays bf16), "
                  "float32 or bfloat16")
      ->capture_default_str()->check(CLI::IsMember(dtype_option_names(kHfDtypes)));
  return {sub, [a] {
            import_hf(a->hf_dir, a->out, a->force, a->dtype);
            return 0;
          }};
}

}  // namespace lt
