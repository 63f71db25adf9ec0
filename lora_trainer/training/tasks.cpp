#include "lora_trainer/training/tasks.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/models/generate.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace lt {

namespace {

std::vector<std::string> strings_of(const json& v, const std::string& where) {
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array() || v.empty()) throw UserError(where + " must be a string or a non-empty list of strings");
  std::vector<std::string> out;
  for (const auto& s : v) {
    if (!s.is_string()) throw UserError(where + " must be a string or a non-empty list of strings");
    out.push_back(s);
  }
  return out;
}

size_t code_points(const std::string& s) {
  return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

}  // namespace

std::vector<std::string> task_paths(const std::vector<std::string>& evaluations) {
  std::vector<std::string> out;
  for (const auto& e : evaluations)
    if (e.rfind("task:", 0) == 0) out.push_back(e.substr(5));
  return out;
}

std::string evaluation_problem(const std::string& entry) {
  if (entry == "perplexity" || (entry.rfind("task:", 0) == 0 && entry.size() > 5)) return "";
  return "has unknown element \"" + entry + "\"; known: \"perplexity\" and \"task:FILE\" (a JSONL task file)";
}

Task read_task(const std::string& path) {
  Task t;
  t.path = path;
  t.name = fs::path(path).stem().string();
  require_regular_file(path, "the task file");
  std::istringstream in(read_file(path));
  std::string line;
  int64_t number = 0;
  bool seen_mc = false;
  while (std::getline(in, line)) {
    ++number;
    if (std::all_of(line.begin(), line.end(), is_space)) continue;
    const std::string where = path + " line " + std::to_string(number);
    const json r = parse_json(line, where);
    if (!r.is_object()) throw UserError(where + ": a record is a JSON object");
    TaskExample e;
    e.line = number;
    const bool mc = r.contains("question") || r.contains("choices");
    const bool gen = r.contains("prompt");
    if (mc == gen)
      throw UserError(where + ": a record is either {\"question\", \"choices\", \"answer\"} (multiple choice) or "
                              "{\"prompt\", \"answer\"} (exact match)");
    if (!r.contains("answer")) throw UserError(where + ": no \"answer\"");
    if (mc) {
      if (!r.value("question", json()).is_string()) throw UserError(where + ": \"question\" must be a string");
      e.question = r["question"];
      e.choices = strings_of(r.value("choices", json()), where + ": \"choices\"");
      if (e.choices.size() < 2) throw UserError(where + ": \"choices\" needs at least two choices");
      const json& a = r["answer"];
      if (a.is_number_integer()) {
        e.answer = a.get<int64_t>();
      } else if (a.is_string()) {
        auto it = std::find(e.choices.begin(), e.choices.end(), a.get<std::string>());
        e.answer = it == e.choices.end() ? -1 : it - e.choices.begin();
      }
      if (e.answer < 0 || e.answer >= static_cast<int64_t>(e.choices.size()))
        throw UserError(where + ": \"answer\" " + a.dump() + " is neither the index of a choice (0 to " +
                        std::to_string(e.choices.size() - 1) + ") nor the text of one");
    } else {
      if (!r["prompt"].is_string()) throw UserError(where + ": \"prompt\" must be a string");
      e.prompt = r["prompt"];
      e.answers = strings_of(r["answer"], where + ": \"answer\"");
      if (r.contains("stop")) {
        e.stop = strings_of(r["stop"], where + ": \"stop\"");
        for (size_t i = 0; i < e.stop.size(); ++i)
          if (e.stop[i].empty())
            throw UserError(where + ": \"stop\"" + (r["stop"].is_array() ? "[" + std::to_string(i) + "]" : std::string()) +
                            " is an empty string, which would end every generation before its first character; give "
                            "the text that ends an answer (e.g. \"\\n\"), or leave \"stop\" out for the default [\"\\n\"]");
      }
      if (r.contains("max_tokens")) {
        if (!r["max_tokens"].is_number_integer() || r["max_tokens"].get<int64_t>() < 1 || r["max_tokens"].get<int64_t>() > 4096)
          throw UserError(where + ": \"max_tokens\" must be an integer from 1 to 4096");
        e.max_tokens = r["max_tokens"];
      }
    }
    if (!t.examples.empty() && (seen_mc != mc))
      throw UserError(where + ": a task file holds one kind of record (multiple choice or exact match); line " +
                      std::to_string(number) + " is the other kind");
    seen_mc = mc;
    t.generation = !mc;
    t.examples.push_back(std::move(e));
  }
  if (t.examples.empty()) throw UserError(path + ": no records (one JSON object a line)");
  return t;
}

TokenPair encode_pair(const Tokenizer& tok, std::string context, std::string continuation) {
  size_t keep = context.size();
  while (keep > 0 && is_space(context[keep - 1])) --keep;
  continuation = context.substr(keep) + continuation;
  context.resize(keep);
  TokenPair p;
  if (context.empty()) {
    p.context = {tok.eot_id()};
    p.continuation = tok.encode(continuation);
    return p;
  }
  const std::vector<uint32_t> whole = tok.encode(context + continuation);
  p.context = tok.encode(context);
  const size_t n = std::min(p.context.size(), whole.size());
  p.continuation.assign(whole.begin() + static_cast<std::ptrdiff_t>(n), whole.end());
  return p;
}

