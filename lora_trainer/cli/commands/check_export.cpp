// `lora_trainer check-export OUT CHECKPOINT [--prompts FILE] [--tokens N] [key=value ...]`: whether the
// export OUT reproduces CHECKPOINT, read back as the tool it is for reads it (export_check.hpp): a Hugging
// Face directory as transformers would, a GGUF (OUT/model.gguf, or the .gguf file) in llama.cpp; exit 3
// naming the first difference.
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/commands/export_check.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

struct CheckExportArgs {
  std::string out, checkpoint;
  ExportCheckOptions o;
};

// Checks OUT as what it is: a .gguf file, a directory of `export --format gguf` (model.gguf, no
// config.json), else a Hugging Face directory.
void check_export(const CheckExportArgs& a) {
  namespace fs = std::filesystem;
  const fs::path out = a.out;
  if (fs::is_regular_file(out)) {
    if (out.extension() != ".gguf")
      throw UserError(a.out + " is a file, not an export: give the directory `export` wrote (a Hugging Face export) or a "
                      "model.gguf");
    check_gguf_export(a.out, a.checkpoint, a.o, a.out);
  } else if (fs::exists(out / "model.gguf") && !fs::exists(out / "config.json")) {
    check_gguf_export((out / "model.gguf").string(), a.checkpoint, a.o, (out / "model.gguf").string());
  } else if (fs::exists(out / "adapter.gguf") && !fs::exists(out / "config.json")) {
    throw UserError(a.out + " holds a llama.cpp LoRA adapter (adapter.gguf): check-export checks whole models; export the "
                    "checkpoint with --format gguf (adapters merged) to check it");
  } else {
    check_hf_export(a.out, a.checkpoint, a.o, a.out);
  }
}

}  // namespace

Command add_check_export(CLI::App& app) {
  auto a = std::make_shared<CheckExportArgs>();
  auto* sub = app.add_subcommand("check-export",
                                 "compare an export with its checkpoint as the other tool reads it (transformers' files "
                                 "by lora_trainer's readers, a GGUF in llama.cpp): the chat template's text, tokens, "
                                 "end-of-turn ids, logits and greedy replies (exit 3 on a difference)");
  sub->add_option("OUT", a->out, "the export: the directory of export --format hf or gguf, or a model.gguf")
      ->required()->check(CLI::ExistingPath);
  sub->add_option("CHECKPOINT", a->checkpoint, "the checkpoint it was exported from")->required()->check(CLI::ExistingDirectory);
  sub->add_option("--prompts", a->o.prompts,
                  "a JSONL file of conversations ({\"messages\": [...]}) or, for a model not trained on chat data, "
                  "{\"text\": ...} prompts; default: three built in")
      ->check(CLI::ExistingFile);
  sub->add_option("--tokens", a->o.reply_tokens, "the longest greedy reply compared")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(4096)));
  sub->add_option("--tokenizer", a->o.tokenizer,
                  "the checkpoint's tokenizer: auto (the one its training data was tokenized with, as sample chooses), "
                  "gpt2, byte, or hf:DIR (where that tokenizer.json is now, when it moved)")
      ->capture_default_str()->check(tokenizer_name({"auto", "gpt2", "byte"}));
  sub->add_option("overrides", a->o.overrides, "key=value settings over the checkpoint's saved config (e.g. runtime/threads=1)");
  return {sub, [a] {
            check_export(*a);
            return 0;
          }};
}

}  // namespace lt
