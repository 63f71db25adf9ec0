// Task evaluations (training/tasks.hpp): lm-evaluation-harness's token split, the task files and their
// refusals, `eval --task` checked against a Python recomputation from its own per-token
// log-probabilities (tests/tools/task_recompute.py) and against llama.cpp's log-probabilities on the
// exported GGUF, and eval/evaluations' task figures in metrics.jsonl, TensorBoard and the report.
#include <cmath>
#include <filesystem>
#include <sstream>

#include "catch.hpp"
#include "distributed_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/training/tasks.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using namespace lt;
using namespace lt::test;
using nlohmann::json;

namespace {

std::vector<uint32_t> bytes(const std::string& s) { return std::vector<uint32_t>(s.begin(), s.end()); }

// Multiple-choice questions on the generated text's words, one with a non-ASCII choice (acc_norm
// divides by characters, not bytes) and one with a trailing space in the question.
const char* kChoices =
    R"({"question": "the cat sat on the", "choices": ["mat", "dog", "house"], "answer": 0}
{"question": "we see it and the", "choices": ["big red dog", "cat"], "answer": "cat"}
{"question": "a small ", "choices": ["house", "café au lait", "mat"], "answer": 2}
{"question": "", "choices": ["the", "zzz"], "answer": 0}
{"question": "it ran to the house of", "choices": ["we", "a"], "answer": 1}
)";
const char* kAnswers =
    R"({"prompt": "the cat sat on", "answer": ["the mat", "a mat"], "stop": ["."]}
{"prompt": "we see", "answer": "it", "max_tokens": 8}
)";

}  // namespace

TEST_CASE("tasks: lm-evaluation-harness's split of a context and its continuation", "[tasks]") {
  auto byte = make_tokenizer("byte");
  TokenPair p = encode_pair(*byte, "Q: 2+2 =", " 4");
  CHECK(p.context == bytes("Q: 2+2 ="));
  CHECK(p.continuation == bytes(" 4"));
  // Trailing whitespace of the context belongs to the continuation.
  p = encode_pair(*byte, "Answer:  ", " yes");
  CHECK(p.context == bytes("Answer:"));
  CHECK(p.continuation == bytes("   yes"));
  // An empty context is the end-of-text token.
  p = encode_pair(*byte, "", " a");
  CHECK(p.context == std::vector<uint32_t>{256});
  CHECK(p.continuation == bytes(" a"));
  // With merges, the continuation is what encoding the whole adds past the context's tokens.
  auto gpt2 = make_tokenizer("gpt2");
  p = encode_pair(*gpt2, "The capital of France is", " Paris");
  const auto whole = gpt2->encode("The capital of France is Paris");
  CHECK(p.context == gpt2->encode("The capital of France is"));
  CHECK(p.continuation == std::vector<uint32_t>(whole.begin() + static_cast<std::ptrdiff_t>(p.context.size()), whole.end()));
  CHECK(gpt2->decode(p.continuation) == " Paris");

  // acc_norm divides by characters, as Python's len counts them: "café" is 4, not its 5 bytes.
  CHECK(length_normalised(-8.0, "café") == -2.0);
  CHECK(length_normalised(-6.0, "abc") == -2.0);
  CHECK(normalize_answer("  The  Mat.\n") == "the mat");
  CHECK(normalize_answer("A mat") == "a mat");
  CHECK(normalize_answer("42") == "42");
}

