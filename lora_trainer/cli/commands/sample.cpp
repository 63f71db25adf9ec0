// `lora_trainer sample CHECKPOINT --prompt TEXT [--chat [--system TEXT]] [--tokens N] [--temperature T]
// [--top-k K] [--seed S] [--tokenizer NAME] [key=value ...]`: text generated from a checkpoint's model;
// with --chat the prompt is a user message rendered with the model's chat template and the reply runs
// to the template's end-of-turn token.
#include <cstdio>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {
namespace {

struct SampleArgs {
  std::string checkpoint, prompt, tokenizer = "auto", system;
  bool chat = false;
  CLI::Option* system_opt = nullptr;
  std::vector<std::string> chat_limits;
  CLI::Option* limit_opt = nullptr;
  GenerateOptions gen;
  std::vector<std::string> overrides;
};

int sample(const SampleArgs& a) {
  Trainer* t = nullptr;
  auto job = load_for_reading(a.checkpoint, a.overrides, &t);
  std::string tokenizer_name = a.tokenizer;
  if (tokenizer_name == "auto") tokenizer_name = t->tokenizer_name("sample");
  auto tok = make_tokenizer(tokenizer_name);
  GenerateOptions o = a.gen;
  o.stop_id = tok->eot_id();
  o.vocab_limit = tok->vocab_size();
  o.tokenizer = tokenizer_name;
  o.where = "sample: the prompt";
  std::string prompt = a.prompt;
  if (a.chat) {
    if (tokenizer_name.rfind("hf:", 0) != 0)
      throw UserError("sample --chat renders the prompt with the model's chat template: give --tokenizer hf:DIR (the model "
                      "directory holding tokenizer.json and tokenizer_config.json), or sample an imported model whose "
                      "directory still holds them");
    ChatTemplate tmpl = ChatTemplate::from_model_dir(tokenizer_name.substr(3));
    jinja::Limits limits;
    for (const auto& l : a.chat_limits) limits.set(l);
    tmpl.set_limits(limits);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", a.prompt}});
    prompt = tmpl.render(messages, true).text;
    // The reply ends at the template's end-of-turn token (tokenizer_config.json's eos_token) when it is one token.
    const auto eos = tok->encode(tmpl.eos_token());
    if (eos.size() == 1) o.stop_id = eos[0];
  } else if (a.system_opt->count() > 0) {
    throw UserError("sample --system belongs to --chat (a system message rendered with the model's chat template)");
  } else if (a.limit_opt->count() > 0) {
    throw UserError("sample --chat-limit belongs to --chat (it bounds the renders of the model's chat template)");
  }
  auto ema = t->ema_weights();  // with eval/use_ema, the moving average generates
  auto ids = generate(t->model(), t->runtime(), tok->encode(prompt), o);
  if (a.chat) {  // the reply alone, without its end-of-turn token
    if (!ids.empty() && static_cast<int64_t>(ids.back()) == o.stop_id) ids.pop_back();
    std::printf("%s\n", tok->decode(ids).c_str());
  } else {
    std::printf("%s%s\n", prompt.c_str(), tok->decode(ids).c_str());
  }
  return 0;
}

}  // namespace

Command add_sample(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "generate text from a checkpoint");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_option("--prompt", a->prompt, "text to continue (with --chat: the user's message)")->required();
  sub->add_flag("--chat", a->chat,
                "render --prompt as a user message with the model's chat template (generation prompt added) and print "
                "the reply, generated up to the template's end-of-turn token; needs the model's tokenizer files (hf:DIR)");
  a->system_opt = sub->add_option("--system", a->system, "with --chat: a system message before the user's");
  a->limit_opt = sub->add_option("--chat-limit", a->chat_limits,
                                 "with --chat: raise a bound on the template's render, NAME=N (steps, output, string, list, "
                                 "depth; docs/chat.md); repeat it for several");
  sub->add_option("--tokens", a->gen.max_new_tokens, "tokens to generate")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  sub->add_option("--temperature", a->gen.temperature, "softmax temperature; 0 = greedy")->capture_default_str()
      ->check(finite_in(0, 1e6));
  sub->add_option("--top-k", a->gen.top_k, "sample from the k most likely tokens; 0 = all")->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
  sub->add_option("--seed", a->gen.seed, "random seed")->capture_default_str()->check(uint64_text());
  sub->add_option("--tokenizer", a->tokenizer, "auto (the one the model's training data was tokenized with: the checkpoint's record, its datasets' "
                  "meta.json, an imported model's tokenizer.json, or byte/gpt2 by a vocabulary only they have; else an "
                  "error), gpt2, byte, or hf:DIR (a Hugging Face tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"auto", "gpt2", "byte"}));
  sub->add_option("overrides", a->overrides, "key=value settings over the saved config (e.g. runtime/threads=1)");
  return {sub, [a] { return sample(*a); }};
}

}  // namespace lt
