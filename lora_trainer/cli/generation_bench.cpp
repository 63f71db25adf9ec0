#include "lora_trainer/cli/generation_bench.hpp"

#include <cstdio>

#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

nlohmann::json run_generation_bench(const GenerationBenchOptions& o) {
  const Config cfg = make_config(o.config_path, o.overrides);
  const ModelOptions mo = ModelOptions::from_config(cfg);
  if (o.prompt_tokens + o.new_tokens > mo.block_size)
    throw UserError("bench --generate: " + std::to_string(o.prompt_tokens) + " prompt tokens + " + std::to_string(o.new_tokens) +
                    " new ones exceed architecture/block_size " + std::to_string(mo.block_size) +
                    ", past which every token recomputes its window with or without the cache: give "
                    "architecture/block_size=" + std::to_string(o.prompt_tokens + o.new_tokens) + " (random weights "
                    "take any length), or fewer --generate / --prompt-tokens");
  const Runtime rt = Runtime::from_config(cfg);
  torch::manual_seed(1);
  CausalLM model = make_model(mo);
  model->init_weights(at::detail::createCPUGenerator(1));
  model->to(rt.device);
  auto gen = at::detail::createCPUGenerator(2);
  auto ids = torch::randint(0, mo.vocab_size, {o.prompt_tokens}, gen, torch::kLong);
  const std::vector<uint32_t> prompt(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());

  GenerateOptions g;
  g.max_new_tokens = o.new_tokens;
  g.temperature = 1.0;  // sampled, as rollouts are
  g.top_k = 0;
  g.seed = 3;
  std::printf("bench --generate: %lld new tokens after a %lld-token prompt, %s, model %lld layers x %lld wide, "
              "vocabulary %lld, block %lld\n", (long long)o.new_tokens, (long long)o.prompt_tokens, rt.describe().c_str(),
              (long long)mo.n_layer, (long long)mo.d_model, (long long)mo.vocab_size, (long long)mo.block_size);
  std::fflush(stdout);
  struct Run {
    const char* name;
    bool cache;
    int64_t rows;
  };
  const Run runs[] = {{"recomputed, 1 row (before the cache)", false, 1},
                      {"KV cache, 1 row", true, 1},
                      {"KV cache, batch", true, o.completions}};
  nlohmann::json out = {{"config", o.config_path}, {"device", rt.device.str()}, {"threads", rt.threads},
                        {"precision", rt.bf16_autocast ? "bf16 autocast" : "f32"}, {"torch_version", compat::torch_version()},
                        {"model", {{"family", to_string(mo.family)}, {"n_layers", mo.n_layer}, {"d_model", mo.d_model},
                                   {"n_heads", mo.n_head}, {"kv_heads", mo.kv_heads()}, {"vocab_size", mo.vocab_size},
                                   {"block_size", mo.block_size}}},
                        {"prompt_tokens", o.prompt_tokens}, {"new_tokens", o.new_tokens}};
  std::vector<std::vector<uint32_t>> first_rows;
  {  // untimed: the first call's allocations and kernel choices
    GenerateOptions w = g;
    w.max_new_tokens = 4;
    generate_batch(model, rt, prompt, 1, w);
  }
  for (const Run& r : runs) {
    GenerateOptions go = g;
    go.kv_cache = r.cache;
    rt.synchronize();
    const double t0 = now_seconds();
    const auto rows = generate_batch(model, rt, prompt, r.rows, go);
    rt.synchronize();
    const double s = now_seconds() - t0;
    int64_t tokens = 0;
    for (const auto& row : rows) tokens += static_cast<int64_t>(row.size());
    first_rows.push_back(rows[0]);
    out["runs"].push_back({{"name", r.name}, {"kv_cache", r.cache}, {"rows", r.rows}, {"seconds", s}, {"tokens", tokens},
                           {"tokens_per_s", tokens / s}});
    std::printf("  %-40s %3lld rows  %8.2f s  %10.1f tokens/s\n", r.name, (long long)r.rows, s, tokens / s);
    std::fflush(stdout);
  }
  const auto& runs_out = out["runs"];
  const double base = runs_out[0]["tokens_per_s"].get<double>();
  out["speedup_cache"] = runs_out[1]["tokens_per_s"].get<double>() / base;
  out["speedup_batch"] = runs_out[2]["tokens_per_s"].get<double>() / base;
  // The same seed draws the same tokens when the logits agree: a difference means the cached forward
  // computes another function (or, rarely, a near tie decided by rounding).
  size_t differ = 0;
  while (differ < first_rows[0].size() && differ < first_rows[1].size() && first_rows[0][differ] == first_rows[1][differ]) ++differ;
  const bool same = first_rows[0] == first_rows[1];
  out["same_tokens"] = same;
  if (!same) out["first_difference"] = differ;
  std::printf("KV cache: %.1fx the recomputed tokens/s one row at a time, %.1fx in a batch of %lld; %s\n",
              out["speedup_cache"].get<double>(), out["speedup_batch"].get<double>(), (long long)o.completions,
              same ? "the same tokens with and without it"
                   : ("the tokens differ from position " + std::to_string(differ)).c_str());
  write_file_atomic(o.out_json, out.dump(2) + "\n");
  std::printf("wrote %s\n", o.out_json.c_str());
  return out;
}

}  // namespace lt
