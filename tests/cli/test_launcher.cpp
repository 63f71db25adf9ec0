// The launcher end to end, as a user runs it: subcommands, exit codes, continue-from-latest, and
// SIGINT -> checkpoint -> re-run ends with exactly the weights of an uninterrupted run.
#include "catch.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

#include "lora_trainer/formats/checkpoint.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

using test::Result;
using test::launch;
using test::read_metrics_lines;
using test::state_digests;

std::string tiny_config(const test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  test::make_byte_dataset(dir / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "train", dir / "tiny.json"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  args.push_back("training/tokens=1280");
  args.push_back(R"(training/dataset=[{"name":"gen","rate":1}])");
  for (const auto& o : extra) args.push_back(o);
  Result r = launch(args);
  REQUIRE(r.code == 0);
  return dir / "tiny.json";
}

}  // namespace

TEST_CASE("launcher: jobs, configure, run, re-run, checkpoints, inspect", "[launcher]") {
  test::TempDir dir;
  Result jobs = launch({"jobs"});
  CHECK(jobs.code == 0);
  CHECK_THAT(jobs.out, Contains("train"));

  std::string cfg = tiny_config(dir);
  Result run = launch({"run", "tiny", cfg, dir / "out"});
  INFO(run.out);
  REQUIRE(run.code == 0);
  CHECK_THAT(run.out, Contains("finished: 10 steps"));
  std::string job = dir / "out/checkpoints/general/default/tiny";
  CHECK(*read_latest(job) == "final/1280");
  CHECK(is_checkpoint(job + "/final/1280"));
  CHECK(std::filesystem::exists(dir / "out/runs/general/default/tiny/metrics.jsonl"));
  CHECK(std::filesystem::exists(dir / "out/runs/general/default/tiny/config.json"));

  Result again = launch({"run", "tiny", cfg, dir / "out"});
  CHECK(again.code == 0);
  CHECK_THAT(again.out, Contains("already finished"));
  CHECK_THAT(again.out, !Contains("note:"));
  // Continuing under another config is allowed, and says what changed (not runtime/ or logging/ keys).
  Result changed = launch({"run", "tiny", cfg, dir / "out", "optimization/lr=0.5", "runtime/threads=1"});
  CHECK(changed.code == 0);
  CHECK_THAT(changed.out, Contains("note: 1 setting differs from the config") && Contains("optimization/lr") &&
                              Contains("-> 0.5") && !Contains("runtime/threads"));

  Result list = launch({"checkpoints", "tiny", dir / "out"});
  CHECK(list.code == 0);
  CHECK_THAT(list.out, Contains("final/1280") && Contains("(latest)"));

  Result insp = launch({"inspect", job + "/final/1280"});
  REQUIRE(insp.code == 0);
  auto j = nlohmann::json::parse(insp.out);
  CHECK(j["metadata"]["step"] == 10);
  CHECK(j["metadata"]["kind"] == "plain");
}

TEST_CASE("launcher: user mistakes exit 2 with a message, never a crash", "[launcher]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir);
  Result typo = launch({"run", "x", cfg, dir / "out", "training/batch_sise=2"});
  CHECK(typo.code == 2);
  CHECK_THAT(typo.out, Contains("training/batch_size"));
  Result missing = launch({"run", "x", dir / "nope.json", dir / "out"});
  CHECK(missing.code == 2);
  CHECK_THAT(missing.out, Contains("nope.json"));
  Result nodata = launch({"run", "x", cfg, dir / "out", R"(training/dataset=[{"name":"absent","rate":1}])"});
  CHECK(nodata.code == 2);
  CHECK_THAT(nodata.out, Contains("absent/meta.json"));
  Result badkind = launch({"configure", "trian", dir / "c.json"});
  CHECK(badkind.code == 2);
  CHECK_THAT(badkind.out, Contains("did you mean \"train\""));
  Result swapped = launch({"run", "x", cfg, "training/batch_size=2"});
  CHECK(swapped.code == 2);
  CHECK_THAT(swapped.out, Contains("looks like a key=value override"));
  Result nosub = launch({});
  CHECK(nosub.code == 2);
  Result help = launch({"--help"});
  CHECK(help.code == 0);
  CHECK_THAT(help.out, Contains("run") && Contains("restore") && Contains("inspect"));
}

