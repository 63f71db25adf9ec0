// The job directory lock (JobDirLock): one writer at a time, and the leftovers of interrupted saves
// removed by the writer that takes the directory: only those its job's writes made, each named.
#include "catch.hpp"

#include <unistd.h>

#include <filesystem>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "fixtures.hpp"
#include "launch.hpp"

using namespace lt;
using lt::test::Contains;
namespace fs = std::filesystem;

TEST_CASE("JobDirLock: a second writer is refused with the holder's PID, and once released the directory can be taken again", "[job]") {
  test::TempDir dir;
  const std::string job = dir / "checkpoints/p/g/j";
  {
    JobDirLock first(job);
    CHECK_THROWS_WITH(JobDirLock(job), Contains("is in use by another run of this job (PID " + std::to_string(::getpid()) + ")"));
  }
  CHECK_NOTHROW(JobDirLock(job));
}

namespace {

// A process that no longer runs: the largest pid Linux gives is below 2^22.
constexpr long kDeadPid = 4194999;

void make_entry(const std::string& path, bool dir = true) {
  fs::create_directories(dir ? path : fs::path(path).parent_path().string());
  write_file_atomic(dir ? path + "/f" : path, "x");
}

}  // namespace

TEST_CASE("JobDirLock: the writer removes only its job's leftovers, at any depth, and lookalikes of anyone else stay", "[job]") {
  test::TempDir dir;
  const std::string job = dir / "checkpoints/p/g/j";
  // What this job's own writes leave when killed: a save in progress, a checkpoint half-deleted,
  // `latest` being rewritten, and a replace killed between its two renames (the checkpoint missing).
  const std::vector<std::string> ours = {job + "/ntoks/.1280.tmp-" + temp_tag(job + "/ntoks/1280", kDeadPid),
                                         job + "/ntoks/.256.del-" + temp_tag(job + "/ntoks/256", kDeadPid),
                                         job + "/best/x/.y.tmp-" + temp_tag(job + "/best/x/y", kDeadPid)};
  const std::string old = job + "/final/.768.old-" + temp_tag(job + "/final/768", kDeadPid);
  const std::string latest_tmp = job + "/latest.tmp-" + temp_tag(job + "/latest", kDeadPid);
  // Named like leftovers but not made by this job: an older lora_trainer's, the user's own, one whose
  // tag was made for another name, at every depth, and a link named like one pointing outside.
  const std::vector<std::string> theirs = {job + "/ntoks/.1280.tmp-123-456", job + "/.notes.old-7-8",
                                           job + "/ntoks/128/.x.del-1-2", job + "/deep/er/.y.tmp-5-6-0123456789abcdef",
                                           job + "/ntoks/.640.tmp-" + temp_tag(job + "/ntoks/512", kDeadPid),
                                           job + "/.keep-me", job + "/.final.old-" + std::to_string(kDeadPid) + "-1"};
  for (const auto& p : ours) make_entry(p);
  for (const auto& p : theirs) make_entry(p);
  make_entry(old);
  make_entry(latest_tmp, false);
  make_entry(job + "/notes.tmp-1-2", false);
  make_entry(dir / "outside");
  fs::create_symlink(dir / "outside", job + "/ntoks/.999.tmp-" + std::to_string(kDeadPid) + "-3");
  {
    JobDirLock lock(job);
  }
  for (const auto& p : ours) CHECK_FALSE(fs::exists(p));
  CHECK_FALSE(fs::exists(latest_tmp));
  CHECK_FALSE(fs::exists(old));
  CHECK(fs::exists(job + "/final/768/f"));  // put back
  for (const auto& p : theirs) CHECK(read_file(p + "/f") == "x");
  CHECK(read_file(job + "/notes.tmp-1-2") == "x");
  CHECK(fs::is_symlink(job + "/ntoks/.999.tmp-" + std::to_string(kDeadPid) + "-3"));
  CHECK(read_file(dir / "outside/f") == "x");
}

TEST_CASE("JobDirLock: re-running a finished job names each leftover it removes and each lookalike it leaves", "[job][launcher]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "train", dir / "tiny.json", "training/tokens=256",
                                   R"(training/dataset=[{"name":"gen","rate":1}])"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  REQUIRE(test::launch(args).code == 0);
  REQUIRE(test::launch({"run", "tiny", dir / "tiny.json", dir / "out"}).code == 0);
  const std::string job = dir / "out/checkpoints/general/default/tiny";
  const std::string ours = job + "/final/.256.tmp-" + temp_tag(job + "/final/256", kDeadPid);
  const std::string theirs = job + "/final/.256.tmp-" + std::to_string(kDeadPid) + "-1", mine = job + "/.backup.old-2";
  for (const auto& p : {ours, theirs, mine}) make_entry(p);
  auto r = test::launch({"run", "tiny", dir / "tiny.json", dir / "out"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains("already finished") && Contains("removed " + ours) && Contains("left " + theirs + " alone") &&
                        Contains("left " + mine + " alone"));
  CHECK_FALSE(fs::exists(ours));
  CHECK(read_file(theirs + "/f") == "x");
  CHECK(read_file(mine + "/f") == "x");
  CHECK(is_checkpoint(job + "/final/256"));
}

TEST_CASE("job_dir_path refuses names that would leave OUT_DIR/checkpoints", "[job]") {
  CHECK(job_dir_path("out", "p", "g", "n") == "out/checkpoints/p/g/n");
  CHECK_THROWS_WITH(job_dir_path("out", "p", "g", "../x"), Contains("is not a valid name"));
  CHECK_THROWS_WITH(job_dir_path("out", ".hidden", "g", "n"), Contains("is not a valid name"));
}
