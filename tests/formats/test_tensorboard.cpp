// TensorBoard event files: the framing and CRC-32C, and a job's file read back with the real protobuf
// and crc32c libraries (tests/tools/read_tfevents.py, Debian's python3-protobuf and python3-crc32c),
// holding exactly the numbers of the job's metrics.jsonl, also after a resume that redoes steps; damaged
// records and lines that lose nothing after them; failed writes that stop the run.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "catch.hpp"
#include "distributed_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/formats/tensorboard.hpp"
#include "lora_trainer/training/metrics_log.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using namespace lt;
using namespace lt::test;
using nlohmann::json;

namespace {

// The event files of a run directory.
std::vector<std::string> event_files(const std::string& run_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec))
    if (e.path().filename().string().find("tfevents") != std::string::npos) out.push_back(e.path().string());
  return out;
}

// The records of an event file as protobuf decodes them, or nothing (a note printed) when Debian's
// python3-protobuf or python3-crc32c is missing.
std::optional<std::vector<json>> decoded(const std::string& file) {
  const Result r = shell("/usr/bin/python3 " + quote(std::string(LT_SOURCE_DIR) + "/tests/tools/read_tfevents.py") + " " +
                         quote(file));
  if (r.code == 3 || r.code == 127) {
    WARN("skipped the protobuf check: " << r.out << "(apt-get install python3-protobuf python3-crc32c)");
    return std::nullopt;
  }
  INFO(r.out);
  REQUIRE(r.code == 0);
  std::vector<json> records;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line)) records.push_back(json::parse(line));
  return records;
}

// Every number of a metrics.jsonl event with its tag, by the documented rule (cli.md, "TensorBoard"),
// written out here apart from scalars_of: `<event>/<field>`, `<event>/<field>/<key>` inside an object,
// `val`'s per_dataset as `val/loss/<name>`; its step is the x axis; strings, booleans and lists are not
// numbers of it.
void numbers_of(const json& v, const std::string& tag, std::map<std::string, double>& out) {
  if (v.is_number()) out[tag] = v.get<double>();
  if (v.is_object())
    for (const auto& [key, x] : v.items()) numbers_of(x, tag + "/" + key, out);
}
std::map<std::string, double> numbers_of(const json& event) {
  std::map<std::string, double> out;
  const std::string kind = event["event"].get<std::string>();
  for (const auto& [field, v] : event.items())
    if (field != "step") numbers_of(v, kind + "/" + (kind == "val" && field == "per_dataset" ? "loss" : field), out);
  return out;
}