TEST_CASE("launcher: bad numbers and names on the command line exit 2 and write nothing", "[launcher]") {
  namespace fs = std::filesystem;
  test::TempDir dir;
  write_file_atomic(dir / "qa.jsonl", "{\"prompt\":\"a\",\"completion\":\"b\"}\n{\"prompt\":\"c\",\"completion\":\"d\"}\n");
  auto tokenize = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"tokenize", "--tokenizer", "byte", "--data-dir", dir / "data/inner"};
    args.insert(args.end(), extra.begin(), extra.end());
    return launch(args);
  };
  fs::create_directories(dir / "data/inner");
  Result neg = tokenize({"--format", "jsonl", "--name", "qa", "--length", "-5", dir / "qa.jsonl"});
  CHECK(neg.code == 2);
  CHECK_THAT(neg.out, Contains("--length"));
  CHECK_FALSE(fs::exists(dir / "data/inner/qa"));
  Result text_len = tokenize({"--name", "t", "--length", "16", dir / "qa.jsonl"});
  CHECK(text_len.code == 2);
  CHECK_THAT(text_len.out, Contains("--length sets the row length of --format jsonl, chat, pairs and prompts"));
  CHECK_FALSE(fs::exists(dir / "data/inner/t"));
  for (std::string bad : {"..", ".hidden", "a/b", ""}) {
    Result r = tokenize({"--format", "jsonl", "--name", bad, dir / "qa.jsonl"});
    INFO(bad << ": " << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("not a valid name"));
  }
  CHECK_FALSE(fs::exists(dir / "data/meta.json"));
  CHECK_FALSE(fs::exists(dir / "data/inner/meta.json"));
  CHECK_FALSE(fs::exists(dir / "data/inner/a"));
  Result sampling = launch({"configure", "train", dir / "c.json", R"(training/dataset=[{"name":"../data/x","rate":1}])"});
  CHECK(sampling.code == 2);
  CHECK_THAT(sampling.out, Contains("dataset name \"../data/x\" is not a valid name"));

  // Numbers out of range are refused before anything is read (any directory passes as CHECKPOINT here).
  for (std::string seed : {"-1", "18446744073709551616", "99999999999999999999999", "1e3"}) {
    Result r = launch({"sample", dir.str(), "--prompt", "hi", "--seed", seed});
    INFO(seed << ": " << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("must be a whole number from 0 to 18446744073709551615"));
  }
  Result rows = launch({"eval", dir.str(), "--rows", "0"});
  CHECK(rows.code == 2);
  CHECK_THAT(rows.out, Contains("--rows"));
  write_file_atomic(dir / "b.json", "{}");
  Result steps = launch({"bench", dir / "b.json", "--steps", "0"});
  CHECK(steps.code == 2);
  CHECK_THAT(steps.out, Contains("--steps") && Contains("not in range") && Contains("1048576"));  // CLI11 2.3 and 2.4 word it differently

  // configure never replaces a file unasked, nor creates directories.
  write_file_atomic(dir / "mine.json", "{\"hand\": \"edited\"}");
  Result over = launch({"configure", "train", dir / "mine.json"});
  CHECK(over.code == 2);
  CHECK_THAT(over.out, Contains("already exists") && Contains("--force"));
  CHECK(read_file(dir / "mine.json") == "{\"hand\": \"edited\"}");
  CHECK(launch({"configure", "train", dir / "mine.json", "--force"}).code == 0);
  CHECK_THAT(read_file(dir / "mine.json"), Contains("\"kind\": \"train\""));
  Result nodir = launch({"configure", "train", dir / "no/such/c.json"});
  CHECK(nodir.code == 2);
  CHECK_THAT(nodir.out, Contains("does not exist; create it first"));
  CHECK_FALSE(fs::exists(dir / "no"));
  Result isdir = launch({"configure", "train", dir / "data"});
  CHECK(isdir.code == 2);
  CHECK_THAT(isdir.out, Contains("is a directory"));
}

