#include "lora_trainer/cli/commands/generation_args.hpp"

#include <cstdio>

#include "lora_trainer/data/tokenize.hpp"

namespace lt {

void GenerationArgs::add_options(CLI::App* sub, const std::string& tokens_help) {
  sub->add_option("CHECKPOINT", checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_option("--tokens", gen.max_new_tokens, tokens_help)->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  sub->add_option("--temperature", gen.temperature, "softmax temperature; 0 = greedy")->capture_default_str()
      ->check(finite_in(0, 1e6));
  sub->add_option("--top-k", gen.top_k, "sample from the k most likely tokens; 0 = all")->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
  sub->add_option("--top-p", gen.top_p, "sample from the fewest most likely tokens whose probabilities reach p "
                  "(after --top-k); 1 = all")->capture_default_str()->check(finite_in(1e-6, 1));
  sub->add_option("--seed", gen.seed, "random seed")->capture_default_str()->check(uint64_text());
  sub->add_option("--tokenizer", tokenizer, "auto (the one the model's training data was tokenized with: the checkpoint's record, its datasets' "
                  "meta.json, an imported model's tokenizer.json, or byte/gpt2 by a vocabulary only they have; else an "
                  "error), gpt2, byte, or hf:DIR (a Hugging Face tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"auto", "gpt2", "byte"}));
  limit_opt = sub->add_option("--chat-limit", chat_limits,
                              "raise a bound on the chat template's render, NAME=N (steps, output, string, list, depth; "
                              "docs/chat.md); repeat it for several");
}

void GenerationArgs::add_overrides(CLI::App* sub) {
  sub->add_option("overrides", overrides, "key=value settings over the saved config (e.g. runtime/threads=1)");
}

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

GeneratingModel load_generating_model(const GenerationArgs& a, const std::string& command) {
  GeneratingModel m;
  m.job = load_for_reading(a.checkpoint, a.overrides, &m.trainer);
  m.tokenizer_name = a.tokenizer == "auto" ? m.trainer->tokenizer_name(command) : a.tokenizer;
  m.tok = make_tokenizer(m.tokenizer_name);
  m.ema = m.trainer->ema_weights();  // with eval/use_ema, the moving average generates
  return m;
}

Conversation conversation_with(const GeneratingModel& m, const GenerationArgs& a, const std::string& command) {
  ChatSetup setup = chat_setup(m.trainer->provenance().model_chat_format(), m.tokenizer_name, *m.tok, command);
  jinja::Limits limits;
  for (const auto& l : a.chat_limits) limits.set(l);
  setup.tmpl.set_limits(limits);
  GenerateOptions o = a.gen;
  o.where = command + ": the conversation rendered with its chat template";
  return Conversation(m.trainer->model(), m.trainer->runtime(), *m.tok, std::move(setup), o);
}

}  // namespace lt
