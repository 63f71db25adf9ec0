// Nothing lost, nothing silent: the launcher against damaged files, diverging training, bad numbers
// and misspellings, as a user meets them; and a job killed (-9) again and again ends as an
// uninterrupted one.
#include "catch.hpp"

#include <hdf5.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <random>
#include <thread>

#include "lora_trainer/formats/checkpoint.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;
namespace fs = std::filesystem;

namespace {

using test::launch;
using test::Result;

// A lora/train config over the tiny model: `pre` and `post` steps of 128 tokens.
std::string lora_config(const test::TempDir& dir, int pre, int post, const std::vector<std::string>& extra = {}) {
  if (!fs::exists(dir / "data/gen")) test::make_byte_dataset(dir / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "--force", "lora/train", dir / "lora.json"};  // called again per case
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  args.push_back("training/pre_lora_tokens=" + std::string(pre ? "[" + std::to_string(pre * 128) + "]" : "[]"));
  args.push_back(std::string("training/pre_lora_dataset=") + (pre ? R"([[{"name":"gen","rate":1}]])" : "[]"));
  args.push_back("training/post_lora_tokens=[" + std::to_string(post * 128) + "]");
  args.push_back(R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])");
  args.push_back("optimization/lora/rank=4");
  for (const auto& o : extra) args.push_back(o);
  Result r = launch(args);
  REQUIRE(r.code == 0);
  return dir / "lora.json";
}

// The file offset of a dataset's data inside an HDF5 file (contiguous layout).
haddr_t data_offset(const std::string& h5, const std::string& dataset) {
  hid_t f = H5Fopen(h5.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  haddr_t at = H5Dget_offset(d);
  H5Dclose(d);
  H5Fclose(f);
  return at;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5A);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

bool all_finite(const std::string& checkpoint) {
  for (const auto& [name, t] : read_checkpoint_tensors(checkpoint))
    if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>()) return false;
  return true;
}

void edit_metadata_json(const std::string& checkpoint, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = checkpoint + "/metadata.json";
  auto meta = nlohmann::json::parse(read_file(path));
  edit(meta);
  write_file_atomic(path, meta.dump(2));
}

}  // namespace

TEST_CASE("reliability: a flipped byte in a tensor is found at every load, naming the tensor", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 5, 5);
  REQUIRE(launch({"run", "j", cfg, dir / "out"}).code == 0);
  std::string ck = test::job_dir(dir, "out", "j") + "/final/1280";
  Result ok = launch({"inspect", "--verify", ck});
  CHECK(ok.code == 0);
  CHECK_THAT(ok.out, Contains("every CRC-32 matches"));
  // The base this LoRA checkpoint refers to (its pre_lora_checkpoint): a flipped byte there is found by
  // every reader of the LoRA checkpoint too, naming the base's file and tensor.
  const std::string pre = test::job_dir(dir, "out", "j") + "/pre_lora_checkpoint";
  {
    const uint64_t at = data_offset(pre + "/state.h5", "params/h.0.attn.c_attn.weight") + 100;
    flip_byte(pre + "/state.h5", at);
    for (const auto& args : std::vector<std::vector<std::string>>{{"inspect", "--verify", ck}, {"eval", ck}}) {
      Result r = launch(args);
      INFO(args[0] << ": " << r.out);
      CHECK(r.code == 2);
      CHECK_THAT(r.out, Contains("pre_lora_checkpoint/state.h5") && Contains("params/h.0.attn.c_attn.weight") &&
                            Contains("corrupt"));
    }
    flip_byte(pre + "/state.h5", at);  // and back (no std::filesystem::remove_all: platforms.md, the pip LibTorch)
  }
  const std::string victim = "params/h.0.attn.c_attn.lora_B";
  flip_byte(ck + "/state.h5", data_offset(ck + "/state.h5", victim) + 100);
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"inspect", "--verify", ck},
           {"inspect", ck},
           {"eval", ck},
           {"restore", "j2", ck, dir / "out"},
           {"run", "j3", cfg, dir / "out", "--restore", ck}}) {
    Result r = launch(args);
    INFO(args[0] << ": " << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains(victim) && Contains("corrupt") && Contains("CRC-32"));
  }
  // A job whose `latest` is damaged stops at the start, before anything is written over.
  REQUIRE(launch({"run", "k", cfg, dir / "out", "training/post_lora_tokens=[1280]", "logging/checkpoint_interval=2"}).code == 0);
  std::string latest = test::job_dir(dir, "out", "k") + "/" + *read_latest(test::job_dir(dir, "out", "k"));
  flip_byte(latest + "/state.h5", data_offset(latest + "/state.h5", "params/h.0.attn.c_attn.lora_A") + 8);
  Result again = launch({"run", "k", cfg, dir / "out", "training/post_lora_tokens=[1280]", "logging/checkpoint_interval=2"});
  CHECK(again.code == 2);
  CHECK_THAT(again.out, Contains("params/h.0.attn.c_attn.lora_A"));
}

