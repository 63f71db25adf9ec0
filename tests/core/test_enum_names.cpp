// Every enum a config key, a flag or a checkpoint spells has one table of names in the enum's order,
// and its parser and printer read that table (core/enum_names.hpp). A table out of step with its enum
// would read `schedule=wsd` as cosine, or write a LoRA checkpoint's kind as "plain": these pin each
// value to the name users and files use, in both directions.
#include <stdexcept>
#include <string>
#include <vector>

#include "catch.hpp"
#include "lora_trainer/core/dataset_style.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/frozen_storage.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/recipes/continual.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/training/optim.hpp"

using namespace lt;

namespace {
enum class Colour { Red, Green, Blue };
const std::vector<std::string> kColours = {"red", "green", "blue"};
}  // namespace

TEST_CASE("enum names: the parser and printer over one table", "[enum]") {
  CHECK(enum_from_name<Colour>(kColours, "green") == Colour::Green);
  CHECK_FALSE(enum_from_name<Colour>(kColours, "Green").has_value());  // names are exact
  CHECK(enum_name(kColours, Colour::Blue) == "blue");
  CHECK_THROWS_AS(enum_name(kColours, static_cast<Colour>(3)), std::logic_error);
  try {
    enum_named<Colour>(kColours, "purple", "paint/colour");
    FAIL("an unknown name was read");
  } catch (const UserError& e) {
    const std::string what = e.what();
    CHECK(what.find("paint/colour") != std::string::npos);  // the key
    CHECK(what.find("\"purple\"") != std::string::npos);    // the value
    CHECK(what.find("red, green, blue") != std::string::npos);  // what to write instead
  }
}

TEST_CASE("enum names: each value is spelled as configs, flags and checkpoints spell it", "[enum]") {
  SECTION("training/schedule, optimization/lora/schedule") {
    CHECK(parse_schedule_kind("constant") == ScheduleKind::Constant);
    CHECK(parse_schedule_kind("wsd") == ScheduleKind::Wsd);
    CHECK(parse_schedule_kind("cosine") == ScheduleKind::Cosine);
    CHECK(schedule_kind_name(ScheduleKind::Wsd) == "wsd");
    CHECK(schedule_kind_name(ScheduleKind::Cosine) == "cosine");
    CHECK_THROWS_AS(parse_schedule_kind("linear"), std::invalid_argument);
  }
  SECTION("distributed/shard_params") {
    CHECK(parse_shard_mode("none") == ShardMode::None);
    CHECK(parse_shard_mode("lora") == ShardMode::Lora);
    CHECK(parse_shard_mode("all") == ShardMode::All);
    CHECK(shard_mode_name(ShardMode::Lora) == "lora");
    CHECK(shard_mode_name(ShardMode::All) == "all");
    CHECK_THROWS_AS(parse_shard_mode("zero3"), std::invalid_argument);
  }
  SECTION("a checkpoint's kind") {
    CHECK(parse_state_kind("plain") == StateKind::Plain);
    CHECK(parse_state_kind("lora") == StateKind::Lora);
    CHECK(state_kind_name(StateKind::Lora) == "lora");
    CHECK_THROWS_AS(parse_state_kind("Lora"), std::invalid_argument);
  }
  SECTION("a dataset's style") {
    CHECK(parse_dataset_style("pmd", "x") == DatasetStyle::PMD);
    CHECK(parse_dataset_style("padded", "x") == DatasetStyle::PADDED);
    CHECK(parse_dataset_style("contrastive", "x") == DatasetStyle::CONTRASTIVE);
    CHECK(style_name(DatasetStyle::CONTRASTIVE) == "contrastive");
    CHECK_THROWS_AS(parse_dataset_style("chat", "dataset \"d\""), UserError);
  }
  SECTION("tokenize --loss-on") {
    CHECK(parse_chat_loss("assistant") == ChatLoss::Assistant);
    CHECK(parse_chat_loss("last") == ChatLoss::LastAssistant);
    CHECK(parse_chat_loss("all") == ChatLoss::All);
    CHECK_THROWS_AS(parse_chat_loss("user"), UserError);
  }
  SECTION("optimization/lora/init") {
    CHECK(parse_lora_init("gaussian") == LoraInit::Gaussian);
    CHECK(parse_lora_init("kaiming_uniform") == LoraInit::KaimingUniform);
    CHECK(std::string(to_string(LoraInit::KaimingUniform)) == "kaiming_uniform");
  }
  SECTION("architecture/family, activation, rope_scaling") {
    CHECK(parse_model_family("gpt2") == ModelFamily::Gpt2);
    CHECK(parse_model_family("llama") == ModelFamily::Llama);
    CHECK(std::string(to_string(ModelFamily::Llama)) == "llama");
    CHECK(std::string(activation_name(ModelOptions::Activation::GeluTanh)) == "gelu_tanh");
    CHECK(std::string(activation_name(ModelOptions::Activation::Silu)) == "silu");
    CHECK(std::string(rope_scaling_name(RopeScaling::Kind::Llama3)) == "llama3");
    CHECK_THROWS_AS(parse_model_family("mistral"), UserError);
  }
  SECTION("training/on_nonfinite, training/fade/curve") {
    CHECK(parse_on_nonfinite("stop") == OnNonfinite::Stop);
    CHECK(parse_on_nonfinite("skip") == OnNonfinite::Skip);
    CHECK(parse_fade_curve("linear") == FadeCurve::Linear);
    CHECK(parse_fade_curve("sigmoid") == FadeCurve::Sigmoid);
    CHECK_THROWS_AS(parse_fade_curve("step"), UserError);
  }
  SECTION("optimization/lora/quantize_base") {
    CHECK(parse_frozen_format("bf16") == FrozenFormat::Bf16);
    CHECK(parse_frozen_format("none") == FrozenFormat::Bf16);  // the older name, still read
    CHECK(std::string(to_string(FrozenFormat::Bf16)) == "bf16");
    CHECK(std::string(to_string(parse_frozen_format("nf4"))) == "nf4");
  }
}
