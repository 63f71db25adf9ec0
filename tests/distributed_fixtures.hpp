// Shared helpers of the data-parallel tests (test_distributed.cpp, test_sharded_base.cpp,
// test_sharded_params.cpp): jobs on byte tokens in f32 configured for several ranks, where a run's
// outputs are, and its losses.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "fixtures.hpp"
#include "launch.hpp"

namespace lt::test {

// Per-step losses of 1, 2 and 3 ranks agree to this relative tolerance: the same f32 arithmetic except
// the order in which the micro-batch gradients are summed.
constexpr double kRankTolerance = 2e-5;

// `configure KIND DIR/FILE` for several ranks on the byte datasets "prose" and "more" (made here):
// tiny_overrides, f32, one thread, a line a step, a 20 s collective timeout, then `settings`; returns
// the config's path.
inline std::string distributed_config(const TempDir& dir, const std::string& kind, const std::string& file,
                                      const std::vector<std::string>& settings) {
  make_byte_dataset(dir / "data", "prose", 1);
  make_byte_dataset(dir / "data", "more", 2);
  std::vector<std::string> args = {"configure", kind, dir / file};
  for (const auto& o : tiny_overrides(dir / "data")) args.push_back(o);
  for (const auto& o : {"runtime/precision=f32", "runtime/threads=1", "logging/report_interval=1", "distributed/timeout_s=20"})
    args.push_back(o);
  args.insert(args.end(), settings.begin(), settings.end());
  Result r = launch(args);
  REQUIRE(r.code == 0);
  return dir / file;
}

// `configure lora/train DIR/lora.json` with the datasets "prose" (phase 1) and "more" (the LoRA phase),
// tiny_overrides, f32, one thread, rank 4, a line a step, a 20 s collective timeout, then `settings`
// and `extra`; returns the config's path.
inline std::string distributed_lora_config(const TempDir& dir, const std::vector<std::string>& settings,
                                           const std::vector<std::string>& extra = {}) {
  std::vector<std::string> all = {R"(training/pre_lora_dataset=[[{"name":"prose","rate":1}]])",
                                  R"(training/post_lora_dataset=[[{"name":"more","rate":1}]])", "optimization/lora/rank=4"};
  all.insert(all.end(), settings.begin(), settings.end());
  all.insert(all.end(), extra.begin(), extra.end());
  return distributed_config(dir, "lora/train", "lora.json", all);
}

// step -> loss of the "train" lines, and (step, dataset) -> loss of the "val" lines.
struct Losses {
  std::map<int64_t, double> train;
  std::map<std::pair<int64_t, std::string>, double> val;
};

inline Losses losses_of(const TempDir& dir, const std::string& out, const std::string& name = "job") {
  Losses l;
  for (const auto& e : read_metrics_lines(dir / (out + "/runs/general/default/" + name))) {
    if (e["event"] == "train") l.train[e["step"].get<int64_t>()] = e["loss"].get<double>();
    if (e["event"] == "val")
      for (auto& [ds, v] : e["per_dataset"].items()) l.val[{e["step"].get<int64_t>(), ds}] = v.get<double>();
  }
  return l;
}

// `launch(args)`, required to exit 0 (its output shown when it does not).
inline Result run_ok(const std::vector<std::string>& args) {
  Result r = launch(args);
  INFO(r.out);
  REQUIRE(r.code == 0);
  return r;
}

// The `loss` of each `kind` event ("train", "boundary") of job `name`'s run with OUT_DIR dir/out.
inline std::vector<nlohmann::json> event_losses(const TempDir& dir, const std::string& out, const std::string& kind,
                                                const std::string& name = "job") {
  std::vector<nlohmann::json> found;
  for (const auto& e : read_metrics_lines(dir / (out + "/runs/general/default/" + name)))
    if (e["event"] == kind) found.push_back(e["loss"]);
  return found;
}

}  // namespace lt::test
