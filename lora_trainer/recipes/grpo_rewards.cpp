#include "lora_trainer/recipes/grpo_rewards.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include "lora_trainer/core/subprocess.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/byte_level_bpe.hpp"
#include "lora_trainer/training/tasks.hpp"

namespace lt {
namespace {

using json = nlohmann::json;

// A compiled pattern, and the first group's text of its first match.
class Pattern {
 public:
  Pattern(const std::string& pattern, const std::string& what) : re_(bpe::regex_compile(pattern, what)), groups_(0) {
    pcre2_pattern_info(re_.get(), PCRE2_INFO_CAPTURECOUNT, &groups_);
  }
  uint32_t groups() const { return groups_; }
  // Whether it matches; *group (when given) the first group's text, or the whole match without groups.
  bool find(const std::string& text, std::string* group = nullptr) const {
    std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> md(pcre2_match_data_create_from_pattern(re_.get(), nullptr),
                                                                       pcre2_match_data_free);
    const int rc = pcre2_match(re_.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md.get(), nullptr);
    if (rc < 0) return false;
    if (group) {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const int k = groups_ > 0 && rc > 1 ? 1 : 0;
      *group = ov[2 * k] == PCRE2_UNSET ? std::string() : text.substr(ov[2 * k], ov[2 * k + 1] - ov[2 * k]);
    }
    return true;
  }

 private:
  bpe::Regex re_;
  uint32_t groups_;
};

class ExactMatch : public Reward {
 public:
  explicit ExactMatch(std::unique_ptr<Pattern> pattern) : pattern_(std::move(pattern)) {}
  std::vector<double> score(const std::vector<RewardInput>& batch) override {
    std::vector<double> out;
    for (const auto& in : batch) {
      const auto answers = record_answers(in.record, in.where);
      std::string said = in.completion;
      if (pattern_ && !pattern_->find(in.completion, &said)) {
        out.push_back(0.0);
        continue;
      }
      said = normalize_answer(said);
      out.push_back(std::any_of(answers.begin(), answers.end(), [&](const std::string& a) { return normalize_answer(a) == said; })
                        ? 1.0 : 0.0);
    }
    return out;
  }

 private:
  std::unique_ptr<Pattern> pattern_;
};

class RegexReward : public Reward {
 public:
  explicit RegexReward(std::unique_ptr<Pattern> pattern) : pattern_(std::move(pattern)) {}
  std::vector<double> score(const std::vector<RewardInput>& batch) override {
    std::vector<double> out;
    for (const auto& in : batch) out.push_back(pattern_->find(in.completion) ? 1.0 : 0.0);
    return out;
  }

 private:
  std::unique_ptr<Pattern> pattern_;
};

class LengthPenalty : public Reward {
 public:
  explicit LengthPenalty(int64_t budget) : budget_(static_cast<double>(std::max<int64_t>(1, budget))) {}
  std::vector<double> score(const std::vector<RewardInput>& batch) override {
    std::vector<double> out;
    for (const auto& in : batch) out.push_back(-static_cast<double>(in.completion_tokens) / budget_);
    return out;
  }

 private:
  double budget_;
};

class CommandReward : public Reward {
 public:
  CommandReward(std::vector<std::string> argv, double timeout_s, std::string what)
      : argv_(std::move(argv)), timeout_s_(timeout_s), what_(std::move(what)) {}
  std::vector<double> score(const std::vector<RewardInput>& batch) override {
    if (!process_) process_ = std::make_unique<LineProcess>(argv_, what_);  // started with the first rollouts
    std::vector<double> out;
    for (const auto& in : batch) {
      json q = json::object();
      if (in.record && in.record->is_object())
        for (const auto& [k, v] : in.record->items()) q[k] = v;
      q["prompt"] = in.prompt;
      q["completion"] = in.completion;
      const std::string about = "scoring the completion of " + in.where;
      const std::string answer = process_->ask(q.dump(-1, ' ', false, json::error_handler_t::replace), timeout_s_, about);
      json a;
      try {
        a = json::parse(answer);
      } catch (const std::exception&) {
        a = json();
      }
      const bool ok = a.is_object() && a.contains("reward") && (a["reward"].is_number() || a["reward"].is_null());
      if (!ok) {
        process_.reset();  // a program out of step with its questions is not asked again
        throw UserError(what_ + " (" + join(argv_, " ") + "), " + about + ": it printed \"" + answer.substr(0, 200) +
                        "\", not a JSON line {\"reward\": NUMBER or null}");
      }
      const double r = a["reward"].is_null() ? NAN : a["reward"].get<double>();
      if (std::isinf(r))
        throw UserError(what_ + " (" + join(argv_, " ") + "), " + about + ": the reward " + answer.substr(0, 200) +
                        " is not finite (null gives none)");
      out.push_back(r);
    }
    return out;
  }