TEST_CASE("reliability: non-finite training stops naming step, loss, norm and lr, and every saved state stays finite", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 10, 10, {"logging/checkpoint_interval=1", "logging/validation_interval=1"});
  Result r = launch({"run", "boom", cfg, dir / "out", "optimization/lr=1e30"});
  INFO(r.out);
  CHECK(r.code == 4);
  CHECK_THAT(r.out, Contains("training diverged at step") && Contains("loss") && Contains("gradient norm") &&
                        Contains("lr 1e+30") && Contains("Lower optimization/lr"));
  CHECK_THAT(r.out, !Contains("internal error") && !Contains("json.exception"));
  const std::string job = test::job_dir(dir, "out", "boom");
  for (const auto& suffix : list_checkpoints(job)) {
    INFO(suffix);
    CHECK(all_finite(job + "/" + suffix));
    auto best = read_checkpoint_metadata(job + "/" + suffix)["best_score"];
    CHECK((best.is_null() || std::isfinite(best.get<double>())));
  }
  // The policy is a config key: skip drops the updates, logs each one, and stops after ten in a row.
  Result skip = launch({"run", "skip", cfg, dir / "out", "optimization/lr=1e30", "training/on_nonfinite=skip"});
  INFO(skip.out);
  CHECK(skip.code == 4);
  CHECK_THAT(skip.out, Contains("skipped the update of step 2") && Contains("10 steps in a row"));
  auto lines = test::read_metrics_lines(dir / "out/runs/general/default/skip");
  CHECK(std::count_if(lines.begin(), lines.end(), [](const nlohmann::json& e) { return e["event"] == "nonfinite"; }) == 10);
  for (const auto& suffix : list_checkpoints(test::job_dir(dir, "out", "skip"))) CHECK(all_finite(test::job_dir(dir, "out", "skip") + "/" + suffix));
  // eval and sample of what was saved work; a finished skip run writes its report.
  Result finished = launch({"run", "skip2", cfg, dir / "out", "optimization/lr=1e30", "training/on_nonfinite=skip",
                            "training/pre_lora_tokens=[256]", "training/post_lora_tokens=[256]"});
  INFO(finished.out);
  CHECK(finished.code == 0);
  CHECK_THAT(finished.out, Contains("== report"));
  std::string fin = test::job_dir(dir, "out", "skip2") + "/final/512";
  CHECK(launch({"eval", fin}).code == 0);
  Result s = launch({"sample", fin, "--prompt", "the cat", "--tokens", "5"});
  CHECK((s.code == 0 || (s.code == 2 && s.out.find("not finite") != std::string::npos)));
}

