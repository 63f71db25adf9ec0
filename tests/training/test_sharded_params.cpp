// distributed/shard_params=all: phase 1's block parameters, their gradients and AdamW moments kept 1/N
// a rank (ZeRO-3, training/sharded_params.hpp), run through the launcher as a user runs it. Each block is
// gathered for its forward and again for its backward, whose gradients are summed over the ranks there
// (a micro-batch at a time) instead of once a step; the checkpoints hold every tensor whole.
//
// Where the arithmetic is the unsharded run's, the results are its bits: one micro-batch a rank on 2
// ranks (a + b is b + a), without clipping (the global norm sums the pieces' squares in another order;
// it is only reported then). With gradient accumulation, clipping and 3 ranks the sums are grouped
// otherwise: within the rank tolerance.
#include "catch.hpp"

#include <cmath>
#include <filesystem>

#include "distributed_fixtures.hpp"

using namespace lt;
using lt::test::Contains;
using test::run_ok;
using test::Result;
using test::job_dir;
using test::Losses;
using test::losses_of;
using test::kRankTolerance;

namespace {

// 4 full steps then 8 LoRA steps of 12 rows, a checkpoint every 2 steps, validation every 4 on 8 rows.
std::string params_config(const test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  return test::distributed_lora_config(dir,
                                       {"training/batch_size=12", "training/pre_lora_tokens=[1536]",
                                        "training/post_lora_tokens=[3072]", "logging/validation_interval=4",
                                        "logging/checkpoint_interval=2", "training/validation_steps=8"},
                                       extra);
}

// `cfg` as job `name` on 2 ranks unsharded (OUT_DIR dir/plain) and with distributed/shard_params=all
// (dir/sharded), which says what it shards and nothing about having no effect.
void run_plain_and_sharded(const test::TempDir& dir, const std::string& cfg, const std::string& name = "job") {
  run_ok({"run", name, cfg, dir / "plain", "--nproc", "2"});
  const Result s = run_ok({"run", name, cfg, dir / "sharded", "--nproc", "2", "distributed/shard_params=all"});
  CHECK_THAT(s.out, Contains("phase 1's block parameters sharded across 2 ranks"));
  CHECK_THAT(s.out, !Contains("has no effect"));
}

void check_close(const std::map<int64_t, double>& got, const std::map<int64_t, double>& ref) {
  for (const auto& [step, loss] : got) {
    INFO("step " << step << ": " << loss << " against " << ref.at(step));
    CHECK(std::abs(loss - ref.at(step)) <= kRankTolerance * std::abs(loss));
  }
}

}  // namespace

TEST_CASE("sharded parameters: phase 1 and the LoRA phase on 2 ranks, bit for bit as unsharded", "[distributed][shard]") {
  test::TempDir dir;
  // One micro-batch a rank (6 rows), no clipping: the sums are the unsharded run's.
  run_plain_and_sharded(dir, params_config(dir, {"training/per_device_batch_size=-1", "optimization/grad_clip=0"}));
  const Losses a = losses_of(dir, "plain"), b = losses_of(dir, "sharded");
  CHECK(a.train.size() == 12);
  CHECK(a.train == b.train);
  CHECK(a.val.size() == 6);
  CHECK(a.val == b.val);
  // Phase 1's checkpoints hold the whole state (parameters, moments), gathered: the same bytes.
  for (const char* ckpt : {"ntoks/768", "pre_lora_checkpoint", "ntoks/3072", "final/4608"}) {
    INFO(ckpt);
    const auto da = test::state_digests(job_dir(dir, "plain") + "/" + ckpt);
    REQUIRE(da.size() > 10);
    CHECK(da == test::state_digests(job_dir(dir, "sharded") + "/" + ckpt));
  }
}

TEST_CASE("sharded parameters: 3 ranks with gradient accumulation and clipping, within the rank tolerance", "[distributed][shard]") {
  test::TempDir dir;
  // Micro-batches of 2 (two a rank), the default clipping, 3 ranks: padding in every block's shards.
  const std::string cfg = params_config(dir, {"training/per_device_batch_size=2"});
  run_ok({"run", "job", cfg, dir / "plain", "--nproc", "3"});
  run_ok({"run", "job", cfg, dir / "sharded", "--nproc", "3", "distributed/shard_params=all"});
  const Losses a = losses_of(dir, "plain"), b = losses_of(dir, "sharded");
  CHECK(b.train.size() == 12);
  check_close(b.train, a.train);
  // The trained tensors: every one within the tolerance of the unsharded run's.
  const NamedTensors ta = read_checkpoint_tensors(job_dir(dir, "plain") + "/final/4608");
  const NamedTensors tb = read_checkpoint_tensors(job_dir(dir, "sharded") + "/final/4608");
  REQUIRE(ta.size() == tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    INFO(ta[i].first);
    REQUIRE(ta[i].first == tb[i].first);
    if (!ta[i].second.is_floating_point()) continue;
    const auto x = ta[i].second.to(torch::kFloat64), y = tb[i].second.to(torch::kFloat64);
    CHECK((x - y).abs().max().item<double>() <= 1e-4 * std::max(1.0, x.abs().max().item<double>()));
  }
}

