// GRPO as the LoRA phase's objective (recipes/grpo_part.hpp): the prompts dataset `tokenize --format
// prompts` writes and its refusals; lora/train with prompts after the boundary (next-token phase 1, then
// GRPO on the adapters) raising a reward its phase 1 left at chance; the first GRPO step's figures (the
// adapters start at B = 0: the policy is its reference); a bit-identical resume in the middle of a batch of
// rollouts trained on twice; the jobs' refusals with exit status 2.
#include "catch.hpp"

#include <cmath>
#include <fstream>
#include <random>

#include "chat_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/data/prompts.hpp"
#include "lora_trainer/recipes/grpo_part.hpp"

using namespace lt;
using lt::test::Contains;
using lt::test::TempDir;

namespace {

// Writes `records` to DIR/NAME.jsonl and tokenizes them (byte tokenizer) as the prompts dataset NAME.
TokenizeResult make_prompts(const TempDir& dir, const std::string& records, const std::string& name = "prompts",
                            int64_t length = 0) {
  write_file_atomic(dir / (name + ".jsonl"), records);
  TokenizeOptions o;
  o.inputs = {dir / (name + ".jsonl")};
  o.out_dir = dir / ("data/" + name);
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  o.length = length;
  return tokenize_jsonl_to_prompts(o);
}

// Prompts "Q0: " ... "Q9: " (the answer field is what exact match would read; the tests reward a format).
std::string quiz_prompts(int n) {
  std::string out;
  for (int i = 0; i < n; ++i)
    out += nlohmann::json({{"prompt", "Q" + std::to_string(i % 10) + ": "}, {"answer", "a"}, {"id", i}}).dump() + "\n";
  return out;
}

// Phase 1's text: lines "Q<digit>: <letter>", the letter a, b, c or d, each a quarter of the time. A
// model taught it answers a prompt "Q3: " with "a" a quarter of the time: a reward on "a" starts there.
void make_quiz_text(const std::string& data_dir) {
  const std::filesystem::path src = std::filesystem::path(data_dir) / "src-quiz";
  std::filesystem::create_directories(src);
  std::mt19937_64 rng(7);
  for (int d = 0; d < 8; ++d) {
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "Q" + std::to_string(rng() % 10) + ": " + std::string(1, static_cast<char>('a' + rng() % 4)) + "\n";
    write_file_atomic((src / ("doc" + std::to_string(d) + ".txt")).string(), text);
  }
  TokenizeOptions o;
  o.inputs = {src.string()};
  o.out_dir = (std::filesystem::path(data_dir) / "quiz").string();
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  tokenize_to_pmd(o);
}

struct GrpoData {
  TempDir dir;
  GrpoData() {
    make_prompts(dir, quiz_prompts(40));
    make_quiz_text(dir / "data");
  }
};

const char* kRewardA = R"(optimization/grpo/rewards=[{"kind":"regex","pattern":"^a","name":"a"}])";

// lora/train: `phase1_steps` full-parameter steps on "quiz" (8 x 32 tokens each), then `grpo_steps` GRPO
// steps of 8 completions (2 prompts x 4) of at most 4 tokens.
std::unique_ptr<Trainer> make_job(const GrpoData& d, const std::string& name, int grpo_steps,
                                  const std::vector<std::string>& extra = {}, int phase1_steps = 4) {
  const std::vector<std::string> job = {"training/pre_lora_tokens=[" + std::to_string(phase1_steps * 8 * 32) + "]",
                                        R"(training/pre_lora_dataset=[[{"name":"quiz","rate":1}]])",
                                        "training/post_lora_tokens=[" + std::to_string(grpo_steps * 8 * 32) + "]",
                                        R"(training/post_lora_dataset=[[{"name":"prompts","rate":1,"style":"prompts"}]])",
                                        "optimization/lora/rank=4",
                                        "training/batch_size=8",
                                        "training/per_device_batch_size=4",
                                        "optimization/grpo/num_generations=4",
                                        "optimization/grpo/max_completion_length=4",
                                        kRewardA};
  return test::build_job<Trainer>(
      "lora/train", name, test::tiny_config(job_registry().find("lora/train").schema(), d.dir / "data", job, extra),
      d.dir / "out");
}

GrpoPart& as_grpo(Trainer& t) {
  auto* g = t.part<GrpoPart>();
  REQUIRE(g);  // prompts after the boundary make the GRPO form
  return *g;
}

const Sampling kPrompts{"prompts", 1.0, DatasetStyle::PROMPTS};
// Phase-1 steps after which the model writes words of the generated text (spaces, word starts).
constexpr int kTaught = 60;

}  // namespace

