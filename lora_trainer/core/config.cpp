#include "lora_trainer/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>

#include "lora_trainer/core/dataset_style.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

std::string opt_type_name(OptType t) {
  switch (t) {
    case OptType::Int: return "integer";
    case OptType::Float: return "number";
    case OptType::Bool: return "boolean";
    case OptType::String: return "string";
    case OptType::IntList: return "list of integers";
    case OptType::StringList: return "list of strings";
    case OptType::Samplings: return "list of samplings [{\"name\":..,\"rate\":..,\"style\":\"pmd\"}]";
    case OptType::SamplingStages: return "list of stages, each a list of samplings";
    case OptType::ParamRules: return "list of rules [{\"match\":..,\"lr_ratio\":..,\"weight_decay\":true|false}]";
    case OptType::TokenIndices: return "list of integers, or {\"module\": [integers]}";
    case OptType::Objects: return "list of objects [{...}]";
  }
  return "?";
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : path) {
    if (c == '/') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

ConfigSchema& ConfigSchema::add(std::string path, OptType type, json default_value, std::string doc,
                                OptCheck check) {
  for (auto& o : options_) {
    if (o.path == path) {  // a subclass re-declares an option: its default and doc win
      o = OptionSpec{std::move(path), type, std::move(default_value), std::move(doc), std::move(check)};
      return *this;
    }
  }
  options_.push_back({std::move(path), type, std::move(default_value), std::move(doc), std::move(check)});
  return *this;
}

ConfigSchema& ConfigSchema::remove(const std::string& path) {
  options_.erase(std::remove_if(options_.begin(), options_.end(), [&](const OptionSpec& o) { return o.path == path; }),
                 options_.end());
  return *this;
}

const OptionSpec* ConfigSchema::find(const std::string& path) const {
  for (const auto& o : options_)
    if (o.path == path) return &o;
  return nullptr;
}

std::vector<std::string> ConfigSchema::paths() const {
  std::vector<std::string> out;
  for (const auto& o : options_) out.push_back(o.path);
  return out;
}

OptCheck check_positive() {
  return [](const json& v) { return v.get<double>() > 0 ? "" : "must be > 0"; };
}
OptCheck check_nonnegative() {
  return [](const json& v) { return v.get<double>() >= 0 ? "" : "must be >= 0"; };
}
OptCheck check_range(double lo, double hi) {
  return [lo, hi](const json& v) {
    double x = v.get<double>();
    if (x >= lo && x <= hi) return std::string();
    std::ostringstream ss;
    ss << "must be between " << lo << " and " << hi;
    return ss.str();
  };
}
OptCheck check_one_of(std::vector<std::string> allowed) {
  return [allowed](const json& v) {
    for (const auto& a : allowed)
      if (v.get<std::string>() == a) return std::string();
    return "must be one of: " + join(allowed);
  };
}
OptCheck check_positive_or_minus_one() {
  return [](const json& v) {
    auto x = v.get<int64_t>();
    return (x > 0 || x == -1) ? "" : "must be > 0, or -1 for the default";
  };
}
OptCheck check_positive_list() {
  return [](const json& v) {
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].get<int64_t>() <= 0) return "element " + std::to_string(i) + " must be > 0";
    return std::string();
  };
}

OptCheck check_each_one_of(std::vector<std::string> allowed) {
  return [allowed](const json& v) {
    for (const auto& e : v)
      if (std::find(allowed.begin(), allowed.end(), e.get<std::string>()) == allowed.end())
        return "has unknown element \"" + e.get<std::string>() + "\"; known: " + join(allowed);
    return std::string();
  };
}

static bool is_integral(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
  if (v.is_number_integer()) return true;
  if (v.is_number_float()) {
    double d = v.get<double>();
    return std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15;
  }
  return false;
}

