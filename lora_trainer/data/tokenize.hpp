// The tokenize job: text files or directories -> a PMD dataset directory (train.bin, val.bin,
// meta.json; see data.hpp). Each file is one document, followed by the end-of-text token. Documents
// are taken in sorted path order and every k-th one (k = 1 / val_fraction, at least one) goes to validation,
// so the split is deterministic; a single document is split by tokens instead (its last val_fraction).
// JSONL records become PADDED (prompt/completion) or CONTRASTIVE (prompt/chosen/rejected) datasets.
// Also make_tokenizer, the tokenizer named by `--tokenizer` (tokenize, sample).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/data/tokenizer.hpp"

namespace lt {

// name: "byte", "gpt2" (from gpt2_dir) or "hf:DIR" (hf_tokenizer.hpp). Throws lt::UserError (util.hpp)
// naming the missing file and the command that fetches it, or the unknown name and the known ones.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& gpt2_dir = default_gpt2_dir());

struct TokenizeOptions {
  std::vector<std::string> inputs;      // files and/or directories (recursed)
  std::vector<std::string> extensions;  // keep only files with these endings (e.g. ".py"); empty = all
  std::string out_dir;                  // the dataset directory to write
  std::string tokenizer = "gpt2";
  std::string tokenizer_dir;            // "" = default_gpt2_dir()
  double val_fraction = 0.05;
  int64_t length = 0;                   // padded: row length L; 0 = the longest record
  bool force = false;                   // write into an existing directory that is not a dataset of ours
  // --format chat (tokenize_jsonl_to_chat)
  std::string chat_template;            // which of a list of named templates ("" = default)
  std::string loss_on = "assistant";    // assistant, last or all (parse_chat_loss)
  std::vector<std::string> chat_vars;   // KEY=VALUE template variables (e.g. enable_thinking=false)
  std::vector<std::string> chat_limits; // NAME=N bounds on the template's renders (jinja::Limits::set)
  bool show = false;                    // print each record's text, ids and mask as JSON lines; write nothing
};

struct TokenizeResult {
  uint64_t documents = 0, val_documents = 0, bytes = 0, train_tokens = 0, val_tokens = 0;
};

// Writes the dataset directory as a whole (publish_dir): it appears complete or not at all, and a
// refused or failed run leaves an existing dataset of that name as it was. Inputs inside the output
// (the dataset being written, or the data directory when it lies inside an input directory) are
// skipped, never read back.
TokenizeResult tokenize_to_pmd(const TokenizeOptions& opts);

// JSONL records {"prompt": str, "completion": str} -> a PADDED dataset (data.hpp): each row is
// prompt + completion + end-of-text, left-padded (pad = end-of-text, mask 0) to `length`; only the
// completion and its end-of-text count in the loss. A longer record keeps its last `length` tokens.
// Every k-th record (k = 1 / val_fraction, at least one) goes to validation.
TokenizeResult tokenize_jsonl_to_padded(const TokenizeOptions& opts);

// JSONL conversations {"messages": [{"role", "content"}, ...], "tools"?, "documents"?} (or {"prompt",
// "completion"}) -> a PADDED dataset: each record rendered with the chat template of the tokenizer's
// model directory (opts.tokenizer must be hf:DIR; chat_template.hpp), tokenized as a whole, one row
// each, the loss on `loss_on`'s tokens. A record longer than `length` (when given), a malformed one or
// one with nothing to learn is a UserError naming FILE:LINE. `show`: prints each record instead.
TokenizeResult tokenize_jsonl_to_chat(const TokenizeOptions& opts);

// JSONL preference records {"prompt": str, "chosen": str, "rejected": str} -> a CONTRASTIVE dataset
// (data.hpp): each record is two rows as tokenize_jsonl_to_padded makes them, prompt + chosen and
// prompt + rejected, padded to one `length`; the prompt is masked out of both. Every k-th record goes
// to validation. A record without the three string fields is a UserError naming FILE:LINE and the field.
TokenizeResult tokenize_jsonl_to_contrastive(const TokenizeOptions& opts);

// JSONL prompt records -> a PROMPTS dataset (prompts.hpp) for GRPO: {"prompt": str, ...} tokenized as it
// is, or {"messages": [...], "tools"?, "documents"?, ...} rendered with the chat template of --tokenizer
// hf:DIR and its generation prompt; every other field ("answer", ...) kept in the records file. A record
// with neither or both, an empty prompt or one longer than `length` (when given) is a UserError naming
// FILE:LINE.
TokenizeResult tokenize_jsonl_to_prompts(const TokenizeOptions& opts);

}  // namespace lt
