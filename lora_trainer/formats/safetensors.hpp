// The safetensors file format (Hugging Face), read and written without the Python library.
//
// A .safetensors file is
//   8 bytes      N, the header's length, unsigned 64-bit little-endian
//   N bytes      the header: a UTF-8 JSON object
//                  {"NAME": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
//                   "__metadata__": {"key": "string value", ...}}   (__metadata__ optional)
//                padded with spaces so that 8 + N is a multiple of 8
//   the rest     the byte buffer: each tensor's little-endian, row-major (C order) data at
//                [begin, end) relative to the buffer's start
// The tensors' ranges cover the buffer exactly, without overlaps or holes, and end - begin is
// numel * the dtype's size. Dtypes read and written here: F64, F32, F16, BF16, I64, I32, I16, I8, U8,
// BOOL. Every offset, shape and size is checked against the file before anything is read; a damaged
// file is a UserError naming the file and the tensor.
//
// A model too large for one file is sharded: model.safetensors.index.json maps each tensor to its
// file ({"metadata": {...}, "weight_map": {"NAME": "model-00001-of-00002.safetensors", ...}}).
// read_safetensors_model reads either layout from a directory.
#pragma once

#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

// One tensor's entry in a header.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the byte buffer
};

// A .safetensors file, memory-mapped read-only; the header is parsed and checked on open.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in name order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // UserError when absent
  // A copy of the tensor on the CPU (the mapping may go away).
  torch::Tensor tensor(const std::string& name) const;
  // The tensor's values where the file is mapped, without a copy: for a reader that converts,
  // quantizes or copies them and keeps nothing of them. Read-only (the pages are; a write is a crash),
  // valid while this file is open; when the tensor is released its pages leave this process's mapping
  // (they stay in the page cache). A copy (tensor()) where the values are not aligned to their dtype.
  torch::Tensor view(const std::string& name) const;
  // Reads the tensor's pages into the page cache and this mapping (madvise's MADV_POPULATE_READ): for a reader that
  // knows what it takes next, on another thread, to overlap the disk with its work on the one before.
  void prefetch(const std::string& name) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// True when t's values are a file's mapped pages (SafetensorsFile::view, or a tensor sharing them: a
// conversion to the dtype they already have): read-only, for the reader to copy if it keeps them.
bool is_mapped_view(const torch::Tensor& t);

// Every tensor of a file, in name order.
NamedTensors read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// Writes `tensors` (any dtype listed above, any device) to `path` atomically (a temporary file in the
// same directory, then rename). Names must be unique and not "__metadata__".
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `tensors` as a Hugging Face model's weights into `dir`, as transformers' save_pretrained does:
// one model.safetensors when they fit in `max_shard_bytes`, else shards model-00001-of-0000N.safetensors
// of at most that size each (in the tensors' order; a tensor larger than the limit is a shard alone)
// and model.safetensors.index.json (metadata.total_size, weight_map: name -> shard). Returns the file
// names written. kHfMaxShardBytes is transformers' default max_shard_size, "5GB".
inline constexpr uint64_t kHfMaxShardBytes = 5'000'000'000ULL;
std::vector<std::string> write_safetensors_model(const std::string& dir, const NamedTensors& tensors,
                                                 const std::map<std::string, std::string>& metadata,
                                                 uint64_t max_shard_bytes = kHfMaxShardBytes);
// "model-00002-of-00005.safetensors" for (2, 5); is_hf_shard_name recognises such a name.
std::string hf_shard_name(size_t i, size_t n);
bool is_hf_shard_name(const std::string& name);

// The weights of a Hugging Face model directory: model.safetensors, or the shards listed by
// model.safetensors.index.json (every shard opened and checked; a tensor the index names but its shard
// lacks, or one a shard holds that the index does not map to it, is an error), read one tensor at a time.
class SafetensorsModel {
 public:
  explicit SafetensorsModel(const std::string& dir);
  ~SafetensorsModel();
  const std::string& dir() const { return dir_; }
  std::vector<SafetensorsEntry> entries() const;  // every tensor of every file, in name order
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // UserError when absent
  // A copy on the CPU, in the file's dtype; the mapped pages it was read from are released.
  torch::Tensor tensor(const std::string& name) const;
  // SafetensorsFile::view: the mapped values, read-only, never to be kept.
  torch::Tensor view(const std::string& name) const;
  // SafetensorsFile::prefetch on a thread of its own (the hint can wait for the disk's queue), one at a
  // time: the caller goes on at once.
  void prefetch(const std::string& name) const;
  uint64_t bytes() const;  // the tensors' bytes in all files

 private:
  mutable std::future<void> prefetching_;  // waited for by the destructor, before files_ are unmapped
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> file_of_;  // tensor name -> its file in files_
};

// Every tensor of a Hugging Face model directory (SafetensorsModel), in name order.
NamedTensors read_safetensors_model(const std::string& dir);

// "F32", "BF16", ... for a dtype (UserError for one the format has no name for here).
std::string safetensors_dtype_name(torch::ScalarType t);

}  // namespace lt