TEST_CASE("tokenize --format prompts keeps each prompt whole and its record beside it, and refuses what it cannot use",
          "[grpo][tokenize]") {
  TempDir d;
  const auto r = make_prompts(d, quiz_prompts(8));
  CHECK(r.documents == 8);
  CHECK(r.val_documents == 2);
  PromptsDataset ds(d / "data", "prompts");
  REQUIRE(ds.rows(Split::Train) == 6);
  REQUIRE(ds.rows(Split::Val) == 2);
  // The rows in record order, validation every 4th: train 0, 1, 2, 4, 5, 6; val 3, 7.
  const std::vector<int> train_ids = {0, 1, 2, 4, 5, 6};
  for (uint64_t row = 0; row < 6; ++row) {
    const nlohmann::json& rec = ds.record(Split::Train, row);
    CHECK(rec["id"] == train_ids[row]);
    CHECK(rec["answer"] == "a");
    const std::vector<uint32_t> p = ds.prompt(Split::Train, row);
    CHECK(std::string(p.begin(), p.end()) == rec["prompt"].get<std::string>());  // byte ids: the text, unpadded
  }
  CHECK(ds.record(Split::Val, 1)["id"] == 7);
  CHECK_THAT(ds.where(Split::Val, 1), Contains("prompts dataset \"prompts\", val record 1"));

  // A record with neither "prompt" nor "messages", with both, a prompt past --length, and "messages"
  // without a chat template: each names the line, and nothing is written.
  struct Bad {
    std::string record, says;
    int64_t length;
  };
  const std::vector<Bad> bad = {
      {R"({"question": "2+2", "answer": "4"})", "and it has neither", 0},
      {R"({"prompt": "2+2", "messages": [{"role": "user", "content": "2+2"}]})", "not both", 0},
      {R"({"prompt": 7})", "\"prompt\" must be a string", 0},
      {R"({"prompt": "a long prompt"})", "longer than a row (--length 4)", 4},
      {R"({"messages": [{"role": "user", "content": "2+2"}]})", "give --tokenizer hf:DIR", 0}};
  for (const auto& b : bad) {
    INFO(b.record);
    TempDir t;
    write_file_atomic(t / "p.jsonl", R"({"prompt": "x"})" "\n" + b.record + "\n");
    TokenizeOptions o;
    o.inputs = {t / "p.jsonl"};
    o.out_dir = t / "data/p";
    o.tokenizer = "byte";
    o.length = b.length;
    CHECK_THROWS_WITH(tokenize_jsonl_to_prompts(o), Contains("p.jsonl:2") && Contains(b.says));
    CHECK(!std::filesystem::exists(t / "data/p"));
  }
}

