// `lora_trainer tokenize INPUT... --name NAME [--format text|jsonl|chat|pairs] ...`: text files into a
// PMD dataset, prompt/completion records or conversations (rendered with the model's chat template)
// into a PADDED one, preference pairs into a CONTRASTIVE one, prompts (for GRPO) into a PROMPTS one.
#include <cstdio>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"

namespace lt {
namespace {

struct TokenizeArgs {
  TokenizeOptions tok;
  std::string name, data_dir = "datasets/data", format = "text";
  CLI::Option* length = nullptr;  // given or not
  std::vector<CLI::Option*> chat_only;    // --format chat's
  std::vector<CLI::Option*> template_opts;  // the template's: --format chat, and prompts of "messages"
};

int tokenize(TokenizeArgs& a) {
  if (a.format == "text" && a.length->count() > 0)
    throw UserError("tokenize: --length sets the row length of --format jsonl, chat, pairs and prompts; text is cut into rows at "
                    "training time (architecture/block_size). Drop --length, or give --format jsonl|chat|pairs|prompts");
  for (const CLI::Option* opt : a.chat_only)
    if (a.format != "chat" && opt->count() > 0)
      throw UserError("tokenize: " + opt->get_name() + " belongs to --format chat (conversations rendered with a chat template)");
  for (const CLI::Option* opt : a.template_opts)
    if (a.format != "chat" && a.format != "prompts" && opt->count() > 0)
      throw UserError("tokenize: " + opt->get_name() + " belongs to --format chat and prompts (conversations rendered with "
                      "a chat template)");
  a.tok.out_dir = (std::filesystem::path(a.data_dir) / a.name).string();
  if (a.tok.show) {
    tokenize_jsonl_to_chat(a.tok);
    return 0;
  }
  auto r = a.format == "chat"    ? tokenize_jsonl_to_chat(a.tok)
           : a.format == "jsonl" ? tokenize_jsonl_to_padded(a.tok)
           : a.format == "pairs" ? tokenize_jsonl_to_contrastive(a.tok)
           : a.format == "prompts" ? tokenize_jsonl_to_prompts(a.tok)
                                 : tokenize_to_pmd(a.tok);
  std::printf("dataset %s: %llu documents (%llu validation), %llu bytes -> %llu train + %llu val tokens\n",
              a.tok.out_dir.c_str(), (unsigned long long)r.documents, (unsigned long long)r.val_documents,
              (unsigned long long)r.bytes, (unsigned long long)r.train_tokens, (unsigned long long)r.val_tokens);
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  TokenizeOptions& tok = a->tok;
  auto* sub = app.add_subcommand("tokenize", "turn text files/directories into a PMD dataset, JSONL prompt/completion records into a PADDED one, "
                                 "JSONL prompt/chosen/rejected preference records into a CONTRASTIVE one, or JSONL prompts (with their answers) "
                                 "into a PROMPTS one for GRPO");
  sub->add_option("INPUT", tok.inputs, "text files or directories")->required();
  sub->add_option("--name", a->name, "dataset name (a directory under --data-dir)")->required()->check(dir_name());
  sub->add_option("--data-dir", a->data_dir, "data directory (config key data/dir)")->capture_default_str();
  sub->add_option("--tokenizer", tok.tokenizer, "gpt2, byte, or hf:DIR (a Hugging Face byte-level BPE tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"gpt2", "byte"}));
  sub->add_option("--tokenizer-dir", tok.tokenizer_dir, "directory with encoder.json and vocab.bpe");
  sub->add_option("--val-fraction", tok.val_fraction, "share of documents for validation")->capture_default_str();
  sub->add_option("--ext", tok.extensions, "only files ending in this (e.g. --ext .py); repeat it or give a "
                  "comma-separated list (--ext .py,.js)")
      ->allow_extra_args(false)->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--format", a->format,
                  "text: each file a document -> PMD; jsonl: {\"prompt\",\"completion\"} records -> PADDED; chat: "
                  "{\"messages\": [{\"role\",\"content\"}...]} conversations rendered with the chat template of "
                  "--tokenizer hf:DIR -> PADDED, the loss on the assistant turns; pairs: "
                  "{\"prompt\",\"chosen\",\"rejected\"} records -> CONTRASTIVE (for dpo/train); prompts: {\"prompt\": text} or "
                  "{\"messages\": [...]} records (the chat template's generation prompt added), any other fields (\"answer\") "
                  "kept for the rewards -> PROMPTS (for GRPO)")
      ->capture_default_str()->check(CLI::IsMember({"text", "jsonl", "chat", "pairs", "prompts"}));
  a->chat_only.push_back(sub->add_option("--loss-on", tok.loss_on,
                                         "chat: which tokens count in the loss: assistant (every assistant turn, its "
                                         "end-of-turn token included), last (the last assistant turn), all")
                             ->capture_default_str()->check(CLI::IsMember(chat_loss_names())));
  a->template_opts.push_back(sub->add_option("--chat-template", tok.chat_template,
                                         "chat: which of the model's named templates (e.g. tool_use; default: \"default\"), "
                                         "or a template file to use instead (a path: FILE.jinja, e.g. a copy with "
                                         "{% generation %} tags)"));
  a->template_opts.push_back(sub->add_option("--chat-var", tok.chat_vars,
                                         "chat: a template variable KEY=VALUE (VALUE as JSON, else a string), e.g. "
                                         "enable_thinking=false; repeat it for several"));
  a->template_opts.push_back(sub->add_option("--chat-limit", tok.chat_limits,
                                         "chat: raise a bound on the template's renders, NAME=N: steps (work per "
                                         "conversation), output (bytes), string (bytes of one string), list (items of "
                                         "one list), depth (macros in macros); repeat it for several"));
  a->chat_only.push_back(sub->add_flag("--show", tok.show,
                                       "chat: print each record's rendered text, token ids and loss mask as a JSON line "
                                       "and write nothing"));
  sub->add_flag("--force", tok.force,
                "write into an existing directory that is not a dataset of lora_trainer (its other files are kept)");
  a->length = sub->add_option("--length", tok.length, "jsonl, chat, pairs, prompts: row length in tokens (0 = the longest row; a longer conversation or prompt is "
                  "an error for chat and prompts)")
                  ->capture_default_str()->check(CLI::Range(int64_t(0), int64_t(1) << 24));
  return {sub, [a] { return tokenize(*a); }};
}

}  // namespace lt
