// DPO (dpo/train): preference pairs tokenized with the prompt masked out, the loss at the reference
// (log 2), learning on a toy preference set, resume mid-run in both forms, and the errors a user meets.
#include "catch.hpp"

#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "dpo_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
using lt::test::kPrefs;

namespace {

using test::make_pairs;
using test::PrefData;
using test::toy_records;

// A dpo/train job on the toy pairs: 4 pairs a step, `steps` steps.
std::unique_ptr<Trainer> make_dpo(const PrefData& d, const std::string& name, bool lora, int steps,
                                      const std::vector<std::string>& extra = {}) {
  const std::vector<std::string> job = {"training/tokens=" + std::to_string(steps * 128),
                                        R"(training/dataset=[{"name":"prefs","rate":1,"style":"contrastive"}])",
                                        std::string("optimization/dpo/lora=") + (lora ? "true" : "false"),
                                        "optimization/lora/rank=4"};
  return test::build_job("dpo/train", name,
                         test::tiny_config(job_registry().find("dpo/train").schema(), d.dir / "data", job, extra),
                         d.dir / "out");
}

const DpoStats& last_step(Trainer& t) {
  DpoPart* dpo = t.part<DpoPart>();
  REQUIRE(dpo);
  return dpo->last_step();
}


// A plain checkpoint of a `train` job (2 steps on "gen"): the pretrained base.
std::string make_base(const PrefData& d) {
  Trainer base(test::job_spec("base"),
                   test::tiny_config(Trainer::schema(), d.dir / "data",
                                     std::vector<std::string>{"training/tokens=1280",
                                                              R"(training/dataset=[{"name":"gen","rate":1}])"}),
                   d.dir / "out");
  base.train_step();
  base.train_step();
  base.save("ntoks/256");
  return base.job_dir() + "/ntoks/256";
}

}  // namespace

TEST_CASE("tokenize --format pairs: chosen and rejected rows share the prompt, which is masked out", "[dpo]") {
  test::TempDir dir;
  std::string records;
  for (int i = 0; i < 4; ++i)
    records += nlohmann::json({{"prompt", "Q" + std::to_string(i) + ":"}, {"chosen", " yes"}, {"rejected", " nope"}}).dump() + "\n";
  auto r = make_pairs(dir, records);
  CHECK(r.documents == 4);
  CHECK(r.val_documents == 1);
  auto meta = read_json_file(dir / "data/prefs/meta.json", "");
  CHECK(meta["style"] == "contrastive");
  CHECK(meta["records"] == 4);
  CHECK(read_json_file(dir / "data/prefs/shape.json", "")["train"] == nlohmann::json::array({6, 9}));  // 3 pairs, 2 rows each

  DataCatalog cat(dir / "data", 257);
  const Dataset& ds = cat.get(kPrefs);
  const int64_t T = 8;  // a window of T + 1 = 9 positions: the whole row
  CHECK(ds.rows_per_sample() == 2);
  CHECK(ds.num_samples(Split::Train, T) == 3);
  std::vector<int64_t> in(2 * T), tg(2 * T);
  ds.sample(Split::Train, 0, T, in.data(), tg.data(), nullptr);  // record 0 ("Q0:"); record 3 went to validation
  // chosen: EOT "Q0:" " yes" EOT, left-padded to 9; rejected: "Q0:" " nope" EOT. Only the completions count.
  const std::vector<int64_t> chosen_in = {256, 'Q', '0', ':', ' ', 'y', 'e', 's'};
  const std::vector<int64_t> chosen_tg = {-1, -1, -1, ' ', 'y', 'e', 's', 256};
  const std::vector<int64_t> rejected_in = {'Q', '0', ':', ' ', 'n', 'o', 'p', 'e'};
  const std::vector<int64_t> rejected_tg = {-1, -1, ' ', 'n', 'o', 'p', 'e', 256};
  CHECK(std::vector<int64_t>(in.begin(), in.begin() + T) == chosen_in);
  CHECK(std::vector<int64_t>(tg.begin(), tg.begin() + T) == chosen_tg);
  CHECK(std::vector<int64_t>(in.begin() + T, in.end()) == rejected_in);
  CHECK(std::vector<int64_t>(tg.begin() + T, tg.end()) == rejected_tg);

  // A pair is one sample of the sampler, two rows wide; it does not mix with single rows.
  MixtureSampler s(cat, {kPrefs}, T, 1, 0);
  CHECK(s.next(5).inputs.sizes() == torch::IntArrayRef({5, 2 * T}));
  test::make_byte_dataset(dir / "data", "gen", 1);
  CHECK_THROWS_WITH(MixtureSampler(cat, {kPrefs, {"gen", 1.0, DatasetStyle::PMD}}, T, 1, 0),
                    Contains("mixes preference pairs with single rows"));
  CHECK_THROWS_WITH(cat.get({"prefs", 1.0, DatasetStyle::PADDED}), Contains("of style contrastive"));
}

