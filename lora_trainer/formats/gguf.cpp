#include "lora_trainer/formats/gguf.hpp"

#include <sys/mman.h>
#include <unistd.h>

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

namespace {

// A bounds-checked cursor over a mapped file: every read names where the file ended.
class Cursor {
 public:
  Cursor(const char* data, uint64_t size, std::string path) : data_(data), size_(size), path_(std::move(path)) {}
  template <class T>
  T get(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const std::string& what) {
    const uint64_t n = get<uint64_t>(what);
    need(n, what);
    std::string s(data_ + pos_, n);
    pos_ += n;
    return s;
  }
  void skip(uint64_t n, const std::string& what) {
    need(n, what);
    pos_ += n;
  }
  uint64_t pos() const { return pos_; }
  [[noreturn]] void fail(const std::string& what) const {
    throw UserError(path_ + " is not a complete GGUF file: " + what + " (at byte " + std::to_string(pos_) + " of " +
                    std::to_string(size_) + "); export it again");
  }

 private:
  void need(uint64_t n, const std::string& what) const {
    if (n > size_ - pos_) fail("it ends in " + what);
  }
  const char* data_;
  uint64_t size_, pos_ = 0;
  std::string path_;
};

// The bytes of one value of a scalar type; 0 for string and array.
uint64_t scalar_bytes(uint32_t type) {
  static const uint64_t bytes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
  return type < 13 ? bytes[type] : 0;
}

// Skips a value of `type` (reading an integer `general.file_type` or `general.alignment` when asked).
void skip_value(Cursor& c, uint32_t type, const std::string& what, int depth = 0) {
  if (type == kString) {
    c.string(what);
  } else if (type == kArray) {
    if (depth > 0) c.fail(what + " is an array of arrays");
    const uint32_t elem = c.get<uint32_t>(what);
    const uint64_t n = c.get<uint64_t>(what);
    if (elem == kString) {
      for (uint64_t i = 0; i < n; ++i) c.string(what);
    } else if (const uint64_t b = scalar_bytes(elem); b > 0) {
      if (n > UINT64_MAX / b) c.fail(what + " has a count of " + std::to_string(n));
      c.skip(n * b, what);
    } else {
      c.fail(what + " has elements of an unknown type " + std::to_string(elem));
    }
  } else if (const uint64_t b = scalar_bytes(type); b > 0) {
    c.skip(b, what);
  } else {
    c.fail(what + " has an unknown value type " + std::to_string(type));
  }
}

}  // namespace

GgufFileInfo read_gguf_info(const std::string& path) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size, "a GGUF file");
  void* map = size > 0 ? mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);
  if (size > 0 && map == MAP_FAILED) throw UserError("could not map " + path + ": " + std::strerror(errno));
  struct Unmap {
    void* p;
    uint64_t n;
    ~Unmap() {
      if (p && p != MAP_FAILED) munmap(p, n);
    }
  } unmap{map, size};
  Cursor c(static_cast<const char*>(map), size, path);
  GgufFileInfo info;
  const uint32_t magic = c.get<uint32_t>("its magic");
  if (std::memcmp(&magic, "GGUF", 4) != 0) throw UserError(path + " is not a GGUF file (it does not start with \"GGUF\")");
  info.version = c.get<uint32_t>("its version");
  if (info.version != 2 && info.version != 3)
    throw UserError(path + " is GGUF version " + std::to_string(info.version) + "; versions 2 and 3 are read");
  info.tensor_count = c.get<uint64_t>("its tensor count");
  info.kv_count = c.get<uint64_t>("its key count");
  uint64_t alignment = kAlignment;
  for (uint64_t i = 0; i < info.kv_count; ++i) {
    const std::string key = c.string("key " + std::to_string(i + 1) + " of " + std::to_string(info.kv_count));
    const uint32_t type = c.get<uint32_t>("the type of key " + key);
    const uint64_t at = c.pos();
    skip_value(c, type, "the value of key " + key);
    if (key == "general.file_type" && (type == kU32 || type == kI32)) {
      uint32_t v;
      std::memcpy(&v, static_cast<const char*>(map) + at, 4);
      info.file_type = v;
    } else if (key == "general.alignment" && type == kU32) {
      uint32_t v;
      std::memcpy(&v, static_cast<const char*>(map) + at, 4);
      if (v == 0 || (v & (v - 1)) != 0) c.fail("general.alignment is " + std::to_string(v) + ", not a power of two");
      alignment = v;
    } else if (key == "tokenizer.chat_template" && type == kString) {
      info.has_chat_template = true;
    }
  }
  struct Extent {
    std::string name;
    uint64_t offset, bytes;
  };
  std::vector<Extent> extents;
  for (uint64_t i = 0; i < info.tensor_count; ++i) {
    const std::string what = "tensor " + std::to_string(i + 1) + " of " + std::to_string(info.tensor_count);
    const std::string name = c.string("the name of " + what);
    const uint32_t dims = c.get<uint32_t>("the dimensions of tensor " + name);
    if (dims > 4) c.fail("tensor " + name + " has " + std::to_string(dims) + " dimensions (ggml has at most 4)");
    uint64_t elements = 1;
    for (uint32_t d = 0; d < dims; ++d) {
      const uint64_t ne = c.get<uint64_t>("the shape of tensor " + name);
      if (ne != 0 && elements > UINT64_MAX / ne) c.fail("tensor " + name + "'s shape overflows");
      elements *= ne;
    }
    const uint32_t type = c.get<uint32_t>("the type of tensor " + name);
    const uint64_t offset = c.get<uint64_t>("the offset of tensor " + name);
    // Sizes of the unquantized types; a quantized one's extent is llama.cpp's to check.
    const uint64_t element_bytes = type == 0 ? 4 : (type == 1 || type == 30) ? 2 : 0;
    if (element_bytes && elements > UINT64_MAX / element_bytes) c.fail("tensor " + name + "'s size overflows");
    // ggml reads each tensor's bytes padded to the alignment, the last one's too.
    const uint64_t raw = elements * element_bytes;
    if (raw > size) c.fail("tensor " + name + " would take " + std::to_string(raw) + " bytes");
    const uint64_t bytes = (raw + alignment - 1) / alignment * alignment;
    extents.push_back({name, offset, bytes});
  }
  const uint64_t data = (c.pos() + alignment - 1) / alignment * alignment;
  for (const Extent& e : extents)
    if (data > size || e.offset > size - data || e.bytes > size - data - e.offset)
      throw UserError(path + " is not a complete GGUF file: tensor " + e.name + "'s data (" + std::to_string(e.bytes) +
                      " bytes at byte " + std::to_string(data + e.offset) + ") runs past its end at byte " + std::to_string(size) +
                      "; export it again");
  return info;
}

}  // namespace lt
