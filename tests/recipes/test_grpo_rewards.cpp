// GRPO's rewards (recipes/grpo_rewards.hpp): exact match of the final answer (a pattern's group, the
// task files' normalisation, answers as strings, numbers or lists), a format's regular expression, the
// length penalty, their weighted sum with missing rewards counted out; a reward program answering JSON
// lines, the fields of the record passed to it; and the errors a user meets: a spec that is wrong
// (naming the entry and key), a record without an answer, a program that cannot start, exits, answers
// nonsense or too late (naming the program, the record and its errors).
#include <cmath>

#include "catch.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/recipes/grpo_rewards.hpp"

using namespace lt;
using lt::test::Contains;
using json = nlohmann::json;

namespace {

RewardInput input(const std::string& completion, const json* record, int64_t tokens = 0) {
  RewardInput in;
  in.prompt = "What is 6 x 7?";
  in.completion = completion;
  in.completion_tokens = tokens;
  in.record = record;
  in.where = "prompts.jsonl line 3";
  return in;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("grpo rewards: exact match of the final answer, a format's pattern, the length penalty, weighted", "[grpo][rewards]") {
  const json record = {{"answer", 42}};
  const json list_record = {{"answer", {"Forty-two", "42"}}};
  RewardSet set(json::parse(R"([{"kind": "exact_match", "pattern": "####\\s*(.+)$"},
                                {"kind": "exact_match", "name": "whole", "weight": 0.5},
                                {"kind": "regex", "pattern": "^<think>[\\s\\S]*</think>", "weight": 0.25},
                                {"kind": "length", "weight": 2}])"),
                16, "optimization/grpo/rewards");
  REQUIRE(set.rewards().size() == 4);
  CHECK(set.rewards()[1].name == "whole");
  const std::vector<RewardInput> batch = {input("<think>6 x 7</think> so #### 42.", &record, 8),
                                          input("#### 41", &record, 4),
                                          input("  FORTY-TWO ", &list_record, 16),
                                          input("no answer here", &record, 0)};
  const auto per = set.score(batch);
  CHECK(per[0] == std::vector<double>{1, 0, 0, 0});  // the group, normalised ("42." -> "42"); no "####": 0
  CHECK(per[1] == std::vector<double>{0, 0, 1, 0});  // the whole completion, normalised, against each answer
  CHECK(per[2] == std::vector<double>{1, 0, 0, 0});
  CHECK(per[3] == std::vector<double>{-0.5, -0.25, -1, 0});
  const auto sum = set.combine(per);
  CHECK(sum[0] == Approx(1 + 0.25 - 1.0));
  CHECK(sum[2] == Approx(0.5 - 2.0));
  // A reward that gives none counts 0; none at all: no reward.
  const auto partial = set.combine({{NAN, 1}, {NAN, NAN}, {NAN, 0}, {NAN, -0.5}});
  CHECK(std::isnan(partial[0]));
  CHECK(partial[1] == Approx(1 - 1.0));
  // A record without an answer, at the first score.
  const json no_answer = {{"question", "?"}};
  CHECK_THAT(error_of([&] { set.score({input("#### 1", &no_answer)}); }),
             Contains("prompts.jsonl line 3") && Contains("\"answer\""));
}

TEST_CASE("grpo rewards: a spec that is wrong is refused naming the entry and the key", "[grpo][rewards]") {
  auto refused = [](const std::string& specs) { return error_of([&] { RewardSet(json::parse(specs), 8, "optimization/grpo/rewards"); }); };
  CHECK_THAT(refused(R"([])"), Contains("optimization/grpo/rewards") && Contains("exact_match"));
  CHECK_THAT(refused(R"([{"kind": "bleu"}])"), Contains("rewards[0].kind") && Contains("bleu"));
  CHECK_THAT(refused(R"([{"kind": "regex"}])"), Contains("rewards[0]") && Contains("pattern"));
  CHECK_THAT(refused(R"([{"kind": "length"}, {"kind": "regex", "pattern": "(unclosed"}])"), Contains("rewards[1].pattern"));
  CHECK_THAT(refused(R"([{"kind": "length", "patern": "x"}])"), Contains("\"patern\"") && Contains("rewards[0]"));
  CHECK_THAT(refused(R"([{"kind": "length"}, {"kind": "length"}])"), Contains("rewards[1]") && Contains("\"name\""));
  CHECK_THAT(refused(R"([{"kind": "command"}])"), Contains("\"command\""));
  CHECK_THAT(refused(R"([{"kind": "command", "command": ["x"], "timeout": 0}])"), Contains("rewards[0].timeout"));
  CHECK_THAT(refused(R"([{"kind": "length", "weight": "high"}])"), Contains("rewards[0].weight"));
}

TEST_CASE("grpo rewards: a reward program answers a JSON line a completion, and its failures name it and the record", "[grpo][rewards]") {
  const std::string py = "/usr/bin/python3";
  // Reward: the completion's length, plus 100 when it equals the record's answer; null for an empty one.
  const std::string program = R"(
import json, sys
for line in sys.stdin:
    q = json.loads(line)
    c = q["completion"]
    r = None if c == "" else len(c) + (100 if c == str(q.get("answer")) else 0)
    print(json.dumps({"reward": r}), flush=True)
)";
  const json record = {{"answer", "abc"}};
  json spec = json::array({{{"kind", "command"}, {"command", {py, "-c", program}}}});
  RewardSet set(spec, 8, "optimization/grpo/rewards");
  auto per = set.score({input("abc", &record), input("hello", &record), input("", &record)});
  CHECK(per[0][0] == 103);
  CHECK(per[0][1] == 5);
  CHECK(std::isnan(per[0][2]));
  per = set.score({input("x", &record)});  // the same program, still running
  CHECK(per[0][0] == 1);

  auto failing = [&](const std::string& code, double timeout = 60) {
    json s = json::array({{{"kind", "command"}, {"command", {py, "-c", code}}, {"timeout", timeout}}});
    RewardSet r(s, 8, "optimization/grpo/rewards");
    return error_of([&] { r.score({input("abc", &record)}); });
  };
  CHECK_THAT(failing("import sys; sys.stderr.write('no model file\\n'); sys.exit(3)"),
             Contains("prompts.jsonl line 3") && Contains("status 3") && Contains("no model file") && Contains("rewards[0]"));
  CHECK_THAT(failing("import sys\nfor l in sys.stdin: print('ok', flush=True)"), Contains("printed \"ok\"") && Contains("{\"reward\""));
  CHECK_THAT(failing("import sys\nfor l in sys.stdin: print('{\"reward\": \"high\"}', flush=True)"), Contains("not a JSON line"));
  CHECK_THAT(failing("import time; time.sleep(30)", 0.5), Contains("no answer within 0.5 s"));
  json missing = json::array({{{"kind", "command"}, {"command", {"lt-no-such-reward-program"}}}});
  RewardSet absent(missing, 8, "optimization/grpo/rewards");
  CHECK_THAT(error_of([&] { absent.score({input("abc", &record)}); }), Contains("cannot start lt-no-such-reward-program"));
}
