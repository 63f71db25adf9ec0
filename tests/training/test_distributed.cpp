// Data-parallel runs over c10d on loopback, through the launcher as a user runs them: 2 ranks take the
// steps 1 rank takes (both phases, with and without optimizer-state sharding), checkpoints move
// between world sizes, and a dead or hung rank ends the others with a clear error in bounded time.
#include "catch.hpp"

#include <cmath>

#include "distributed_fixtures.hpp"
#include "lora_trainer/cli/local_ranks.hpp"

using namespace lt;
using lt::test::Contains;
using test::launch;
using test::Result;
using test::job_dir;
using test::Losses;
using test::losses_of;
using test::kRankTolerance;

namespace {

// A LoRA job on byte tokens in f32: 8 full steps, then 8 LoRA steps, 8 rows a step in micro-batches
// of 2 (4 per rank with 2 ranks), a checkpoint every 4 steps.
std::string lora_config(const test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  return test::distributed_lora_config(dir,
                                       {"training/batch_size=8", "training/per_device_batch_size=2", "training/pre_lora_tokens=[2048]",
                                        "training/post_lora_tokens=[2048]", "logging/validation_interval=4",
                                        "logging/checkpoint_interval=4", "training/validation_steps=8"},
                                       extra);
}

// `cfg` run as job "job" on 2 ranks with the optimizer state unsharded (under "two") and sharded with the
// LoRA state (under "sharded"): both succeed and their checkpoints ntoks/3072 and final/4096 are bit-identical.
struct ShardedRuns {
  std::string plain_out;                                        // the unsharded run's output
  std::map<std::string, std::map<std::string, std::string>> digests;  // checkpoint -> its state digests
};
ShardedRuns sharded_matches_plain(const test::TempDir& dir, const std::string& cfg) {
  Result plain = launch({"run", "job", cfg, dir / "two", "--nproc", "2", "distributed/shard_optimizer=none"});
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  Result sharded = launch({"run", "job", cfg, dir / "sharded", "--nproc", "2", "distributed/shard_optimizer=lora"});
  INFO(sharded.out);
  REQUIRE(sharded.code == 0);
  ShardedRuns out{plain.out, {}};
  for (const char* ckpt : {"ntoks/3072", "final/4096"}) {
    INFO(ckpt);
    auto a = test::state_digests(job_dir(dir, "two", "job") + "/" + ckpt);
    CHECK(a == test::state_digests(job_dir(dir, "sharded", "job") + "/" + ckpt));
    out.digests[ckpt] = a;
  }
  return out;
}

template <class Key>
void require_close(const std::map<Key, double>& a, const std::map<Key, double>& b, size_t expected) {
  REQUIRE(a.size() == expected);
  REQUIRE(b.size() == expected);
  for (const auto& [k, va] : a) {
    REQUIRE(b.count(k));
    INFO("a " << va << " b " << b.at(k));
    CHECK(std::abs(va - b.at(k)) <= kRankTolerance * std::abs(va));
  }
}

}  // namespace

TEST_CASE("distributed: 2 ranks take the steps of 1 rank in both phases, with and without optimizer sharding",
          "[distributed]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir);
  Result one = launch({"run", "job", cfg, dir / "one"});
  INFO(one.out);
  REQUIRE(one.code == 0);
  Result plain = launch({"run", "job", cfg, dir / "two", "--nproc", "2", "distributed/shard_optimizer=none"});
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.out, Contains("2 ranks (4 rows each a step)"));
  Result sharded = launch({"run", "job", cfg, dir / "sharded", "--nproc", "2", "distributed/shard_optimizer=all"});
  INFO(sharded.out);
  REQUIRE(sharded.code == 0);

  // Per-step training losses over both phases, and the validation of both datasets (its rows split
  // between the ranks and the sums reduced), agree with one process.
  Losses l1 = losses_of(dir, "one", "job"), l2 = losses_of(dir, "two", "job"), ls = losses_of(dir, "sharded", "job");
  require_close(l1.train, l2.train, 16);
  require_close(l1.val, l2.val, 8);
  require_close(l1.train, ls.train, 16);

  // Sharding changes where the moments live, not the arithmetic: every checkpoint (written by rank 0
  // after gathering the shards) is bit-identical to the unsharded run's.
  for (const char* ckpt : {"ntoks/1024", "pre_lora_checkpoint", "ntoks/3072", "final/4096"}) {
    INFO(ckpt);
    auto a = test::state_digests(job_dir(dir, "two", "job") + "/" + ckpt);
    auto b = test::state_digests(job_dir(dir, "sharded", "job") + "/" + ckpt);
    REQUIRE(a.size() > 10);
    CHECK(a == b);
  }
  auto meta = read_checkpoint_metadata(job_dir(dir, "sharded", "job") + "/final/4096");
  CHECK(meta["distributed"]["ranks"] == 2);
  CHECK(meta["distributed"]["optimizer_sharded"] == true);
  // One process and two differ only in summation order, not by a whole micro-batch.
  CHECK(test::state_digests(job_dir(dir, "one", "job") + "/final/4096") !=
        test::state_digests(job_dir(dir, "two", "job") + "/final/4096"));
}