TEST_CASE("tokenize --format pairs: a bad record is an error naming its line and field, exit status 2", "[dpo]") {
  test::TempDir dir;
  const std::string records = R"({"prompt":"a","chosen":"b","rejected":"c"})" "\n"
                              R"({"prompt":"a","chosen":"b"})" "\n";
  CHECK_THROWS_WITH(make_pairs(dir, records), Contains("prefs.jsonl:2") && Contains("\"rejected\" is missing"));
  write_file_atomic(dir / "bad.jsonl", R"({"prompt":"a","chosen":"b","rejected":"c"})" "\n" "\n" R"({"prompt":"a","chosen":1,"rejected":"c"})" "\n");
  auto r = test::launch({"tokenize", "--format", "pairs", "--tokenizer", "byte", "--name", "bad", "--data-dir", dir / "data",
                         dir / "bad.jsonl"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("bad.jsonl:3") && Contains("\"chosen\" is not a string"));
}

TEST_CASE("the DPO loss: log 2 at the reference, rewards beta (pi - ref), conservative DPO's smoothing", "[dpo]") {
  DpoOptions o;
  o.beta = 0.5;
  auto same = torch::tensor({-3.0, -7.5, -1.25}, torch::kFloat32);
  DpoTerms t = dpo_loss(same, same - 1, same, same - 1, o);
  for (int i = 0; i < 3; ++i) CHECK(t.losses[i].item<double>() == std::log(2.0));
  // pi_c - ref_c = 2, pi_r - ref_r = -2: logratio 4, rewards +-1 (beta 0.5), margin 2.
  auto pc = torch::tensor({0.0}), pr = torch::tensor({-4.0}), rc = torch::tensor({-2.0}), rr = torch::tensor({-2.0});
  t = dpo_loss(pc, pr, rc, rr, o);
  CHECK(t.chosen_rewards.item<double>() == 1.0);
  CHECK(t.rejected_rewards.item<double>() == -1.0);
  CHECK(t.losses.item<double>() == Approx(std::log1p(std::exp(-2.0))).epsilon(1e-12));
  o.label_smoothing = 0.1;
  t = dpo_loss(pc, pr, rc, rr, o);
  CHECK(t.losses.item<double>() == Approx(0.9 * std::log1p(std::exp(-2.0)) + 0.1 * std::log1p(std::exp(2.0))).epsilon(1e-12));
}

TEST_CASE("dpo/train with LoRA: with the adapters at zero (B = 0) the loss is exactly log 2 and the margin 0", "[dpo]") {
  PrefData d;
  // With DoRA the magnitudes start at the base's row norms, so the policy is still exactly the reference.
  const bool dora = GENERATE(false, true);
  INFO((dora ? "DoRA" : "LoRA"));
  auto t = make_dpo(d, dora ? "zero_dora" : "zero", /*lora=*/true, 4,
                    {"training/allow_random_base=true", std::string("optimization/lora/dora=") + (dora ? "true" : "false")});
  auto before = t->evaluate({kPrefs}, 8);  // no adapters yet: the model is its reference
  CHECK(before[0].loss == Approx(std::log(2.0)).epsilon(1e-14));  // every pair's is log 2 exactly (the test above)
  StepResult r = t->train_step();  // the transition at step 0 puts on adapters with B = 0
  REQUIRE(dynamic_cast<Trainer&>(*t).in_lora_phase());
  const DpoStats& s = last_step(*t);
  CHECK(s.pairs == 4);
  CHECK(s.margin == 0.0);
  CHECK(s.chosen == 0.0);
  CHECK(s.correct == 0.0);
  CHECK(r.loss == Approx(std::log(2.0)).epsilon(1e-15));
  CHECK(r.grad_norm > 0);  // B gets a gradient at zero
}

TEST_CASE("dpo/train on a toy preference set: the reward margin and the accuracy rise, in both forms", "[dpo]") {
  PrefData d;
  const bool lora = GENERATE(true, false);
  INFO((lora ? "LoRA" : "full-parameter"));
  auto t = make_dpo(d, lora ? "toy_lora" : "toy_full", lora, 40,
                    {"training/allow_random_base=true", "optimization/lora/lr=0.01", "optimization/lora/schedule=constant",
                     "optimization/lr=0.002", "training/schedule=constant", "optimization/dpo/beta=0.5"});
  auto v0 = t->evaluate({kPrefs}, 10)[0];
  for (int i = 0; i < 40; ++i) t->train_step();
  auto v1 = t->evaluate({kPrefs}, 10)[0];
  INFO("margin " << v0.dpo.reward_margin << " -> " << v1.dpo.reward_margin << ", accuracy " << v0.dpo.accuracy << " -> " << v1.dpo.accuracy
                 << ", loss " << v0.loss << " -> " << v1.loss);
  if (lora) CHECK(v0.dpo.accuracy == 0.0);  // the model is its reference: no pair ranked right
  CHECK(std::abs(v0.dpo.reward_margin) < 1e-3);  // full-parameter: the reference is the bf16 copy, not exactly the model
  CHECK(v1.dpo.accuracy >= 0.9);
  CHECK(v1.dpo.reward_margin > v0.dpo.reward_margin + 1.0);
  CHECK(v1.loss < 0.5 * std::log(2.0));
  CHECK(last_step(*t).correct == last_step(*t).pairs);
}

TEST_CASE("dpo/train from a restored base: resume mid-run is bit-identical, with LoRA and full-parameter", "[dpo]") {
  PrefData d;
  const std::string base = make_base(d);
  const bool lora = GENERATE(true, false);
  INFO((lora ? "LoRA" : "full-parameter"));
  const std::string kind = lora ? "lora" : "full";
  auto straight = make_dpo(d, "straight_" + kind, lora, 6);
  straight->restore_from_path(base);
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(straight->train_step().loss);
  {
    auto first = make_dpo(d, "split_" + kind, lora, 6);
    first->restore_from_path(base);
    for (int i = 0; i < 3; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
    first->save("ntoks/384");
  }
  auto resumed = make_dpo(d, "split_" + kind, lora, 6);
  resumed->restore_from_path("ntoks/384");
  REQUIRE(resumed->step() == 3);
  for (int i = 3; i < 6; ++i) {
    INFO("step " << i);
    REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  }
  test::require_same_state(*straight, *resumed);
  if (!lora) {  // the reference is the base, kept in the checkpoint
    auto saved = read_checkpoint_tensors(resumed->job_dir() + "/ntoks/384");
    std::map<std::string, torch::Tensor> by_name(saved.begin(), saved.end());
    auto stored = read_checkpoint_tensors(base);
    for (auto& [n, t] : stored)
      if (n.rfind("params/", 0) == 0) CHECK(torch::equal(by_name.at("ref/" + n.substr(7)), t.to(torch::kBFloat16)));
  }
}

TEST_CASE("dpo/train refuses what it cannot train (text datasets, no base, modules_to_save) and other jobs refuse pairs", "[dpo]") {
  PrefData d;
  auto text = make_dpo(d, "text", true, 2, {"training/allow_random_base=true", R"(training/dataset=[{"name":"gen","rate":1}])"});
  CHECK_THROWS_WITH(text->run(), Contains("dpo/train trains on preference pairs") && Contains("\"gen\" of style pmd"));
  auto nobase = make_dpo(d, "nobase", false, 2);
  CHECK_THROWS_WITH(nobase->run(), Contains("add `--restore CHECKPOINT`") && Contains("training/allow_random_base=true"));
  CHECK_THROWS_WITH(make_dpo(d, "mts", true, 2, {R"(optimization/lora/modules_to_save=["wte"])"}),
                    Contains("optimization/lora/modules_to_save must be [] in dpo/train"));
  Trainer plain(test::job_spec("plain"),
                    test::tiny_config(Trainer::schema(), d.dir / "data",
                                      std::vector<std::string>{R"(training/dataset=[{"name":"prefs","rate":1,"style":"contrastive"}])"}),
                    d.dir / "out");
  CHECK_THROWS_WITH(plain.run(), Contains("\"prefs\" is contrastive") && Contains("`dpo/train`"));
}

TEST_CASE("dpo/train through the launcher: tokenize pairs, --restore a base, 2 ranks take the steps of 1, the base sharded or not", "[dpo][distributed][shard]") {
  test::TempDir dir;
  write_file_atomic(dir / "prefs.jsonl", toy_records(40));
  auto tok = test::launch({"tokenize", "--format", "pairs", "--tokenizer", "byte", "--name", "prefs", "--data-dir",
                           dir / "data", "--val-fraction", "0.25", dir / "prefs.jsonl"});
  INFO(tok.out);
  REQUIRE(tok.code == 0);
  test::make_byte_dataset(dir / "data", "gen", 1);
  auto configure = [&](const std::string& kind, const std::string& path, std::vector<std::string> extra) {
    std::vector<std::string> args = {"configure", kind, path};
    for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
    for (const auto& o : {"training/batch_size=8", "training/per_device_batch_size=2", "runtime/precision=f32",
                          "runtime/threads=1", "logging/report_interval=1", "logging/validation_interval=3",
                          "training/validation_steps=8", "distributed/timeout_s=20"})
      args.push_back(o);
    args.insert(args.end(), extra.begin(), extra.end());
    REQUIRE(test::launch(args).code == 0);
  };
  configure("train", dir / "train.json", {"training/tokens=512", R"(training/dataset=[{"name":"gen","rate":1}])"});
  REQUIRE(test::launch({"run", "base", dir / "train.json", dir / "base"}).code == 0);
  const std::string base = dir / "base/checkpoints/general/default/base/final/512";
  configure("dpo/train", dir / "dpo.json",
            {"training/tokens=1536", R"(training/dataset=[{"name":"prefs","rate":1,"style":"contrastive"}])",
             "optimization/lora/rank=4", "optimization/lora/lr=0.01", "optimization/lora/schedule=constant"});

  auto nobase = test::launch({"run", "dpo", dir / "dpo.json", dir / "nobase"});
  CHECK(nobase.code == 2);
  CHECK_THAT(nobase.out, Contains("--restore CHECKPOINT"));

  auto one = test::launch({"run", "dpo", dir / "dpo.json", dir / "one", "--restore", base});
  INFO(one.out);
  REQUIRE(one.code == 0);
  CHECK_THAT(one.out, Contains("reward_margin") && Contains("dpo loss"));
  auto two = test::launch({"run", "dpo", dir / "dpo.json", dir / "two", "--restore", base, "--nproc", "2"});
  INFO(two.out);
  REQUIRE(two.code == 0);

  std::vector<nlohmann::json> train1, train2, val1, val2;
  auto split = [&](const std::string& out, std::vector<nlohmann::json>& train, std::vector<nlohmann::json>& val) {
    for (const auto& e : test::read_metrics_lines(dir / (out + "/runs/general/default/dpo"))) {
      if (e["event"] == "train") train.push_back(e);
      if (e["event"] == "val") val.push_back(e);
    }
  };
  split("one", train1, val1);
  split("two", train2, val2);
  REQUIRE(train1.size() == 6);
  REQUIRE(train2.size() == 6);
  REQUIRE(val1.size() == 2);
  REQUIRE(val2.size() == 2);
  for (size_t i = 0; i < 6; ++i)
    for (const char* k : {"loss", "reward_margin", "accuracy"}) {
      INFO("step " << i + 1 << " " << k << ": " << train1[i][k] << " vs " << train2[i][k]);
      CHECK(std::abs(train1[i][k].get<double>() - train2[i][k].get<double>()) <= 1e-4 * (1 + std::abs(train1[i][k].get<double>())));
    }
  for (size_t i = 0; i < 2; ++i) {
    INFO(val1[i].dump() << "\n" << val2[i].dump());
    CHECK(val1[i]["perplexity"].empty());
    CHECK(std::abs(val1[i]["loss"].get<double>() - val2[i]["loss"].get<double>()) <= 1e-4);
    CHECK(std::abs(val1[i]["reward_margin"]["prefs"].get<double>() - val2[i]["reward_margin"]["prefs"].get<double>()) <= 1e-4);
    CHECK(val1[i]["accuracy"]["prefs"] == val2[i]["accuracy"]["prefs"]);
  }
  // DPO's figures in the run's TensorBoard file, as protobuf decodes it (tests/tools/read_tfevents.py).
  std::string events;
  for (const auto& e : std::filesystem::directory_iterator(dir / "one/runs/general/default/dpo"))
    if (e.path().filename().string().find("tfevents") != std::string::npos) events = e.path().string();
  REQUIRE(!events.empty());
  const auto decoded = test::shell("/usr/bin/python3 " + test::quote(std::string(LT_SOURCE_DIR) + "/tests/tools/read_tfevents.py") +
                                   " " + test::quote(events));
  if (decoded.code == 3 || decoded.code == 127) {
    WARN("skipped the TensorBoard check: " << decoded.out);
  } else {
    REQUIRE(decoded.code == 0);
    std::set<std::string> tags;
    std::istringstream lines(decoded.out);
    for (std::string line; std::getline(lines, line);) {
      const auto r = nlohmann::json::parse(line);
      if (r.contains("scalars"))
        for (const auto& [tag, v] : r["scalars"].items()) tags.insert(tag);
    }
    for (const char* tag : {"train/loss", "train/reward_margin", "train/accuracy", "val/loss/prefs", "val/reward_margin/prefs",
                            "val/accuracy/prefs"})
      CHECK(tags.count(tag) == 1);
  }
  CHECK(train1.front()["loss"].get<double>() == Approx(std::log(2.0)).epsilon(1e-12));  // from the base, adapters at 0
  CHECK(val1.back()["reward_margin"]["prefs"].get<double>() > 0);

  // The base sharded across the 2 ranks (distributed/shard_params=lora): the policy's and the
  // reference's forwards gather it, the validation's too (its 2 micro-batches of pairs split 1 + 1, the
  // ranks in lockstep); every figure is the unsharded 2 ranks' bit for bit.
  auto sharded = test::launch({"run", "dpo", dir / "dpo.json", dir / "sharded", "--restore", base, "--nproc", "2",
                               "distributed/shard_params=lora"});
  INFO(sharded.out);
  REQUIRE(sharded.code == 0);
  CHECK_THAT(sharded.out, Contains("sharded (distributed/shard_params)"));
  std::vector<nlohmann::json> train3, val3;
  split("sharded", train3, val3);
  REQUIRE(train3.size() == 6);
  REQUIRE(val3.size() == 2);
  for (size_t i = 0; i < 6; ++i)
    for (const char* k : {"loss", "reward_margin", "accuracy", "grad_norm"}) {
      INFO("step " << i + 1 << " " << k);
      CHECK(train2[i][k] == train3[i][k]);
    }
  for (size_t i = 0; i < 2; ++i) {
    CHECK(val2[i]["loss"] == val3[i]["loss"]);
    CHECK(val2[i]["reward_margin"] == val3[i]["reward_margin"]);
  }

  // Full-parameter DPO with the policy's parameters sharded (distributed/shard_params=all): the
  // reference is copied from the gathered blocks, whole; one micro-batch a rank and no clipping, so
  // every figure is the unsharded 2 ranks' bit for bit (the norm is only reported: within 1e-6).
  const std::vector<std::string> full = {"--restore", base, "--nproc", "2", "optimization/dpo/lora=false",
                                         "training/per_device_batch_size=-1", "optimization/grad_clip=0"};
  auto run_full = [&](const std::string& out, const std::vector<std::string>& more) {
    std::vector<std::string> args = {"run", "dpo", dir / "dpo.json", dir / out};
    args.insert(args.end(), full.begin(), full.end());
    args.insert(args.end(), more.begin(), more.end());
    const test::Result r = test::launch(args);
    INFO(r.out);
    REQUIRE(r.code == 0);
    std::vector<nlohmann::json> train, val;
    split(out, train, val);
    REQUIRE(train.size() == 6);
    return train;
  };
  const auto unsharded = run_full("full", {}), zero3 = run_full("full_sharded", {"distributed/shard_params=all"});
  // At the first step the reference is the policy rounded to bf16: the loss is log 2 but for that rounding.
  CHECK(unsharded.front()["loss"].get<double>() == Approx(std::log(2.0)).epsilon(1e-3));
  for (size_t i = 0; i < 6; ++i) {
    INFO("step " << i + 1);
    for (const char* k : {"loss", "reward_margin", "accuracy"}) CHECK(unsharded[i][k] == zero3[i][k]);
    CHECK(std::abs(unsharded[i]["grad_norm"].get<double>() - zero3[i]["grad_norm"].get<double>()) <=
          1e-6 * unsharded[i]["grad_norm"].get<double>());
  }
}
