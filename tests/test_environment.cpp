// The environment ctest gives a test: LT_TEST_ENV="NAME=value,NAME=value,..." (CMakeLists.txt), set here
// before the test binary runs anything, then the binary starts itself again.
//
// Why one variable: catch_discover_tests cuts a list-valued ENVIRONMENT property into separate
// properties (CMake 3.25's Catch.cmake with Catch2 2, Catch2 3's own), so of "A=1;B=2" a test got A
// alone, and the forced-kernel profiles ("baseline: ...") ran with the machine's own kernels. Why start
// again: OpenBLAS reads OPENBLAS_CORETYPE and libgomp OMP_WAIT_POLICY when they are loaded, before
// any code of ours; a process started with the variables set has every library see them, and so does
// every launcher a test starts (it inherits them).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "lora_trainer/core/runtime.hpp"

namespace {

// This process's command line, as execv wants it.
std::vector<std::string> command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t start = 0; start < all.size();) {
    const size_t end = all.find('\0', start);
    args.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return args;
}

// Sets each NAME=value of `spec` (LT_TEST_ENV's form); whether any was not already so.
bool set_environment(const char* spec) {
  bool changed = false;
  const std::string s = spec;
  for (size_t start = 0; start <= s.size();) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "LT_TEST_ENV: \"%s\" is not NAME=value (in \"%s\")\n", item.c_str(), spec);
      std::exit(2);
    }
    const std::string name = item.substr(0, eq), value = item.substr(eq + 1);
    const char* now = std::getenv(name.c_str());
    if (!now || value != now) {
      setenv(name.c_str(), value.c_str(), 1);
      changed = true;
    }
    start = end + 1;
  }
  return changed;
}

struct TestEnvironment {
  TestEnvironment() {
    const char* spec = std::getenv("LT_TEST_ENV");
    // Unchanged: started again already (or ctest's environment had them). ONEDNN_MAX_CPU_ISA then makes
    // bf16 products run as that CPU runs them.
    if (!spec || !*spec || !set_environment(spec)) {
      lt::follow_onednn_isa_cap();
      return;
    }
    std::vector<std::string> args = command_line();
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    std::perror("LT_TEST_ENV: starting the tests again with their environment failed");
    std::exit(2);
  }
};

const TestEnvironment kTestEnvironment;

}  // namespace