static std::string check_samplings(const json& v) {
  if (!v.is_array() || v.empty()) return "must be a non-empty list of samplings";
  double sum = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& s = v[i];
    std::string at = "sampling " + std::to_string(i);
    if (!s.is_object()) return at + " must be an object {\"name\":..,\"rate\":..}";
    for (auto it = s.begin(); it != s.end(); ++it)
      if (it.key() != "name" && it.key() != "rate" && it.key() != "style")
        return at + " has unknown field \"" + it.key() + "\" (known: name, rate, style)";
    if (!s.contains("name") || !s["name"].is_string() || s["name"].get<std::string>().empty())
      return at + " needs a \"name\" (a dataset directory under data/dir)";
    if (const std::string problem = name_problem(s["name"].get<std::string>()); !problem.empty())
      return at + ": dataset name " + problem;
    if (!s.contains("rate") || !s["rate"].is_number() || s["rate"].get<double>() <= 0)
      return at + " needs a \"rate\" > 0";
    if (s.contains("style")) {
      const auto& styles = dataset_style_names();
      if (!s["style"].is_string() || std::find(styles.begin(), styles.end(), s["style"].get<std::string>()) == styles.end())
        return at + " has style " + s["style"].dump() + "; use " + dataset_style_choices();
    }
    sum += s["rate"].get<double>();
  }
  if (std::fabs(sum - 1.0) > 1e-6) {
    std::ostringstream ss;
    ss << "rates sum to " << sum << "; they must sum to 1";
    return ss.str();
  }
  return "";
}

// Converts (where lossless) and checks the JSON type of a value; returns "" or what is wrong.
static std::string coerce(OptType type, json& v) {
  switch (type) {
    case OptType::Int:
      if (!is_integral(v)) return "must be an integer, got " + v.dump();
      v = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
      return "";
    case OptType::Float:
      if (!v.is_number()) return "must be a number, got " + v.dump();
      v = v.get<double>();
      return "";
    case OptType::Bool:
      if (!v.is_boolean()) return "must be true or false, got " + v.dump();
      return "";
    case OptType::String:
      if (!v.is_string()) return "must be a string, got " + v.dump();
      return "";
    case OptType::IntList:
      if (!v.is_array()) return "must be a list of integers, got " + v.dump();
      for (auto& e : v) {
        if (!is_integral(e)) return "must be a list of integers; element " + e.dump() + " is not";
        e = e.is_number_integer() ? e.get<int64_t>() : static_cast<int64_t>(e.get<double>());
      }
      return "";
    case OptType::TokenIndices:
      if (v.is_array()) return coerce(OptType::IntList, v);
      if (!v.is_object()) return "must be a list of integers or {\"module\": [integers]}, got " + v.dump();
      for (auto it = v.begin(); it != v.end(); ++it) {
        std::string e = coerce(OptType::IntList, it.value());
        if (!e.empty()) return "\"" + it.key() + "\": " + e;
      }
      return "";
    case OptType::Objects:
      if (!v.is_array()) return "must be a list of objects, got " + v.dump();
      for (size_t i = 0; i < v.size(); ++i)
        if (!v[i].is_object()) return "must be a list of objects; element " + std::to_string(i) + " (" + v[i].dump() + ") is not";
      return "";
    case OptType::StringList:
      if (!v.is_array()) return "must be a list of strings, got " + v.dump();
      for (auto& e : v)
        if (!e.is_string()) return "must be a list of strings; element " + e.dump() + " is not";
      return "";
    case OptType::Samplings:
      return check_samplings(v);
    case OptType::ParamRules:
      if (!v.is_array()) return "must be a list of rules, got " + v.dump();
      for (size_t i = 0; i < v.size(); ++i) {
        const json& r = v[i];
        const std::string at = "rule " + std::to_string(i) + " (" + r.dump() + ")";
        if (!r.is_object()) return at + " is not an object";
        if (!r.contains("match") || !r["match"].is_string() || r["match"].get<std::string>().empty())
          return at + " needs \"match\": a non-empty substring of parameter names";
        for (auto it = r.begin(); it != r.end(); ++it)
          if (it.key() != "match" && it.key() != "lr_ratio" && it.key() != "weight_decay")
            return at + ": unknown field \"" + it.key() + "\" (known: match, lr_ratio, weight_decay)";
        if (r.contains("lr_ratio") && (!r["lr_ratio"].is_number() || r["lr_ratio"].get<double>() <= 0))
          return at + ": lr_ratio must be a number > 0";
        if (r.contains("weight_decay") && !r["weight_decay"].is_boolean())
          return at + ": weight_decay must be true or false";
      }
      return "";
    case OptType::SamplingStages:
      if (!v.is_array()) return "must be a list of stages (each a list of samplings)";
      for (size_t i = 0; i < v.size(); ++i) {
        std::string e = check_samplings(v[i]);
        if (!e.empty()) return "stage " + std::to_string(i) + ": " + e;
      }
      return "";
  }
  return "";
}