// Requires the decoded records to be a file-version record, then one record of scalars for each event
// of metrics.jsonl that has numbers, in order, at its step, with exactly its numbers (as float32).
void require_same_numbers(const std::vector<json>& records, const std::vector<json>& events) {
  REQUIRE(!records.empty());
  CHECK(records[0]["file_version"] == "brain.Event:2");
  size_t at = 1;
  int scalars = 0;
  for (const auto& e : events) {
    const auto expected = numbers_of(e);
    if (expected.empty()) continue;
    INFO("event " << e.dump());
    REQUIRE(at < records.size());
    const json& r = records[at++];
    CHECK(r["step"] == e["step"]);
    CHECK(r["wall_time"].get<double>() > 1.7e9);
    CHECK(r["scalars"].size() == expected.size());
    for (const auto& [tag, value] : expected) {
      INFO(tag);
      REQUIRE(r["scalars"].contains(tag));
      CHECK(r["scalars"][tag].get<float>() == static_cast<float>(value));
      ++scalars;
    }
  }
  CHECK(at == records.size());
  CHECK(scalars > 20);
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C, the record framing, and a cut last record", "[tensorboard]") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);  // the CRC-32C check value (RFC 3720, B.4)
  CHECK(crc32c("", 0) == 0u);
  CHECK(crc32c("56789", 5, crc32c("1234", 4)) == 0xE3069283u);

  TempDir dir;
  EventFileWriter w(dir.str());
  CHECK(fs::path(w.path()).filename().string().rfind("events.out.tfevents.", 0) == 0);
  w.add_scalars(1, {{"train/loss", 2.5f}});
  w.add_scalars(2, {{"train/loss", 2.25f}, {"train/lr", 1e-3f}});
  w.add_scalars(3, {{"train/loss", 2.0f}});
  std::vector<int64_t> steps;
  CHECK(read_event_records(w.path(), &steps).size() == 4);
  CHECK((steps == std::vector<int64_t>{0, 1, 2, 3}));

  // A kill in the middle of a record: the next writer (the same file) drops the cut record.
  const std::string bytes = read_file(w.path());
  write_file_atomic(w.path(), bytes.substr(0, bytes.size() - 5));
  steps.clear();
  CHECK(read_event_records(w.path(), &steps).size() == 3);
  EventFileWriter again(dir.str());
  CHECK(again.path() == w.path());
  again.truncate_after(1);
  steps.clear();
  CHECK(read_event_records(w.path(), &steps).size() == 2);
  CHECK((steps == std::vector<int64_t>{0, 1}));
  again.add_scalars(2, {{"train/loss", 2.3f}});
  steps.clear();
  CHECK(read_event_records(w.path(), &steps).size() == 3);
  CHECK((steps == std::vector<int64_t>{0, 1, 2}));
  CHECK(event_files(dir.str()).size() == 1);

  // The writer's bytes decode with protobuf, as TensorBoard reads them.
  if (auto records = decoded(w.path())) {
    REQUIRE(records->size() == 3);
    CHECK((*records)[2]["step"] == 2);
    CHECK((*records)[2]["scalars"]["train/loss"].get<float>() == 2.3f);
  }
}

TEST_CASE("tensorboard: a lora/train job's event file holds the numbers of its metrics.jsonl, also after a resume", "[tensorboard]") {
  TempDir dir;
  // 4 phase-1 steps and 8 LoRA steps, a line a step, validations every 3 steps and at the stage ends.
  const std::string cfg = distributed_lora_config(dir, {"training/pre_lora_tokens=[512]", "training/post_lora_tokens=[1024]",
                                                        "logging/validation_interval=3", "logging/checkpoint_interval=5"});
  run_ok({"run", "job", cfg, dir / "out"});
  const std::string run_dir = dir / "out/runs/general/default/job";
  const auto files = event_files(run_dir);
  REQUIRE(files.size() == 1);
  const auto events = read_metrics_lines(run_dir);
  std::set<std::string> kinds;
  for (const auto& e : events) kinds.insert(e["event"].get<std::string>());
  CHECK((kinds == std::set<std::string>{"train", "val", "transition", "memory"}));
  const auto before = decoded(files[0]);
  if (!before) return;
  require_same_numbers(*before, events);
  // The figures a user looks for are there under their tags.
  std::set<std::string> tags;
  for (const auto& r : *before)
    if (r.contains("scalars"))
      for (const auto& [tag, v] : r["scalars"].items()) tags.insert(tag);
  for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "train/tok_per_s", "train/tokens", "train/stage",
                          "val/loss", "val/tokens", "val/stage", "val/loss/prose", "val/loss/more", "val/perplexity/prose",
                          "transition/tokens", "transition/trainable_params", "transition/frozen_params"})
    CHECK(tags.count(tag) == 1);

  // The event of step 2 damaged in both files (a byte of its record's payload, a stretch of its line),
  // then resumed from step 5 (latest moved back): the steps after it are redone, the damaged event is
  // dropped from both, saying so, and every intact one after it is kept: the file again holds exactly
  // what metrics.jsonl holds, each step once.
  REQUIRE(events[1]["step"] == 2);
  {
    std::vector<int64_t> steps;
    const auto records = read_event_records(files[0], &steps);
    REQUIRE(steps[2] == 2);
    std::string bytes = read_file(files[0]);
    const size_t at = 16 + records[0].size() + 16 + records[1].size() + 12 + records[2].size() / 2;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x20);
    write_file_atomic(files[0], bytes);
    std::string lines = read_file(run_dir + "/metrics.jsonl");
    lines.replace(lines.find('\n') + 3, 6, "#####");
    write_file_atomic(run_dir + "/metrics.jsonl", lines);
  }
  write_file_atomic(job_dir(dir, "out") + "/latest", "ntoks/640");
  const std::string out = run_ok({"run", "job", cfg, dir / "out"}).out;
  CHECK_THAT(out, Contains("from its latest checkpoint ntoks/640") && Contains("metrics.jsonl: dropped line 2") &&
                      Contains("damaged bytes at byte") && Contains("(after record 2)"));
  REQUIRE(event_files(run_dir) == files);
  const auto resumed = read_metrics_lines(run_dir);
  REQUIRE(resumed.size() == events.size() - 1);
  for (size_t i = 0; i < resumed.size(); ++i) CHECK(resumed[i]["step"] == events[i < 1 ? i : i + 1]["step"]);
  const auto after = decoded(files[0]);
  REQUIRE(after);
  require_same_numbers(*after, resumed);
  CHECK(after->size() == before->size() - 1);

  // logging/tensorboard=false: metrics.jsonl alone.
  run_ok({"run", "plain", cfg, dir / "out", "logging/tensorboard=false"});
  CHECK(event_files(dir / "out/runs/general/default/plain").empty());
  CHECK(fs::exists(dir / "out/runs/general/default/plain/metrics.jsonl"));
}

