// docs/config.md against the schemas: every key of every job kind has a row, every row names a key
// of the kinds it lists, its default is the one `configure` writes, and the key counts are the
// schemas'. The reference a user reads stays true when an option is added, removed or changed.
#include "catch.hpp"

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/util.hpp"

using namespace lt;
using nlohmann::json;

namespace {

// One row of a key table: the key, its default cell and the kinds it is documented for (empty: the
// table has no jobs column, so every kind that has the key).
struct Row {
  std::string key, default_cell, heading;
  std::set<std::string> kinds;
  int line = 0;
};

std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (size_t i = 1; i < line.size(); ++i) {  // after the leading '|'
    if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
      cur += '|';
      ++i;
    } else if (line[i] == '|') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += line[i];
    }
  }
  for (auto& c : out) {
    c.erase(0, c.find_first_not_of(' '));
    c.erase(c.find_last_not_of(' ') + 1);
  }
  return out;
}

// "all", "LoRA", "continual", "dpo", "grpo" or a backticked kind, comma-separated (config.md's group names).
std::set<std::string> kinds_of(const std::string& jobs) {
  static const std::map<std::string, std::set<std::string>> groups = {
      {"all", {"train", "lora/train", "continual/train/benchmark", "continual/train/benchmark_lora", "dpo/train", "grpo/train"}},
      {"LoRA", {"lora/train", "continual/train/benchmark_lora"}},
      {"continual", {"continual/train/benchmark", "continual/train/benchmark_lora"}},
      {"dpo", {"dpo/train"}},
      {"grpo", {"grpo/train"}}};
  std::set<std::string> out;
  std::stringstream in(jobs);
  for (std::string part; std::getline(in, part, ',');) {
    part.erase(0, part.find_first_not_of(' '));
    part.erase(part.find_last_not_of(' ') + 1);
    if (part.size() > 2 && part.front() == '`' && part.back() == '`') {
      out.insert(part.substr(1, part.size() - 2));
    } else {
      auto g = groups.find(part);
      INFO("jobs cell \"" << jobs << "\"");
      REQUIRE(g != groups.end());
      out.insert(g->second.begin(), g->second.end());
    }
  }
  return out;
}

std::vector<Row> key_rows(const std::string& text) {
  std::vector<Row> rows;
  std::stringstream in(text);
  bool in_keys = false;
  std::string heading;
  int key_col = -1, default_col = -1, jobs_col = -1, n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (line.rfind("## ", 0) == 0) in_keys = line == "## Keys";
    if (!in_keys) continue;
    if (line.rfind("### ", 0) == 0) heading = line.substr(4);
    if (line.rfind("| key |", 0) == 0) {
      const auto head = cells(line);
      key_col = default_col = jobs_col = -1;
      for (size_t i = 0; i < head.size(); ++i) {
        if (head[i] == "key") key_col = static_cast<int>(i);
        if (head[i] == "default") default_col = static_cast<int>(i);
        if (head[i] == "jobs") jobs_col = static_cast<int>(i);
      }
      continue;
    }
    if (line.rfind("| `", 0) != 0 || key_col < 0) continue;
    const auto c = cells(line);
    Row r;
    r.line = n;
    r.heading = heading;
    r.key = c.at(key_col).substr(1, c.at(key_col).size() - 2);
    r.default_cell = default_col >= 0 ? c.at(default_col) : "";
    if (jobs_col >= 0) r.kinds = kinds_of(c.at(jobs_col));
    rows.push_back(r);
  }
  return rows;
}

// The default a cell states, when it is one backticked JSON value; null (unchecked) otherwise.
json stated_default(const std::string& cell) {
  if (cell.size() < 2 || cell.front() != '`' || cell.back() != '`' || std::count(cell.begin(), cell.end(), '`') != 2)
    return json();
  try {
    return json::parse(cell.substr(1, cell.size() - 2));
  } catch (const json::exception&) {
    return json();
  }
}

bool same_value(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  if (a.type() != b.type() || a.size() != b.size()) return a == b;
  if (a.is_array()) {
    for (size_t i = 0; i < a.size(); ++i)
      if (!same_value(a[i], b[i])) return false;
    return true;
  }
  if (a.is_object()) {
    for (auto& [k, v] : a.items())
      if (!b.contains(k) || !same_value(v, b[k])) return false;
    return true;
  }
  return a == b;
}

}  // namespace

TEST_CASE("docs/config.md documents every key of every job kind with the default configure writes", "[config][docs]") {
  const std::string text = read_file(std::string(LT_SOURCE_DIR) + "/docs/config.md");
  const std::vector<Row> rows = key_rows(text);
  REQUIRE(rows.size() > 60);
  int defaults_checked = 0;
  for (const auto& cls : job_registry().all()) {
    const ConfigSchema schema = cls.schema();
    for (const auto& opt : schema.options()) {
      INFO("kind " << cls.kind << ", key " << opt.path);
      const Row* doc = nullptr;
      for (const auto& r : rows)
        if (r.key == opt.path && (r.kinds.empty() || r.kinds.count(cls.kind))) doc = &r;
      CHECK(doc);  // a key users cannot look up
      if (!doc) continue;
      INFO("docs/config.md line " << doc->line << ": default " << doc->default_cell << "; the schema's "
                                  << opt.default_value.dump());
      const json stated = stated_default(doc->default_cell);
      if (opt.path == "job/kind" || stated.is_null()) continue;  // a default described in words
      CHECK(same_value(stated, opt.default_value));
      ++defaults_checked;
    }
  }
  CHECK(defaults_checked > 300);  // most defaults are stated as values, and so checked
  // Every row names a key that the kinds it lists have.
  for (const auto& r : rows) {
    INFO("docs/config.md line " << r.line << ": " << r.key);
    bool somewhere = false;
    for (const auto& cls : job_registry().all()) {
      const bool has = cls.schema().find(r.key) != nullptr;
      somewhere = somewhere || has;
      if (r.kinds.count(cls.kind)) CHECK(has);  // documented for a kind that lacks it
    }
    CHECK(somewhere);  // a key no job has (removed or misspelt)
  }
}

TEST_CASE("docs/config.md's key counts per job kind are the schemas'", "[config][docs]") {
  const std::string text = read_file(std::string(LT_SOURCE_DIR) + "/docs/config.md");
  for (const auto& cls : job_registry().all()) {
    INFO(cls.kind);
    const size_t keys = cls.schema().options().size();
    // "configure KIND  FILE  # N keys" in the opening example.
    const std::regex configure("configure " + cls.kind + " +\\S+ +# (\\d+) keys");
    std::smatch m;
    REQUIRE(std::regex_search(text, m, configure));
    CHECK(std::stoul(m[1]) == keys);
    // "- `KIND` (n): ... Total N." under "Which keys each job has".
    const std::string which = text.substr(text.find("## Which keys each job has"));
    const std::regex total("- `" + cls.kind + "` \\(\\d+\\):[\\s\\S]*?Total (\\d+)\\.");
    REQUIRE(std::regex_search(which, m, total));
    CHECK(std::stoul(m[1]) == keys);
  }
}
