// distributed/shard_params=lora: the LoRA phase's frozen base kept 1/N a rank (peft/block_shard.hpp),
// run through the launcher as a user runs it. Sharding changes where the base's bytes live, not the
// arithmetic: every loss and every checkpoint of a sharded run equals the unsharded run's on as many
// ranks, bit for bit (the gathered weights are the same bytes, and a checkpointed block recomputes what
// the plain one computed).
#include "catch.hpp"

#include <cmath>
#include <filesystem>

#include "distributed_fixtures.hpp"

using namespace lt;
using lt::test::Contains;
using test::launch;
using test::run_ok;
using test::Result;
using test::job_dir;
using test::Losses;
using test::losses_of;
using test::kRankTolerance;

namespace {

// A LoRA job on byte tokens in f32: 4 full steps, then 8 LoRA steps of 12 rows (micro-batches of 2: 6
// a rank on 2 ranks, 4 on 3), a checkpoint every 2 steps; validation every 4 steps on 8 rows, which 3
// ranks do not share evenly (4 micro-batches: two ranks run one of theirs, one runs two).
std::string base_config(const test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  return test::distributed_lora_config(dir,
                                       {"training/batch_size=12", "training/per_device_batch_size=2", "training/pre_lora_tokens=[1536]",
                                        "training/post_lora_tokens=[3072]", "logging/validation_interval=4",
                                        "logging/checkpoint_interval=2", "training/validation_steps=8"},
                                       extra);
}

// `cfg` on `ranks` ranks unsharded (under "plain<ranks>") and with the base sharded (under
// "sharded<ranks>", with `more` settings): the same losses and the same LoRA-phase checkpoints, bit for
// bit. Returns the sharded run's output.
std::string sharded_equals_plain(const test::TempDir& dir, const std::string& cfg, int ranks,
                                 const std::vector<std::string>& more = {}) {
  const std::string n = std::to_string(ranks), plain = "plain" + n, sharded = "sharded" + n;
  run_ok({"run", "job", cfg, dir / plain, "--nproc", n});
  std::vector<std::string> args = {"run", "job", cfg, dir / sharded, "--nproc", n, "distributed/shard_params=lora"};
  args.insert(args.end(), more.begin(), more.end());
  const Result s = run_ok(args);
  CHECK_THAT(s.out, Contains("peak resident memory per rank: 0: "));  // the launcher's, for each rank
  const Losses a = losses_of(dir, plain), b = losses_of(dir, sharded);
  CHECK(a.train.size() == 12);
  CHECK(a.train == b.train);
  CHECK(a.val.size() == 6);
  CHECK(a.val == b.val);
  for (const char* ckpt : {"ntoks/3072", "final/4608"}) {
    INFO(ckpt);
    const auto da = test::state_digests(job_dir(dir, plain) + "/" + ckpt);
    REQUIRE(da.size() > 10);
    CHECK(da == test::state_digests(job_dir(dir, sharded) + "/" + ckpt));
  }
  const auto meta = [&](const std::string& out) { return read_checkpoint_metadata(job_dir(dir, out) + "/final/4608"); };
  CHECK(meta(sharded)["frozen_base"]["digest"] == meta(plain)["frozen_base"]["digest"]);
  return s.out;
}

}  // namespace

TEST_CASE("sharded base: 2 and 3 ranks train the LoRA phase bit for bit as the unsharded base does", "[distributed][shard]") {
  test::TempDir dir;
  const std::string cfg = base_config(dir);
  for (int ranks : {2, 3}) {
    INFO(ranks << " ranks");
    const std::string out = sharded_equals_plain(dir, cfg, ranks);
    CHECK_THAT(out, Contains(" on each of " + std::to_string(ranks) + " ranks: 24576 of them, the blocks' linear weights, sharded"));
  }
}

TEST_CASE("sharded base: an NF4 base shards its codes and scales, bit for bit as unsharded", "[distributed][shard][qlora]") {
  test::TempDir dir;
  const std::string cfg = base_config(dir, {"optimization/lora/quantize_base=nf4"});
  const std::string out = sharded_equals_plain(dir, cfg, 3);
  CHECK_THAT(out, Contains("of them NF4"));
  CHECK_THAT(out, Contains("sharded (distributed/shard_params)"));
}