TEST_CASE("tensorboard: a damaged record in the middle loses no intact record after it, whatever part is damaged", "[tensorboard]") {
  TempDir dir;
  std::string valid;
  std::vector<size_t> offset;  // where each record starts
  {
    EventFileWriter w(dir.str());
    for (int step = 1; step <= 6; ++step) w.add_scalars(step, {{"train/loss", 3.0f - step / 4.0f}, {"train/stage", 0.0f}});
    valid = read_file(w.path());
    for (size_t at = 0; at < valid.size();) {
      offset.push_back(at);
      uint64_t length = 0;
      std::memcpy(&length, valid.data() + at, 8);
      at += 16 + length;
    }
    REQUIRE(offset.size() == 7);  // the file version, then steps 1..6
  }
  const std::string path = EventFileWriter(dir.str()).path();
  auto flip = [](std::string s, size_t at) {
    s[at] = static_cast<char>(s[at] ^ 0x41);
    return s;
  };
  const size_t r3 = offset[3];  // the record of step 3
  struct Case {
    std::string what, bytes;
    std::vector<int64_t> steps;  // the records read back
    std::vector<std::string> said;
  };
  const std::vector<Case> cases = {
      {"its payload", flip(valid, r3 + 14), {0, 1, 2, 4, 5, 6}, {"damaged bytes at byte " + std::to_string(r3), "(after record 3)"}},
      {"its length", flip(valid, r3 + 1), {0, 1, 2, 4, 5, 6}, {"at byte " + std::to_string(r3)}},
      {"its length's CRC", flip(valid, r3 + 9), {0, 1, 2, 4, 5, 6}, {"at byte " + std::to_string(r3)}},
      {"its payload's CRC", flip(valid, offset[4] - 2), {0, 1, 2, 4, 5, 6}, {"at byte " + std::to_string(r3)}},
      {"garbage between two records", valid.substr(0, r3) + "garbage" + valid.substr(r3), {0, 1, 2, 3, 4, 5, 6},
       {"7 damaged bytes at byte " + std::to_string(r3)}},
      {"two records", flip(flip(valid, offset[2] + 20), offset[5] + 20), {0, 1, 3, 4, 6}, {"(after record 2)", "(after record 4)"}},
      {"the file version", flip(valid, 3), {1, 2, 3, 4, 5, 6}, {"at byte 0 (the file's first record)"}},
      {"a cut last record", valid.substr(0, valid.size() - 3), {0, 1, 2, 3, 4, 5}, {"cut short at byte " + std::to_string(offset[6])}},
  };
  for (const auto& c : cases) {
    INFO("damaged: " << c.what);
    write_file_atomic(path, c.bytes);
    std::vector<int64_t> steps;
    std::vector<std::string> damage;
    read_event_records(path, &steps, &damage);
    CHECK(steps == c.steps);
    std::string said;
    for (const auto& d : damage) said += d + "\n";
    for (const auto& s : c.said) CHECK_THAT(said, Contains(s));
    // A resume rewrites the file from its intact records (the file version first), which protobuf reads
    // to the end, as TensorBoard does.
    EventFileWriter(dir.str()).truncate_after(5);
    steps.clear();
    damage.clear();
    read_event_records(path, &steps, &damage);
    CHECK(damage.empty());
    std::vector<int64_t> kept = {0};
    for (int64_t s : c.steps)
      if (s > 0 && s <= 5) kept.push_back(s);
    CHECK(steps == kept);
    if (auto records = decoded(path)) {
      REQUIRE(records->size() == kept.size());
      CHECK((*records)[0]["file_version"] == "brain.Event:2");
      CHECK(records->back()["step"] == kept.back());
    }
  }
}

