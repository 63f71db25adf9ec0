// TensorBoard event files: the framing and CRC-32C, and a job's file read back with the real protobuf
// and crc32c libraries (tests/tools/read_tfevents.py, Debian's python3-protobuf and python3-crc32c),
// holding exactly the numbers of the job's metrics.jsonl, also after a resume that redoes steps.
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>

#include "catch.hpp"
#include "distributed_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/formats/tensorboard.hpp"
#include "lora_trainer/training/metrics_log.hpp"

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

// Requires the decoded records to be a file-version record, then one record of scalars for each event
// of metrics.jsonl that has numbers, in order, at its step, with its numbers (as float32).
void require_same_numbers(const std::vector<json>& records, const std::vector<json>& events) {
  REQUIRE(!records.empty());
  CHECK(records[0]["file_version"] == "brain.Event:2");
  size_t at = 1;
  int scalars = 0;
  for (const auto& e : events) {
    const auto expected = scalars_of(e);
    if (expected.empty()) continue;
    INFO("event " << e.dump());
    REQUIRE(at < records.size());
    const json& r = records[at++];
    CHECK(r["step"] == e["step"]);
    CHECK(r["wall_time"].get<double>() > 1.7e9);
    REQUIRE(r["scalars"].size() == expected.size());
    for (const auto& s : expected) {
      INFO(s.tag);
      REQUIRE(r["scalars"].contains(s.tag));
      CHECK(r["scalars"][s.tag].get<float>() == s.value);
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
  CHECK((kinds == std::set<std::string>{"train", "val", "transition"}));
  const auto before = decoded(files[0]);
  if (!before) return;
  require_same_numbers(*before, events);
  // The figures a user looks for are there under their tags.
  std::set<std::string> tags;
  for (const auto& r : *before)
    if (r.contains("scalars"))
      for (const auto& [tag, v] : r["scalars"].items()) tags.insert(tag);
  for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "train/tok_per_s", "train/tokens", "val/loss",
                          "val/loss/prose", "val/loss/more", "val/perplexity/prose", "transition/trainable_params",
                          "transition/frozen_params"})
    CHECK(tags.count(tag) == 1);

  // Resumed from step 5 (latest moved back): the steps after it are redone, and the file again holds
  // exactly what metrics.jsonl holds, each step once.
  write_file_atomic(job_dir(dir, "out") + "/latest", "ntoks/640");
  CHECK_THAT(run_ok({"run", "job", cfg, dir / "out"}).out, Contains("from its latest checkpoint ntoks/640"));
  REQUIRE(event_files(run_dir) == files);
  const auto resumed = read_metrics_lines(run_dir);
  CHECK(resumed.size() == events.size());
  const auto after = decoded(files[0]);
  REQUIRE(after);
  require_same_numbers(*after, resumed);
  CHECK(after->size() == before->size());

  // logging/tensorboard=false: metrics.jsonl alone.
  run_ok({"run", "plain", cfg, dir / "out", "logging/tensorboard=false"});
  CHECK(event_files(dir / "out/runs/general/default/plain").empty());
  CHECK(fs::exists(dir / "out/runs/general/default/plain/metrics.jsonl"));
}
