// The launcher: `lora_trainer <subcommand>`. Each subcommand is added by its own file (commands/); main()
// parses, runs the one given, and maps what went wrong to the exit status (docs/cli.md, "Exit codes").
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/commands/export_check.hpp"
#include "lora_trainer/cli/local_ranks.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/training/divergence.hpp"

namespace fs = std::filesystem;
using namespace lt;

namespace {

// A first argument that is no subcommand: name it and suggest the closest one.
void check_subcommand(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return;
  std::vector<std::string> names;
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  const std::string given = argv[1];
  if (std::find(names.begin(), names.end(), given) != names.end()) return;
  std::string near = closest_match(given, names);
  throw UserError("unknown command \"" + given + "\"" + (near.empty() ? "" : "; did you mean \"" + near + "\"?") +
                  " The commands are: " + join(names) + " (`lora_trainer --help` describes them)");
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe or a file, so that progress (stdout) and errors (stderr) keep their order.
  // stderr too, though unbuffered by default: glibc writes an unbuffered stream's long fprintf in pieces
  // (of 128 bytes in Debian 13's 2.41, checked with strace), and the ranks of one job share it, so another rank's line could
  // land inside one of ours. Line-buffered, each line is one write. (Partial lines, the progress bar's
  // "\r" redraws, are flushed where they are written.)
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::setvbuf(stderr, nullptr, _IOLBF, 0);
  CLI::App app{"lora_trainer: train a language model (GPT-2 or Llama family) in two phases (full parameters, then LoRA adapters), with restorable jobs.\n"
               "Docs: docs/cli.md, docs/config.md, checkpoints/README.md"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");
  // What this binary was built against: the LibTorch (its autograd decides what a block keeps for the
  // backward, docs/memory.md) and whether it has the CUDA kernels.
  app.set_version_flag("--version", std::string("lora_trainer, built against LibTorch ") + compat::torch_version() +
#if defined(LT_WITH_CUDA)
                                        " with CUDA"
#else
                                        " (CPU only)"
#endif
  );
  const std::vector<Command> commands = {
      add_jobs(app),      add_configure(app),    add_run(app, argv[0]), add_checkpoints(app), add_restore(app),
      add_inspect(app),   add_export(app),       add_check_export(app), add_import_hf(app),   add_eval(app),
      add_sample(app),    add_chat(app),         add_plan(app),         add_bench(app),       add_tokenize(app)};

  try {
    check_subcommand(app, argc, argv);
  } catch (const UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const UserError& e) {
    if (distributed().active()) std::fprintf(stderr, "error (rank %d): %s\n", distributed().rank(), e.what());
    else std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const ExportCheckFailed& e) {
    std::fprintf(stderr, "check failed: %s\n", e.what());
    return kExitCheckFailed;
  } catch (const TrainingDiverged& e) {
    if (distributed().active()) std::fprintf(stderr, "error (rank %d): %s\n", distributed().rank(), e.what());
    else std::fprintf(stderr, "error: %s\n", e.what());
    return kExitDiverged;
  } catch (const DistributedError& e) {
    // The process group cannot be shut down cleanly with a peer gone: leave at once.
    std::fprintf(stderr, "error: %s\n", e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(kExitLostRank);
  } catch (const fs::filesystem_error& e) {
    // The file system refused (a path that is a file, no permission, a full or read-only disk): the
    // user's environment, named with its path.
    std::string paths = e.path1().string() + (e.path2().empty() ? "" : " -> " + e.path2().string());
    std::fprintf(stderr, "error: %s: %s (check that the path is a writable directory with free space)\n", paths.c_str(),
                 e.code().message().c_str());
    return 2;
  } catch (const nlohmann::json::exception& e) {
    // A JSON reader that did not say which file (each should): still the input's fault, not ours.
    try {
      rethrow_json_error("a JSON input", e);
    } catch (const UserError& u) {
      std::fprintf(stderr, "error: %s\n", u.what());
    }
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory. If an input file states a size (a tensor shape, a vocabulary), check it; "
                         "otherwise lower training/batch_size or architecture/* or use a machine with more memory\n");
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "internal error (please report): %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
