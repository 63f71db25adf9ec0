// `lora_trainer inspect CHECKPOINT [--verify] [--base DIR]`: a checkpoint's metadata and per-tensor digests as
// JSON, or with --verify one line saying whether every tensor matches the checksum recorded when it was
// saved (and a second, for a checkpoint that refers to its frozen base, whether the base matches its digest).
#include <cstdio>
#include <iostream>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"

namespace lt {
namespace {

struct InspectArgs {
  std::string checkpoint, base;
  bool verify = false;
};

// The frozen base a LoRA checkpoint refers to, read from where it is and checked against its digest.
std::string verify_frozen_base(const CheckpointMeta& ck, const std::string& base) {
  size_t tensors = 0;
  const std::string where =
      read_referenced_base(ck, base, [&](const std::string&, const torch::Tensor&) -> std::optional<uint32_t> {
        ++tensors;
        return std::nullopt;
      }, Take::Copies);
  return "frozen base " + where + ": " + std::to_string(tensors) + " tensors read; the digest of their bf16 values matches "
         "the one recorded (" + (ck.frozen_base ? ck.frozen_base->digest : std::string()) + ")";
}

int inspect(const InspectArgs& a) {
  if (!a.verify) {
    std::cout << inspect_checkpoint(a.checkpoint).dump(2) << "\n";
    return 0;
  }
  std::printf("%s\n", verify_checkpoint(a.checkpoint).c_str());
  const CheckpointMeta ck = CheckpointMeta::read(a.checkpoint);
  if (ck.frozen_base) std::printf("%s\n", verify_frozen_base(ck, a.base).c_str());
  return 0;
}

}  // namespace

Command add_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  auto* sub = app.add_subcommand("inspect", "print a checkpoint's metadata and per-tensor digests as JSON");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_flag("--verify", a->verify,
                "only check every tensor's data against the CRC-32 recorded at save: one line, exit 0 when all "
                "match, exit 2 naming the first corrupt tensor. A LoRA checkpoint that refers to its frozen base: the "
                "base is read too and checked against the digest recorded");
  sub->add_option("--base", a->base, "with --verify: where the frozen base is now, when it moved from the place the "
                                     "checkpoint records");
  return {sub, [a] { return inspect(*a); }};
}

}  // namespace lt