TEST_CASE("tasks: a bad task file is refused naming the file, the line and what is wrong", "[tasks]") {
  TempDir d;
  auto refused = [&](const std::string& text) {
    write_file_atomic(d / "t.jsonl", text);
    try {
      read_task(d / "t.jsonl");
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK_THAT(refused(R"({"question": "q", "choices": ["a", "b"], "answer": 2})"),
             Contains("line 1: \"answer\" 2 is neither the index of a choice (0 to 1) nor the text of one"));
  CHECK_THAT(refused("\n" R"({"question": "q", "choices": ["a", "b"], "answer": "c"})"), Contains("line 2"));
  CHECK_THAT(refused(R"({"question": "q", "choices": ["a"], "answer": 0})"), Contains("at least two choices"));
  CHECK_THAT(refused(R"({"question": "q", "choices": ["a", "b"], "answer": 0}
{"prompt": "p", "answer": "x"})"),
             Contains("line 2: a task file holds one kind of record"));
  CHECK_THAT(refused(R"({"text": "q"})"), Contains("is either {\"question\", \"choices\", \"answer\"}"));
  CHECK_THAT(refused(R"({"prompt": "p"})"), Contains("no \"answer\""));
  CHECK_THAT(refused(R"({"prompt": "p", "answer": "x", "max_tokens": 0})"), Contains("\"max_tokens\" must be an integer"));
  CHECK_THAT(refused("{not json"), Contains("t.jsonl line 1"));
  CHECK_THAT(refused(""), Contains("no records"));
}

TEST_CASE("tasks: eval --task scores as lm-evaluation-harness does (Python recomputation, llama.cpp), and eval/evaluations reports task accuracy before and after LoRA", "[tasks]") {
  TempDir dir;
  write_file_atomic(dir / "choices.jsonl", kChoices);
  write_file_atomic(dir / "answers.jsonl", kAnswers);
  const std::string cfg = distributed_lora_config(
      dir, {"training/pre_lora_tokens=[512]", "training/post_lora_tokens=[512]", "logging/validation_interval=2",
            "architecture/activation=gelu_tanh",  // llama.cpp's gpt2 GELU
            "eval/evaluations=[\"perplexity\",\"task:" + (dir / "choices.jsonl") + "\",\"task:" + (dir / "answers.jsonl") + "\"]"});
  Result run = run_ok({"run", "job", cfg, dir / "out"});
  CHECK_THAT(run.out, Contains("| task choices accuracy "));
  CHECK_THAT(run.out, Contains("| task answers exact match "));

  // Every validation logged the tasks' figures; TensorBoard has them as scalars.
  const std::string run_dir = dir / "out/runs/general/default/job";
  int vals = 0;
  for (const auto& e : read_metrics_lines(run_dir))
    if (e["event"] == "val") {
      ++vals;
      REQUIRE(e.contains("task_accuracy"));
      CHECK(e["task_accuracy"].contains("choices"));
      CHECK(e["task_accuracy_norm"].contains("choices"));
      CHECK(e["task_exact_match"].contains("answers"));
      const double acc = e["task_accuracy"]["choices"];
      CHECK(std::abs(acc * 5 - std::round(acc * 5)) < 1e-9);  // a share of the 5 questions
    }
  CHECK(vals >= 4);
  // The report shows the task figures at the boundary and at the end, beside perplexity.
  const std::string report = read_file(run_dir + "/report.md");
  CHECK_THAT(report, Contains("task choices accuracy"));
  CHECK_THAT(report, Contains("task answers exact match"));

  // eval --task on the final checkpoint, its per-example scores recomputed in Python.
  const std::string final_ck = job_dir(dir, "out") + "/final/1024";
  // A missing task file, an unknown evaluation: exit 2, named, before anything runs.
  Result bad = launch({"eval", final_ck, "--task", dir / "missing.jsonl"});
  CHECK(bad.code == 2);
  CHECK_THAT(bad.out, Contains("missing.jsonl"));
  bad = launch({"run", "other", cfg, dir / "out", R"(eval/evaluations=["perplexity","accuracy"])"});
  CHECK(bad.code == 2);
  CHECK_THAT(bad.out, Contains("has unknown element \"accuracy\"; known: \"perplexity\" and \"task:FILE\""));
  bad = launch({"run", "other", cfg, dir / "out", "eval/evaluations=[\"task:" + (dir / "missing.jsonl") + "\"]"});
  CHECK(bad.code == 2);
  CHECK_THAT(bad.out, Contains("missing.jsonl"));
  Result ev = run_ok({"eval", final_ck, "--task", dir / "choices.jsonl", "--task", dir / "answers.jsonl", "--json",
                      "--per-example", dir / "per_example.json"});
  const json out = json::parse(ev.out.substr(ev.out.find('{')));
  CHECK(out["tokenizer"] == "byte");
  CHECK(out["tasks"]["choices"]["examples"] == 5);
  CHECK(out["tasks"]["answers"]["examples"] == 2);
  const json per = read_json_file(dir / "per_example.json");
  REQUIRE(per.size() == 2);
  // A choice's log-likelihood is a sum of log-probabilities: negative, one per continuation token.
  for (const auto& c : per[0]["examples"][0]["choices"]) {
    CHECK(c["loglikelihood"].get<double>() < 0);
    CHECK(c["logprobs"].size() == c["continuation"].size());
  }
  Result py = shell("python3 " + quote(std::string(LT_SOURCE_DIR) + "/tests/tools/task_recompute.py") + " " +
                    quote(dir / "per_example.json") + " --byte");
  INFO(py.out);
  if (py.code == 127) {
    WARN("skipped the Python recomputation: no python3");
  } else {
    CHECK(py.code == 0);
    CHECK_THAT(py.out, Contains("\"task\": \"choices\", \"examples\": 5"));
  }

  // llama.cpp on the exported model: the same log-likelihoods within its float16 cache's rounding.
  run_ok({"export", final_ck, dir / "gguf", "--format", "gguf", "--dtype", "float32"});
  json sequences = json::array();
  for (const auto& e : per[0]["examples"])
    for (const auto& c : e["choices"]) {
      std::vector<int64_t> ids = c["context"];
      for (const auto& t : c["continuation"]) ids.push_back(t.get<int64_t>());
      ids.pop_back();  // inputs: the last token is only predicted
      sequences.push_back(ids);
    }
  write_file_atomic(dir / "request.json", json{{"model", dir / "gguf/model.gguf"}, {"sequences", sequences}}.dump());
  Result l = shell("node " + quote(std::string(LT_SOURCE_DIR) + "/tests/tools/llama_cpp_logits.mjs") + " " + quote(dir / "request.json"));
  if (l.code == 3 || l.code == 127) {
    WARN("skipped the llama.cpp check: " << l.out << "(bash scripts/fetch_llama_cpp.sh installs node-llama-cpp)");
    return;
  }
  REQUIRE(l.code == 0);
  const json logits = json::parse(l.out)["logits"];
  size_t k = 0;
  double worst = 0;
  for (const auto& e : per[0]["examples"])
    for (const auto& c : e["choices"]) {
      const auto& rows = logits[k++];
      const size_t n_context = c["context"].size(), n_cont = c["continuation"].size();
      double ll = 0;
      for (size_t i = 0; i < n_cont; ++i) {
        const auto& row = rows[n_context - 1 + i];
        double max = -1e300, sum = 0;
        for (const auto& v : row) max = std::max(max, v.get<double>());
        for (const auto& v : row) sum += std::exp(v.get<double>() - max);
        ll += row[c["continuation"][i].get<size_t>()].get<double>() - max - std::log(sum);
      }
      worst = std::max(worst, std::abs(ll - c["loglikelihood"].get<double>()));
    }
  std::printf("eval --task against llama.cpp on the exported GGUF: largest log-likelihood difference %.5f\n", worst);
  CHECK(worst < 0.02);
}