TEST_CASE("reliability: a token id outside the vocabulary and inconsistent PADDED files name file, position and id", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 5, 5);
  // One id past the byte vocabulary (257) in the middle of train.bin.
  const std::string bin = dir / "data/gen/train.bin";
  {
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4 * 77);
    uint32_t id = 300;
    f.write(reinterpret_cast<const char*>(&id), 4);
  }
  Result r = launch({"run", "ids", cfg, dir / "out"});
  INFO(r.out);
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains(bin) && Contains("token id 300") && Contains("position 77") && Contains("257"));
  CHECK(!fs::exists(test::job_dir(dir, "out", "ids")));

  // PADDED: a mask value other than 0/1, and meta.json disagreeing with shape.json.
  fs::create_directories(dir / "src");
  std::string jsonl;
  for (int i = 0; i < 12; ++i) jsonl += R"({"prompt":"q)" + std::to_string(i) + R"(","completion":"answer )" + std::to_string(i) + "\"}\n";
  write_file_atomic(dir / "src/r.jsonl", jsonl);
  REQUIRE(launch({"tokenize", "--format", "jsonl", "--tokenizer", "byte", "--name", "qa", "--data-dir", dir / "data", dir / "src/r.jsonl"}).code == 0);
  std::string padded_cfg = lora_config(dir, 0, 5, {R"(training/post_lora_dataset=[[{"name":"qa","rate":1,"style":"padded"}]])",
                                                   "training/allow_random_base=true"});
  REQUIRE(launch({"run", "p0", padded_cfg, dir / "out"}).code == 0);
  std::string mask = read_file(dir / "data/qa/train.mask.bin");
  std::string good_mask = mask;
  mask[5] = 2;
  write_file_atomic(dir / "data/qa/train.mask.bin", mask);
  Result m = launch({"run", "p1", padded_cfg, dir / "out"});
  CHECK(m.code == 2);
  CHECK_THAT(m.out, Contains("train.mask.bin") && Contains("value 2"));
  write_file_atomic(dir / "data/qa/train.mask.bin", good_mask);
  auto meta = nlohmann::json::parse(read_file(dir / "data/qa/meta.json"));
  meta["val_records"] = meta["val_records"].get<int>() + 1;
  write_file_atomic(dir / "data/qa/meta.json", meta.dump());
  Result s = launch({"run", "p2", padded_cfg, dir / "out"});
  CHECK(s.code == 2);
  CHECK_THAT(s.out, Contains("val_records") && Contains("shape.json"));
}

TEST_CASE("reliability: damaged checkpoint metadata names the field", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 5, 5);
  REQUIRE(launch({"run", "m", cfg, dir / "out"}).code == 0);
  std::string ck = test::job_dir(dir, "out", "m") + "/final/1280";
  // cp and remove_tree, not std::filesystem's copy and remove_all: PyTorch's pip LibTorch exports its
  // own copies of those, which crash when they serve this program (see util.hpp).
  auto fresh_copy = [&] {
    remove_tree(dir / "ck");
    REQUIRE(test::shell("cp -r " + test::quote(dir / "ck-src") + " " + test::quote(dir / "ck")).code == 0);
  };
  REQUIRE(test::shell("cp -r " + test::quote(ck) + " " + test::quote(dir / "ck-src")).code == 0);
  struct Damage {
    const char* field;
    std::function<void(nlohmann::json&)> edit;
  };
  for (const auto& d : std::vector<Damage>{
           {"step", [](nlohmann::json& m) { m.erase("step"); }},
           {"tokens", [](nlohmann::json& m) { m["tokens"] = "many"; }},
           {"trainable_params", [](nlohmann::json& m) { m["trainable_params"] = 3; }},
           {"data", [](nlohmann::json& m) { m["data"]["cursors"]["0"] = -4; }},
           {"job", [](nlohmann::json& m) { m["job"]["name"] = 12; }},
           {"kind", [](nlohmann::json& m) { m["kind"] = "full"; }},
       }) {
    fresh_copy();
    edit_metadata_json(dir / "ck", d.edit);
    for (const auto& args : std::vector<std::vector<std::string>>{{"restore", "r", dir / "ck", dir / "out"},
                                                                   {"eval", dir / "ck"},
                                                                   {"export", dir / "ck", dir / "exp"}}) {
      Result r = launch(args);
      INFO(d.field << " " << args[0] << ": " << r.out);
      CHECK(r.code == 2);
      CHECK_THAT(r.out, Contains(std::string("field \"") + d.field + "\""));
    }
  }
  // A number too large for any type, in the metadata.
  fresh_copy();
  std::string text = read_file(dir / "ck/metadata.json");
  text.replace(text.find("\"step\": 10"), 10, "\"step\": 1e999");
  write_file_atomic(dir / "ck/metadata.json", text);
  Result big = launch({"eval", dir / "ck"});
  CHECK(big.code == 2);
  CHECK_THAT(big.out, Contains("metadata.json") && Contains("1e999"));
}

