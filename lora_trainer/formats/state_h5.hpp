// state.h5, the tensors of a checkpoint, as HDF5 (state_h5.cpp says how). The checkpoint format around
// it (metadata.json, atomic saves, which tensors a state holds) is checkpoint.hpp's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

// Where each tensor's bytes lie in the file: (offset, length), sorted by offset.
using DataRanges = std::vector<std::pair<uint64_t, uint64_t>>;

// Tensors made one at a time for a write that holds one of them in memory (an import of a model larger
// than the memory it may take): `names` in the order written, `get(i)` makes the i-th when its turn
// comes (it is released once written), `bytes` their total (for the message of a full disk).
struct TensorStream {
  std::vector<std::string> names;
  std::function<torch::Tensor(size_t)> get;
  uint64_t bytes = 0;
  static TensorStream of(const NamedTensors& tensors);  // tensors already in memory
};

// Writes `tensors` (any device; copied to the CPU) to `path`. A full file system is a UserError saying
// so, with the space free and the space needed.
DataRanges write_state_h5(const std::string& path, const TensorStream& tensors);
DataRanges write_state_h5(const std::string& path, const NamedTensors& tensors);

// Every tensor of the file, sorted by name, each checked against its recorded CRC-32 (a mismatch, an
// unknown dtype or a shape the file does not hold is a UserError naming the tensor). `verified` counts
// the tensors that had a CRC-32 (files written before checksums have none); `crcs` (when given)
// receives each tensor's, in the same order.
NamedTensors read_state_h5(const std::string& path, int* verified = nullptr, std::vector<std::string>* crcs = nullptr);

// A state.h5 open for reading one tensor at a time (a load that holds one tensor in memory, not the
// whole file), each read checked as read_state_h5 checks it.
class StateH5Reader {
 public:
  struct Info {
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  explicit StateH5Reader(const std::string& path);  // UserError naming the file when it cannot be opened
  ~StateH5Reader();
  StateH5Reader(const StateH5Reader&) = delete;
  StateH5Reader& operator=(const StateH5Reader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<std::string>& names() const { return names_; }  // sorted
  bool contains(const std::string& name) const;
  // The dtype and shape as recorded, without reading the data.
  Info info(const std::string& name) const;
  // The tensor on the CPU, its CRC-32 checked (`verified` and `crc` as read_state_h5's).
  torch::Tensor read(const std::string& name, int* verified = nullptr, std::string* crc = nullptr) const;

 private:
  std::string path_;
  int64_t file_ = -1;  // the HDF5 file id (hid_t)
  std::vector<std::string> names_;
};

// The CRC-32 of the file's bytes outside `ranges` (HDF5's own structures), as 8 hex digits, and the
// file's size. A UserError naming the file when it cannot be read.
std::pair<std::string, uint64_t> structure_crc32(const std::string& path, const DataRanges& ranges);

// The name a dtype is recorded under ("float32", "bfloat16", ...).
std::string dtype_name(torch::ScalarType t);

// fsync of a written file (errors ignored: the rename that publishes it is what must be durable).
void fsync_file(const std::string& path);

}  // namespace lt
