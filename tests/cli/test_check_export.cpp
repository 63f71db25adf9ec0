// An export checked against its checkpoint as transformers would read it (`export --check`,
// `check-export`): a LoRA model trained on conversations passes, and each way of breaking an export
// that users meet (a wrong end-of-turn id, a changed template, the adapters left out) fails with exit 3
// naming it; a failed `export --check` publishes nothing.
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "chat_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using lt::test::Contains;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

TEST_CASE("check-export: a chat model's HF export passes, a broken one fails naming what is wrong", "[chat][launcher][hf]") {
  lt::test::TempDir tmp;
  const std::string model = lt::test::chat_model_dir(tmp), data = tmp / "data";
  const std::vector<std::string> records = {
      R"({"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]})",
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
          {"role": "assistant", "content": "Blue."}]})",
      R"({"prompt": "Hi", "completion": "Hello!"})"};
  lt::test::tokenize_conversations(tmp, model, data, records, 3, "0.2");
  // A short phase one (its end is pre_lora_checkpoint: the base without adapters), then adapters that
  // move the logits well past the tolerance.
  std::vector<std::string> args = {"configure", "lora/train", tmp / "chat.json"};
  for (const auto& o : lt::test::chat_job_overrides(data, 8192)) args.push_back(o);
  const std::string& conv = lt::test::kConversations;
  for (const std::string& o : std::vector<std::string>{"training/pre_lora_tokens=[512]", "training/pre_lora_dataset=" + conv,
                                                       "training/post_lora_dataset=" + conv, "optimization/lora/lr=0.02"})
    args.push_back(o);
  REQUIRE(lt::test::launch(args).code == 0);
  auto r = lt::test::launch({"run", "chat", tmp / "chat.json", tmp / "out"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const std::string job = tmp / "out/checkpoints/general/default/chat", ck = job + "/final/8704";

  // The export, checked before it is published; and again, as written.
  r = lt::test::launch({"export", ck, tmp / "hf", "--format", "hf", "--check"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Contains("check passed") && Contains("built-in conversation 3"));
  CHECK_THAT(r.out, Contains("prompt tokens alike"));
  r = lt::test::launch({"check-export", tmp / "hf", ck, "--tokens", "8"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains("check passed"));
  // Its own conversations: a record a line.
  lt::write_file_atomic(tmp / "prompts.jsonl", ojson::parse(records[0]).dump() + "\n");
  r = lt::test::launch({"check-export", tmp / "hf", ck, "--prompts", tmp / "prompts.jsonl"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains(tmp / "prompts.jsonl:1"));

  // A wrong end-of-turn id (generation_config.json), as a user copying files by hand makes it.
  fs::copy(tmp / "hf", tmp / "wrong_eot");
  lt::write_file_atomic(tmp / "wrong_eot/generation_config.json", R"({"eos_token_id": 5})");
  r = lt::test::launch({"check-export", tmp / "wrong_eot", ck});
  INFO(r.out);
  CHECK(r.code == 3);
  CHECK_THAT(r.out, Contains("end-of-turn ids") && Contains("generation_config.json"));
  // Another template (its system turns written otherwise).
  fs::copy(tmp / "hf", tmp / "other_template");
  json tc = lt::read_json_file(tmp / "other_template/tokenizer_config.json");
  std::string tmpl = tc["chat_template"];
  tmpl.replace(tmpl.find("+ message.role +"), std::string("+ message.role +").size(), "+ (message.role | upper) +");
  tc["chat_template"] = tmpl;
  lt::write_file_atomic(tmp / "other_template/tokenizer_config.json", tc.dump());
  fs::remove(tmp / "other_template/chat_template.jinja");
  r = lt::test::launch({"check-export", tmp / "other_template", ck});
  INFO(r.out);
  CHECK(r.code == 3);
  CHECK_THAT(r.out, Contains("tokenizer_config.json) renders another text") && Contains("built-in conversation 1"));
  // The adapters left out: the base alone (pre_lora_checkpoint, in the frozen base's bf16).
  REQUIRE(lt::test::launch({"export", job + "/pre_lora_checkpoint", tmp / "base_only", "--format", "hf", "--dtype", "bfloat16"}).code == 0);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"})
    if (fs::exists(fs::path(tmp / "hf") / f)) fs::copy_file(fs::path(tmp / "hf") / f, fs::path(tmp / "base_only") / f, fs::copy_options::overwrite_existing);
  r = lt::test::launch({"check-export", tmp / "base_only", ck});
  INFO(r.out);
  CHECK(r.code == 3);
  CHECK_THAT(r.out, Contains("logits") && Contains("an adapter left out"));

  // A failed export --check publishes nothing: OUT keeps the earlier export.
  const std::string before = lt::read_file(tmp / "hf/config.json");
  fs::remove_all(tmp / "hf/model.safetensors");
  lt::write_file_atomic(tmp / "long.jsonl", ojson{{"messages", {{{"role", "user"}, {"content", std::string(2000, 'x')}}}}}.dump() + "\n");
  r = lt::test::launch({"export", ck, tmp / "hf", "--format", "hf", "--check", "--prompts", tmp / "long.jsonl"});
  INFO(r.out);
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("does not fit the model's block"));
  CHECK_FALSE(fs::exists(tmp / "hf/model.safetensors"));
  CHECK(lt::read_file(tmp / "hf/config.json") == before);
  r = lt::test::launch({"export", ck, tmp / "native", "--check"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("--check checks --format hf exports"));
}

TEST_CASE("check-export: a model not trained on chat data is checked on plain prompts", "[launcher][hf]") {
  lt::test::TempDir tmp;
  lt::test::make_byte_dataset(tmp / "data", "gen", 5);
  std::vector<std::string> args = {"configure", "train", tmp / "job.json", "training/tokens=2048",
                                   R"(training/dataset=[{"name":"gen","rate":1}])", "architecture/family=llama",
                                   "architecture/activation=silu"};
  for (const auto& o : lt::test::tiny_overrides(tmp / "data")) args.push_back(o);
  REQUIRE(lt::test::launch(args).code == 0);
  auto r = lt::test::launch({"run", "plain", tmp / "job.json", tmp / "out"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const std::string ck = tmp / "out/checkpoints/general/default/plain/final/2048";
  r = lt::test::launch({"export", ck, tmp / "hf", "--format", "hf", "--check", "--check-tokens", "4"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Contains("built-in prompt 3") && Contains("check passed"));
}