TEST_CASE("distributed: the modules_to_save train on 2 ranks with their moments sharded like the adapters'", "[distributed]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {R"(optimization/lora/modules_to_save=["wte","ln_f"])",
                                            "optimization/lora/modules_to_save_lr_ratio=0.5"});
  const ShardedRuns runs = sharded_matches_plain(dir, cfg);
  for (const auto& [ckpt, a] : runs.digests) {
    INFO(ckpt);
    CHECK(a.count("optim/exp_avg/wte.weight") == 1);
  }
  auto meta = read_checkpoint_metadata(job_dir(dir, "sharded", "job") + "/final/4096");
  CHECK(meta["distributed"]["optimizer_sharded"] == true);
  CHECK(meta["lora"]["modules_to_save"] == nlohmann::json::array({"wte.weight", "ln_f.weight", "ln_f.bias"}));
}

TEST_CASE("distributed: trainable token rows train on 2 ranks with their moments sharded like the adapters'", "[distributed][tokens]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"optimization/lora/trainable_token_indices=[32,101,256]"});
  // Ids outside the vocabulary: exit 2, naming the id and the vocabulary size.
  Result bad = launch({"run", "bad", cfg, dir / "bad", "--nproc", "2", "optimization/lora/trainable_token_indices=[32,257]"});
  CHECK(bad.code == 2);
  CHECK_THAT(bad.out, Contains("optimization/lora/trainable_token_indices: token id 257 is outside the vocabulary of "
                               "wte.weight (size 257"));
  const ShardedRuns runs = sharded_matches_plain(dir, cfg);
  CHECK_THAT(runs.plain_out, Contains("+ 96 in 3 trainable token rows of wte.weight (f32)"));
  for (const auto& [ckpt, a] : runs.digests) {
    INFO(ckpt);
    CHECK(a.count("params/wte.trainable_tokens_delta") == 1);
    CHECK(a.count("optim/exp_avg/wte.trainable_tokens_delta") == 1);
  }
  auto meta = read_checkpoint_metadata(job_dir(dir, "sharded", "job") + "/final/4096");
  CHECK(meta["distributed"]["optimizer_sharded"] == true);
  CHECK(meta["lora"]["trainable_tokens"] == nlohmann::json{{"wte.weight", {32, 101, 256}}});
}

TEST_CASE("distributed: DoRA magnitudes train on 2 ranks with their moments sharded like the adapters'", "[distributed][dora]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"optimization/lora/dora=true"});
  const ShardedRuns runs = sharded_matches_plain(dir, cfg);
  for (const auto& [ckpt, a] : runs.digests) {
    INFO(ckpt);
    size_t magnitudes = 0, moments = 0;
    for (const auto& [name, digest] : a) {
      if (name.rfind("params/", 0) == 0 && ends_with(name, ".lora_magnitude")) ++magnitudes;
      if (name.rfind("optim/exp_avg/", 0) == 0 && ends_with(name, ".lora_magnitude")) ++moments;
    }
    CHECK(magnitudes > 0);
    CHECK(moments == magnitudes);
  }
  auto meta = read_checkpoint_metadata(job_dir(dir, "sharded", "job") + "/final/4096");
  CHECK(meta["distributed"]["optimizer_sharded"] == true);
  CHECK(meta["lora"]["dora"] == true);
}

