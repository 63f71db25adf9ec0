// `lora_trainer sample CHECKPOINT --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
// [--tokenizer NAME] [key=value ...]`: text generated from a checkpoint's model.
#include <cstdio>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {
namespace {

struct SampleArgs {
  std::string checkpoint, prompt, tokenizer = "auto";
  GenerateOptions gen;
  std::vector<std::string> overrides;
};

int sample(const SampleArgs& a) {
  Trainer* t = nullptr;
  auto job = load_for_reading(a.checkpoint, a.overrides, &t);
  std::string tokenizer_name = a.tokenizer;
  if (tokenizer_name == "auto") {
    // The imported model's own tokenizer.json where its directory still has one; else by vocabulary.
    const nlohmann::json& base = t->base_model();
    const std::string hf = base.is_object() ? base.value("hf_dir", std::string()) : std::string();
    tokenizer_name = !hf.empty() && std::filesystem::exists(hf + "/tokenizer.json") ? "hf:" + hf
                     : t->model()->options().vocab_size == 257                         ? "byte"
                                                                                       : "gpt2";
  }
  auto tok = make_tokenizer(tokenizer_name);
  GenerateOptions o = a.gen;
  o.stop_id = tok->eot_id();
  o.vocab_limit = tok->vocab_size();
  auto ema = t->ema_weights();  // with eval/use_ema, the moving average generates
  auto ids = generate(t->model(), t->runtime(), tok->encode(a.prompt), o);
  std::printf("%s%s\n", a.prompt.c_str(), tok->decode(ids).c_str());
  return 0;
}

}  // namespace

Command add_sample(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  auto* sub = app.add_subcommand("sample", "generate text from a checkpoint");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_option("--prompt", a->prompt, "text to continue")->required();
  sub->add_option("--tokens", a->gen.max_new_tokens, "tokens to generate")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  sub->add_option("--temperature", a->gen.temperature, "softmax temperature; 0 = greedy")->capture_default_str()
      ->check(finite_in(0, 1e6));
  sub->add_option("--top-k", a->gen.top_k, "sample from the k most likely tokens; 0 = all")->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
  sub->add_option("--seed", a->gen.seed, "random seed")->capture_default_str()->check(uint64_text());
  sub->add_option("--tokenizer", a->tokenizer, "auto (an imported model's own tokenizer.json when its directory has one, else byte when "
                  "the vocabulary is 257, else gpt2), gpt2, byte, or hf:DIR (a Hugging Face tokenizer.json in DIR)")
      ->capture_default_str()->check(tokenizer_name({"auto", "gpt2", "byte"}));
  sub->add_option("overrides", a->overrides, "key=value settings over the saved config (e.g. runtime/threads=1)");
  return {sub, [a] { return sample(*a); }};
}

}  // namespace lt
