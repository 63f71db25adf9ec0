// The GGUF file format (ggml's, read by llama.cpp, ollama and their kin), written without ggml.
//
// A GGUF file (version 3, little-endian; ggml/docs/gguf.md) is
//   "GGUF"                 4 bytes of magic
//   uint32                 the version, 3
//   uint64 tensor_count, uint64 kv_count
//   kv_count pairs         key (a string), uint32 value type, value
//   tensor_count infos     name (a string), uint32 n_dims, uint64 ne[n_dims], uint32 ggml type,
//                          uint64 offset of its data from the start of the data section
//   padding                to a multiple of general.alignment (32 unless the file sets it)
//   the data section       each tensor's bytes at its offset, offsets multiples of the alignment
// A string is a uint64 length and that many UTF-8 bytes (no terminator); an array a uint32 element
// type, a uint64 count and the elements. Value types: UINT8 0, INT8 1, UINT16 2, INT16 3, UINT32 4,
// INT32 5, FLOAT32 6, BOOL 7, STRING 8, ARRAY 9, UINT64 10, INT64 11, FLOAT64 12.
// ne is ggml's order, the fastest-varying dimension first: a row-major PyTorch tensor of shape
// (out, in) has ne = [in, out]. Tensor types written here: F32 0, F16 1, BF16 30.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace lt {

class GgufWriter {
 public:
  void set_string(const std::string& key, const std::string& v);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_strings(const std::string& key, const std::vector<std::string>& v);
  void set_i32s(const std::string& key, const std::vector<int32_t>& v);
  void set_f32s(const std::string& key, const std::vector<float>& v);

  // A tensor (float32, float16 or bfloat16, on the CPU; made contiguous), under `name`. A name longer
  // than ggml's 63 bytes, a name given twice or another dtype is a UserError.
  void add_tensor(const std::string& name, torch::Tensor t);

  // Writes the file atomically (write_file_atomic: a temporary beside it, then one rename).
  void write(const std::string& path) const;

  size_t tensor_count() const { return tensors_.size(); }

 private:
  void key(const std::string& k, uint32_t type);
  std::string kv_;  // the key/value section as written
  uint64_t kv_count_ = 0;
  std::vector<std::pair<std::string, torch::Tensor>> tensors_;
  std::vector<std::string> keys_;
};

// What a GGUF file says of itself, read with every length, count and tensor extent checked against the
// file's size: for a look at a file before handing it to llama.cpp (whose reader trusts it).
struct GgufFileInfo {
  uint32_t version = 0;
  uint64_t tensor_count = 0, kv_count = 0;
  int64_t file_type = -1;  // general.file_type (llama_ftype), -1 when absent
  bool has_chat_template = false;  // tokenizer.chat_template
};
// A file that is not GGUF version 2 or 3, or is truncated or inconsistent, is a UserError naming the
// file and the first thing wrong (e.g. "ends at byte 1000 in the value of key tokenizer.ggml.tokens").
GgufFileInfo read_gguf_info(const std::string& path);

}  // namespace lt
