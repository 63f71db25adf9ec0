// `lora_trainer bench CONFIG [--steps N] [--warmup N] [--out FILE] ...`: the speed benchmark (cli/bench.hpp);
// with --generate N, the generation benchmark (cli/generation_bench.hpp).
#include "lora_trainer/cli/bench.hpp"
#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/generation_bench.hpp"

namespace lt {

Command add_bench(CLI::App& app) {
  auto b = std::make_shared<BenchOptions>();
  auto g = std::make_shared<GenerationBenchOptions>();
  auto* sub = app.add_subcommand("bench", "time phase-1 and LoRA steps of a lora/train config's model (synthetic tokens); "
                                          "with --generate, its generation with and without the KV cache");
  sub->add_option("CONFIG", b->config_path, "a lora/train config (e.g. configs/demo.json)")->required()->check(CLI::ExistingFile);
  sub->add_option("--steps", b->steps, "timed steps per phase")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  sub->add_option("--warmup", b->warmup_steps, "untimed steps before them")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  sub->add_option("--out", b->out_json, "JSON file for the figures")->capture_default_str();
  sub->add_option("--weights-out", b->weights_out, "also write the initial weights (torch pickle) for scripts/reference_gpt.py");
  sub->add_option("--profile", b->profile,
                  "also write PROFILE-full.trace.json and PROFILE-lora.trace.json: Chrome traces of the timed "
                  "steps (their times are then not representative); scripts/profile_summary.py sums them by op");
  sub->add_option("--cuda-profile", b->cuda_profile,
                  "full or lora: record only that phase's timed steps in a CUDA profiler started with "
                  "--profile-from-start off (ncu, nsys); scripts/profile_kernels.sh runs it")
      ->check(CLI::IsMember({"full", "lora"}));
  auto* generate = sub->add_option("--generate", g->new_tokens,
                                   "instead of training steps, time writing this many new tokens after a prompt (random "
                                   "weights): recomputing the context for each token, with the KV cache, and with the "
                                   "cache in a batch of --completions; figures to --out (default bench_generate.json)")
                       ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  for (const char* name : {"--steps", "--warmup", "--weights-out", "--profile", "--cuda-profile"})
    generate->excludes(sub->get_option(name));  // the training steps' options
  sub->add_option("--prompt-tokens", g->prompt_tokens, "with --generate: the prompt's length")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(1) << 20))->needs(generate);
  sub->add_option("--completions", g->completions, "with --generate: the rows of the batched run")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(4096)))->needs(generate);
  sub->add_option("overrides", b->overrides, "key=value settings over the config");
  return {sub, [b, g, generate, sub] {
            if (generate->count() == 0) {
              run_bench(*b);
              return 0;
            }
            g->config_path = b->config_path;
            g->overrides = b->overrides;
            if (sub->get_option("--out")->count() > 0) g->out_json = b->out_json;
            run_generation_bench(*g);
            return 0;
          }};
}

}  // namespace lt
