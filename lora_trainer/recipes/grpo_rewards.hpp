// GRPO's rewards: what scores a completion. Built in: exact match of the final answer (the task files'
// normalisation, training/tasks.hpp), a regular expression (a format), a length penalty; and any
// program: started once, it reads a JSON line a completion and prints a JSON line with its reward.
// Several rewards are weighted and summed (TRL's reward_weights): a reward that gives none (NaN) counts
// 0 in the sum, and a completion that no reward scored has no reward (NaN: advantage 0).
//
// optimization/grpo/rewards is a list of objects, each {"kind": ..., "weight": w (default 1),
// "name": for the figures (default the kind)} and the kind's keys:
//   exact_match  "pattern" (optional): a regular expression whose first group captures the final
//                answer (e.g. "####\\s*(.+)$", or "\\\\boxed\\{([^}]*)\\}"); without it the whole completion.
//                1 when the answer, normalised, equals one of the record's "answer" (a string, a number or a
//                list of them) normalised, else 0 (also when the pattern finds nothing).
//   regex        "pattern": 1 when it matches somewhere in the completion, else 0.
//   length       -(completion tokens) / max_completion_length: from 0 (empty) to -1 (the whole budget).
//   command      "command": [program, args...], "timeout" (seconds a completion, default 60). The program
//                reads {"prompt": ..., "completion": ..., and the record's other fields} a line and prints
//                {"reward": x} a line (x a number, or null for none). It starts with the first rollouts and
//                is restarted by a resumed run; a failure, a timeout or an answer that is not such a line is
//                a UserError naming the program, the record and what it printed.
// Patterns are PCRE2's (Perl's syntax, UTF-8, Unicode classes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

// One completion to score.
struct RewardInput {
  std::string prompt;                // the prompt's text, as the model read it
  std::string completion;            // the completion's text, without its stop id
  int64_t completion_tokens = 0;
  const nlohmann::json* record = nullptr;  // the prompt's record (answer and any other fields), or null
  std::string where;                 // the record's origin, for messages ("prompts.jsonl line 12")
};

class Reward {
 public:
  virtual ~Reward() = default;
  // The batch's scores, one a completion; NaN where it gives none.
  virtual std::vector<double> score(const std::vector<RewardInput>& batch) = 0;
};

struct WeightedReward {
  std::string name;
  double weight = 1;
  std::unique_ptr<Reward> reward;
};

// The rewards of optimization/grpo/rewards (`key` names it in errors), checked now: an unknown kind or
// key, a missing pattern or command, a pattern that does not compile, two rewards of one name: a
// UserError naming the entry and the key. max_completion_length scales the length penalty.
class RewardSet {
 public:
  RewardSet(const nlohmann::json& specs, int64_t max_completion_length, const std::string& key);
  RewardSet(RewardSet&&) noexcept;
  ~RewardSet();
  // Each reward's scores of the batch: per[k][i] is reward k's score of completion i.
  std::vector<std::vector<double>> score(const std::vector<RewardInput>& batch);
  // The weighted sum of per[k][i] over k, NaN scores counted 0; NaN where every reward gave NaN.
  std::vector<double> combine(const std::vector<std::vector<double>>& per) const;
  const std::vector<WeightedReward>& rewards() const { return rewards_; }

 private:
  std::vector<WeightedReward> rewards_;
};

// The record's answers as exact match compares them: "answer" as a string, a number's JSON text, or a
// list of them. A UserError naming `where` when the record has none.
std::vector<std::string> record_answers(const nlohmann::json* record, const std::string& where);

}  // namespace lt