 private:
  std::vector<std::string> argv_;
  double timeout_s_;
  std::string what_;
  std::unique_ptr<LineProcess> process_;
};

}  // namespace

std::vector<std::string> record_answers(const json* record, const std::string& where) {
  const json* a = record && record->is_object() && record->contains("answer") ? &(*record)["answer"] : nullptr;
  auto text = [&](const json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number()) return v.dump();
    throw UserError(where + ": \"answer\" must be a string, a number or a list of them, not " + v.dump().substr(0, 80));
  };
  if (!a) throw UserError(where + ": the exact_match reward needs the record's \"answer\" (a string, a number or a list of them)");
  std::vector<std::string> out;
  if (a->is_array()) {
    for (const auto& v : *a) out.push_back(text(v));
    if (out.empty()) throw UserError(where + ": \"answer\" is an empty list");
  } else {
    out.push_back(text(*a));
  }
  return out;
}

RewardSet::RewardSet(const json& specs, int64_t max_completion_length, const std::string& key) {
  if (!specs.is_array() || specs.empty())
    throw UserError(key + ": a list of rewards, e.g. [{\"kind\": \"exact_match\"}] (kinds: exact_match, regex, length, command)");
  std::set<std::string> names;
  for (size_t i = 0; i < specs.size(); ++i) {
    const json& s = specs[i];
    const std::string at = key + "[" + std::to_string(i) + "]";
    if (!s.is_object() || !s.contains("kind") || !s["kind"].is_string())
      throw UserError(at + ": an object with \"kind\": exact_match, regex, length or command");
    const std::string kind = s["kind"];
    std::set<std::string> allowed = {"kind", "weight", "name"};
    if (kind == "exact_match" || kind == "regex") allowed.insert("pattern");
    if (kind == "command") allowed.insert({"command", "timeout"});
    for (const auto& [k, v] : s.items())
      if (!allowed.count(k)) throw UserError(at + ": \"" + k + "\" is not a key of a " + kind + " reward (keys: " + join({allowed.begin(), allowed.end()}) + ")");
    WeightedReward w;
    w.name = s.value("name", kind);
    if (!s.value("weight", json(1.0)).is_number() || !std::isfinite(s.value("weight", 1.0)))
      throw UserError(at + ".weight: a finite number");
    w.weight = s.value("weight", 1.0);
    auto pattern = [&](bool required) -> std::unique_ptr<Pattern> {
      if (!s.contains("pattern")) {
        if (required) throw UserError(at + ": a " + kind + " reward needs \"pattern\", a regular expression");
        return nullptr;
      }
      if (!s["pattern"].is_string() || s["pattern"].get<std::string>().empty()) throw UserError(at + ".pattern: a non-empty string");
      try {
        return std::make_unique<Pattern>(s["pattern"].get<std::string>(), at + ".pattern");
      } catch (const UserError&) {
        throw;
      } catch (const std::exception& e) {
        throw UserError(e.what());
      }
    };
    if (kind == "exact_match") {
      w.reward = std::make_unique<ExactMatch>(pattern(false));
    } else if (kind == "regex") {
      w.reward = std::make_unique<RegexReward>(pattern(true));
    } else if (kind == "length") {
      w.reward = std::make_unique<LengthPenalty>(max_completion_length);
    } else if (kind == "command") {
      if (!s.contains("command") || !s["command"].is_array() || s["command"].empty())
        throw UserError(at + ": a command reward needs \"command\": [program, arguments...]");
      std::vector<std::string> argv;
      for (const auto& a : s["command"]) {
        if (!a.is_string()) throw UserError(at + ".command: each element a string");
        argv.push_back(a);
      }
      const json t = s.value("timeout", json(60.0));
      if (!t.is_number() || !(t.get<double>() > 0) || !std::isfinite(t.get<double>()))
        throw UserError(at + ".timeout: seconds a completion, a positive number");
      w.reward = std::make_unique<CommandReward>(argv, t.get<double>(), at + " (reward \"" + w.name + "\")");
    } else {
      throw UserError(at + ".kind: \"" + kind + "\" is none of exact_match, regex, length, command");
    }
    if (!names.insert(w.name).second)
      throw UserError(at + ": a second reward named \"" + w.name + "\": give each its own \"name\" (the figures are by name)");
    rewards_.push_back(std::move(w));
  }
}

RewardSet::RewardSet(RewardSet&&) noexcept = default;
RewardSet::~RewardSet() = default;

std::vector<std::vector<double>> RewardSet::score(const std::vector<RewardInput>& batch) {
  std::vector<std::vector<double>> per;
  for (auto& r : rewards_) {
    per.push_back(r.reward->score(batch));
    if (per.back().size() != batch.size()) throw std::logic_error("reward " + r.name + " scored a batch partly");
  }
  return per;
}

std::vector<double> RewardSet::combine(const std::vector<std::vector<double>>& per) const {
  const size_t n = per.empty() ? 0 : per[0].size();
  std::vector<double> out(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    bool any = false;
    for (size_t k = 0; k < per.size(); ++k) {
      if (std::isnan(per[k][i])) continue;
      out[i] += rewards_[k].weight * per[k][i];
      any = true;
    }
    if (!any) out[i] = NAN;
  }
  return out;
}

}  // namespace lt
