#include "lora_trainer/formats/gguf.hpp"

#include <algorithm>
#include <cstring>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

namespace {

constexpr uint64_t kAlignment = 32;  // GGUF's default general.alignment
constexpr size_t kMaxNameBytes = 63;  // GGML_MAX_NAME - 1

enum : uint32_t { kU8 = 0, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9, kU64 = 10 };

template <class T>
void put(std::string& out, T v) {  // little-endian hosts only (x86-64, aarch64)
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

uint32_t ggml_type(torch::ScalarType t, const std::string& name) {
  switch (t) {
    case torch::kFloat32: return 0;
    case torch::kFloat16: return 1;
    case torch::kBFloat16: return 30;
    default:
      throw UserError("GGUF: tensor " + name + " is " + std::string(c10::toString(t)) +
                      "; GGUF is written in float32, float16 or bfloat16");
  }
}

uint64_t padded(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

void GgufWriter::key(const std::string& k, uint32_t type) {
  if (std::find(keys_.begin(), keys_.end(), k) != keys_.end()) throw std::logic_error("GGUF key set twice: " + k);
  keys_.push_back(k);
  put_string(kv_, k);
  put<uint32_t>(kv_, type);
  ++kv_count_;
}

void GgufWriter::set_string(const std::string& k, const std::string& v) {
  key(k, kString);
  put_string(kv_, v);
}
void GgufWriter::set_u32(const std::string& k, uint32_t v) {
  key(k, kU32);
  put(kv_, v);
}
void GgufWriter::set_i32(const std::string& k, int32_t v) {
  key(k, kI32);
  put(kv_, v);
}
void GgufWriter::set_f32(const std::string& k, float v) {
  key(k, kF32);
  put(kv_, v);
}
void GgufWriter::set_bool(const std::string& k, bool v) {
  key(k, kBool);
  put<uint8_t>(kv_, v ? 1 : 0);
}
void GgufWriter::set_strings(const std::string& k, const std::vector<std::string>& v) {
  key(k, kArray);
  put<uint32_t>(kv_, kString);
  put<uint64_t>(kv_, v.size());
  for (const auto& s : v) put_string(kv_, s);
}
void GgufWriter::set_i32s(const std::string& k, const std::vector<int32_t>& v) {
  key(k, kArray);
  put<uint32_t>(kv_, kI32);
  put<uint64_t>(kv_, v.size());
  for (int32_t x : v) put(kv_, x);
}
void GgufWriter::set_f32s(const std::string& k, const std::vector<float>& v) {
  key(k, kArray);
  put<uint32_t>(kv_, kF32);
  put<uint64_t>(kv_, v.size());
  for (float x : v) put(kv_, x);
}

void GgufWriter::add_tensor(const std::string& name, torch::Tensor t) {
  if (name.size() > kMaxNameBytes)
    throw UserError("GGUF: tensor name " + name + " is longer than ggml's " + std::to_string(kMaxNameBytes) + " bytes");
  for (const auto& [n, _] : tensors_)
    if (n == name) throw std::logic_error("GGUF tensor added twice: " + name);
  ggml_type(t.scalar_type(), name);
  if (t.dim() < 1 || t.dim() > 4) throw UserError("GGUF: tensor " + name + " has " + std::to_string(t.dim()) + " dimensions; ggml takes 1 to 4");
  tensors_.emplace_back(name, t.to(torch::kCPU).contiguous());
}

void GgufWriter::write(const std::string& path) const {
  std::string head = "GGUF";
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, kv_count_);
  head += kv_;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors_) {
    put_string(head, name);
    put<uint32_t>(head, static_cast<uint32_t>(t.dim()));
    for (int64_t d = t.dim() - 1; d >= 0; --d) put<uint64_t>(head, static_cast<uint64_t>(t.size(d)));
    put<uint32_t>(head, ggml_type(t.scalar_type(), name));
    put<uint64_t>(head, offset);
    offset = padded(offset + t.nbytes());
  }
  head.resize(padded(head.size()), '\0');
  static const char zeros[kAlignment] = {};
  std::vector<std::pair<const void*, size_t>> pieces = {{head.data(), head.size()}};
  for (const auto& [name, t] : tensors_) {
    pieces.emplace_back(t.data_ptr(), t.nbytes());
    const size_t pad = padded(t.nbytes()) - t.nbytes();
    if (pad) pieces.emplace_back(zeros, pad);
  }
  write_file_atomic(path, pieces);
}

}  // namespace lt
