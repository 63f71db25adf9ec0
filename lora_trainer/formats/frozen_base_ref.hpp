// The "frozen_base" block of a checkpoint's metadata as a value (frozen_base.hpp describes the block and
// reads the base it refers to). Apart from frozen_base.hpp so that checkpoint.hpp's CheckpointMeta can
// hold one: frozen_base.hpp includes checkpoint.hpp. Its functions are defined in frozen_base.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

struct FrozenBaseRef {
  std::string path;      // absolute, as saved
  std::string relative;  // from the checkpoint's directory ("" when not recorded)
  std::string format;    // "hf" or "checkpoint"
  std::map<std::string, std::vector<int64_t>> tensors;  // our names -> shapes
  uint64_t bytes = 0;    // their bf16 bytes
  std::string digest;

  nlohmann::json to_json() const;
  // The block of checkpoint `dir`'s metadata; a UserError naming the field that is missing or wrong.
  static FrozenBaseRef from_json(const nlohmann::json& j, const std::string& dir);
};

}  // namespace lt