TEST_CASE("sharded base: a job without phase one loads its base sharded (llama, DoRA, NF4 on 3 ranks)", "[distributed][shard][llama]") {
  test::TempDir dir;
  const std::string cfg = base_config(dir, {"architecture/family=llama", "architecture/activation=silu", "architecture/n_kv_heads=1",
                                       "architecture/d_ff=48", "architecture/tie_embeddings=false", "architecture/qkv_bias=true",
                                       "optimization/lora/dora=true"});
  run_ok({"run", "base", cfg, dir / "base"});
  const std::string base = job_dir(dir, "base", "base") + "/pre_lora_checkpoint";
  for (const char* quantize : {"none", "nf4"}) {
    INFO(quantize);
    const std::string q = std::string("optimization/lora/quantize_base=") + quantize;
    const std::vector<std::string> common = {"training/pre_lora_tokens=[]", R"(training/pre_lora_dataset=[])",
                                             "training/post_lora_tokens=[2304]", q, "--restore", base};
    auto args = [&](const std::string& out, bool sharded) {
      std::vector<std::string> a = {"run", "job", cfg, dir / out, "--nproc", "3"};
      if (sharded) a.push_back("distributed/shard_params=lora");
      a.insert(a.end(), common.begin(), common.end());
      return a;
    };
    const std::string tag = quantize;
    run_ok(args("plain_" + tag, false));
    const Result s = run_ok(args("sharded_" + tag, true));
    CHECK_THAT(s.out, Contains("linear weights sharded across the 3 ranks as they came (distributed/shard_params)"));
    CHECK(losses_of(dir, "plain_" + tag).train.size() == 6);
    CHECK(losses_of(dir, "plain_" + tag).train == losses_of(dir, "sharded_" + tag).train);
    const auto a = test::state_digests(job_dir(dir, "plain_" + tag) + "/final/2304");
    REQUIRE(a.count("params/model.layers.1.mlp.down_proj.lora_magnitude") == 1);
    CHECK(a == test::state_digests(job_dir(dir, "sharded_" + tag) + "/final/2304"));
  }
}

TEST_CASE("sharded base: a resume is bit-identical, and a checkpoint continues on 2 -> 1 -> 3 ranks", "[distributed][shard]") {
  test::TempDir dir;
  const std::string cfg = base_config(dir);
  run_ok({"run", "job", cfg, dir / "s", "--nproc", "2", "distributed/shard_params=lora"});
  const Losses ref = losses_of(dir, "s");

  // Stopped mid phase 2 and resumed on 2 sharded ranks: the end is bit for bit the uninterrupted run's.
  run_ok({"run", "job", cfg, dir / "r", "--nproc", "2", "distributed/shard_params=lora", "--restore",
          job_dir(dir, "s") + "/ntoks/3072"});
  CHECK(test::state_digests(job_dir(dir, "s") + "/final/4608") == test::state_digests(job_dir(dir, "r") + "/final/4608"));

  // 2 ranks' checkpoint on 1 rank, whose checkpoint goes on on 3 sharded ranks: the uninterrupted run's
  // losses within the rank tolerance.
  run_ok({"run", "job", cfg, dir / "one", "--restore", job_dir(dir, "s") + "/ntoks/3072"});
  run_ok({"run", "job", cfg, dir / "three", "--nproc", "3", "distributed/shard_params=lora", "--restore",
          job_dir(dir, "one") + "/ntoks/3840"});
  const Losses one = losses_of(dir, "one"), three = losses_of(dir, "three");
  CHECK(one.train.size() == 4);
  CHECK(three.train.size() == 2);
  for (const auto* tail : {&one.train, &three.train})
    for (const auto& [step, loss] : *tail) {
      INFO("step " << step << ": " << loss << " against " << ref.train.at(step));
      CHECK(std::abs(loss - ref.train.at(step)) <= kRankTolerance * std::abs(loss));
    }
}

