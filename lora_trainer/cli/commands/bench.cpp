// `lora_trainer bench CONFIG [--steps N] [--warmup N] [--out FILE] ...`: the speed benchmark (cli/bench.hpp).
#include "lora_trainer/cli/bench.hpp"
#include "lora_trainer/cli/commands/command.hpp"

namespace lt {

Command add_bench(CLI::App& app) {
  auto b = std::make_shared<BenchOptions>();
  auto* sub = app.add_subcommand("bench", "time phase-1 and LoRA steps of a lora/train config's model (synthetic tokens)");
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
  sub->add_option("overrides", b->overrides, "key=value settings over the config");
  return {sub, [b] {
            run_bench(*b);
            return 0;
          }};
}

}  // namespace lt