TEST_CASE("reliability: numbers out of range, NaN and misspellings are exit 2 naming the culprit", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 5, 5);
  struct Case {
    std::vector<std::string> args;
    std::string culprit;
  };
  std::string out = dir / "out";
  REQUIRE(launch({"run", "ok", cfg, out}).code == 0);
  std::string ck = test::job_dir(dir, "out", "ok") + "/final/1280";
  write_file_atomic(dir / "big.json", read_file(cfg).replace(read_file(cfg).find("\"lr\": 0.0006"), 12, "\"lr\": 1e999"));
  write_file_atomic(dir / "a-file", "x");
  for (const auto& c : std::vector<Case>{
           {{"run", "x", cfg, out, "optimization/lr=1e999"}, "optimization/lr"},
           {{"run", "x", cfg, out, "optimization/lr=-1e999"}, "optimization/lr"},
           {{"run", "x", cfg, out, "optimization/lr=nan"}, "optimization/lr"},
           {{"run", "x", cfg, out, "training/seed=18446744073709551615"}, "training/seed"},
           {{"run", "x", cfg, out, "training/batch_size=99999999999999999999"}, "training/batch_size"},
           {{"run", "x", dir / "big.json", out}, "big.json"},
           {{"run", "x", cfg, dir / "a-file"}, "a-file"},
           {{"sample", ck, "--prompt", "a", "--temperature", "nan"}, "--temperature"},
           {{"sample", ck, "--prompt", "a", "--tokens", "99999999999999999999"}, "--tokens"},
           {{"eval", ck, "--rows", "-3"}, "--rows"},
           {{"runn", "x", cfg, out}, "did you mean \"run\""},
           {{"inspekt", ck}, "did you mean \"inspect\""},
       }) {
    Result r = launch(c.args);
    INFO(c.args[0] << " ... " << c.args.back() << ": " << r.out);
    CHECK(r.code == 2);
    CHECK_THAT(r.out, Contains(c.culprit));
    CHECK_THAT(r.out, !Contains("internal error") && !Contains("json.exception") && !Contains("filesystem error"));
  }
  // Options taking several values leave the key=value overrides after them alone.
  Result e = launch({"eval", ck, "--dataset", "gen", "--json", "data/dir=" + (dir / "data"), "training/validation_steps=2"});
  INFO(e.out);
  REQUIRE(e.code == 0);
  CHECK(nlohmann::json::parse(e.out.substr(e.out.find('{')))["datasets"]["gen"]["tokens"] == 2 * 32);
}

