// Configuration: every option is a slash path ("training/batch_size") with a type, a default, a doc
// line and a range check, declared in code by the job that uses it (its schema). Values are layered:
// defaults < config file (JSON, nested by path) < `key=value` overrides. Unknown keys, wrong types and
// out-of-range values are UserErrors that name the key (and the closest known key for a typo).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

using json = nlohmann::json;

enum class OptType {
  Int,
  Float,
  Bool,
  String,
  IntList,
  StringList,
  Samplings,       // [{"name": str, "rate": number > 0, "style": "pmd"|"padded"|"contrastive"|"prompts"}], rates summing to 1
  SamplingStages,  // a list of Samplings, one per stage
  ParamRules,      // [{"match": str, "lr_ratio": number > 0, "weight_decay": bool}], the last two optional
  TokenIndices,    // a list of integers, or {"module": [integers], ...} (PEFT's trainable_token_indices)
  Objects,         // a list of objects, their fields checked by the option's check (GRPO's rewards)
};

std::string opt_type_name(OptType t);

// Returns "" when the value is acceptable, otherwise what is wrong ("must be > 0").
using OptCheck = std::function<std::string(const json&)>;

struct OptionSpec {
  std::string path;
  OptType type;
  json default_value;
  std::string doc;
  OptCheck check;  // may be empty
};

// The set of options a job understands.
class ConfigSchema {
 public:
  ConfigSchema& add(std::string path, OptType type, json default_value, std::string doc,
                    OptCheck check = {});
  // Drops an option a subclass does not use (e.g. lora/train's phases replace training/tokens).
  ConfigSchema& remove(const std::string& path);
  const OptionSpec* find(const std::string& path) const;
  const std::vector<OptionSpec>& options() const { return options_; }
  std::vector<std::string> paths() const;

 private:
  std::vector<OptionSpec> options_;
};

// Common checks.
OptCheck check_positive();
OptCheck check_nonnegative();
OptCheck check_range(double lo, double hi);  // inclusive
OptCheck check_one_of(std::vector<std::string> allowed);
OptCheck check_positive_or_minus_one();
OptCheck check_positive_list();  // every element of an IntList > 0
OptCheck check_each_one_of(std::vector<std::string> allowed);  // every element of a StringList

class Config {
 public:
  explicit Config(ConfigSchema schema);  // every option at its default

  // Layers a config file (JSON, nested by path) over the current values. `source` names it in errors.
  void merge_json(const json& nested, const std::string& source);
  void merge_file(const std::string& path);
  // "training/batch_size=64": the value is parsed as JSON; if that fails it is taken as a string.
  void apply_override(const std::string& assignment);
  void set(const std::string& path, const json& value, const std::string& source = "code");

  const json& get(const std::string& path) const;
  int64_t get_int(const std::string& path) const;
  double get_double(const std::string& path) const;
  bool get_bool(const std::string& path) const;
  std::string get_string(const std::string& path) const;

  // Nested JSON of every value (the resolved config).
  json to_json() const;
  const ConfigSchema& schema() const { return schema_; }

 private:
  const OptionSpec& spec_or_throw(const std::string& path, const std::string& source) const;
  ConfigSchema schema_;
  json values_;  // flat: path -> value
};

// Splits "a/b/c" into {"a","b","c"}.
std::vector<std::string> split_path(const std::string& path);

}  // namespace lt
