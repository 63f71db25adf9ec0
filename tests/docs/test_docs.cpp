// The docs against the program (issue 59, "Docs a user can read"): every `lora_trainer SUBCOMMAND`
// that README.md and docs/*.md name in code is a subcommand the launcher's --help lists; every config
// key they name in code (`area/key`, `area/sub/key=value`, `area/sub/*`, the areas being the schemas'
// own) is a key of some job's schema; and every table of figures in docs/performance.md shares its
// section with the command that produced it and a date. A renamed key or subcommand fails here,
// naming the file, the line and the token.
#include "catch.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "launch.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using namespace lt;

namespace {

// Tokens that look like keys and are not, on purpose: (file, token) and why.
const std::set<std::pair<std::string, std::string>> kNotKeys = {
    {"docs/config.md", "training/batch_sise"},  // the error a misspelt key gives, quoted
};

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool blank(const std::string& line) { return line.find_first_not_of(" \t\r") == std::string::npos; }

bool is_fence(const std::string& line) {
  const size_t i = line.find_first_not_of(" \t");
  return i != std::string::npos && line.compare(i, 3, "```") == 0;
}

// Code in markdown: each line of a fenced block, and each inline `span` (a span may cross a line break
// inside its paragraph; its line is where it opens). Lines [first, last) of `lines`, numbered from 1.
struct Piece {
  int line;
  std::string text;
};

std::vector<Piece> code_pieces(const std::vector<std::string>& lines, size_t first, size_t last) {
  std::vector<Piece> out;
  std::vector<std::pair<int, std::string>> para;  // the paragraph so far (outside fences)
  auto flush = [&]() {
    std::string joined;
    std::vector<std::pair<size_t, int>> starts;  // offset in `joined` -> line number
    for (const auto& p : para) {
      starts.emplace_back(joined.size(), p.first);
      joined += p.second;
      joined += '\n';
    }
    size_t i = 0;
    while (true) {
      const size_t a = joined.find('`', i);
      if (a == std::string::npos) break;
      const size_t b = joined.find('`', a + 1);
      if (b == std::string::npos) break;
      int line = 0;
      for (const auto& s : starts)
        if (s.first <= a) line = s.second;
      std::string text = joined.substr(a + 1, b - a - 1);
      std::replace(text.begin(), text.end(), '\n', ' ');
      out.push_back({line, text});
      i = b + 1;
    }
    para.clear();
  };
  bool fenced = false;
  for (size_t k = first; k < last; ++k) {
    const std::string& l = lines[k];
    const int n = static_cast<int>(k) + 1;
    if (is_fence(l)) {
      flush();
      fenced = !fenced;
    } else if (fenced) {
      out.push_back({n, l});
    } else if (blank(l)) {
      flush();
    } else {
      para.emplace_back(n, l);
    }
  }
  flush();
  return out;
}

struct Doc {
  std::string name;  // relative to the source directory: "README.md", "docs/cli.md"
  std::vector<std::string> lines;
};

// README.md and docs/*.md.
std::vector<Doc> docs() {
  const fs::path root(LT_SOURCE_DIR);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root / "docs"))
    if (e.is_regular_file() && e.path().extension() == ".md") names.push_back("docs/" + e.path().filename().string());
  std::sort(names.begin(), names.end());
  names.insert(names.begin(), "README.md");
  std::vector<Doc> out;
  for (const auto& n : names) out.push_back({n, split_lines(read_file((root / n).string()))});
  return out;
}

// "lora_trainer WORD" where lora_trainer is the program: a path ending in /lora_trainer, or the bare
// name at the start of a command (after env settings, `$ `, `time`, `&&`, `|`, `;`, `(`). Not
// lora_trainer_tests, lora_trainer/ paths or the word in a list of folders.
const std::regex& subcommand_use() {
  static const std::regex re(
      R"((?:(?:^|&&|\|\||[;|(])\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:time\s+)?|/)lora_trainer[ \t]+([a-z][a-z0-9-]*))");
  return re;
}

