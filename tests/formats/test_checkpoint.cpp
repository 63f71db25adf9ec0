// Checkpoints: bit-exact round trip of every dtype, atomic saves, verified loads.
#include "catch.hpp"

#include <filesystem>
#include <optional>

#include "lora_trainer/formats/checkpoint.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
namespace fs = std::filesystem;

static NamedTensors sample_state() {
  torch::manual_seed(1);
  auto f = torch::randn({3, 4});
  f[0][0] = std::numeric_limits<float>::quiet_NaN();
  f[0][1] = -0.0f;
  f[0][2] = std::numeric_limits<float>::infinity();
  return {{"params/w", f},
          {"params/bf", torch::randn({5, 2}).to(torch::kBFloat16)},
          {"params/half", torch::randn({7}).to(torch::kFloat16)},
          {"params/dbl", torch::randn({2, 2}, torch::kFloat64)},
          {"optim/step", torch::tensor(int64_t(42))},
          {"x/i32", torch::arange(6, torch::kInt32).reshape({2, 3})},
          {"x/i16", torch::arange(6, torch::kInt16)},
          {"x/u8", torch::arange(250, 256, torch::kUInt8)},
          {"x/i8", torch::arange(-3, 3, torch::kInt8)},
          {"x/bool", torch::tensor({true, false, true})},
          {"x/empty", torch::empty({0, 3})}};
}

// The fields every checkpoint's metadata carries (a weights-only one needs no more).
static nlohmann::json meta(int64_t step = 0) {
  return {{"kind", "plain"}, {"step", step}, {"tokens", 0}, {"weights_only", true}};
}

static bool bits_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

TEST_CASE("every dtype round-trips bit for bit", "[checkpoint]") {
  test::TempDir dir;
  auto state = sample_state();
  save_checkpoint(dir / "ck", state, meta(42));
  auto back = read_checkpoint_tensors(dir / "ck");
  std::map<std::string, torch::Tensor> by_name(back.begin(), back.end());
  REQUIRE(back.size() == state.size());
  for (const auto& [name, t] : state) {
    INFO(name);
    REQUIRE(by_name.count(name));
    CHECK(bits_equal(by_name[name], t));
  }
  auto meta = read_checkpoint_metadata(dir / "ck");
  CHECK(meta["step"] == 42);
  CHECK(meta["format_version"] == kCheckpointFormatVersion);
}

TEST_CASE("a checkpoint written from a TensorStream holds one made tensor at a time, and reads back as the tensors", "[checkpoint]") {
  // import-hf writes a model larger than the memory it may take this way: each tensor made when its
  // turn comes and released once written.
  test::TempDir dir;
  const NamedTensors state = sample_state();
  TensorStream stream;
  for (const auto& [n, t] : state) stream.names.push_back(n);
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::optional<WeakTensor> previous;  // the last tensor made, without keeping it alive
  size_t made = 0, alive_at_make = 0;
  stream.get = [&](size_t i) {
    CHECK(i == made);  // in order, each once
    if (previous && !previous->expired()) ++alive_at_make;
    ++made;
    torch::Tensor t = state[i].second.clone();  // a fresh tensor, as a file read makes
    previous.emplace(t.getIntrusivePtr());
    return t;
  };
  save_checkpoint(dir / "ck", stream, meta());
  CHECK(made == state.size());
  CHECK(alive_at_make == 0);  // the writer kept none of the tensors it had written
  REQUIRE(previous);
  CHECK(previous->expired());
  std::map<std::string, torch::Tensor> back;
  for (auto& [n, t] : read_checkpoint_tensors(dir / "ck")) back[n] = t;
  REQUIRE(back.size() == state.size());
  for (const auto& [n, t] : state) CHECK(bits_equal(back.at(n), t));
}

TEST_CASE("load_checkpoint_into copies into a template and reports every mismatch", "[checkpoint]") {
  test::TempDir dir;
  save_checkpoint(dir / "ck", {{"params/a", torch::ones({2, 3})}, {"params/b", torch::ones({4})}}, meta());
  NamedTensors ok = {{"params/a", torch::zeros({2, 3})}, {"params/b", torch::zeros({4})}};
  load_checkpoint_into(dir / "ck", ok);
  CHECK(torch::equal(ok[0].second, torch::ones({2, 3})));

  NamedTensors bad = {{"params/a", torch::zeros({3, 2})}, {"params/c", torch::zeros({4})}};
  CHECK_THROWS_WITH(load_checkpoint_into(dir / "ck", bad),
                    Contains("params/a: shape (2, 3) in the checkpoint, (3, 2) expected") &&
                        Contains("missing params/c") && Contains("unexpected params/b"));
  NamedTensors wrong_dtype = {{"params/a", torch::zeros({2, 3}, torch::kBFloat16)}, {"params/b", torch::zeros({4})}};
  CHECK_THROWS_WITH(load_checkpoint_into(dir / "ck", wrong_dtype), Contains("dtype float32 in the checkpoint"));
}

TEST_CASE("a torn save is never taken for a checkpoint", "[checkpoint]") {
  test::TempDir dir;
  std::string job = dir / "job";
  save_checkpoint(job + "/ntoks/100", {{"params/a", torch::ones({2})}}, meta(1));
  write_latest(job, "ntoks/100");
  // What a crash mid-save leaves: a hidden temporary, and (worse) a directory without metadata.
  fs::create_directories(job + "/ntoks/.200.tmp-1-2");
  write_file_atomic(job + "/ntoks/.200.tmp-1-2/state.h5", "partial");
  fs::create_directories(job + "/ntoks/300");
  write_file_atomic(job + "/ntoks/300/state.h5", "partial");
  CHECK(list_checkpoints(job) == std::vector<std::string>{"ntoks/100"});
  CHECK(*read_latest(job) == "ntoks/100");
  CHECK_FALSE(is_checkpoint(job + "/ntoks/300"));
  CHECK_THROWS_WITH(read_checkpoint_metadata(job + "/ntoks/300"), Contains("not a complete checkpoint"));
}

TEST_CASE("saving over an existing checkpoint replaces it whole", "[checkpoint]") {
  test::TempDir dir;
  save_checkpoint(dir / "best", {{"params/a", torch::ones({2})}}, meta(1));
  save_checkpoint(dir / "best", {{"params/b", torch::zeros({3})}}, meta(2));
  auto back = read_checkpoint_tensors(dir / "best");
  REQUIRE(back.size() == 1);
  CHECK(back[0].first == "params/b");
  CHECK(read_checkpoint_metadata(dir / "best")["step"] == 2);
  int leftovers = 0;
  for (auto& e : fs::directory_iterator(dir.path))
    leftovers += e.path().filename().string()[0] == '.';
  CHECK(leftovers == 0);
}

TEST_CASE("inspect gives per-tensor digests that change with the bytes", "[checkpoint]") {
  test::TempDir dir;
  save_checkpoint(dir / "a", {{"params/w", torch::ones({4})}}, meta());
  save_checkpoint(dir / "b", {{"params/w", torch::ones({4}) * 2}}, meta());
  auto ia = inspect_checkpoint(dir / "a"), ib = inspect_checkpoint(dir / "b");
  CHECK(ia["tensors"][0]["name"] == "params/w");
  CHECK(ia["tensors"][0]["dtype"] == "float32");
  CHECK(ia["tensors"][0]["fnv1a64"] != ib["tensors"][0]["fnv1a64"]);
  CHECK(inspect_checkpoint(dir / "a")["tensors"][0]["fnv1a64"] == ia["tensors"][0]["fnv1a64"]);
}