TEST_CASE("sharded base: a job with phase one started from an export shards its base at the boundary, bit for bit as unsharded",
          "[distributed][shard]") {
  // The export's weights are phase one's starting point, not yet frozen: the base is sharded when the
  // LoRA phase freezes it, as in a job that trains phase one from its own initialisation.
  test::TempDir dir;
  const std::string cfg = base_config(dir);
  run_ok({"run", "job", cfg, dir / "s", "--nproc", "2"});
  run_ok({"export", job_dir(dir, "s") + "/pre_lora_checkpoint", dir / "start"});
  run_ok({"run", "job", cfg, dir / "plain", "--nproc", "2", "--restore", dir / "start"});
  const Result s = run_ok({"run", "job", cfg, dir / "sharded", "--nproc", "2", "distributed/shard_params=lora", "--restore",
                           dir / "start"});
  CHECK_THAT(s.out, Contains("transition to LoRA at step 4") && Contains("sharded (distributed/shard_params)"));
  const Losses a = losses_of(dir, "plain"), b = losses_of(dir, "sharded");
  CHECK(a.train.size() == 12);
  CHECK(a.train == b.train);
  CHECK(test::state_digests(job_dir(dir, "plain") + "/final/4608") == test::state_digests(job_dir(dir, "sharded") + "/final/4608"));
}

TEST_CASE("sharded base: what it cannot do is refused with exit 2 before training", "[distributed][shard]") {
  test::TempDir dir;
  const std::string cfg = base_config(dir);
  SECTION("a copy of the base in every checkpoint") {
    Result r = launch({"run", "job", cfg, dir / "a", "--nproc", "2", "distributed/shard_params=lora", "logging/save_frozen_base=true"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("logging/save_frozen_base=true and distributed/shard_params=lora do not go together"));
    CHECK_FALSE(std::filesystem::exists(dir / "a/checkpoints/general/default/job/latest"));
  }
  SECTION("a random base") {
    Result r = launch({"run", "job", cfg, dir / "b", "--nproc", "2", "distributed/shard_params=lora", "training/pre_lora_tokens=[]",
                       "training/pre_lora_dataset=[]", "training/allow_random_base=true"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("needs a base in a file"));
  }
  SECTION("a checkpoint that holds its own copy of the base") {
    run_ok({"run", "job", cfg, dir / "copy", "logging/save_frozen_base=true"});
    Result r = launch({"run", "job", cfg, dir / "c", "--nproc", "2", "distributed/shard_params=lora", "--restore",
                       job_dir(dir, "copy") + "/ntoks/3072"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("holds its own copy of the frozen base"));
    CHECK_FALSE(std::filesystem::exists(dir / "c/checkpoints/general/default/job/latest"));
  }
  SECTION("one process: nothing to shard, said, and the job runs") {
    Result r = launch({"run", "job", cfg, dir / "e", "distributed/shard_params=lora"});
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Contains("note: distributed/shard_params=lora has no effect in this run: it runs as one process"));
  }
  SECTION("a value it does not know") {
    Result r = launch({"run", "job", cfg, dir / "d", "--nproc", "2", "distributed/shard_params=everything"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("distributed/shard_params"));
  }
}

TEST_CASE("sharded base: a continual LoRA benchmark on 2 ranks, its boundary evaluations in lockstep, bit for bit as unsharded",
          "[distributed][shard][benchmark]") {
  test::TempDir dir;
  // 3 micro-batches of boundary rows over 2 ranks: one rank runs one of them twice, uncounted.
  const std::string cfg = test::distributed_config(
      dir, "continual/train/benchmark_lora", "bench.json",
      {"training/batch_size=8", "training/per_device_batch_size=2", "optimization/lora/rank=4", "eval/boundary_rows=6",
       "training/pre_lora_tokens=[1024]", "training/post_lora_tokens=[1024,1024]",
       R"(training/pre_lora_dataset=[[{"name":"prose","rate":1}]])",
       R"(training/post_lora_dataset=[[{"name":"more","rate":1}],[{"name":"prose","rate":1}]])"});
  run_ok({"run", "bench", cfg, dir / "plain", "--nproc", "2"});
  const Result s = run_ok({"run", "bench", cfg, dir / "sharded", "--nproc", "2", "distributed/shard_params=lora"});
  CHECK_THAT(s.out, Contains("sharded (distributed/shard_params)"));
  auto events = [&](const std::string& out, const char* kind) { return test::event_losses(dir, out, kind, "bench"); };
  CHECK(events("plain", "train").size() == 12);
  CHECK(events("plain", "train") == events("sharded", "train"));
  CHECK(events("plain", "boundary").size() == 3);
  CHECK(events("plain", "boundary") == events("sharded", "boundary"));
  CHECK(read_file(dir / "plain/runs/general/default/bench/forgetting.txt") ==
        read_file(dir / "sharded/runs/general/default/bench/forgetting.txt"));
}
