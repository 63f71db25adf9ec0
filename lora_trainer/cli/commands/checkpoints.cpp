// `lora_trainer checkpoints NAME OUT_DIR`: a job's checkpoints under every project and group, with their
// kind, step and tokens, and which is `latest`.
#include <cstdio>
#include <filesystem>
#include <optional>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"

namespace fs = std::filesystem;

namespace lt {
namespace {

int list_job_checkpoints(const std::string& name, const std::string& out) {
  fs::path root = fs::path(out) / "checkpoints";
  int found = 0;
  if (fs::is_directory(root)) {
    for (auto& project : fs::directory_iterator(root)) {
      if (!project.is_directory()) continue;
      for (auto& group : fs::directory_iterator(project)) {
        fs::path job_dir = group.path() / name;
        if (!fs::is_directory(job_dir)) continue;
        std::printf("%s\n", job_dir.string().c_str());
        std::optional<std::string> latest;
        try {
          latest = read_latest(job_dir.string());
        } catch (const UserError& e) {
          std::printf("  warning: %s\n", e.what());
        }
        for (const auto& suffix : list_checkpoints(job_dir.string())) {
          const CheckpointMeta ck = CheckpointMeta::read((job_dir / suffix).string());
          std::printf("  %-28s kind %-6s step %8lld  tokens %12lld%s\n", suffix.c_str(),
                      state_kind_name(ck.kind).c_str(), (long long)ck.step,
                      (long long)ck.tokens, latest && *latest == suffix ? "  (latest)" : "");
          ++found;
        }
      }
    }
  }
  if (!found) {
    std::fprintf(stderr, "error: no checkpoints of job \"%s\" under %s\n", name.c_str(), root.string().c_str());
    return 2;
  }
  return 0;
}

}  // namespace

Command add_checkpoints(CLI::App& app) {
  auto name = std::make_shared<std::string>(), out_dir = std::make_shared<std::string>();
  auto* sub = app.add_subcommand("checkpoints", "list the checkpoints of a job");
  sub->add_option("NAME", *name, "the run's name")->required();
  sub->add_option("OUT_DIR", *out_dir, "output root")->required();
  return {sub, [name, out_dir] { return list_job_checkpoints(*name, *out_dir); }};
}

}  // namespace lt