TEST_CASE("sharded parameters: a resume is bit-identical, and a checkpoint continues on 2 -> 1 -> 3 ranks", "[distributed][shard]") {
  test::TempDir dir;
  const std::string cfg = params_config(dir, {"training/per_device_batch_size=-1", "optimization/grad_clip=0"});
  run_ok({"run", "job", cfg, dir / "s", "--nproc", "2", "distributed/shard_params=all"});
  const Losses ref = losses_of(dir, "s");

  // Stopped in phase 1 and resumed on 2 sharded ranks: every later checkpoint is the uninterrupted run's.
  run_ok({"run", "job", cfg, dir / "r", "--nproc", "2", "distributed/shard_params=all", "--restore",
          job_dir(dir, "s") + "/ntoks/768"});
  for (const char* ckpt : {"pre_lora_checkpoint", "final/4608"}) {
    INFO(ckpt);
    CHECK(test::state_digests(job_dir(dir, "s") + "/" + ckpt) == test::state_digests(job_dir(dir, "r") + "/" + ckpt));
  }

  // The sharded run's phase-1 checkpoint on 1 rank, whose next one goes on on 3 sharded ranks (the rows
  // each rank takes change: 12, then 4): the uninterrupted run's losses within the rank tolerance.
  run_ok({"run", "job", cfg, dir / "one", "--restore", job_dir(dir, "s") + "/ntoks/768"});
  run_ok({"run", "job", cfg, dir / "three", "--nproc", "3", "distributed/shard_params=all", "--restore",
          job_dir(dir, "one") + "/ntoks/1536"});
  const Losses one = losses_of(dir, "one"), three = losses_of(dir, "three");
  CHECK(one.train.size() == 10);
  CHECK(three.train.size() == 8);
  check_close(one.train, ref.train);
  check_close(three.train, ref.train);
}

TEST_CASE("sharded parameters: a train job (no LoRA phase) shards what it trains, bit for bit as unsharded", "[distributed][shard]") {
  test::TempDir dir;
  run_plain_and_sharded(dir, test::distributed_config(dir, "train", "train.json",
                                                      {R"(training/dataset=[{"name":"prose","rate":1}])", "training/tokens=1536",
                                                       "training/batch_size=12", "training/per_device_batch_size=-1",
                                                       "optimization/grad_clip=0", "logging/checkpoint_interval=2",
                                                       "optimization/ema/decay=0.9"}));
  const Losses a = losses_of(dir, "plain"), b = losses_of(dir, "sharded");
  CHECK(a.train.size() == 4);
  CHECK(a.train == b.train);
  // The average (optimization/ema/decay) of the pieces, gathered with the rest.
  const auto da = test::state_digests(job_dir(dir, "plain") + "/final/1536");
  CHECK(da.count("ema/h.0.attn.c_attn.weight") == 1);
  CHECK(da == test::state_digests(job_dir(dir, "sharded") + "/final/1536"));

  // A job started from weights (an export, as from a pretrained model): each rank stores its part of
  // each weight as it is read; the run is the unsharded one's.
  run_ok({"export", job_dir(dir, "plain") + "/final/1536", dir / "weights"});
  const std::string cfg = dir / "train.json";
  run_ok({"run", "job", cfg, dir / "from_plain", "--nproc", "2", "--restore", dir / "weights"});
  run_ok({"run", "job", cfg, dir / "from_sharded", "--nproc", "2", "--restore", dir / "weights", "distributed/shard_params=all"});
  const Losses c = losses_of(dir, "from_plain"), d = losses_of(dir, "from_sharded");
  CHECK(c.train.size() == 4);
  CHECK(c.train.at(1) < a.train.at(1) - 0.01);  // it starts from the trained weights, not a fresh init
  CHECK(c.train == d.train);
  CHECK(test::state_digests(job_dir(dir, "from_plain") + "/final/1536") ==
        test::state_digests(job_dir(dir, "from_sharded") + "/final/1536"));
}

TEST_CASE("sharded parameters: a continual benchmark trains every stage sharded, its boundary evaluations in lockstep",
          "[distributed][shard][benchmark]") {
  test::TempDir dir;
  // Two full-parameter stages (the optimizer rebuilt over the pieces at the second); 3 micro-batches of
  // boundary rows over 2 ranks: one rank runs one of them twice, uncounted.
  run_plain_and_sharded(dir,
                        test::distributed_config(dir, "continual/train/benchmark", "bench.json",
                                                 {"training/batch_size=8", "training/per_device_batch_size=-1",
                                                  "optimization/grad_clip=0", "eval/boundary_rows=6", "training/tokens=[768,768]",
                                                  R"(training/dataset=[[{"name":"prose","rate":1}],[{"name":"more","rate":1}]])"}),
                        "bench");
  auto events = [&](const std::string& out, const char* kind) { return test::event_losses(dir, out, kind, "bench"); };
  CHECK(events("plain", "train").size() == 6);
  CHECK(events("plain", "train") == events("sharded", "train"));
  CHECK(events("plain", "boundary").size() == 2);
  CHECK(events("plain", "boundary") == events("sharded", "boundary"));
  CHECK(read_file(dir / "plain/runs/general/default/bench/forgetting.txt") ==
        read_file(dir / "sharded/runs/general/default/bench/forgetting.txt"));
}
