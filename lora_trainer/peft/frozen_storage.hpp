// The frozen storages by name: one table (the registry) that names each storage a frozen linear weight
// can take (frozen_weight.hpp's FrozenWeight), makes it, and says how a checkpoint keeps it. Everything
// that chooses, prints, parses, records or reads back a storage goes through it:
// optimization/lora/quantize_base (lora_options.cpp), the checkpoint's lora.quantize_base and
// lora.quantized (lora_metadata.cpp), the transition and the load of a base (lora_phase.cpp,
// trainer_state.cpp), a checkpoint's state tensors (<name>/<weight>.<field>) and the export's merge
// (export.cpp). bf16 and nf4 are built in (frozen_weight.cpp); another storage is one file that defines
// its FrozenWeight and registers it (register_frozen_storage; docs/design.md's worked example, the
// test-only int8 of tests/peft/test_int8_storage.cpp).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace lt {

class FrozenWeight;

// A frozen storage: its place in the registry. FrozenFormat() is bf16.
class FrozenFormat {
 public:
  static const FrozenFormat Bf16;  // "bf16": the parameter itself, cast to bf16 in place
  static const FrozenFormat Nf4;   // "nf4": QLoRA's 4-bit NormalFloat (kernels/nf4.hpp)
  constexpr FrozenFormat() = default;
  constexpr int id() const { return id_; }
  friend constexpr bool operator==(FrozenFormat a, FrozenFormat b) { return a.id_ == b.id_; }
  friend constexpr bool operator!=(FrozenFormat a, FrozenFormat b) { return a.id_ != b.id_; }
  friend constexpr bool operator<(FrozenFormat a, FrozenFormat b) { return a.id_ < b.id_; }

 private:
  constexpr explicit FrozenFormat(int id) : id_(id) {}
  int id_ = 0;
  friend struct FrozenStorageRegistry;
};

// A storage as the registry knows it.
struct FrozenStorage {
  // Its one name: the value of optimization/lora/quantize_base and of a checkpoint's lora.quantize_base
  // that choose it, what to_string prints, and its checkpoint prefix (state_prefix()). Lower-case
  // letters, digits and '_'.
  std::string name;
  // How messages name what it stores ("NF4" in "8 of them NF4"): the name if empty.
  std::string label;
  // Makes the storage of a weight: `weight` (a layer's parameter, on its device) holds the values, or is
  // a stand-in (frozen_stand_in: a restore's template), for which the storage allocates itself without
  // values, for the restore to fill (FrozenWeight::assign, or its state() tensors loaded in place).
  // freeze_weight then makes the parameter a stand-in unless the storage is held_by_parameter (bf16).
  std::function<std::shared_ptr<FrozenWeight>(torch::Tensor weight)> make;
  // The bytes a weight of `shape` takes in it (FrozenWeight::bytes() of one made), for the memory plan
  // (training/memory_plan.hpp), which reads no weights. Unset: 2 a value, as bf16.
  std::function<int64_t(const std::vector<int64_t>& shape)> stored_bytes;

  // stored_bytes of `shape`, or 2 a value where the storage does not say.
  int64_t bytes_of(const std::vector<int64_t>& shape) const;

  // Whether it quantizes: every storage but bf16. optimization/lora/quantize_base=<it> stores the
  // blocks' linear weights in it (LoraPhase::quantized_weights), and a checkpoint lists them with their
  // shapes in lora.quantized.
  bool quantizes() const { return name != "bf16"; }
  // The prefix of its state() tensors in a checkpoint that copies its base: "<name>/" (nf4/<weight>.codes).
  std::string state_prefix() const { return name + "/"; }
  const std::string& shown() const { return label.empty() ? name : label; }
};

// Adds a storage to the registry and returns its FrozenFormat; at static initialization or before the
// config that names it is read. Throws std::invalid_argument for a name that is taken (bf16, nf4,
// "none": bf16's older name), that a checkpoint's other tensors use (params, ema, optim, rng) or that is
// not lower-case letters, digits and '_'.
FrozenFormat register_frozen_storage(FrozenStorage storage);
// The registry's entry of `format`.
const FrozenStorage& frozen_storage(FrozenFormat format);
// Its name ("bf16", "nf4"): the one printer.
const char* to_string(FrozenFormat format);
// The one parser: a storage by its name; "none" is bf16's older name (configs and checkpoints written
// before the registry). std::invalid_argument naming the known ones for another.
FrozenFormat parse_frozen_format(const std::string& name);
// The registered names, in registration order (bf16, nf4, ...).
std::vector<std::string> frozen_format_names();
// The registered storages that quantize (all but bf16).
std::vector<FrozenFormat> quantizing_frozen_formats();

}  // namespace lt
