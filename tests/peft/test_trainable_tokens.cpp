// PEFT's trainable tokens (optimization/lora/trainable_token_indices): chosen rows of the token embedding
// train beside the adapters, are checkpointed, resumed, exported and started from init_from.
#include "catch.hpp"

#include <csignal>

#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/training/report.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

using Data = test::TwoDatasets;
using test::logits_of;
using test::make_lora;
using test::snapshot;
using test::tiny_gpt;
using test::check_resume_mid_phase2_and_final;



namespace {
const char* kTokens = R"(optimization/lora/trainable_token_indices=[5,101,200])";
const std::vector<int64_t> kTokenIds = {5, 101, 200};
}  // namespace

TEST_CASE("trainable token rows: ids checked against the vocabulary and the embedding, and rows that replace the weight's", "[lora][tokens]") {
  GPT m = tiny_gpt();
  auto params = named_params(*m);
  CHECK(token_embeddings(*m) == std::vector<std::string>{"wte.weight"});  // not wpe: positions are no tokens
  CHECK(resolve_trainable_tokens(*m, params, "", {0, 256}) == "wte.weight");
  CHECK(resolve_trainable_tokens(*m, params, "wte", {3}) == "wte.weight");  // PEFT's dict form
  CHECK_THROWS_WITH(resolve_trainable_tokens(*m, params, "", {3, 257}),
                    Contains("token id 257 is outside the vocabulary of wte.weight (size 257: ids 0 to 256)"));
  CHECK_THROWS_WITH(resolve_trainable_tokens(*m, params, "", {-1}), Contains("token id -1 is outside the vocabulary"));
  CHECK_THROWS_WITH(resolve_trainable_tokens(*m, params, "", {4, 9, 4}), Contains("token id 4 is listed twice"));
  CHECK_THROWS_WITH(resolve_trainable_tokens(*m, params, "wpe", {3}),
                    Contains("\"wpe\" is not a token embedding of this model") && Contains(": wte.weight"));
  CHECK_THROWS_WITH(resolve_trainable_tokens(*m, params, "wte", {}), Contains("no token ids given"));
  CHECK(TrainableTokens::values_name("model.embed_tokens.weight") == "model.embed_tokens.trainable_tokens_delta");

  // Rows set on the embedding compute what the weight with those rows replaced computes, in the lookup
  // and in the tied head; the weight itself is untouched.
  GPT merged = tiny_gpt();
  TrainableTokens tokens = make_trainable_tokens("wte.weight", m->wte->weight, kTokenIds);
  CHECK(tokens.values.sizes() == at::IntArrayRef({3, 32}));
  CHECK(torch::equal(tokens.values[1], m->wte->weight[101]));  // initialised to the base's rows, as PEFT does
  tokens.values.normal_(0.0, 0.5);
  attach_token_rows(*m, tokens);
  {
    torch::NoGradGuard ng;
    merged->wte->weight.copy_(replace_token_rows(merged->wte->weight, kTokenIds, tokens.values));
  }
  CHECK(torch::equal(merged->wte->weight[200], tokens.values[2]));
  CHECK(torch::equal(m->wte->weight, tiny_gpt()->wte->weight));
  auto idx = torch::tensor({5, 6, 101, 7, 200, 5, 0, 256}, torch::kLong).view({2, 4});
  CHECK((logits_of(*m, idx) - logits_of(*merged, idx)).abs().max().item<double>() < 1e-6);
  {
    AdaptersOff off(*m);  // DPO's reference: the rows are switched off with the adapters
    CHECK((logits_of(*m, idx) - logits_of(*tiny_gpt(), idx)).abs().max().item<double>() == 0);
  }
  CHECK((logits_of(*m, idx) - logits_of(*merged, idx)).abs().max().item<double>() < 1e-6);  // and back on
  detach_token_rows(*m);
  CHECK((logits_of(*m, idx) - logits_of(*tiny_gpt(), idx)).abs().max().item<double>() == 0);
}

