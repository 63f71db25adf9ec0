// The launcher end to end, as a user runs it: subcommands, exit codes, continue-from-latest, and
// SIGINT -> checkpoint -> re-run ends with exactly the weights of an uninterrupted run.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "lora_trainer/checkpoint.hpp"
#include "fixtures.hpp"

using namespace lt;
using Catch::Matchers::Contains;

namespace {

struct Result {
  int code;
  std::string out;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

Result launch(const std::vector<std::string>& args) {
  std::string cmd = quote(LT_LAUNCHER);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

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

// Digests of the tensors that define the training state (weights and optimizer), by name.
std::map<std::string, std::string> state_digests(const std::string& ckpt) {
  std::map<std::string, std::string> out;
  const nlohmann::json info = inspect_checkpoint(ckpt);
  for (const auto& t : info["tensors"]) out[t["name"].get<std::string>()] = t["fnv1a64"].get<std::string>();
  return out;
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
  Result nosub = launch({});
  CHECK(nosub.code == 2);
  Result help = launch({"--help"});
  CHECK(help.code == 0);
  CHECK_THAT(help.out, Contains("run") && Contains("restore") && Contains("inspect"));
}

TEST_CASE("launcher: SIGINT saves a checkpoint and the re-run ends as an uninterrupted run", "[launcher]") {
  test::TempDir dir;
  std::string cfg = tiny_config(dir, {"training/tokens=25600", "logging/report_interval=1"});  // 200 steps
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
  auto a = state_digests(dir / "out/checkpoints/general/default/straight/final/25600");
  auto b = state_digests(job + "/final/25600");
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
  CHECK(j["optimization"]["lora"]["target_modules"].size() == 4);
  CHECK(j["optimization"]["lora"].contains("lr"));
  CHECK(j["training"]["pre_lora_tokens"].is_array());
  CHECK(j["training"]["post_lora_dataset"][0][0]["name"] == "code");
  CHECK_FALSE(j["training"].contains("tokens"));  // replaced by the phases' budgets
}