TEST_CASE("launcher: SIGINT saves a checkpoint and the re-run ends as an uninterrupted run", "[launcher]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir, {"training/tokens=12800", "logging/report_interval=1"});  // 100 steps
  Result straight = launch({"run", "straight", cfg, dir / "out"});
  REQUIRE(straight.code == 0);

  std::string log = dir / "interrupted.log";
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    (void)f;
    dup2(fileno(stdout), 2);
    std::string out = dir / "out";
    execl(LT_LAUNCHER, LT_LAUNCHER, "run", "interrupted", cfg.c_str(), out.c_str(), (char*)nullptr);
    _exit(127);
  }
  // Wait until it has taken a few steps, then interrupt it.
  bool started = false;
  for (int i = 0; i < 600 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    started = std::filesystem::exists(log) && read_file(log).find("step      5/") != std::string::npos;
  }
  REQUIRE(started);
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  std::string out = read_file(log);
  INFO(out);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_THAT(out, Contains("stopped by signal"));
  std::string job = dir / "out/checkpoints/general/default/interrupted";
  auto latest = read_latest(job);
  REQUIRE(latest);
  CHECK(latest->rfind("ntoks/", 0) == 0);

  Result resumed = launch({"run", "interrupted", cfg, dir / "out"});
  INFO(resumed.out);
  REQUIRE(resumed.code == 0);
  CHECK_THAT(resumed.out, Contains("continuing interrupted from its latest checkpoint"));
  auto a = state_digests(dir / "out/checkpoints/general/default/straight/final/12800");
  auto b = state_digests(job + "/final/12800");
  REQUIRE(a.size() > 10);
  CHECK(a == b);
}

TEST_CASE("launcher: the LoRA job is listed and `configure` shows every LoRA key with its default", "[launcher]") {
  test::TempDir dir;
  CHECK_THAT(launch({"jobs"}).out, Contains("lora/train"));
  REQUIRE(launch({"configure", "lora/train", dir / "lora.json"}).code == 0);
  auto j = nlohmann::json::parse(read_file(dir / "lora.json"));
  CHECK(j["job"]["kind"] == "lora/train");
  CHECK(j["optimization"]["lora"]["rank"] == 16);
  CHECK(j["optimization"]["lora"]["alpha"] == 16.0);
  CHECK(j["optimization"]["lora"]["target_modules"] == nlohmann::json::array({"all-linear"}));
  CHECK(j["optimization"]["lora"].contains("lr"));
  CHECK(j["training"]["pre_lora_tokens"].is_array());
  CHECK(j["training"]["post_lora_dataset"][0][0]["name"] == "code");
  CHECK_FALSE(j["training"].contains("tokens"));  // replaced by the phases' budgets
}