TEST_CASE("metrics.jsonl: a damaged line in the middle is dropped on resume, the lines after it kept", "[tensorboard]") {
  TempDir dir;
  MetricsLog log(dir.str(), true, false);
  for (int step = 1; step <= 6; ++step) log.event({{"event", "train"}, {"step", step}, {"loss", 3.0 - step / 4.0}});
  const std::string path = dir / "metrics.jsonl";
  std::vector<std::string> lines;
  {
    std::istringstream in(read_file(path));
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  REQUIRE(lines.size() == 6);
  // Line 2 damaged, line 4 an object whose step is not a number, and a torn last line (a kill).
  write_file_atomic(path, lines[0] + "\n" + lines[1].substr(0, 9) + "\x01\xff" + lines[1].substr(9) + "\n" + lines[2] + "\n" +
                              R"({"event":"train","step":"x"})" "\n" + lines[4] + "\n" + lines[5] + "\n" +
                              lines[5].substr(0, 12));
  log.truncate_after(5);
  CHECK(read_file(path) == lines[0] + "\n" + lines[2] + "\n" + lines[4] + "\n");
  log.event({{"event", "train"}, {"step", 6}, {"loss", 1.5}});
  CHECK(read_metrics_lines(dir.str()).size() == 4);
}

namespace {

// Runs `f` in a child process whose files cannot grow past `limit` bytes (RLIMIT_FSIZE with SIGXFSZ
// ignored: a write past it fails with EFBIG, as one on a full disk with ENOSPC); the message of the
// UserError `f` throws, "" when it throws none, or "not a UserError: ..." for another exception.
std::string error_under_file_size_limit(rlim_t limit, const std::function<void()>& f) {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  std::fflush(stdout);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipe_fds[0]);
    std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {limit, limit};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    std::string said;
    try {
      f();
    } catch (const UserError& e) {
      said = e.what();
    } catch (const std::exception& e) {
      said = std::string("not a UserError: ") + e.what();
    }
    if (::write(pipe_fds[1], said.data(), said.size()) < 0) ::_exit(1);
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string said;
  char buf[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) said.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));
  return said;
}

}  // namespace

