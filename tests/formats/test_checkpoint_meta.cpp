// CheckpointMeta::read parses a checkpoint's metadata.json into typed fields once: a wrongly typed field
// is refused there, the error naming the file and the field, and an older checkpoint without the
// optional fields reads them as the values they had before they existed. The files are copies of the
// format-1 fixture (tests/data/checkpoints/format1_lora) with their metadata edited.
#include "catch.hpp"

#include <filesystem>
#include <functional>

#include <nlohmann/json.hpp>

#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"

using namespace lt;
using lt::test::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const fs::path kFormat1Lora = fs::path(LT_SOURCE_DIR) / "tests/data/checkpoints/format1_lora";

// A copy of the fixture at `dir`, its metadata changed by `edit`.
std::string edited_fixture(const std::string& dir, const std::function<void(json&)>& edit) {
  fs::create_directories(dir);
  fs::copy_file(kFormat1Lora / "state.h5", fs::path(dir) / "state.h5");
  json m = read_json_file((kFormat1Lora / "metadata.json").string());
  edit(m);
  write_file_atomic(dir + "/metadata.json", m.dump(2));
  return dir;
}

}  // namespace

TEST_CASE("checkpoint metadata: the fixture's fields read as typed values", "[checkpoint][format]") {
  const CheckpointMeta ck = CheckpointMeta::read(kFormat1Lora.string());
  CHECK(ck.kind == StateKind::Lora);
  CHECK(ck.step == 6);
  CHECK(ck.tokens == 768);
  CHECK(ck.total_steps == 12);
  REQUIRE(ck.best_score);
  CHECK(*ck.best_score == Approx(5.295351982116699));
  CHECK(ck.best_stage == 0);
  const std::map<int, uint64_t> cursors = {{0, 16}, {1, 8}};
  CHECK(ck.cursors == cursors);
  REQUIRE(ck.ema);
  CHECK(ck.ema->decay == Approx(0.9));
  CHECK(ck.ema->params.size() == 25);
  REQUIRE(ck.job);
  CHECK(ck.job->name == "fx");
  CHECK(ck.job->kind == "lora/train");
  CHECK(ck.has_config);
  CHECK(ck.config.contains("architecture"));
  CHECK(ck.trainable_params.size() == 25);
  // Fields it was written without: as they were before they existed.
  CHECK(ck.tokenizer.empty());
  CHECK(ck.base_model.is_null());
  CHECK(ck.base_hf_dir().empty());
  CHECK(ck.base_hf_config().is_null());
  CHECK_FALSE(ck.frozen_base);
  CHECK_FALSE(ck.exported_from);
  CHECK_FALSE(ck.imported_from);
}

TEST_CASE("checkpoint metadata: optional fields an older checkpoint lacks read as they did", "[checkpoint][format]") {
  test::TempDir d;
  const std::string dir = edited_fixture(d / "old", [](json& m) {
    for (const char* key : {"best_score", "best_stage", "ema", "tokenizer", "base_model", "frozen_base"}) m.erase(key);
  });
  const CheckpointMeta ck = CheckpointMeta::read(dir);
  CHECK_FALSE(ck.best_score);
  CHECK(ck.best_stage == 0);
  CHECK_FALSE(ck.ema);
  CHECK(ck.tokenizer.empty());
  CHECK(ck.base_model.is_null());
  CHECK_FALSE(ck.frozen_base);
  const CheckpointMeta null_score = CheckpointMeta::read(edited_fixture(d / "null", [](json& m) { m["best_score"] = nullptr; }));
  CHECK_FALSE(null_score.best_score);
}

TEST_CASE("checkpoint metadata: a wrongly typed field is refused at read, naming the file and the field",
          "[checkpoint][format][hostile]") {
  test::TempDir d;
  struct Case {
    const char* name;
    std::function<void(json&)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"best_score", [](json& m) { m["best_score"] = "x"; }, "field \"best_score\" must be a number or null"},
      {"tokenizer", [](json& m) { m["tokenizer"] = 5; }, "\"tokenizer\" must be a tokenizer's name"},
      {"cursors", [](json& m) { m["data"]["cursors"]["0"] = "a"; }, "field \"data\" must be an object with \"cursors\""},
      {"best_stage", [](json& m) { m["best_stage"] = -1; }, "field \"best_stage\" must be a non-negative integer"},
      {"ema", [](json& m) { m["ema"]["decay"] = "x"; }, "field \"ema\" must be an object"},
      {"job", [](json& m) { m["job"]["name"] = 3; }, "field \"job\" must be an object of strings"},
      {"config", [](json& m) { m["config"] = "x"; }, "field \"config\" must be an object"},
      {"trainable_params", [](json& m) { m["trainable_params"] = {1, 2}; }, "field \"trainable_params\" must be a list"},
      {"frozen_base", [](json& m) { m["frozen_base"] = {{"path", 5}}; }, "frozen_base.path is missing or of the wrong type"},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    const std::string dir = edited_fixture(d / c.name, c.edit);
    CHECK_THROWS_WITH(CheckpointMeta::read(dir), Contains(dir + "/metadata.json") && Contains(c.says));
    CHECK_THROWS_AS(read_checkpoint_metadata(dir), UserError);
  }
}
