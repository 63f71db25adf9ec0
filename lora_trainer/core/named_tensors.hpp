// An ordered list of (name, tensor): the form in which parameters, optimizer state and checkpoints
// travel between the parts of the library. Order is meaningful; names are the identity.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace lt {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

inline std::vector<std::string> names_of(const NamedTensors& t) {
  std::vector<std::string> out;
  for (const auto& p : t) out.push_back(p.first);
  return out;
}

}  // namespace lt