TEST_CASE("a failed write of metrics.jsonl or the event file stops the run naming the file, and keeps whole records", "[tensorboard]") {
  TempDir dir;
  auto events = [](MetricsLog& log) {
    for (int step = 1; step <= 200; ++step)
      log.event({{"event", "train"}, {"step", step}, {"loss", 3.0 - step / 100.0}, {"lr", 1e-3}, {"tokens", step * 128}});
  };
  // metrics.jsonl alone, then beside the event file (which reaches the limit at another step).
  for (bool tensorboard : {false, true}) {
    INFO("tensorboard " << tensorboard);
    const std::string run = dir / (tensorboard ? "both" : "jsonl");
    const std::string said = error_under_file_size_limit(3000, [&] {
      MetricsLog log(run, true, tensorboard);
      events(log);
    });
    CHECK_THAT(said, Contains("could not write " + run + "/") && Contains("File too large") && Contains("run the same command again"));
    const auto lines = read_metrics_lines(run);  // every line whole (parse throws on a torn one)
    CHECK(lines.size() > 5);
    CHECK(lines.size() < 200);
    CHECK(read_file(run + "/metrics.jsonl").back() == '\n');
    if (tensorboard) {
      const auto files = event_files(run);
      REQUIRE(files.size() == 1);
      std::vector<std::string> damage;
      CHECK(read_event_records(files[0], nullptr, &damage).size() >= lines.size());
      CHECK(damage.empty());
    }
  }
  // The event file alone.
  const std::string said = error_under_file_size_limit(2000, [&] {
    EventFileWriter w(dir / "tb");
    for (int step = 1; step <= 200; ++step) w.add_scalars(step, {{"train/loss", 1.0f}, {"train/lr", 1e-3f}});
  });
  const auto files = event_files(dir / "tb");
  REQUIRE(files.size() == 1);
  CHECK_THAT(said, Contains("could not write " + files[0]) && Contains("File too large"));
  std::vector<std::string> damage;
  CHECK(read_event_records(files[0], nullptr, &damage).size() > 5);
  CHECK(damage.empty());
  CHECK(fs::file_size(files[0]) <= 2000);
  // A full disk: metrics.jsonl on /dev/full.
  if (fs::exists("/dev/full")) {
    fs::create_directories(dir / "full");
    fs::create_symlink("/dev/full", dir / "full/metrics.jsonl");
    MetricsLog log(dir / "full", true, false);
    CHECK_THROWS_WITH(log.event({{"event", "train"}, {"step", 1}}),
                      Contains("could not write " + dir / "full/metrics.jsonl") && Contains("No space left on device"));
  }
}

TEST_CASE("a run whose metrics.jsonl cannot grow stops with exit 2 naming it, not exit 0 with lines missing", "[tensorboard]") {
  TempDir dir;
  make_byte_dataset(dir / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "train", dir / "cfg.json"};
  for (const auto& o : tiny_overrides(dir / "data")) args.push_back(o);
  for (const char* o : {R"(training/dataset=[{"name":"gen","rate":1}])", "training/tokens=5120", "logging/report_interval=1",
                        "training/validation=false", "runtime/threads=1", "logging/tensorboard=false"})
    args.push_back(o);
  REQUIRE(launch(args).code == 0);
  REQUIRE(fs::file_size(dir / "cfg.json") < 2500);  // config.json fits under the limit, 40 lines of metrics do not
  // 3 KiB a file (bash's ulimit -f counts KiB), SIGXFSZ ignored: the write past it fails with EFBIG.
  std::string cmd = "trap '' XFSZ; ulimit -f 3; exec " + quote(LT_LAUNCHER) + " run job " + quote(dir / "cfg.json") + " " +
                    quote(dir / "out");
  const Result r = shell("bash -c " + quote(cmd));
  INFO(r.out);
  CHECK(r.code == 2);
  const std::string run_dir = dir / "out/runs/general/default/job";
  CHECK_THAT(r.out, Contains("error: could not write " + run_dir + "/metrics.jsonl: File too large"));
  const auto lines = read_metrics_lines(run_dir);  // whole lines only
  CHECK(lines.size() > 5);
  CHECK(lines.size() < 40);
  CHECK_FALSE(fs::exists(dir / "out/checkpoints/general/default/job/final"));
}
