// The job directory lock (JobDirLock): one writer at a time, and the leftovers of interrupted saves
// removed by the writer that takes the directory.
#include "catch.hpp"

#include <unistd.h>

#include <filesystem>

#include "lora_trainer/training/job.hpp"
#include "lora_trainer/core/util.hpp"
#include "fixtures.hpp"

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

TEST_CASE("JobDirLock: the writer removes hidden leftovers of interrupted saves and nothing else", "[job]") {
  test::TempDir dir;
  const std::string job = dir / "checkpoints/p/g/j";
  for (const std::string d : {"/ntoks/.1280.tmp-123-456", "/.final.old-7-8", "/ntoks/128", "/.keep-me"}) {
    fs::create_directories(job + d);
    write_file_atomic(job + d + "/f", "x");
  }
  JobDirLock lock(job);
  CHECK_FALSE(fs::exists(job + "/ntoks/.1280.tmp-123-456"));
  CHECK_FALSE(fs::exists(job + "/.final.old-7-8"));
  CHECK(fs::exists(job + "/ntoks/128/f"));
  CHECK(fs::exists(job + "/.keep-me/f"));
}

TEST_CASE("job_dir_path refuses names that would leave OUT_DIR/checkpoints", "[job]") {
  CHECK(job_dir_path("out", "p", "g", "n") == "out/checkpoints/p/g/n");
  CHECK_THROWS_WITH(job_dir_path("out", "p", "g", "../x"), Contains("is not a valid name"));
  CHECK_THROWS_WITH(job_dir_path("out", ".hidden", "g", "n"), Contains("is not a valid name"));
}