TEST_CASE("distributed: a QLoRA base on 2 ranks, each rank quantizing the same codes, sharded and unsharded bit-identical",
          "[distributed][qlora]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"optimization/lora/quantize_base=nf4", "logging/save_frozen_base=true"});
  const ShardedRuns runs = sharded_matches_plain(dir, cfg);
  CHECK_THAT(runs.plain_out, Contains("of them NF4"));
  for (const auto& [ckpt, a] : runs.digests) {
    INFO(ckpt);
    CHECK(a.count("nf4/h.0.attn.c_attn.weight.codes") == 1);  // the checkpoint copies the NF4 base
    CHECK(a.count("params/h.0.attn.c_attn.weight") == 0);
  }
  auto meta = read_checkpoint_metadata(job_dir(dir, "sharded", "job") + "/final/4096");
  CHECK(meta["lora"]["quantize_base"] == "nf4");
}

TEST_CASE("distributed: checkpoints of 2 ranks restore on 1 rank and those of 1 rank on 2", "[distributed]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir);
  REQUIRE(launch({"run", "job", cfg, dir / "one"}).code == 0);
  Result two = launch({"run", "job", cfg, dir / "two", "--nproc", "2"});  // default: the adapters' moments sharded
  INFO(two.out);
  REQUIRE(two.code == 0);
  Losses l1 = losses_of(dir, "one", "job");

  // 2 ranks' LoRA-phase state (sharded moments, gathered into the checkpoint) continues on 1 rank.
  Result a = launch({"run", "a", cfg, dir / "a", "--restore", job_dir(dir, "two", "job") + "/ntoks/3072"});
  INFO(a.out);
  REQUIRE(a.code == 0);
  // 1 rank's phase-1 state continues on 2 ranks through the transition, sharding phase 1 as well.
  Result b = launch({"run", "b", cfg, dir / "b", "--nproc", "2", "distributed/shard_optimizer=all", "--restore",
                     job_dir(dir, "one", "job") + "/ntoks/1024"});
  INFO(b.out);
  REQUIRE(b.code == 0);

  std::map<int64_t, double> tail_a, tail_b, ref_a, ref_b;
  for (auto& [step, loss] : losses_of(dir, "a", "a").train) tail_a[step] = loss;
  for (auto& [step, loss] : losses_of(dir, "b", "b").train) tail_b[step] = loss;
  for (auto& [step, loss] : l1.train) {
    if (step > 12) ref_a[step] = loss;
    if (step > 4) ref_b[step] = loss;
  }
  require_close(ref_a, tail_a, 4);
  require_close(ref_b, tail_b, 12);
}