double length_normalised(double loglikelihood, const std::string& choice) {
  return loglikelihood / std::max<double>(1, static_cast<double>(code_points(choice)));
}

std::string normalize_answer(const std::string& s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (is_space(c)) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  while (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

namespace {

ChoiceScore score_choice(CausalLM& model, const Runtime& rt, TokenPair tokens, const std::string& tokenizer,
                         const std::string& where) {
  ChoiceScore s;
  s.tokens = std::move(tokens);
  std::vector<uint32_t> all(s.tokens.context.begin(), s.tokens.context.end());
  all.insert(all.end(), s.tokens.continuation.begin(), s.tokens.continuation.end());
  check_token_ids(all, model->options().vocab_size, tokenizer, where);
  std::vector<int64_t> ids(all.begin(), all.end());
  const int64_t block = model->options().block_size;
  // The last block_size + 1 tokens: block_size inputs, each predicting the next.
  const int64_t first = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - block - 1);
  std::vector<int64_t> window(ids.begin() + first, ids.end());
  const int64_t n = static_cast<int64_t>(window.size()) - 1;
  const int64_t cont = static_cast<int64_t>(s.tokens.continuation.size());
  if (n < 1 || cont == 0) return s;
  torch::Tensor input = torch::tensor(std::vector<int64_t>(window.begin(), window.end() - 1)).unsqueeze(0);
  torch::Tensor logits;
  {
    AutocastGuard autocast(rt);
    logits = model->forward(input.to(rt.device));
  }
  torch::Tensor logp = logits[0].to(torch::kFloat32).log_softmax(-1).cpu();  // (n, V)
  const int64_t scored = std::min(cont, n);
  for (int64_t k = n - scored; k < n; ++k) {
    const double lp = logp[k][window[k + 1]].item<double>();
    s.logprobs.push_back(lp);
    s.loglikelihood += lp;
  }
  return s;
}

}  // namespace

TaskResult run_task(CausalLM& model, const Runtime& rt, const Tokenizer& tok, const Task& task) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  TaskResult r;
  r.name = task.name;
  r.generation = task.generation;
  r.examples = static_cast<int64_t>(task.examples.size());
  int64_t right = 0, right_norm = 0;
  for (const auto& e : task.examples) {
    TaskExampleResult x;
    const std::string where = task.path + " line " + std::to_string(e.line);
    if (!task.generation) {
      double best = -1e300, best_norm = -1e300;
      for (size_t c = 0; c < e.choices.size(); ++c) {
        x.choices.push_back(score_choice(model, rt, encode_pair(tok, e.question, " " + e.choices[c]), tok.name(),
                                        where + " (choice " + std::to_string(c) + ")"));
        const double ll = x.choices.back().loglikelihood;
        const double norm = length_normalised(ll, e.choices[c]);
        if (ll > best) best = ll, x.predicted = static_cast<int64_t>(c);
        if (norm > best_norm) best_norm = norm, x.predicted_norm = static_cast<int64_t>(c);
      }
      x.correct = x.predicted == e.answer;
      x.correct_norm = x.predicted_norm == e.answer;
    } else {
      std::vector<uint32_t> prompt = tok.encode(e.prompt);
      if (prompt.empty()) prompt = {tok.eot_id()};
      GenerateOptions o;
      o.max_new_tokens = e.max_tokens;
      o.temperature = 0;
      o.top_k = 0;
      o.stop_ids = {tok.eot_id()};
      o.vocab_limit = tok.vocab_size();
      o.tokenizer = tok.name();
      o.where = where + " (its prompt)";
      std::vector<uint32_t> out = generate(model, rt, prompt, o);
      if (!out.empty() && out.back() == tok.eot_id()) out.pop_back();
      std::string text = tok.decode(out);
      for (const auto& stop : e.stop) {
        const size_t at = text.find(stop);  // read_task refuses an empty one
        if (at != std::string::npos) text.resize(at);
      }
      x.generated = text;
      const std::string said = normalize_answer(text);
      x.correct = std::any_of(e.answers.begin(), e.answers.end(), [&](const std::string& a) { return normalize_answer(a) == said; });
    }
    right += x.correct;
    right_norm += x.correct_norm;
    r.per_example.push_back(std::move(x));
  }
  if (task.generation) r.exact_match = static_cast<double>(right) / std::max<int64_t>(1, r.examples);
  else {
    r.accuracy = static_cast<double>(right) / std::max<int64_t>(1, r.examples);
    r.accuracy_norm = static_cast<double>(right_norm) / std::max<int64_t>(1, r.examples);
  }
  if (was_training) model->train();
  return r;
}

void TaskSet::read(const std::vector<std::string>& paths) {
  for (const auto& path : paths)
    if (!tasks_.count(path)) tasks_.emplace(path, read_task(path));
}

std::vector<TaskResult> TaskSet::run(CausalLM& model, const Runtime& rt, const std::vector<std::string>& paths,
                                     const std::function<std::string()>& tokenizer_name) {
  std::vector<TaskResult> out;
  if (paths.empty()) return out;
  if (!tokenizer_) tokenizer_ = make_tokenizer(tokenizer_name());
  read(paths);
  for (const auto& path : paths) out.push_back(run_task(model, rt, *tokenizer_, tasks_.at(path)));
  return out;
}

}  // namespace lt