TEST_CASE("launcher: restore rebuilds a job from a checkpoint's saved config, overrides on top", "[launcher]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir, {"logging/checkpoint_interval=4"});
  REQUIRE(launch({"run", "orig", cfg, dir / "out"}).code == 0);
  std::string ck = dir / "out/checkpoints/general/default/orig/ntoks/512";
  REQUIRE(is_checkpoint(ck));
  // The config file is gone: everything comes from the checkpoint.
  std::filesystem::remove(cfg);
  Result r = launch({"restore", "copy", ck, dir / "out2", "logging/report_interval=2"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("step 4 of 10") && Contains("finished: 10 steps"));
  auto saved = nlohmann::json::parse(read_file(dir / "out2/runs/general/default/copy/config.json"));
  CHECK(saved["logging"]["report_interval"] == 2);
  CHECK(saved["architecture"]["d_model"] == 32);
  // It continues the original exactly: the same final weights.
  auto a = state_digests(dir / "out/checkpoints/general/default/orig/final/1280");
  auto b = state_digests(dir / "out2/checkpoints/general/default/copy/final/1280");
  CHECK(a == b);
}

TEST_CASE("launcher: skip phase one from a pretrained checkpoint, then export", "[launcher]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir);
  REQUIRE(launch({"run", "pre", cfg, dir / "out"}).code == 0);
  std::string base = dir / "out/checkpoints/general/default/pre/final/1280";
  std::vector<std::string> args = {"configure", "lora/train", dir / "ft.json"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  for (std::string o : {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[640]",
                        R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "optimization/lora/rank=4"})
    args.push_back(o);
  REQUIRE(launch(args).code == 0);
  Result ft = launch({"run", "ft", dir / "ft.json", dir / "out", "--restore", base});
  INFO(ft.out);
  REQUIRE(ft.code == 0);
  CHECK_THAT(ft.out, Contains("initialised weights from") && Contains("step 0 of 5") && Contains("transition to LoRA at step 0"));
  std::string final_ck = dir / "out/checkpoints/general/default/ft/final/640";
  auto meta = read_checkpoint_metadata(final_ck);
  CHECK(meta["kind"] == "lora");
  CHECK(meta["step"] == 5);
  // Again: finished, and --restore is not applied a second time.
  CHECK_THAT(launch({"run", "ft", dir / "ft.json", dir / "out", "--restore", base}).out, Contains("already finished"));
  Result ex = launch({"export", final_ck, dir / "merged"});
  REQUIRE(ex.code == 0);
  CHECK(read_checkpoint_metadata(dir / "merged")["merged_adapters"] == 8);
  // A checkpoint that does not exist is a user error.
  CHECK(launch({"run", "ft2", dir / "ft.json", dir / "out", "--restore", dir / "nowhere"}).code == 2);
}

TEST_CASE("launcher: a LoRA run ends with a report and a plot, and eval and sample read its checkpoints", "[launcher]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  std::vector<std::string> args = {"configure", "lora/train", dir / "l.json"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  for (std::string o : {"training/pre_lora_tokens=[640]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                        "training/post_lora_tokens=[640]", R"(training/post_lora_dataset=[[{"name":"gen2","rate":1}]])",
                        "optimization/lora/rank=4", "logging/report_interval=1"})
    args.push_back(o);
  REQUIRE(launch(args).code == 0);
  Result run = launch({"run", "rep", dir / "l.json", dir / "out"});
  INFO(run.out);
  REQUIRE(run.code == 0);
  CHECK_THAT(run.out, Contains("== report: job rep") && Contains("before LoRA (step 5)") && Contains("after LoRA (step 10)") &&
                          Contains("4096 trainable"));
  std::string rundir = dir / "out/runs/general/default/rep";
  std::string svg = read_file(rundir + "/loss.svg");
  CHECK_THAT(svg, Contains("<svg") && Contains("LoRA from here") && Contains("validation: gen2"));
  CHECK(std::filesystem::exists(rundir + "/report.md"));
  // Validation at the phase boundary measured every dataset.
  bool boundary_val = false;
  for (const auto& e : read_metrics_lines(rundir))
    if (e["event"] == "val" && e["step"] == 5) boundary_val = e["perplexity"].contains("gen") && e["perplexity"].contains("gen2");
  CHECK(boundary_val);

  std::string ck = dir / "out/checkpoints/general/default/rep/final/1280";
  Result ev = launch({"eval", ck, "--json", "--rows", "4"});
  INFO(ev.out);
  REQUIRE(ev.code == 0);
  auto j = nlohmann::json::parse(ev.out);
  CHECK(j["kind"] == "lora");
  CHECK(j["datasets"]["gen2"]["perplexity"].get<double>() > 1.0);
  CHECK(j["datasets"]["gen"]["tokens"] == 4 * 32);
  Result pre = launch({"eval", dir / "out/checkpoints/general/default/rep/pre_lora_checkpoint", "--dataset", "gen2", "--json"});
  REQUIRE(pre.code == 0);
  CHECK(nlohmann::json::parse(pre.out)["kind"] == "plain");

  Result s1 = launch({"sample", ck, "--prompt", "the cat", "--tokens", "20", "--seed", "3"});
  Result s2 = launch({"sample", ck, "--prompt", "the cat", "--tokens", "20", "--seed", "3"});
  REQUIRE(s1.code == 0);
  CHECK(s1.out.rfind("the cat", 0) == 0);
  CHECK(s1.out.size() > std::string("the cat").size());
  CHECK(s1.out == s2.out);  // the seed makes it repeatable
  // Reading a checkpoint writes nothing beside it.
  CHECK_FALSE(std::filesystem::exists("/nonexistent-lora-trainer-out"));
}