// The subcommands `lora_trainer --help` lists under "Subcommands:".
std::set<std::string> subcommands() {
  const test::Result help = test::launch({"--help"});
  INFO(help.out);
  REQUIRE(help.code == 0);
  const std::regex row(R"(^  ([a-z][a-z0-9-]*)(\s.*)?$)");
  std::set<std::string> out;
  bool in_list = false;
  for (const auto& l : split_lines(help.out)) {
    if (l.rfind("Subcommands:", 0) == 0) {
      in_list = true;
      continue;
    }
    if (!in_list) continue;
    if (blank(l)) {
      if (!out.empty()) break;
      continue;
    }
    std::smatch m;
    if (std::regex_match(l, m, row)) out.insert(m[1].str());
  }
  REQUIRE(out.count("run") == 1);
  REQUIRE(out.count("configure") == 1);
  return out;
}

std::string joined(const std::set<std::string>& s) {
  std::string out;
  for (const auto& x : s) out += (out.empty() ? "" : ", ") + x;
  return out;
}

}  // namespace

TEST_CASE("docs: every lora_trainer subcommand README.md and docs name is one the launcher has", "[docs][launcher]") {
  const std::set<std::string> known = subcommands();
  int named = 0;
  for (const auto& doc : docs()) {
    for (const auto& piece : code_pieces(doc.lines, 0, doc.lines.size())) {
      for (std::sregex_iterator it(piece.text.begin(), piece.text.end(), subcommand_use()), end; it != end; ++it) {
        ++named;
        const std::string word = (*it)[1].str();
        if (!known.count(word))
          FAIL_CHECK(doc.name << ":" << piece.line << ": `lora_trainer " << word << "` names no subcommand ("
                              << "`lora_trainer --help` lists " << joined(known) << "): write today's subcommand, "
                              << "or, if the text is not a command, reword it so that `lora_trainer` is not "
                              << "followed by a word");
      }
    }
  }
  CHECK(named > 40);  // the docs' commands are found at all (71 on 2026-11-29)
}

TEST_CASE("docs: every config key README.md and docs name in code is a key of some job", "[docs][config]") {
  std::set<std::string> keys, areas;
  for (const auto& cls : job_registry().all()) {
    const ConfigSchema schema = cls.schema();
    for (const auto& opt : schema.options()) {
      keys.insert(opt.path);
      areas.insert(opt.path.substr(0, opt.path.find('/')));
    }
  }
  std::string alternatives;
  for (const auto& a : areas) {
    REQUIRE(std::regex_match(a, std::regex("[a-z_]+")));
    alternatives += (alternatives.empty() ? "" : "|") + a;
  }
  REQUIRE(areas.count("training") == 1);
  // AREA/seg[/seg...], optionally /* (a prefix: some key starts with it); the characters around it are
  // checked below, so that paths (docs/x.md, lora_trainer/training/job.hpp, data/cache/x.bin) are not keys.
  const std::regex key("(" + alternatives + ")((?:/[a-z0-9_]+)+)(/\\*)?");
  const std::string before = " \t'\"([{,", after = " \t'\"=),:;]}";
  int named = 0;
  std::set<std::pair<std::string, std::string>> excused;
  for (const auto& doc : docs()) {
    for (const auto& piece : code_pieces(doc.lines, 0, doc.lines.size())) {
      const std::string& t = piece.text;
      for (std::sregex_iterator it(t.begin(), t.end(), key), end; it != end; ++it) {
        const size_t a = static_cast<size_t>(it->position(0)), b = a + static_cast<size_t>(it->length(0));
        if (a > 0 && before.find(t[a - 1]) == std::string::npos) continue;  // inside a path or a word
        const bool ends = b == t.size() || after.find(t[b]) != std::string::npos ||
                          (t[b] == '.' && (b + 1 == t.size() || !std::isalnum(static_cast<unsigned char>(t[b + 1]))));
        if (!ends) continue;  // a file (training/optim.cpp), a longer path, a word that goes on
        ++named;
        const std::string name = (*it)[1].str() + (*it)[2].str();
        const bool prefix = (*it)[3].matched;
        bool exists = keys.count(name) > 0 && !prefix;
        if (prefix)
          for (const auto& k : keys) exists = exists || k.rfind(name + "/", 0) == 0;
        if (exists) continue;
        if (kNotKeys.count({doc.name, name})) {
          excused.insert({doc.name, name});
          continue;
        }
        FAIL_CHECK(doc.name << ":" << piece.line << ": `" << name << (prefix ? "/*" : "")
                            << "` is not a config key of any job (`lora_trainer configure KIND FILE` writes "
                            << "every key, docs/config.md lists them): write today's key; if the token is not "
                            << "meant as a key, add it to kNotKeys in tests/docs/test_docs.cpp with the reason");
      }
    }
  }
  CHECK(named > 300);  // the docs' keys are found at all (606 on 2026-11-29)
  for (const auto& e : kNotKeys) {
    INFO(e.first << ": `" << e.second << "` is in kNotKeys but no longer in the docs: remove it from the list");
    CHECK(excused.count(e));
  }
}