TEST_CASE("distributed: a rank that dies or hangs ends the others with a clear error within the timeout",
          "[distributed]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"training/pre_lora_tokens=[2560000]", "distributed/timeout_s=5"});
  // Two ranks started as torchrun starts them, each on its own.
  auto start_pair = [&](const std::string& name, pid_t* r0, pid_t* r1) {
    std::map<std::string, std::string> env = {{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                                              {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(test::port_for_rank0())}};
    env["RANK"] = "0";
    *r0 = test::spawn({"run", name, cfg, dir / "out"}, env, dir / (name + ".0.log"));
    env["RANK"] = "1";
    *r1 = test::spawn({"run", name, cfg, dir / "out"}, env, dir / (name + ".1.log"));
    REQUIRE(test::wait_for_text(dir / (name + ".0.log"), "step      3/", 60));
  };

  // Ends rank 1 with `sig` (SIGKILL: it dies; SIGSTOP: it hangs); rank 0's exit code, how long it
  // took to exit, and its output.
  auto end_rank1 = [&](const std::string& name, int sig) {
    pid_t r0, r1;
    start_pair(name, &r0, &r1);
    kill(r1, sig);
    const double t0 = now_seconds();
    const int code = test::wait_exit(r0, 30);
    const double waited = now_seconds() - t0;
    kill(r1, SIGKILL);
    kill(r1, SIGCONT);
    test::wait_exit(r1, 5);
    return std::make_tuple(code, waited, read_file(dir / (name + ".0.log")));
  };

  SECTION("killed") {
    auto [code, waited, log] = end_rank1("killed", SIGKILL);
    INFO(log);
    REQUIRE(code != -1);
    CHECK(waited < 15);
    CHECK(code == 3);
    CHECK_THAT(log, Contains("error: rank 0 of 2:") && Contains("failed") && Contains("distributed/timeout_s"));
    CHECK_THAT(log, !Contains("terminate called") && !Contains("Exception raised from"));
  }
  SECTION("hung") {
    auto [code, waited, log] = end_rank1("hung", SIGSTOP);
    INFO(log);
    REQUIRE(code != -1);
    CHECK(waited >= 4);  // it waited for the timeout (5 s), not less
    CHECK(waited < 5 + 10);
    CHECK(code == 3);
    CHECK_THAT(log, Contains("error: rank 0 of 2:") && Contains("distributed/timeout_s = 5 s"));
  }
  SECTION("killed under run --nproc") {
    const std::string log = dir / "nproc.log";
    pid_t parent = test::spawn({"run", "nproc", cfg, dir / "out", "--nproc", "2"}, {}, log);
    REQUIRE(test::wait_for_text(log, "step      3/", 60));
    test::Result kids = test::shell("pgrep -P " + std::to_string(parent) + " | tail -n 1");
    const pid_t child = static_cast<pid_t>(std::atol(kids.out.c_str()));
    REQUIRE(child > 0);
    kill(child, SIGKILL);
    const int code = test::wait_exit(parent, 30);
    INFO(read_file(log));
    REQUIRE(code != -1);
    CHECK(code != 0);
    CHECK_THAT(read_file(log), Contains("was killed by signal") && Contains("error: rank"));
  }
}

TEST_CASE("distributed: run --nproc serves the ranks' store, and a port that is not a store ends a rank clearly",
          "[distributed]") {
  test::TempDir dir;
  // A program listening on a port and never answering: the store's port taken by someone else.
  int port = 0;
  const int squatter = test::bind_loopback(0, true, &port);
  REQUIRE(squatter >= 0);
  const std::string cfg = lora_config(dir, {"distributed/timeout_s=2"});

  SECTION("run --nproc asked for a taken MASTER_PORT refuses before starting a rank") {
    const double t0 = now_seconds();
    Result taken = launch({"run", "job", cfg, dir / "out", "--nproc", "2"}, "MASTER_PORT=" + std::to_string(port));
    INFO(taken.out);
    CHECK(taken.code == 2);
    CHECK(now_seconds() - t0 < 10);
    CHECK_THAT(taken.out, Contains("cannot serve the ranks' store on port " + std::to_string(port) + " (MASTER_PORT)") &&
                              Contains("Leave MASTER_PORT unset"));
    CHECK_THAT(taken.out, !Contains("started 2 ranks"));
    CHECK_FALSE(std::filesystem::exists(dir / "out/checkpoints"));
  }
  SECTION("ranks started by hand whose MASTER_PORT leads elsewhere end within 2 x timeout + 10 s") {
    // Rank 1 (rank 0 would serve the store) and a rank 0 told that its starter serves it: both clients.
    std::map<std::string, std::string> env = {{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", std::to_string(port)}, {"RANK", "1"}};
    const pid_t r1 = test::spawn({"run", "job", cfg, dir / "out"}, env, dir / "r1.log");
    env["RANK"] = "0";
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    const pid_t r0 = test::spawn({"run", "job", cfg, dir / "out"}, env, dir / "r0.log");
    const double t0 = now_seconds();
    const int c1 = test::wait_exit(r1, 60), c0 = test::wait_exit(r0, 10);
    const double waited = now_seconds() - t0;
    for (pid_t p : {r0, r1}) kill(p, SIGKILL);  // where a rank still hangs: not left behind
    INFO(read_file(dir / "r1.log") << read_file(dir / "r0.log"));
    CHECK(c1 == kExitLostRank);
    CHECK(c0 == kExitLostRank);
    CHECK(waited < 40);
    const std::string at = "127.0.0.1:" + std::to_string(port);
    CHECK_THAT(read_file(dir / "r1.log"), Contains("rank 1 of 2: rendezvous at " + at + " did not finish within 14 s") &&
                                              Contains("does not answer as a c10d store") &&
                                              Contains("rank 0 can listen on that port"));
    CHECK_THAT(read_file(dir / "r0.log"), Contains("rank 0 of 2: rendezvous at " + at + " did not finish") &&
                                              Contains("the process that started them serves the store there"));
  }
  close(squatter);
}

// torchrun's static rendezvous (--master_addr/--master_port, no --rdzv_backend) serves the store from its
// agent and starts every rank as a client of it, as `run --nproc` does. Debian's python3-torch has it.
TEST_CASE("distributed: torchrun starts the ranks of a job as run --nproc does, bit-identical", "[distributed][torchrun]") {
  // -r/-t: LibTorch 1.13's torchrun on Python 3.11 cannot parse its own default redirect setting.
  const std::string torchrun = "timeout 300 torchrun --nnodes 1 --master_addr 127.0.0.1 -r 2 -t 2 --no_python";
  if (test::shell("command -v torchrun").code != 0) {
    WARN("skipped: no torchrun (apt-get install python3-torch provides one)");
    return;
  }
  // Debian 13's (2.6) asks for a libuv store, and was built without libuv: it cannot start anything.
  const Result probe = test::shell(torchrun + " --nproc_per_node 1 --master_port " + std::to_string(test::port_for_rank0()) + " true");
  if (probe.code != 0) {
    const size_t last = probe.out.find_last_of('\n', probe.out.size() >= 2 ? probe.out.size() - 2 : 0);
    WARN("skipped: this torchrun cannot start a process: " << probe.out.substr(last == std::string::npos ? 0 : last + 1));
    return;
  }
  test::TempDir dir;
  const std::string cfg = lora_config(dir);
  Result nproc = launch({"run", "job", cfg, dir / "nproc", "--nproc", "2"});
  INFO(nproc.out);
  REQUIRE(nproc.code == 0);
  const std::string cmd = torchrun + " --nproc_per_node 2 --master_port " + std::to_string(test::port_for_rank0()) + " " +
                          test::quote(LT_LAUNCHER) + " run job " + test::quote(cfg) + " " + test::quote(dir / "torchrun");
  Result tr = test::shell(cmd);
  INFO(tr.out);
  REQUIRE(tr.code == 0);
  for (const char* ckpt : {"pre_lora_checkpoint", "final/4096"}) {
    INFO(ckpt);
    auto a = test::state_digests(job_dir(dir, "nproc", "job") + "/" + ckpt);
    REQUIRE(a.size() > 10);
    CHECK(a == test::state_digests(job_dir(dir, "torchrun", "job") + "/" + ckpt));
  }
  CHECK(read_checkpoint_metadata(job_dir(dir, "torchrun", "job") + "/final/4096")["distributed"]["ranks"] == 2);
}

TEST_CASE("distributed: mistakes in the launch get a clear error and exit 2", "[distributed]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir);
  Result odd = launch({"run", "odd", cfg, dir / "out", "--nproc", "3"});
  CHECK(odd.code == 2);
  CHECK_THAT(odd.out, Contains("training/batch_size (8) must be a multiple of the number of ranks (3)"));
  Result micro = launch({"run", "micro", cfg, dir / "out", "--nproc", "2", "training/per_device_batch_size=3"});
  CHECK(micro.code == 2);
  CHECK_THAT(micro.out, Contains("4 rows a step, which must be a multiple of training/per_device_batch_size (3)"));
  // A micro-batch larger than a rank's share: the share is one micro-batch.
  Result big = launch({"run", "big", cfg, dir / "big", "--nproc", "2", "training/per_device_batch_size=8",
                       "training/pre_lora_tokens=[512]", "training/post_lora_tokens=[512]"});
  INFO(big.out);
  CHECK(big.code == 0);
  CHECK_THAT(big.out, Contains("each takes 4 rows a step, fewer than training/per_device_batch_size (8)"));
  Result both = launch({"run", "both", cfg, dir / "out", "--nproc", "2"}, "WORLD_SIZE=2");
  CHECK(both.code == 2);
  CHECK_THAT(both.out, Contains("cannot be combined with WORLD_SIZE=2"));
  Result no_master = launch({"run", "nm", cfg, dir / "out"}, "WORLD_SIZE=2 RANK=0 MASTER_ADDR= MASTER_PORT=");
  CHECK(no_master.code == 2);
  CHECK_THAT(no_master.out, Contains("MASTER_ADDR is not set"));
  CHECK_FALSE(std::filesystem::exists(dir / "out/checkpoints"));
  Result restore = launch({"restore", "r", dir.str(), dir / "out"}, "WORLD_SIZE=2");
  CHECK(restore.code == 2);
  CHECK_THAT(restore.out, Contains("`restore` runs as one process"));

  // Ranks that do not see the same OUT_DIR (no shared file system): rank 0 continues a finished job,
  // rank 1 would start afresh. Both stop before training, with a message.
  REQUIRE(launch({"run", "job", cfg, dir / "seen"}).code == 0);
  std::map<std::string, std::string> env = {{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                            {"MASTER_PORT", std::to_string(test::port_for_rank0())}};
  env["RANK"] = "0";
  pid_t r0 = test::spawn({"run", "job", cfg, dir / "seen"}, env, dir / "r0.log");
  env["RANK"] = "1";
  pid_t r1 = test::spawn({"run", "job", cfg, dir / "unseen"}, env, dir / "r1.log");
  const int c0 = test::wait_exit(r0, 60), c1 = test::wait_exit(r1, 60);
  INFO(read_file(dir / "r0.log") << read_file(dir / "r1.log"));
  CHECK(c0 == 2);
  CHECK(c1 == 2);
  CHECK_THAT(read_file(dir / "r0.log"), Contains("the ranks start from different steps (rank 0 at step 16"));
  CHECK_FALSE(std::filesystem::exists(dir / "unseen/checkpoints"));
}

TEST_CASE("distributed: a llama-family job trains both phases on 2 ranks, sharded and unsharded bit-identical", "[distributed][llama]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"architecture/family=llama", "architecture/activation=silu", "architecture/n_kv_heads=1",
                                            "architecture/d_ff=48", "architecture/tie_embeddings=false", "architecture/qkv_bias=true"});
  Result plain = launch({"run", "job", cfg, dir / "two", "--nproc", "2", "distributed/shard_optimizer=none"});
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  Result sharded = launch({"run", "job", cfg, dir / "sharded", "--nproc", "2", "distributed/shard_optimizer=all"});
  INFO(sharded.out);
  REQUIRE(sharded.code == 0);
  for (const char* ckpt : {"ntoks/1024", "pre_lora_checkpoint", "final/4096"}) {
    INFO(ckpt);
    auto a = test::state_digests(job_dir(dir, "two", "job") + "/" + ckpt);
    CHECK(a == test::state_digests(job_dir(dir, "sharded", "job") + "/" + ckpt));
  }
  auto final_digests = test::state_digests(job_dir(dir, "two", "job") + "/final/4096");
  CHECK(final_digests.count("params/model.layers.1.mlp.down_proj.lora_B") == 1);
  // The untied head is frozen: the checkpoint refers to it, in both runs the same values.
  CHECK(final_digests.count("params/lm_head.weight") == 0);
  const auto refs = [&](const char* run) {
    return read_checkpoint_metadata(job_dir(dir, run, "job") + "/final/4096")["frozen_base"];
  };
  CHECK(refs("two")["tensors"].contains("lm_head.weight"));
  CHECK(refs("two")["digest"] == refs("sharded")["digest"]);
}

TEST_CASE("distributed: activation checkpointing on 2 ranks writes the plain run's checkpoints bit for bit, dropout on",
          "[distributed][activation_checkpointing]") {
  test::TempDir dir;
  const std::string cfg = lora_config(dir, {"architecture/dropout=0.1"});
  Result plain = launch({"run", "job", cfg, dir / "plain", "--nproc", "2"});
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  Result ckpt = launch({"run", "job", cfg, dir / "ckpt", "--nproc", "2", "training/activation_checkpointing=true"});
  INFO(ckpt.out);
  REQUIRE(ckpt.code == 0);
  CHECK(losses_of(dir, "plain", "job").train == losses_of(dir, "ckpt", "job").train);
  for (const char* c : {"ntoks/1024", "pre_lora_checkpoint", "ntoks/3072", "final/4096"}) {
    INFO(c);
    auto a = test::state_digests(job_dir(dir, "plain", "job") + "/" + c);
    REQUIRE(a.size() > 10);
    CHECK(a == test::state_digests(job_dir(dir, "ckpt", "job") + "/" + c));
  }
}
