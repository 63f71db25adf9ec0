// Resume is bit-identical: N steps straight equal k steps, save, restore in a fresh trainer, N-k steps
// (weights, optimizer state and per-step losses), with and without gradient accumulation and dropout.
#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

std::unique_ptr<Trainer> make_trainer(const std::string& name, const std::string& out, const std::string& data,
                                          const std::vector<std::string>& extra = {}) {
  const std::vector<std::string> job = {"training/tokens=1280",
                                        R"(training/dataset=[{"name":"gen","rate":0.5},{"name":"gen2","rate":0.5}])"};
  return std::make_unique<Trainer>(test::job_spec(name), test::tiny_config(Trainer::schema(), data, job, extra), out);
}

void check_resume(const std::vector<std::string>& extra, int k) {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  auto straight = make_trainer("straight", dir / "out", dir / "data", extra);
  const int64_t N = straight->total_steps();
  REQUIRE(N == 10);
  std::vector<double> losses;
  for (int64_t i = 0; i < N; ++i) losses.push_back(straight->train_step().loss);
  CHECK(losses.back() < losses.front());  // it learns

  {
    auto first = make_trainer("split", dir / "out", dir / "data", extra);
    for (int i = 0; i < k; ++i) CHECK(first->train_step().loss == losses[static_cast<size_t>(i)]);
    first->save("ntoks/" + std::to_string(first->tokens()));
  }
  auto resumed = make_trainer("split", dir / "out", dir / "data", extra);
  REQUIRE(resumed->restore_latest() == "ntoks/" + std::to_string(k * 128));
  CHECK(resumed->step() == k);
  CHECK(resumed->tokens() == k * 128);
  for (int64_t i = k; i < N; ++i) {
    INFO("step " << i);
    CHECK(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  }
  test::require_same_state(*straight, *resumed);
}

}  // namespace

TEST_CASE("resume is bit-identical", "[resume]") { check_resume({}, 4); }

TEST_CASE("resume is bit-identical with gradient accumulation", "[resume]") {
  check_resume({"training/per_device_batch_size=2"}, 3);
}

TEST_CASE("resume is bit-identical with dropout (the RNG state is restored exactly)", "[resume]") {
  check_resume({"architecture/dropout=0.1", "training/per_device_batch_size=1"}, 5);
}

TEST_CASE("accumulation computes the same gradient as one big batch", "[resume]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  auto whole = make_trainer("a", dir / "out", dir / "data", {"runtime/precision=f32"});
  auto accum = make_trainer("b", dir / "out", dir / "data", {"runtime/precision=f32", "training/per_device_batch_size=1"});
  auto r1 = whole->train_step();
  auto r2 = accum->train_step();
  CHECK(r1.loss == Approx(r2.loss).epsilon(1e-5));
  CHECK(r1.grad_norm == Approx(r2.grad_norm).epsilon(1e-4));
}

TEST_CASE("restoring a checkpoint of another model size says what differs", "[resume]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  auto small = make_trainer("small", dir / "out", dir / "data");
  small->train_step();
  small->save("ntoks/128");
  auto big = make_trainer("big", dir / "out", dir / "data", {"architecture/d_model=64"});
  CHECK_THROWS_WITH(big->restore_from_path(small->job_dir() + "/ntoks/128"),
                    Contains("params/wte.weight: shape (257, 32) in the checkpoint, (257, 64) expected"));
}
