// Task evaluations beyond perplexity, from a JSONL file: `eval --task FILE`, and at every validation
// with eval/evaluations ["task:FILE", ...].
//
// A record is one of
//   {"question": "...", "choices": ["...", ...], "answer": 0}     multiple choice (answer: an index
//                                                                  or the text of a choice)
//   {"prompt": "...", "answer": "..." or ["...", ...],             exact match of a greedy generation
//    "stop": ["\n", ...], "max_tokens": 32}                        (stop and max_tokens optional)
// and a file holds one kind. Multiple choice follows lm-evaluation-harness: each choice is scored by
// the sum of its tokens' log-probabilities after the question, as the continuation " " + choice, split
// from the question as `encode_pair` says; accuracy takes the choice with the highest sum,
// length-normalised accuracy (acc_norm) the highest sum divided by the choice's length in characters
// (Unicode code points). Exact match generates greedily from the prompt up to max_tokens (default 32),
// the end-of-text token or the first stop string (default "\n"), and compares the text before it with
// each answer after normalize_answer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

struct TaskExample {
  // Multiple choice.
  std::string question;
  std::vector<std::string> choices;
  int64_t answer = -1;
  // Exact match.
  std::string prompt;
  std::vector<std::string> answers;
  std::vector<std::string> stop{"\n"};
  int64_t max_tokens = 32;
  int64_t line = 0;  // in the task file, for messages
};

struct Task {
  std::string name;  // the file's name without .jsonl
  std::string path;
  bool generation = false;  // exact match; else multiple choice
  std::vector<TaskExample> examples;
};

// The task files of eval/evaluations: the FILE of each "task:FILE" entry, in order.
std::vector<std::string> task_paths(const std::vector<std::string>& evaluations);
// What eval/evaluations accepts: "perplexity" and "task:FILE"; "" or what is wrong with `entry`.
std::string evaluation_problem(const std::string& entry);

// Reads a task file; a record that is neither kind, mixes kinds, has an answer that is not one of its
// choices, or a stop string that is empty (it would cut every text to nothing) is a UserError naming
// the file, the line and the key.
Task read_task(const std::string& path);

// lm-evaluation-harness's split of a context and its continuation into tokens: trailing whitespace of
// the context moves to the start of the continuation; the continuation's tokens are those of
// encode(context + continuation) past the tokens of encode(context) (so a merge across the boundary
// belongs to the continuation). An empty context is the end-of-text token alone.
struct TokenPair {
  std::vector<uint32_t> context, continuation;
};
TokenPair encode_pair(const Tokenizer& tok, std::string context, std::string continuation);

// acc_norm's score of a choice: its log-likelihood over its length in characters (Unicode code points,
// as Python's len counts them; not bytes).
double length_normalised(double loglikelihood, const std::string& choice);

// Lowercase (ASCII), surrounding whitespace and final periods removed, inner whitespace runs one space.
std::string normalize_answer(const std::string& s);

struct ChoiceScore {
  TokenPair tokens;
  std::vector<double> logprobs;  // one a continuation token
  double loglikelihood = 0;      // their sum
};

struct TaskExampleResult {
  std::vector<ChoiceScore> choices;  // multiple choice
  int64_t predicted = -1, predicted_norm = -1;
  std::string generated;  // exact match: the text compared
  bool correct = false, correct_norm = false;
};

struct TaskResult {
  std::string name;
  bool generation = false;
  int64_t examples = 0;
  double accuracy = 0, accuracy_norm = 0;  // multiple choice
  double exact_match = 0;                  // exact match
  std::vector<TaskExampleResult> per_example;
};

// Runs `task` on `model` (no gradients, eval mode for the call) with `tok`, under the runtime's
// precision. Inputs longer than the model's block size keep their last block_size tokens.
TaskResult run_task(CausalLM& model, const Runtime& rt, const Tokenizer& tok, const Task& task);

// The task files a job evaluates, each read once, and the tokenizer they run with, made when the first
// one runs.
class TaskSet {
 public:
  // Reads the files not read yet (a UserError names a missing or bad one).
  void read(const std::vector<std::string>& paths);
  // run_task of each file on `model`, with the tokenizer `tokenizer_name()` names (asked once).
  std::vector<TaskResult> run(CausalLM& model, const Runtime& rt, const std::vector<std::string>& paths,
                              const std::function<std::string()>& tokenizer_name);

 private:
  std::map<std::string, Task> tasks_;  // by path
  std::unique_ptr<Tokenizer> tokenizer_;
};

}  // namespace lt
