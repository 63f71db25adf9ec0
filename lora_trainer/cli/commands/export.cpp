// `lora_trainer export CHECKPOINT OUT [--format native|hf|peft|gguf|gguf-adapter] [--ema] [--force]
// [--check [--prompts FILE] [--check-tokens N]]`: a checkpoint's model written for other tools (docs/huggingface.md,
// docs/llama_cpp.md) or as a weights-only checkpoint with the adapters merged; with --check, compared
// with the checkpoint before it is published (export_check.hpp).
#include <cstdlib>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/commands/export_check.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/gguf_export.hpp"
#include "lora_trainer/formats/huggingface.hpp"

namespace lt {
namespace {

struct ExportArgs {
  std::string checkpoint, out, format = "native", base, dtype = "source", max_shard_size = "5GB", tokenizer = "auto";
  bool ema = false, force = false, check = false;
  ExportCheckOptions check_options;
  CLI::Option* prompts_opt = nullptr;
};

// transformers' max_shard_size: "5GB" (10^9), "500MB", "2GiB" (2^30), "100KB", or bytes.
uint64_t shard_bytes(const std::string& text) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1.0}, {"", 1.0}};
  for (const auto& [unit, scale] : units) {
    if (text.size() <= unit.size() || text.compare(text.size() - unit.size(), unit.size(), unit) != 0) continue;
    const std::string number = text.substr(0, text.size() - unit.size());
    char* end = nullptr;
    const double v = std::strtod(number.c_str(), &end);
    if (end == number.c_str() || *end != '\0' || !(v > 0) || v * scale > 1e18) break;
    return static_cast<uint64_t>(v * scale);
  }
  throw UserError("export --max-shard-size " + text + ": expected a positive size such as 5GB, 500MB, 2GiB or a number "
                  "of bytes. Nothing was written");
}

int export_checkpoint(const ExportArgs& a) {
  const bool gguf = a.format == "gguf" || a.format == "gguf-adapter";
  if (a.format != "hf" && a.max_shard_size != "5GB")
    throw UserError("export: --max-shard-size is an option of --format hf. Nothing was written");
  const torch::ScalarType dtype = parse_dtype_option(a.dtype, kGgufDtypes, "export");
  if (a.format != "hf" && !gguf && dtype != c10::ScalarType::Undefined)
    throw UserError("export: --dtype is an option of --format hf, gguf and gguf-adapter (native writes float32 for "
                    "training, peft the adapters in float32). Nothing was written");
  if (a.format == "hf" && dtype == torch::kFloat16)
    throw UserError("export --format hf --dtype float16: Hugging Face exports are float32 or bfloat16 (" +
                    join(dtype_option_names(kHfDtypes)) + "). Nothing was written");
  if (a.check && a.format != "hf" && a.format != "gguf")
    throw UserError("export --check checks --format hf exports (the files read back by lora_trainer's own readers) and "
                    "--format gguf exports (model.gguf read by llama.cpp). Nothing was written");
  if (!a.check && a.prompts_opt->count() > 0) throw UserError("export --prompts belongs to --check. Nothing was written");
  if (a.check && a.ema)
    throw UserError("export --check --ema: the check compares with the checkpoint's trained values; export without --ema to "
                    "check it. Nothing was written");
  if (a.format != "gguf" && a.tokenizer != "auto")
    throw UserError("export: --tokenizer is an option of --format gguf (the model file carries the tokenizer). "
                    "Nothing was written");
  if (gguf) {
    GgufExportOptions o;
    o.use_ema = a.ema;
    o.force = a.force;
    o.base = a.base;
    o.dtype = a.dtype;
    o.tokenizer = a.tokenizer;
    if (a.check)  // on the written file before it takes OUT's place: a failed check publishes nothing
      o.check = [&](const std::string& staged) {
        ExportCheckOptions co = a.check_options;
        co.tokenizer = a.tokenizer;  // the tokenizer model.gguf was written with
        check_gguf_export(staged, a.checkpoint, co, a.out + "/model.gguf");
      };
    if (a.format == "gguf") export_gguf(a.checkpoint, a.out, o);
    else export_gguf_adapter(a.checkpoint, a.out, o);
  } else if (a.format == "hf") {
    std::function<void(const std::string&)> check;
    if (a.check)  // on the written files before they take OUT's place: a failed check publishes nothing
      check = [&](const std::string& staged) { check_hf_export(staged, a.checkpoint, a.check_options, a.out); };
    export_hf(a.checkpoint, a.out, a.ema, a.force, a.base, a.dtype, shard_bytes(a.max_shard_size), check);
  }
  else if (a.format == "peft") export_peft(a.checkpoint, a.out, a.ema, a.force, a.base);
  else export_merged(a.checkpoint, a.out, a.ema, a.force, a.base);
  return 0;
}

}  // namespace