TEST_CASE("tokenize --format prompts renders a conversation with the chat template and its generation prompt", "[grpo][tokenize][chat]") {
  TempDir t;
  const std::string model = test::chat_model_dir(t);
  write_file_atomic(t / "p.jsonl", std::string(R"({"messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"})") +
                                       "\n" + R"({"prompt": "plain text", "answer": "x"})" + "\n");
  TokenizeOptions o;
  o.inputs = {t / "p.jsonl"};
  o.out_dir = t / "data/p";
  o.tokenizer = "hf:" + model;
  o.val_fraction = 0.5;
  tokenize_jsonl_to_prompts(o);
  PromptsDataset ds(t / "data", "p");
  auto tok = make_tokenizer("hf:" + model);
  const std::string text = tok->decode(ds.prompt(Split::Train, 0));
  CHECK(text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(ds.record(Split::Train, 0)["answer"] == "4");
  CHECK(ds.meta().contains("chat"));  // its end of turn stops the completions
}

// The model's probability of `next` after `prompt` (byte tokens), without gradients.
double next_probability(Trainer& t, const std::string& prompt, char next) {
  torch::NoGradGuard ng;
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  auto logits = t.model()->forward(torch::tensor(ids, torch::kLong).unsqueeze(0).to(t.runtime().device));
  return torch::softmax(logits[0][static_cast<int64_t>(ids.size()) - 1].to(torch::kFloat32), -1)[next].item<double>();
}

TEST_CASE("lora/train with prompts after the boundary: GRPO on the adapters from a policy equal to its reference, raising the reward",
          "[grpo][lora]") {
  GrpoData d;
  const std::vector<std::string> recipe = {"optimization/lr=0.01", "optimization/lora/lr=0.003",
                                           "optimization/lora/schedule=constant", "optimization/grpo/beta=0.04"};
  auto t = make_job(d, "toy", 60, recipe, kTaught);
  GrpoPart& grpo = as_grpo(*t);
  const std::vector<Phase> plan = t->phases();
  REQUIRE(plan.size() == 2);
  CHECK(plan[0].loss != plan[1].loss);
  CHECK(plan[0].batches == nullptr);
  CHECK(plan[1].batches != nullptr);
  for (int i = 0; i < kTaught; ++i) t->train_step();
  REQUIRE(!t->in_lora_phase());
  const DatasetEval v0 = t->evaluate({kPrompts}, 10)[0];
  CHECK(v0.tokens == 10);
  CHECK(v0.loss == -v0.figures["reward"].get<double>());
  // Phase 1 taught the quiz: after "Q2: " each letter about a quarter of the time.
  const double p0 = next_probability(*t, "Q2: ", 'a');
  CHECK(p0 > 0.15);
  CHECK(p0 < 0.4);

  StepResult r = t->train_step();  // B = 0: the policy is the reference, so the KL estimate is 0
  REQUIRE(t->in_lora_phase());
  const nlohmann::json first = grpo.last_step();
  INFO(first.dump());
  CHECK(first["kl"].get<double>() == 0.0);
  CHECK(first["clip_ratio"].get<double>() == 0.0);  // one iteration: the ratio is 1
  CHECK(first["completion_tokens"].get<double>() >= 1.0);
  CHECK(first["completion_tokens"].get<double>() <= 4.0);
  CHECK(first.contains("reward/a"));
  CHECK(r.grad_norm > 0);

  std::vector<double> rewards = {first["reward"].get<double>()};
  for (int i = 1; i < 60; ++i) {
    t->train_step();
    rewards.push_back(grpo.last_step()["reward"].get<double>());
  }
  auto mean = [&](size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += rewards[i];
    return s / static_cast<double>(to - from);
  };
  // The rewarded answer became likelier (the probability itself: the rollouts' rewards are samples).
  const double p1 = next_probability(*t, "Q2: ", 'a');
  INFO("P(a | Q2: ) " << p0 << " -> " << p1 << "; the rollouts' rewards " << mean(0, 20) << " " << mean(20, 40) << " "
                      << mean(40, 60));
  CHECK(p1 > p0 + 0.07);
  CHECK(mean(40, 60) > mean(0, 20) + 0.05);
  CHECK(grpo.last_step()["kl"].get<double>() > 0.0);
  const DatasetEval v1 = t->evaluate({kPrompts}, 10)[0];
  CHECK(v1.figures.contains("reward/a"));
}

TEST_CASE("GRPO's stop strings cut each completion after the token that completes one, and the rewards read the text before it",
          "[grpo][lora]") {
  GrpoData d;
  const std::vector<std::string> space = {R"(optimization/grpo/rewards=[{"kind":"regex","pattern":" ","name":"space"}])",
                                          "optimization/grpo/max_completion_length=20", "optimization/lr=0.01"};
  for (const bool stop : {false, true}) {
    INFO((stop ? "with" : "without") << " the stop string \" \"");
    std::vector<std::string> extra = space;
    if (stop) extra.push_back(R"(optimization/grpo/stop=[" "])");
    auto t = make_job(d, stop ? "stop" : "nostop", 4, extra, kTaught);
    for (int i = 0; i < kTaught; ++i) t->train_step();
    t->train_step();  // the first GRPO step: its rollouts
    const double reward = as_grpo(*t).last_step()["reward/space"].get<double>();
    // The next batch of rollouts as the trainer takes it: each row's completion is its targets.
    const Phase lora = t->phases()[1];
    const Batch b = lora.batches->next_share(0, 8);
    int cut = 0;
    for (int64_t r = 0; r < 8; ++r) {
      std::string text;
      int64_t n = 0;
      for (int64_t k = 0; k < b.targets.size(1); ++k)
        if (const int64_t id = b.targets[r][k].item<int64_t>(); id >= 0) {
          ++n;
          if (id < 256) text += static_cast<char>(id);
        }
      CHECK(n >= 1);
      CHECK(n <= 20);
      const size_t at = text.find(' ');
      if (stop) {
        CHECK((at == std::string::npos || at + 1 == text.size()));  // nothing after the first space
        cut += at != std::string::npos;
      } else {
        cut += at != std::string::npos && at + 1 < text.size();
      }
    }
    CHECK(cut > 0);  // spaces are a text's most common byte
    if (stop) CHECK(reward == 0.0);  // the text the reward reads ends before the space
    else CHECK(reward > 0.0);
  }
}

TEST_CASE("lora/train with GRPO: resume in the middle of a batch of rollouts trained on twice is bit-identical",
          "[grpo][lora]") {
  GrpoData d;
  const std::vector<std::string> recipe = {"optimization/grpo/num_iterations=2", "optimization/grpo/beta=0.04",
                                           "optimization/lr=0.01", "optimization/lora/lr=0.003"};
  auto straight = make_job(d, "straight", 6, recipe, kTaught);
  std::vector<double> losses;
  std::vector<nlohmann::json> figures;
  for (int i = 0; i < kTaught + 6; ++i) {
    losses.push_back(straight->train_step().loss);
    figures.push_back(as_grpo(*straight).last_step());
  }
  // The GRPO steps learn (their rewards differ within groups), so a wrong resume would show.
  int moved = 0;
  for (int i = kTaught; i < kTaught + 6; ++i) moved += losses[static_cast<size_t>(i)] != 0.0;
  REQUIRE(moved >= 4);
  // GRPO steps 1-2 train on one batch of rollouts, 3-4 on the next: after 3 the batch's second iteration
  // is next (its rollouts come from the checkpoint); after 2 a new batch is.
  const int at = kTaught + GENERATE(2, 3);
  INFO("resumed after step " << at);
  const std::string name = "split" + std::to_string(at);
  {
    auto first = make_job(d, name, 6, recipe, kTaught);
    for (int i = 0; i < at; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
    first->save("ntoks/" + std::to_string(at));
  }
  auto resumed = make_job(d, name, 6, recipe, kTaught);
  resumed->restore_from_path("ntoks/" + std::to_string(at));
  REQUIRE(resumed->step() == at);
  for (int64_t i = at; i < kTaught + 6; ++i) {
    INFO("step " << i + 1);
    REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
    CHECK(as_grpo(*resumed).last_step()["reward"] == figures[static_cast<size_t>(i)]["reward"]);
  }
  test::require_same_state(*straight, *resumed);
  // The second iteration on a batch may clip (the ratio moved off 1); the first never does.
  CHECK(figures[kTaught]["clip_ratio"].get<double>() == 0.0);
}

TEST_CASE("GRPO jobs refuse prompts where they cannot train and batches that are not whole groups (exit status 2)",
          "[grpo][lora][cli]") {
  GrpoData d;
  SECTION("a batch that is not whole groups") {
    auto t = make_job(d, "odd", 2, {"optimization/grpo/num_generations=3"});
    CHECK_THROWS_WITH(t->run(), Contains("training/batch_size (8) counts completions, 3 a prompt") && Contains("multiple of 3"));
  }
  SECTION("a prompt and its completion past block_size") {
    auto t = make_job(d, "long", 2, {"optimization/grpo/max_completion_length=30"});
    for (int i = 0; i < 4; ++i) t->train_step();
    CHECK_THROWS_WITH(t->train_step(), Contains("max_completion_length (30)") && Contains("architecture/block_size (32)"));
  }
  SECTION("prompts before the boundary, or mixed with text after it") {
    const Config pre = test::tiny_config(job_registry().find("lora/train").schema(), d.dir / "data",
                                         std::vector<std::string>{
                                             "training/pre_lora_tokens=[512]",
                                             R"(training/pre_lora_dataset=[[{"name":"prompts","rate":1,"style":"prompts"}]])",
                                             "training/post_lora_tokens=[512]",
                                             R"(training/post_lora_dataset=[[{"name":"quiz","rate":1}]])"});
    CHECK_THROWS_WITH(job_registry().find("lora/train").make(test::job_spec("pre"), pre, d.dir / "out"),
                      Contains("pre_lora_dataset has preference pairs or prompts: \"prompts\" (prompts)"));
    const Config mixed = test::tiny_config(
        job_registry().find("lora/train").schema(), d.dir / "data",
        std::vector<std::string>{"training/pre_lora_tokens=[512]", R"(training/pre_lora_dataset=[[{"name":"quiz","rate":1}]])",
                                 "training/post_lora_tokens=[512]",
                                 R"(training/post_lora_dataset=[[{"name":"prompts","rate":0.5,"style":"prompts"},{"name":"quiz","rate":0.5}]])"});
    CHECK_THROWS_WITH(job_registry().find("lora/train").make(test::job_spec("mixed"), mixed, d.dir / "out"),
                      Contains("mixes datasets of different kinds"));
  }
  SECTION("the command line: a train job on prompts, grpo/train without a base, a bad reward spec") {
    auto run = [&](const std::string& kind, const std::string& name, std::vector<std::string> extra) {
      const std::string cfg = d.dir / (name + ".json");
      REQUIRE(test::launch({"configure", kind, cfg}).code == 0);
      std::vector<std::string> args = {"run", name, cfg, d.dir / "cli"};
      for (const auto& o : test::tiny_overrides(d.dir / "data")) args.push_back(o);
      for (const auto& o : extra) args.push_back(o);
      return test::launch(args);
    };
    auto r = run("train", "p", {R"(training/dataset=[{"name":"prompts","rate":1,"style":"prompts"}])"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("holds prompts: they train with GRPO"));
    r = run("grpo/train", "g", {"training/batch_size=8", "optimization/grpo/num_generations=4"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("add `--restore CHECKPOINT`"));
    r = run("grpo/train", "g2", {R"(optimization/grpo/rewards=[{"kind":"regex"}])"});
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains("optimization/grpo/rewards") && Contains("needs \"pattern\""));
  }
}

namespace {

// The bytes of the LoRA phase's items whose name contains `what`.
int64_t lora_item(const MemoryPlan& plan, const std::string& what) {
  int64_t bytes = 0;
  for (const auto& phase : plan.phases)
    if (phase.name.find("LoRA") != std::string::npos)
      for (const auto& item : phase.items)
        if (item.what.find(what) != std::string::npos) bytes += item.host + item.device;
  return bytes;
}

}  // namespace

TEST_CASE("memory plan: GRPO counts its unfused log-probabilities, and its rollouts' KV cache where it outgrows the step",
          "[memory][grpo]") {
  GrpoData d;
  auto t = make_job(d, "plan", 1, {"runtime/precision=f32"});
  const MemoryPlan& grpo = t->memory_plan();
  MemoryPlanInputs in = grpo.inputs;
  REQUIRE(in.rollout_rows == 4);  // num_generations, said by GrpoPart before any rollout
  REQUIRE(!in.bf16);              // f32 (also on a CPU whose auto is bf16): 4 bytes a value
  // A step's rows are as long as the longest prompt and a whole completion (max_completion_length 4),
  // shorter than block_size here: the plan counts that many positions.
  int64_t longest = 0;
  for (const Sampling& s : t->data().datasets())
    if (s.style == DatasetStyle::PROMPTS)
      longest = std::max<int64_t>(longest, dynamic_cast<const PromptsDataset&>(t->data().open(s)).longest_prompt());
  const int64_t width = longest + 4;
  REQUIRE(width < in.model.block_size);
  CHECK(in.rollout_width == width);
  // The same job without rollouts, its rows that long: the same activations; the fused loss with the
  // logits whole keeps them (N x V x 4 bytes); GRPO's token_logps keeps them, an f32 copy, its
  // log-sum-exp and the gradient: four times that.
  MemoryPlanInputs plain = in;
  plain.rollout_rows = 0;
  plain.chunked_loss = false;
  plain.model.block_size = width;
  const MemoryPlan next_token = plan_memory(plain);
  REQUIRE(lora_item(next_token, "logits and loss") > 0);
  CHECK(lora_item(grpo, "activations (") == lora_item(next_token, "activations ("));
  CHECK(lora_item(grpo, "log-probabilities (unfused)") == 4 * lora_item(next_token, "logits and loss"));
  // Counted as block_size long, the step holds more.
  MemoryPlanInputs whole = in;
  whole.rollout_width = 0;
  CHECK(lora_item(plan_memory(whole), "activations (") > lora_item(grpo, "activations ("));
  // The tiny model's cache of 4 completions is smaller than its step: nothing beyond it.
  CHECK(lora_item(grpo, "KV cache") == 0);
  // 65,536 completions at once: 2 (keys, values) x layers x rows x d_model x width f32 values, held
  // before the step, so the phase holds the cache where the step's activations and logits would be.
  in.rollout_rows = 65536;
  const ModelOptions& m = in.model;
  const int64_t cache = 2 * m.n_layer * in.rollout_rows * m.kv_heads() * m.head_dim() * width * 4;
  const MemoryPlan big = plan_memory(in);
  CHECK(lora_item(big, "KV cache") ==
        cache - lora_item(big, "activations (") - lora_item(big, "log-probabilities"));
  // A machine between the two peaks: the job is refused, naming the cache.
  in.host_memory = (grpo.host_peak() + big.host_peak()) / 2;
  const MemoryPlan refused = plan_memory(in);
  CHECK(!refused.fits());
  CHECK_THAT(refused.refusal(), Contains("KV cache"));
  in.rollout_rows = 4;
  CHECK(plan_memory(in).fits());
}