TEST_CASE("launcher: bench reports both phases, and the LoRA state is a bf16 base plus adapter-only optimizer state", "[launcher]") {
  test::TempDir dir;
  std::vector<std::string> args = {"configure", "lora/train", dir / "b.json"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  args.push_back("optimization/lora/rank=4");
  REQUIRE(launch(args).code == 0);
  Result r = launch({"bench", dir / "b.json", "--steps", "2", "--warmup", "1", "--out", dir / "bench.json",
                     "--weights-out", dir / "w.pt"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("matmul peak") && Contains("LoRA step time / full step time"));
  auto j = nlohmann::json::parse(read_file(dir / "bench.json"));
  REQUIRE(j["phases"].size() == 2);
  const auto& full = j["phases"][0];
  const auto& lora = j["phases"][1];
  CHECK(full["tokens_per_s"].get<double>() > 0);
  CHECK(full["mfu"].get<double>() > 0);
  CHECK(j["matmul_peak_gflops"].get<double>() > 0);
  const int64_t n_params = full["state_bytes"]["weights"].get<int64_t>() / 4;  // f32 in phase 1
  CHECK(full["state_bytes"]["optimizer"].get<int64_t>() == 8 * n_params);
  CHECK(lora["state_bytes"]["weights"].get<int64_t>() == 2 * n_params);  // the frozen base in bf16
  const int64_t adapter_values = lora["state_bytes"]["adapters"].get<int64_t>() / 4;
  // 2 layers, rank 4, (in + out) summed over c_attn (32, 96), c_proj (32, 32), c_fc (32, 128), mlp.c_proj (128, 32)
  CHECK(adapter_values == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32)));
  CHECK(lora["state_bytes"]["gradients"].get<int64_t>() == 4 * adapter_values);
  CHECK(lora["state_bytes"]["optimizer"].get<int64_t>() == 8 * adapter_values);
  CHECK(j["first_batch_check"]["loss"].get<double>() > 0);
  CHECK(std::filesystem::file_size(dir / "w.pt") > static_cast<uintmax_t>(n_params * 4));

  // --cuda-profile brackets a phase for a CUDA profiler: a clear error where there is no CUDA device.
  Result which = launch({"bench", dir / "b.json", "--steps", "1", "--warmup", "1", "--cuda-profile", "middle"});
  CHECK(which.code == 2);
  CHECK_THAT(which.out, Contains("--cuda-profile"));
  Result prof = launch({"bench", dir / "b.json", "--steps", "1", "--warmup", "1", "--cuda-profile", "lora", "--out",
                        dir / "prof.json"});
  INFO(prof.out);
  if (torch::cuda::is_available()) {
    CHECK(prof.code == 0);
  } else {
    CHECK(prof.code == 2);
    CHECK_THAT(prof.out, Contains("--cuda-profile records CUDA kernels") && Contains("runtime/device=cuda"));
    CHECK_FALSE(std::filesystem::exists(dir / "prof.json"));
  }
}

TEST_CASE("launcher: one writer per job directory, and a second run of the same job is refused, naming the first", "[launcher]") {
  test::TempDir dir;
  // 100,000 steps: still running when it is killed below, even on a fast machine
  std::string cfg = tiny_config(dir, {"training/tokens=12800000", "logging/report_interval=1", "logging/checkpoint_interval=1000000"});
  const std::string log = dir / "first.log";
  pid_t first = test::spawn({"run", "busy", cfg, dir / "out"}, {}, log);
  REQUIRE(test::wait_for_text(log, "step      3/", 60));
  Result second = launch({"run", "busy", cfg, dir / "out"});
  INFO(second.out);
  CHECK(second.code == 2);
  CHECK_THAT(second.out, Contains("is in use by another run of this job (PID " + std::to_string(first) + ")"));
  Result nproc = launch({"run", "busy", cfg, dir / "out", "--nproc", "2"});
  CHECK(nproc.code == 2);
  CHECK_THAT(nproc.out, Contains("is in use by another run of this job"));
  // Another job in the same OUT_DIR is not held up.
  Result other = launch({"run", "other", cfg, dir / "out", "training/tokens=256"});
  CHECK(other.code == 0);
  kill(first, SIGKILL);  // a crash: the kernel releases the lock
  CHECK(test::wait_exit(first, 30) == 128 + SIGKILL);
  Result after = launch({"run", "busy", cfg, dir / "out", "training/tokens=256"});
  INFO(after.out);
  CHECK(after.code == 0);
}