TEST_CASE("reliability: skipping phase one needs a base, and the report says which", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 0, 5);
  Result refused = launch({"run", "nobase", cfg, dir / "out"});
  INFO(refused.out);
  CHECK(refused.code == 2);
  CHECK_THAT(refused.out, Contains("--restore") && Contains("training/allow_random_base"));
  CHECK(!fs::exists(test::job_dir(dir, "out", "nobase")));
  Result random = launch({"run", "rnd", cfg, dir / "out", "training/allow_random_base=true"});
  CHECK(random.code == 0);
  CHECK_THAT(random.out, Contains("randomly initialised") && !Contains("pretrained base"));
  // A base from another job: the report names it.
  std::string pre_cfg = lora_config(dir, 5, 5);
  REQUIRE(launch({"run", "pre", pre_cfg, dir / "out"}).code == 0);
  std::string base = test::job_dir(dir, "out", "pre") + "/pre_lora_checkpoint";
  cfg = lora_config(dir, 0, 5);
  Result ft = launch({"run", "ft", cfg, dir / "out", "--restore", base});
  INFO(ft.out);
  CHECK(ft.code == 0);
  CHECK_THAT(ft.out, Contains("the frozen base is " + base));
  // Another job's plain state restored into a job with a phase one: said on screen, counters go on.
  std::string mid_cfg = lora_config(dir, 8, 2, {"logging/checkpoint_interval=3"});
  REQUIRE(launch({"run", "src", mid_cfg, dir / "out"}).code == 0);
  Result branch = launch({"run", "dst", mid_cfg, dir / "out", "--restore", test::job_dir(dir, "out", "src") + "/ntoks/384"});
  INFO(branch.out);
  CHECK(branch.code == 0);
  CHECK_THAT(branch.out, Contains("loaded the plain state of job src at step 3") && Contains("continues from there"));
  // Branched past the boundary: the report claims no phase-1 speed it did not measure.
  Result late = launch({"run", "late", mid_cfg, dir / "out", "--restore", test::job_dir(dir, "out", "src") + "/ntoks/1152"});
  INFO(late.out);
  CHECK(late.code == 0);
  CHECK_THAT(late.out, Contains("loaded the lora state of job src at step 9") && Contains("not run by this run"));
}

TEST_CASE("reliability: killed with -9 again and again, mid-step and mid-save, a job ends as an uninterrupted one", "[reliability]") {
  test::TempDir dir;
  std::string cfg = lora_config(dir, 20, 20, {"logging/checkpoint_interval=1", "logging/validation_interval=5",
                                              "logging/report_interval=1"});
  REQUIRE(launch({"run", "clean", cfg, dir / "out"}).code == 0);
  const auto want = test::state_digests(test::job_dir(dir, "out", "clean") + "/final/5120");
  // Five kills, each once the run has reached a later step than the one before, then 0-10 ms later:
  // a save follows every step, so they land in steps, saves and validations (a timing taken from the
  // clean run would not survive a loaded machine).
  std::mt19937 rng(12345);
  int kills = 0, target = 0;
  for (int k = 0; k < 5; ++k) {
    // Beyond the step the next run resumes from (a kill lands a few steps after its target).
    auto latest = read_latest(test::job_dir(dir, "out", "killed"));
    const int resumes_at = latest ? read_checkpoint_metadata(test::job_dir(dir, "out", "killed") + "/" + *latest)["step"].get<int>() : 0;
    target = std::max(target, resumes_at) + std::uniform_int_distribution<int>(2, 6)(rng);
    const std::string log = dir / ("killed" + std::to_string(k) + ".log");
    pid_t pid = test::spawn({"run", "killed", cfg, dir / "out"}, {}, log);
    char line[32];
    std::snprintf(line, sizeof line, "step %6d/", target);
    const bool reached = test::wait_for_text(log, line, 120);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 10)(rng)));
    kill(pid, SIGKILL);
    int code = test::wait_exit(pid, 30);
    INFO(read_file(log));
    REQUIRE(reached);
    if (code == 0) break;  // it had finished
    REQUIRE(code == 128 + SIGKILL);
    ++kills;
  }
  Result end = launch({"run", "killed", cfg, dir / "out"});
  INFO(end.out);
  REQUIRE(end.code == 0);
  INFO("kills: " << kills);
  CHECK(kills == 5);
  CHECK(test::state_digests(test::job_dir(dir, "out", "killed") + "/final/5120") == want);
  CHECK(launch({"inspect", "--verify", test::job_dir(dir, "out", "killed") + "/final/5120"}).code == 0);
}
