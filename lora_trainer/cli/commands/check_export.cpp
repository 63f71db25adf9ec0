// `lora_trainer check-export OUT CHECKPOINT [--prompts FILE] [--tokens N] [key=value ...]`: whether the
// Hugging Face export OUT reproduces CHECKPOINT, read back as transformers would read it
// (export_check.hpp); exit 3 naming the first difference.
#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/commands/export_check.hpp"

namespace lt {
namespace {

struct CheckExportArgs {
  std::string out, checkpoint;
  ExportCheckOptions o;
};

}  // namespace

Command add_check_export(CLI::App& app) {
  auto a = std::make_shared<CheckExportArgs>();
  auto* sub = app.add_subcommand("check-export",
                                 "compare an export with its checkpoint as the other tool would read it: the chat "
                                 "template's text, tokens, end-of-turn ids, logits and greedy replies (exit 3 on a difference)");
  sub->add_option("OUT", a->out, "the export's directory (export --format hf)")->required()->check(CLI::ExistingDirectory);
  sub->add_option("CHECKPOINT", a->checkpoint, "the checkpoint it was exported from")->required()->check(CLI::ExistingDirectory);
  sub->add_option("--prompts", a->o.prompts,
                  "a JSONL file of conversations ({\"messages\": [...]}) or, for a model not trained on chat data, "
                  "{\"text\": ...} prompts; default: three built in")
      ->check(CLI::ExistingFile);
  sub->add_option("--tokens", a->o.reply_tokens, "the longest greedy reply compared")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(4096)));
  sub->add_option("overrides", a->o.overrides, "key=value settings over the checkpoint's saved config (e.g. runtime/threads=1)");
  return {sub, [a] {
            check_hf_export(a->out, a->checkpoint, a->o, a->out);
            return 0;
          }};
}

}  // namespace lt
