// logging/keep_checkpoints: only the newest N periodic checkpoints of the job stay; nothing else is
// deleted, a kill mid-delete leaves a whole checkpoint or none, and the job still resumes.
#include "catch.hpp"

#include <filesystem>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
namespace fs = std::filesystem;

namespace {

std::unique_ptr<Trainer> make_job(const std::string& name, const test::TempDir& dir, const std::vector<std::string>& extra) {
  const std::vector<std::string> job = {"training/tokens=1280", R"(training/dataset=[{"name":"gen","rate":1}])",
                                        "logging/checkpoint_interval=1", "training/validation=false"};
  return std::make_unique<Trainer>(test::job_spec(name), test::tiny_config(Trainer::schema(), dir / "data", job, extra),
                                   dir / "out");
}

std::vector<std::string> periodic(const std::string& job_dir) {
  std::vector<std::string> out;
  for (const auto& c : list_checkpoints(job_dir))
    if (c.rfind("ntoks/", 0) == 0) out.push_back(c);
  return out;
}

}  // namespace

TEST_CASE("keep_checkpoints: the newest N periodic checkpoints stay, every other checkpoint and foreign file is kept, and the job resumes", "[job]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  // Copied into this job's ntoks/ (each older by its name): another job's checkpoint, another
  // project's checkpoint of a job with the same run name, and a directory of the user's.
  auto other = make_job("other", dir, {"logging/keep_checkpoints=0"});
  other->train_step();
  other->save("ntoks/64");
  auto same_name = make_job("kept", dir, {"logging/keep_checkpoints=0", "job/project=elsewhere"});
  same_name->train_step();
  same_name->save("ntoks/96");
  const std::string job_dir = dir / "out/checkpoints/general/default/kept";
  REQUIRE(same_name->job_dir() != job_dir);
  fs::create_directories(job_dir + "/ntoks");
  fs::copy(other->job_dir() + "/ntoks/64", job_dir + "/ntoks/64", fs::copy_options::recursive);
  fs::copy(same_name->job_dir() + "/ntoks/96", job_dir + "/ntoks/96", fs::copy_options::recursive);
  fs::create_directories(job_dir + "/ntoks/notes");
  // This job's checkpoint as a lora_trainer before write records saved it: no proof, so it stays.
  {
    auto t = make_job("kept", dir, {});
    t->train_step();
    t->save("ntoks/32", false);
    REQUIRE(fs::remove(job_dir + "/ntoks/32/" + kWriteRecord));
  }

  {
    auto t = make_job("kept", dir, {"logging/keep_checkpoints=2", "training/tokens=768"});  // 6 steps
    REQUIRE(t->job_dir() == job_dir);
    t->save("best", false);
    t->run();
  }
  // Periodic saves at steps 1-5 (tokens 128..640); the newest two of this job stay.
  CHECK(periodic(job_dir) == std::vector<std::string>{"ntoks/32", "ntoks/512", "ntoks/64", "ntoks/640", "ntoks/96"});
  CHECK(read_checkpoint_metadata(job_dir + "/ntoks/64")["job"]["name"] == "other");
  CHECK(read_checkpoint_metadata(job_dir + "/ntoks/96")["job"]["project"] == "elsewhere");
  CHECK(fs::is_directory(job_dir + "/ntoks/notes"));
  CHECK(is_checkpoint(job_dir + "/best"));
  CHECK(is_checkpoint(job_dir + "/final/768"));
  // Nothing half-deleted is left under a hidden name either.
  for (const auto& e : fs::directory_iterator(job_dir + "/ntoks")) CHECK(e.path().filename().string()[0] != '.');

  // The job resumes from what was kept: a longer budget continues after final.
  auto resumed = make_job("kept", dir, {"logging/keep_checkpoints=2", "training/tokens=1280"});
  REQUIRE(resumed->restore_latest() == "final/768");
  CHECK(resumed->step() == 6);
}

TEST_CASE("keep_checkpoints=0 (the default) keeps every periodic checkpoint", "[job]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  auto t = make_job("all", dir, {"training/tokens=640"});
  t->run();
  CHECK(periodic(t->job_dir()).size() == 4);
}

TEST_CASE("delete_checkpoint is safe against a kill: a checkpoint caught mid-delete is cleared, never put back", "[job]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  auto t = make_job("killed", dir, {});
  t->train_step();
  t->save("ntoks/128");
  t->train_step();
  t->save("ntoks/256");
  // A kill after delete_checkpoint's rename and before its removal leaves the hidden `.NAME.del-*`.
  const std::string job = t->job_dir();
  const std::string doomed = job + "/ntoks/.128.del-" + temp_tag(job + "/ntoks/128", 4194999);
  fs::rename(job + "/ntoks/128", doomed);
  CHECK(periodic(job) == std::vector<std::string>{"ntoks/256"});
  CHECK(remove_interrupted_saves(job) == 1);
  CHECK_FALSE(fs::exists(job + "/ntoks/128"));
  CHECK_FALSE(fs::exists(doomed));
  // And the delete itself: the checkpoint is gone from its name at once.
  delete_checkpoint(job + "/ntoks/256");
  CHECK_FALSE(fs::exists(job + "/ntoks/256"));
  CHECK(fs::is_empty(job + "/ntoks"));
}