TEST_CASE("trainable token rows: after LoRA steps only the adapters and the chosen rows changed, checkpointed with their moments", "[lora][tokens]") {
  Data d;
  auto t = make_lora(d, "tokens", {kTokens});
  for (int i = 0; i < 5; ++i) t->train_step();
  const torch::Tensor wte = t->model()->named_parameters()["wte.weight"];
  const torch::Tensor f32_rows = wte.index_select(0, torch::tensor(kTokenIds).to(wte.device())).clone();
  t->transition_to_lora();
  const TrainableTokens& rows = t->trainable_tokens();
  REQUIRE(rows.defined());
  CHECK(rows.name == "wte.weight");
  CHECK(rows.ids == kTokenIds);
  CHECK(rows.values.scalar_type() == torch::kFloat32);
  CHECK(torch::equal(rows.values, f32_rows));  // the f32 rows, taken before the base's cast to bf16
  CHECK(t->saved_modules().empty());
  auto base = snapshot(base_params(*t->model()));
  auto A = snapshot(t->lora_params().named());
  t->train_step();
  t->train_step();
  // Every base tensor, the whole embedding included, is bit-identical: the rows are replaced in the
  // forward, never written into the frozen weight.
  test::check_base_frozen_as(base, base_params(*t->model()));
  for (int64_t r = 0; r < 3; ++r) CHECK_FALSE(torch::equal(rows.values[r], f32_rows[r]));  // each row trained
  CHECK_FALSE(torch::equal(A[1].second, t->lora_params().named()[1].second));              // and the adapters
  std::vector<std::string> want;
  for (auto& [n, x] : t->lora_params().named()) want.push_back(n);
  want.push_back("wte.trainable_tokens_delta");
  CHECK(t->optimizer().param_names() == want);
  t->save("ntoks/896");
  auto meta = read_checkpoint_metadata(t->job_dir() + "/ntoks/896");
  CHECK(meta["lora"]["trainable_tokens"] == nlohmann::json{{"wte.weight", kTokenIds}});
  std::map<std::string, torch::Tensor> stored;
  for (auto& [n, x] : test::checkpoint_tensors(t->job_dir() + "/ntoks/896")) stored[n] = x;
  CHECK(torch::equal(stored.at("params/wte.trainable_tokens_delta"), rows.values.cpu()));
  CHECK(stored.count("optim/exp_avg/wte.trainable_tokens_delta") == 1);
  CHECK(stored.at("params/wte.weight").scalar_type() == torch::kBFloat16);
  // The transition line's totals: the adapters plus 3 rows of 32.
  int transitions = 0;
  for (const auto& e : read_metrics(t->run_dir()))
    if (e["event"] == "transition") {
      ++transitions;
      CHECK(e["token_params"] == 3 * 32);
      CHECK(e["trainable_params"] == count_lora_params(t->lora_params()) + 3 * 32);
      CHECK(e["trainable_tokens"] == nlohmann::json{{"wte.weight", kTokenIds}});
    }
  CHECK(transitions == 1);
  // A job with other rows (or none) cannot take this state over silently.
  for (const char* other : {R"(optimization/lora/trainable_token_indices=[5,101])", "optimization/lora/trainable_token_indices=[]"}) {
    auto o = make_lora(d, "tokens", {other});
    CHECK_THROWS_WITH(o->restore_from_path("ntoks/896"), Contains("trained the token rows {\"wte.weight\":[5,101,200]}") &&
                                                             Contains("optimization/lora/trainable_token_indices selects"));
  }
}

TEST_CASE("trainable_token_indices that do not fit are refused with the key and the value", "[lora][tokens]") {
  Data d;
  const std::string key = "optimization/lora/trainable_token_indices";
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + "=[5,257]"}),
                    Contains(key + ": token id 257 is outside the vocabulary of wte.weight (size 257"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + "=[5,6,5]"}), Contains(key + ": token id 5 is listed twice"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + R"(={"lm_head":[5]})"}), Contains(key + ": \"lm_head\" is not a token embedding"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + R"(={"wte":[5],"wpe":[1]})"}), Contains("names 2 modules"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + "=[5]", R"(optimization/lora/modules_to_save=["wte"])"}),
                    Contains(key + ": selects rows of wte.weight, which optimization/lora/modules_to_save already trains in full"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + "=\"5\""}), Contains("must be a list of integers or {\"module\": [integers]}"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {key + R"(={"wte":[1.5]})"}), Contains("\"wte\": must be a list of integers"));
  CHECK(make_lora(d, "dict", {key + R"(={"wte":[5]})"}) != nullptr);  // PEFT's dict form, naming our module
}