Command add_export(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  auto* sub = app.add_subcommand("export", "write a checkpoint's model elsewhere: by default a weights-only plain checkpoint "
                                           "with the adapters merged in; or Hugging Face / PEFT files (docs/huggingface.md), or GGUF for llama.cpp "
                                           "(docs/llama_cpp.md)");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory (plain or LoRA)")->required()->check(CLI::ExistingDirectory);
  sub->add_option("OUT", a->out, "directory to write (native: usable with `run ... --restore OUT`)")->required();
  sub->add_option("--format", a->format,
                  "native: our weights-only checkpoint, adapters merged; hf: model.safetensors + config.json "
                  "(transformers' GPT2LMHeadModel, or LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM for the llama family), "
                  "adapters merged; peft: adapter_config.json + "
                  "adapter_model.safetensors (the adapters of a LoRA checkpoint only); gguf: model.gguf for llama.cpp "
                  "(adapters merged, the tokenizer included); gguf-adapter: adapter.gguf, a llama.cpp LoRA adapter to "
                  "load over the base's model.gguf (docs/llama_cpp.md)")
      ->capture_default_str()->check(CLI::IsMember({"native", "hf", "peft", "gguf", "gguf-adapter"}));
  sub->add_option("--dtype", a->dtype,
                  "hf, gguf: the weights' dtype: source (the checkpoint's base as stored: bf16 for a LoRA-phase checkpoint "
                  "or a bf16 import, float32 for phase one), float32, bfloat16 or (gguf) float16; adapters are merged in "
                  "float32 and the result rounded once. gguf-adapter: the adapters' (source = float32)")
      ->capture_default_str()->check(CLI::IsMember(dtype_option_names(kGgufDtypes)));
  sub->add_option("--tokenizer", a->tokenizer,
                  "gguf: the tokenizer model.gguf carries: auto (the one the model's training data was tokenized with, "
                  "as sample chooses; an error where nothing tells), byte, gpt2 or hf:DIR")
      ->capture_default_str();
  sub->add_option("--max-shard-size", a->max_shard_size,
                  "hf: the largest weights file; a larger model is written as model-00001-of-0000N.safetensors shards "
                  "with model.safetensors.index.json, as transformers' save_pretrained does (5GB = 5*10^9 bytes; MB, "
                  "GiB, ... or bytes)")
      ->capture_default_str();
  sub->add_flag("--force", a->force,
                "write into an existing directory that is not an earlier export of lora_trainer: files of the "
                "names this export writes are replaced, every other file is kept");
  sub->add_flag("--ema", a->ema,
                "write the moving average of the trained tensors (optimization/ema/decay) instead of their values");
  sub->add_option("--base", a->base,
                  "where the frozen base of a LoRA checkpoint that refers to it is now, when it moved from the place "
                  "its metadata records (a Hugging Face model directory or a checkpoint); its digest is checked");
  sub->add_flag("--check", a->check,
                "hf, gguf: before OUT takes the new files, read them back as transformers would (with lora_trainer's own "
                "readers) or as llama.cpp does (node-llama-cpp, where it is installed) and compare with the checkpoint: the chat template's text, the tokens, the end-of-turn ids, "
                "the logits and the greedy replies of a few conversations; a difference is exit 3 and OUT stays as it "
                "was (check-export checks an export already written)");
  a->prompts_opt = sub->add_option("--prompts", a->check_options.prompts,
                                   "with --check: a JSONL file of conversations ({\"messages\": [...]}) or, for a model "
                                   "not trained on chat data, {\"text\": ...} prompts; default: three built in")
                       ->check(CLI::ExistingFile);
  sub->add_option("--check-tokens", a->check_options.reply_tokens, "with --check: the longest greedy reply compared")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(4096)));
  return {sub, [a] { return export_checkpoint(*a); }};
}

}  // namespace lt
