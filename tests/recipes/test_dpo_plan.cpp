// DPO's reference in the memory plan: the full-parameter form keeps a frozen bf16 copy of the starting
// weights beside the trained ones, which the plan counts (and refuses by) before the copy is allocated;
// the LoRA form's reference is the base with its adapters off, which costs nothing.
#include "catch.hpp"

#include <string>
#include <vector>

#include "dpo_fixtures.hpp"
#include "fixtures.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"

using namespace lt;

namespace {

std::unique_ptr<Trainer> make_dpo(const test::PrefData& d, bool lora) {
  const std::vector<std::string> job = {"training/tokens=256", R"(training/dataset=[{"name":"prefs","rate":1,"style":"contrastive"}])",
                                        std::string("optimization/dpo/lora=") + (lora ? "true" : "false"), "optimization/lora/rank=4"};
  return test::build_job("dpo/train", lora ? "dpo_lora" : "dpo_full",
                         test::tiny_config(job_registry().find("dpo/train").schema(), d.dir / "data", job), d.dir / "out");
}

// The bytes of the plan's items whose name contains `what`, over its phases.
int64_t planned(const MemoryPlan& plan, const std::string& what) {
  int64_t bytes = 0;
  for (const auto& phase : plan.phases)
    for (const auto& item : phase.items)
      if (item.what.find(what) != std::string::npos) bytes += item.host + item.device;
  return bytes;
}

}  // namespace

TEST_CASE("memory plan: DPO's full-parameter form counts its bf16 reference copy, the LoRA form nothing", "[memory][dpo]") {
  test::PrefData d;
  auto full = make_dpo(d, false);
  int64_t params = 0;
  for (const auto& p : full->model()->parameters()) params += p.numel();
  CHECK(planned(full->memory_plan(), "DPO's reference") == 2 * params);
  auto lora = make_dpo(d, true);
  CHECK(planned(lora->memory_plan(), "DPO's reference") == 0);
}