TEST_CASE("with trainable token rows, resume mid phase 2 and from final is bit-identical", "[lora][tokens]") {
  Data d;
  const std::vector<std::string> opts = {kTokens, R"(optimization/lora/modules_to_save=["ln_f"])"};
  auto [straight, resumed] = check_resume_mid_phase2_and_final(d, opts);
  CHECK(torch::equal(straight->trainable_tokens().values, resumed->trainable_tokens().values));
}

TEST_CASE("export merges the trainable token rows into the embedding (and so the tied head): the logits are the unmerged model's", "[lora][tokens]") {
  Data d;
  auto a = make_lora(d, "exp", {"runtime/precision=f32", kTokens});
  a->run();
  const std::string ck = a->job_dir() + "/final/1280";
  export_merged(ck, d.dir / "exported");
  std::map<std::string, torch::Tensor> out, in;
  for (auto& [n, x] : read_checkpoint_tensors(d.dir / "exported")) out[n] = x;
  for (auto& [n, x] : test::checkpoint_tensors(ck)) in[n] = x;
  const auto& W = out.at("params/wte.weight");
  const auto& rows = in.at("params/wte.trainable_tokens_delta");
  for (int64_t r = 0; r < 257; ++r) {
    auto k = std::find(kTokenIds.begin(), kTokenIds.end(), r);
    if (k == kTokenIds.end()) REQUIRE(torch::equal(W[r], in.at("params/wte.weight")[r].to(torch::kFloat32)));
    else REQUIRE(torch::equal(W[r], rows[k - kTokenIds.begin()]));
  }
  Trainer plain(test::job_spec("from_export"),
                    test::tiny_config(Trainer::schema(), d.dir / "data", test::kPlainF32), d.dir / "out");
  plain.restore_from_path(d.dir / "exported");
  auto idx = torch::tensor(std::vector<int64_t>{5, 101, 200, 7, 5, 33, 200, 1}).view({2, 4}).repeat({1, 4});
  const double diff = (logits_of(*plain.model(), idx) - logits_of(*a->model(), idx)).abs().max().item<double>();
  CHECK(diff < 1e-4);
  // The rows mattered: the base with the exported adapters but the original rows computes something else.
  auto base_rows = in.at("params/wte.weight").to(torch::kFloat32);
  {
    torch::NoGradGuard ng;
    plain.model()->named_parameters()["wte.weight"].copy_(base_rows);
  }
  CHECK((logits_of(*plain.model(), idx) - logits_of(*a->model(), idx)).abs().max().item<double>() > 100 * diff);
}

TEST_CASE("init_from loads the trainable token rows from our checkpoint or its PEFT export, and refuses other rows", "[lora][tokens]") {
  Data d;
  auto src = make_lora(d, "src", {kTokens});
  src->run();
  const std::string final_ck = src->job_dir() + "/final/1280";
  export_peft(final_ck, d.dir / "peft");
  auto cfg = nlohmann::json::parse(read_file(d.dir / "peft/adapter_config.json"));
  CHECK(cfg["trainable_token_indices"] == nlohmann::json(kTokenIds));
  std::map<std::string, torch::Tensor> adapter;
  for (auto& [n, x] : read_safetensors(d.dir / "peft/adapter_model.safetensors")) adapter[n] = x;
  CHECK(torch::equal(adapter.at("base_model.model.transformer.wte.token_adapter.trainable_tokens_delta"),
                     src->trainable_tokens().values.cpu()));
  for (const std::string from : {final_ck, d.dir / "peft"}) {
    INFO(from);
    auto t = make_lora(d, "from", {kTokens, "optimization/lora/init_from=\"" + from + "\""});
    for (int i = 0; i < 5; ++i) t->train_step();
    t->transition_to_lora();
    CHECK(torch::equal(t->trainable_tokens().values, src->trainable_tokens().values));
    CHECK(torch::equal(t->lora_params().B[0], src->lora_params().B[0]));
    for (const char* other : {R"(optimization/lora/trainable_token_indices=[5,101,201])", "optimization/lora/trainable_token_indices=[]"}) {
      INFO(other);
      auto refused = make_lora(d, "refused", {other, "optimization/lora/init_from=\"" + from + "\""});
      CHECK_THROWS_WITH(refused->run(), Contains("trained the token rows {\"wte.weight\":[5,101,200]}") &&
                                            Contains("Set it as the source had it"));
      CHECK(refused->step() == 0);
    }
  }
}
