// Whether an export reproduces the checkpoint it was made from, read back as the tool it is made for
// reads it (`export --check`, `check-export OUT CHECKPOINT`; docs/cli.md). A few conversations (built
// in, or --prompts FILE; plain prompts for a model not trained on chat data) are run twice: through the
// checkpoint's own model, chat template and tokenizer, and through what was written.
//   - A Hugging Face export is read back by our own readers, independent of the export's writer: its
//     tokenizer.json, its chat template (tokenizer_config.json) and generation_config.json's end-of-turn
//     ids, its config.json and safetensors weights (as `run --restore` and `import-hf` read a model
//     directory).
//   - A GGUF export (model.gguf) is read by the real llama.cpp, the prebuilt one of the npm package
//     node-llama-cpp, run through node (llama_cpp_check.mjs): the conversation rendered by the file's own
//     tokenizer.chat_template as llama.cpp's chat renders it and tokenized by the file's tokenizer, its
//     end-of-generation ids, its logits. Where node or the package is missing the check says it was
//     skipped (and passes).
// Compared, in order, for each conversation: the rendered text (HF), the prompt's token ids, the
// end-of-turn ids, the next-token logits after the prompt and after each token of the checkpoint's greedy
// reply (within the export dtype's tolerance), and the greedy choice token by token up to the end of
// turn. The first difference is an ExportCheckFailed (exit 3) that names it; `export --check` then
// publishes nothing (OUT stays as it was).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace lt {

class ExportCheckFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
constexpr int kExitCheckFailed = 3;

struct ExportCheckOptions {
  // A JSONL file of what to check on: a chat record a line ({"messages": [...]}, or {"prompt",
  // "completion"}: its prompt), or for a model without a chat template {"text": "..."}; "" = built in.
  std::string prompts;
  int64_t reply_tokens = 16;           // the longest greedy reply compared
  std::string tokenizer = "auto";      // the checkpoint's tokenizer (auto: the one its data was tokenized with)
  std::vector<std::string> overrides;  // key=value over the checkpoint's saved config (e.g. runtime/threads=1)
};

// Checks `dir`, a Hugging Face export of `checkpoint` (config.json and safetensors weights), printing a
// line a conversation; `shown` is the name messages give the export (OUT, where `dir` is its staging
// directory). A UserError for an input that cannot be checked (not an HF export, a bad --prompts file).
void check_hf_export(const std::string& dir, const std::string& checkpoint, const ExportCheckOptions& o,
                     const std::string& shown);
// Checks `file`, a model.gguf written by `export --format gguf` from `checkpoint`, in llama.cpp.
void check_gguf_export(const std::string& file, const std::string& checkpoint, const ExportCheckOptions& o,
                       const std::string& shown);

}  // namespace lt