TEST_CASE("docs: every table of figures in docs/performance.md names its command and its date", "[docs]") {
  const std::string name = "docs/performance.md";
  const std::vector<std::string> lines = split_lines(read_file(std::string(LT_SOURCE_DIR) + "/" + name));
  // A command: an invocation of the launcher (as above), or a code span or fenced line that starts
  // (after env settings) with lora_trainer, python3 scripts/, bash scripts/ or cmake.
  const std::regex command(
      R"(^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:time\s+)?(?:\S*/)?(?:lora_trainer\s+[a-z]|python3\s+scripts/|bash\s+scripts/|cmake\s))");
  const std::regex date(R"(20\d\d-\d\d-\d\d)");
  const std::regex heading(R"(^#{1,3} )"), separator(R"(^\|\s*:?-{3,})"), digit(R"(\d)");
  // Sections: from a heading (#, ## or ###) to the next, fences skipped.
  std::vector<size_t> starts = {0};
  bool fenced = false;
  for (size_t k = 0; k < lines.size(); ++k) {
    if (is_fence(lines[k])) fenced = !fenced;
    if (!fenced && k > 0 && std::regex_search(lines[k], heading)) starts.push_back(k);
  }
  starts.push_back(lines.size());
  int tables = 0;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const size_t first = starts[s], last = starts[s + 1];
    bool has_command = false, has_date = false;
    for (const auto& piece : code_pieces(lines, first, last)) {
      const size_t i = piece.text.find_first_not_of(" \t");
      const std::string text = i == std::string::npos ? "" : piece.text.substr(i);
      has_command = has_command || std::regex_search(text, command) || std::regex_search(text, subcommand_use());
    }
    for (size_t k = first; k < last; ++k) has_date = has_date || std::regex_search(lines[k], date);
    for (size_t k = first; k + 1 < last; ++k) {
      if (lines[k].rfind("|", 0) != 0 || !std::regex_search(lines[k + 1], separator)) continue;
      const size_t table = k;
      bool figures = false;
      for (k += 2; k < last && lines[k].rfind("|", 0) == 0; ++k) figures = figures || std::regex_search(lines[k], digit);
      if (!figures) continue;
      ++tables;
      if (!has_command)
        FAIL_CHECK(name << ":" << table + 1 << ": the table of figures under \"" << lines[first]
                        << "\" names no command: put the command that produced it in the same section, in a "
                        << "fenced block or a code span (lora_trainer ..., build/lora_trainer ..., python3 "
                        << "scripts/..., bash scripts/..., PAIRS=3 bash scripts/...)");
      if (!has_date)
        FAIL_CHECK(name << ":" << table + 1 << ": the table of figures under \"" << lines[first]
                        << "\" names no date: say when it was measured (YYYY-MM-DD) in the same section");
    }
  }
  CHECK(tables >= 10);  // the tables are found at all (17 on 2026-11-29)
}
