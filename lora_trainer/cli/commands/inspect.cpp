// `lora_trainer inspect CHECKPOINT [--verify]`: a checkpoint's metadata and per-tensor digests as JSON, or
// with --verify one line saying whether every tensor matches the checksum recorded when it was saved.
#include <cstdio>
#include <iostream>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/formats/checkpoint.hpp"

namespace lt {
namespace {

struct InspectArgs {
  std::string checkpoint;
  bool verify = false;
};

int inspect(const InspectArgs& a) {
  if (a.verify) std::printf("%s\n", verify_checkpoint(a.checkpoint).c_str());
  else std::cout << inspect_checkpoint(a.checkpoint).dump(2) << "\n";
  return 0;
}

}  // namespace

Command add_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  auto* sub = app.add_subcommand("inspect", "print a checkpoint's metadata and per-tensor digests as JSON");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_flag("--verify", a->verify,
                "only check every tensor's data against the CRC-32 recorded at save: one line, exit 0 when all "
                "match, exit 2 naming the first corrupt tensor");
  return {sub, [a] { return inspect(*a); }};
}

}  // namespace lt