TEST_CASE("experiment: scripts/learning_forgetting.py trains full and LoRA runs from one base, evaluates both datasets, writes the table and the plot", "[launcher][experiment]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  REQUIRE(launch({"run", "pre", cfg, dir / "out"}).code == 0);
  const std::string base = dir / "out/checkpoints/general/default/pre/final/1280";
  const std::string script = "python3 scripts/learning_forgetting.py --binary " + test::quote(LT_LAUNCHER);
  const std::string only = "full lr 0.001,LoRA r16 lr 0.002,LoRA r16 lr 0.002 + wte x0.5";
  Result r = test::shell(script + " " + test::quote(base) + " gen2 gen --out " + test::quote(dir / "lf") +
                         " --tokens 256 --rows 4 --only " + test::quote(only));
  INFO(r.out);
  REQUIRE(r.code == 0);
  auto results = nlohmann::json::parse(read_file(dir / "lf/results.json"));
  REQUIRE(results["runs"].size() == 4);  // the base, then the three runs
  CHECK(results["runs"][0]["family"] == "base");
  CHECK(results["runs"][1]["label"] == "full lr 0.001");
  CHECK(results["runs"][3]["family"] == "lora+modules");
  for (const auto& run : results["runs"]) {
    INFO(run.dump());
    CHECK(run["target_loss"].get<double>() > 0);
    CHECK(run["source_loss"].get<double>() > 0);
  }
  // Each run trained on the target: its loss there fell from the base's, and the LoRA runs are LoRA states.
  for (size_t i = 1; i < 4; ++i) CHECK(results["runs"][i]["target_loss"].get<double>() < results["runs"][0]["target_loss"].get<double>());
  CHECK(read_checkpoint_metadata(results["runs"][2]["checkpoint"].get<std::string>())["kind"] == "lora");
  CHECK(read_checkpoint_metadata(results["runs"][3]["checkpoint"].get<std::string>())["lora"]["modules_to_save"] ==
        nlohmann::json::array({"wte.weight"}));
  const std::string table = read_file(dir / "lf/results.md");
  CHECK_THAT(table, Contains("| full lr 0.001 |") && Contains("| LoRA r16 lr 0.002 + wte x0.5 |") && Contains("gen2 loss (learned)"));
  const std::string svg = read_file(dir / "lf/learning_forgetting.svg");
  CHECK_THAT(svg, Contains("<svg") && Contains("full lr 0.001") && Contains("base (before)"));
  // Again: the finished runs are not trained twice.
  Result again = test::shell(script + " " + test::quote(base) + " gen2 gen --out " + test::quote(dir / "lf") +
                             " --tokens 256 --rows 4 --only " + test::quote(only));
  CHECK(again.code == 0);
  CHECK_THAT(again.out, Contains("already trained"));
  // Mistakes: a base that is not a checkpoint, a LoRA state, a label that does not exist.
  Result bad = test::shell(script + " " + test::quote(dir / "nowhere") + " gen2 gen --out " + test::quote(dir / "lf2"));
  CHECK(bad.code == 2);
  CHECK_THAT(bad.out, Contains("is not a checkpoint"));
  Result lora = test::shell(script + " " + test::quote(results["runs"][2]["checkpoint"].get<std::string>()) + " gen2 gen --out " +
                            test::quote(dir / "lf3"));
  CHECK(lora.code == 2);
  CHECK_THAT(lora.out, Contains("the base must be plain"));
  Result label = test::shell(script + " " + test::quote(base) + " gen2 gen --out " + test::quote(dir / "lf4") + " --only nope");
  CHECK(label.code == 2);
  CHECK_THAT(label.out, Contains("no run is labelled"));
}
