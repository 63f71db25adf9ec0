// The library's folders are its architecture (docs/design.md, "The layout"): each folder is an area,
// and a file includes only its own area and the areas below it. An include that goes up (a checkpoint
// reader needing a trainer, a model needing a dataset) fails here, naming the file and the include.
// Only the program's own files (cli/main.cpp, cli/commands/) use CLI11: the library parses no arguments.
#include "catch.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>

namespace fs = std::filesystem;

namespace {

// Each area and the areas its files may include, besides their own (lowest first).
const std::map<std::string, std::set<std::string>> kMayInclude = {
    {"kernels", {}},                                      // the loss and NF4 kernels: plain C++ and CUDA
    {"core", {"kernels"}},                                // errors, files, config, runtime, c10d
    {"peft", {"core", "kernels"}},                        // adapters over any module tree, frozen storages
    {"models", {"core", "kernels", "peft"}},              // the families and their layers
    {"jinja", {"core"}},                                  // the Jinja engine of chat templates
    {"data", {"core", "jinja"}},                          // datasets, tokenizers, stage plans, chat templates
    {"formats", {"core", "kernels", "peft", "models", "jinja", "data"}},  // files in and out
    {"training", {"core", "kernels", "peft", "models", "jinja", "data", "formats"}},
    {"recipes", {"core", "kernels", "peft", "models", "jinja", "data", "formats", "training"}},
    {"cli", {"core", "kernels", "peft", "models", "jinja", "data", "formats", "training", "recipes"}},
};

// Includes that go up today, each with the change that removes it (none left: import-hf's read of
// the architecture through Trainer::lora_schema() went with issue 29's step 5).
const std::set<std::pair<std::string, std::string>> kKnownExceptions = {};

}  // namespace

TEST_CASE("layout: every file of the library lies in an area and includes only its own and lower areas", "[layout]") {
  const fs::path root = fs::path(LT_SOURCE_DIR) / "lora_trainer";
  const std::regex include(R"re(^\s*#\s*include\s+"lora_trainer/([a-z_]+)/([^"]+)")re");
  const std::regex cli11(R"re(^\s*#\s*include\s+<CLI/)re");
  int files = 0, includes = 0;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    const fs::path rel = fs::relative(e.path(), root);
    INFO(rel.string());
    REQUIRE(std::distance(rel.begin(), rel.end()) >= 2);  // lora_trainer/AREA/[FOLDER/]FILE: a folder is its area's
    const std::string area = rel.begin()->string();
    const bool program_only = rel == "cli/main.cpp" || rel.parent_path() == "cli/commands";
    REQUIRE(kMayInclude.count(area) == 1);
    ++files;
    std::ifstream in(e.path());
    int line_no = 0;
    for (std::string line; std::getline(in, line);) {
      ++line_no;
      if (std::regex_search(line, cli11) && !program_only)  // the library has no command line (CMakeLists.txt)
        FAIL_CHECK(rel.string() << ":" << line_no << " includes CLI11: only cli/main.cpp and cli/commands/ may; "
                                << "they are built into the program, not the library");
      std::smatch m;
      if (!std::regex_search(line, m, include)) continue;
      ++includes;
      const std::string to = m[1].str(), target = to + "/" + m[2].str();
      CHECK(fs::exists(root / target));
      if (to == area || kMayInclude.at(area).count(to) || kKnownExceptions.count({rel.string(), target})) continue;
      FAIL_CHECK(rel.string() << ":" << line_no << " includes " << target << ": " << area << " may include only "
                              << (kMayInclude.at(area).empty() ? std::string("itself") : "itself and lower areas"));
    }
  }
  CHECK(files > 80);
  CHECK(includes > 200);
  for (const auto& [from, to] : kKnownExceptions) {  // an exception no longer needed is removed from the list
    INFO(from << " -> " << to);
    std::ifstream in(root / from);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find("\"lora_trainer/" + to + "\"") != std::string::npos);
  }
}

TEST_CASE("layout: no file of the library is over 600 lines, and no test name holds a semicolon (ctest splits the name there)",
          "[layout]") {
  // A file past 600 lines holds more than one concept: split it along its parts (design.md, "The layout").
  const fs::path root = fs::path(LT_SOURCE_DIR);
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(root / "lora_trainer")) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path());
    int lines = 0;
    for (std::string line; std::getline(in, line);) ++lines;
    ++files;
    if (lines > 600) FAIL_CHECK(fs::relative(e.path(), root).string() << " has " << lines << " lines: split it along its parts");
  }
  CHECK(files > 80);
  // ctest's discovery of Catch2 tests cuts a name at ';', so the test it runs is not the one written.
  const std::regex test_case(R"re(TEST_CASE\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+))re");
  const std::regex literal(R"re("((?:[^"\\]|\\.)*)")re");
  int names = 0;
  for (const auto& e : fs::recursive_directory_iterator(root / "tests")) {
    if (!e.is_regular_file() || e.path().extension() != ".cpp") continue;
    std::ifstream in(e.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (auto it = std::sregex_iterator(text.begin(), text.end(), test_case); it != std::sregex_iterator(); ++it) {
      const std::string literals = (*it)[1].str();
      std::string name;
      for (auto l = std::sregex_iterator(literals.begin(), literals.end(), literal); l != std::sregex_iterator(); ++l)
        name += (*l)[1].str();
      ++names;
      if (name.find(';') != std::string::npos)
        FAIL_CHECK(fs::relative(e.path(), root).string() << ": the test \"" << name << "\" has a ';' in its name: ctest "
                                                         << "would run only the part before it; use a comma");
    }
  }
  CHECK(names > 300);
}
