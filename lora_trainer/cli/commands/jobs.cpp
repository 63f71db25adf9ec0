// `lora_trainer jobs`: the registered job kinds, one a line.
#include <cstdio>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/registry.hpp"

namespace lt {

Command add_jobs(CLI::App& app) {
  auto* sub = app.add_subcommand("jobs", "list the registered job kinds");
  return {sub, [] {
            for (const auto& c : job_registry().all()) std::printf("%-28s %s\n", c.kind.c_str(), c.description.c_str());
            return 0;
          }};
}

}  // namespace lt