Config::Config(ConfigSchema schema) : schema_(std::move(schema)), values_(json::object()) {
  for (const auto& o : schema_.options()) values_[o.path] = o.default_value;
}

const OptionSpec& Config::spec_or_throw(const std::string& path, const std::string& source) const {
  if (const auto* s = schema_.find(path)) return *s;
  std::string msg = source + ": unknown config key \"" + path + "\"";
  std::string near = closest_match(path, schema_.paths());
  if (!near.empty()) msg += "; did you mean \"" + near + "\"?";
  msg += " (`lora_trainer configure JOB out.json` writes every known key with its default)";
  throw UserError(msg);
}

void Config::set(const std::string& path, const json& value, const std::string& source) {
  const OptionSpec& spec = spec_or_throw(path, source);
  json v = value;
  std::string err = coerce(spec.type, v);
  if (err.empty() && spec.check) err = spec.check(v);
  if (!err.empty())
    throw UserError(source + ": config key \"" + path + "\" " + err + " (expected " +
                    opt_type_name(spec.type) + "; " + spec.doc + ")");
  values_[path] = v;
}

static void flatten(const json& node, const std::string& prefix, const ConfigSchema& schema,
                    std::vector<std::pair<std::string, json>>& out) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    std::string path = prefix.empty() ? it.key() : prefix + "/" + it.key();
    // A known option is a leaf even when its value is an object or list; unknown objects recurse so
    // that a typo deep inside is reported with its full path.
    if (schema.find(path) || !it.value().is_object()) {
      out.emplace_back(path, it.value());
    } else {
      flatten(it.value(), path, schema, out);
    }
  }
}

void Config::merge_json(const json& nested, const std::string& source) {
  if (!nested.is_object()) throw UserError(source + ": a config must be a JSON object");
  std::vector<std::pair<std::string, json>> flat;
  flatten(nested, "", schema_, flat);
  for (const auto& [path, value] : flat) set(path, value, source);
}

void Config::merge_file(const std::string& path) {
  merge_json(read_json_file(path, "fix the file, or write a fresh one with `lora_trainer configure JOB OUT`"), path);
}

void Config::apply_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw UserError("override \"" + assignment + "\" is not of the form key=value (e.g. training/batch_size=64)");
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  try {
    (void)json(assignment).dump();  // the config is JSON: its text must be valid UTF-8
  } catch (const json::type_error&) {
    throw UserError("override \"" + json(assignment).dump(-1, ' ', false, json::error_handler_t::replace) +
                    "\" is not valid UTF-8 text; give keys and values as UTF-8");
  }
  // Bare words are strings (job/project=demo); anything that is JSON is parsed as JSON, with its limits
  // (nesting depth, duplicate keys, numbers that fit).
  json v = json::accept(text) ? parse_json(text, "override " + key) : json(text);
  set(key, v, "override " + key);
}

const json& Config::get(const std::string& path) const {
  auto it = values_.find(path);
  if (it == values_.end()) throw std::logic_error("config key not in this job's schema: " + path);
  return *it;
}
int64_t Config::get_int(const std::string& path) const { return get(path).get<int64_t>(); }
double Config::get_double(const std::string& path) const { return get(path).get<double>(); }
bool Config::get_bool(const std::string& path) const { return get(path).get<bool>(); }
std::string Config::get_string(const std::string& path) const { return get(path).get<std::string>(); }

json Config::to_json() const {
  json out = json::object();
  for (const auto& o : schema_.options()) {
    json* node = &out;
    auto parts = split_path(o.path);
    for (size_t i = 0; i + 1 < parts.size(); ++i) node = &(*node)[parts[i]];
    (*node)[parts.back()] = values_.at(o.path);
  }
  return out;
}

}  // namespace lt
