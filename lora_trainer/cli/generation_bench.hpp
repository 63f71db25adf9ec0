// The generation benchmark (`lora_trainer bench CONFIG --generate N`): how fast a config's model
// (random weights) writes N new tokens after a prompt, through generate.hpp, three ways side by side in
// one run: recomputing the whole context for each token, one completion at a time (what generation
// did before the KV cache); with the cache, one at a time (`sample`, `chat`, `eval --task`); with the
// cache, G completions of the prompt as one batch (a policy's rollouts). Also whether the first two
// give the same tokens. Prints a table and writes the figures as JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

struct GenerationBenchOptions {
  std::string config_path;             // any config: its architecture and runtime keys
  std::vector<std::string> overrides;  // key=value over it
  int64_t new_tokens = 256;            // each completion's length (no stop id ends it)
  int64_t prompt_tokens = 64;
  int64_t completions = 8;             // the batched run's rows
  std::string out_json = "bench_generate.json";
};

nlohmann::json run_generation_bench(const GenerationBenchOptions& opts);

}  // namespace lt
