#include "lora_trainer/formats/safetensors.hpp"

#include <ATen/Parallel.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {

static_assert(sizeof(void*) == 8, "safetensors offsets are 64-bit");

// The format is little-endian; so is every machine this project builds on (x86-64, aarch64).
bool little_endian() {
  const uint16_t one = 1;
  return *reinterpret_cast<const uint8_t*>(&one) == 1;
}

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};
const DtypeName kDtypes[] = {{"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16},
                             {"BF16", torch::kBFloat16}, {"I64", torch::kInt64},  {"I32", torch::kInt32},
                             {"I16", torch::kInt16},     {"I8", torch::kInt8},    {"U8", torch::kUInt8},
                             {"BOOL", torch::kBool}};

// The longest header we accept: the Python library's own limit (100 MB).
constexpr uint64_t kMaxHeader = 100'000'000;
// The most dimensions a tensor may have (LibTorch's own kernels take at most 25).
constexpr size_t kMaxDims = 32;

std::string json_shape(const std::vector<int64_t>& s) {  // as the header writes it: [3, 32]
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw UserError(std::string("safetensors: no dtype name for ") + c10::toString(t));
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  if (!little_endian()) throw UserError("safetensors: this machine is big-endian; the format is little-endian");
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size, "safetensors file");
  size_ = static_cast<size_t>(size);
  if (size_ < 8) {
    ::close(fd);
    throw UserError(path + ": not a safetensors file (" + std::to_string(size_) + " bytes, shorter than the 8-byte header length)");
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw UserError("could not map " + path + ": " + std::strerror(errno));
  }
  try {
    const auto* bytes = static_cast<const uint8_t*>(map_);
    uint64_t n = 0;
    std::memcpy(&n, bytes, 8);
    if (n > kMaxHeader || n > size_ - 8)
      throw UserError(path + ": header length " + std::to_string(n) + " does not fit the file (" +
                      std::to_string(size_) + " bytes): truncated or not a safetensors file");
    data_start_ = 8 + n;
    const uint64_t buffer = size_ - data_start_;
    const json header = parse_json(std::string(reinterpret_cast<const char*>(bytes + 8), n), path + " (header)",
                                   "not a safetensors file, or damaged");
    if (!header.is_object()) throw UserError(path + ": the header is not a JSON object");
    for (auto& [name, v] : header.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) throw UserError(path + ": __metadata__ is not an object");
        for (auto& [k, s] : v.items()) {
          if (!s.is_string()) throw UserError(path + ": __metadata__ value of \"" + k + "\" is not a string");
          metadata_[k] = s.get<std::string>();
        }
        continue;
      }
      const std::string where = path + ": tensor " + name;
      if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
        throw UserError(where + ": its entry needs dtype, shape and data_offsets");
      SafetensorsEntry e;
      e.name = name;
      if (!v["dtype"].is_string()) throw UserError(where + ": dtype is not a string");
      const std::string dt = v["dtype"].get<std::string>();
      const DtypeName* found = nullptr;
      for (const auto& d : kDtypes)
        if (dt == d.name) found = &d;
      if (!found) throw UserError(where + ": dtype " + dt + " is not supported (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
      e.dtype = found->type;
      if (!v["shape"].is_array()) throw UserError(where + ": shape is not a list");
      if (v["shape"].size() > kMaxDims)
        throw UserError(where + ": shape has " + std::to_string(v["shape"].size()) + " dimensions, more than " +
                        std::to_string(kMaxDims) + ": a damaged file");
      // Every size, and their product in bytes, must fit in 64 bits (and so, below, in the file): a
      // product that wraps around would pass the byte count check below.
      uint64_t numel = 1;
      bool overflow = false;
      for (const auto& d : v["shape"]) {
        if (!d.is_number_unsigned()) throw UserError(where + ": shape " + v["shape"].dump() + " has a non-integer or negative size");
        const uint64_t s = d.get<uint64_t>();
        overflow |= s > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, s, &numel);
        e.shape.push_back(static_cast<int64_t>(s));
      }
      const auto& off = v["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
        throw UserError(where + ": data_offsets must be two unsigned integers, got " + off.dump());
      e.begin = off[0].get<uint64_t>();
      e.end = off[1].get<uint64_t>();
      if (e.begin > e.end || e.end > buffer)
        throw UserError(where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                        "] lie outside the file's " + std::to_string(buffer) + "-byte data buffer (truncated file?)");
      uint64_t want = 0;
      overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(e.dtype)), &want);
      if (overflow)
        throw UserError(where + ": shape " + v["shape"].dump() + " " + dt + " is larger than 2^64 bytes: a damaged file");
      if (e.end - e.begin != want)
        throw UserError(where + ": " + std::to_string(e.end - e.begin) + " bytes for shape " + json_shape(e.shape) +
                        " " + dt + ", which needs " + std::to_string(want));
      entries_.push_back(std::move(e));
    }
    // The ranges must tile the buffer: no overlap, no hole, nothing after the last one.
    std::vector<const SafetensorsEntry*> by_offset;
    for (const auto& e : entries_) by_offset.push_back(&e);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    uint64_t at = 0;
    for (const auto* e : by_offset) {
      if (e->begin != at)
        throw UserError(path + ": tensor " + e->name + " starts at byte " + std::to_string(e->begin) + " of the data buffer, " +
                        (e->begin < at ? "inside the previous tensor" : "leaving a gap after byte " + std::to_string(at)) +
                        ": a damaged file");
      at = e->end;
    }
    if (at != buffer)
      throw UserError(path + ": the tensors cover " + std::to_string(at) + " bytes of the " + std::to_string(buffer) +
                      "-byte data buffer: a damaged file");
    std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

bool SafetensorsFile::contains(const std::string& name) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), name, [](const auto& e, const std::string& n) { return e.name < n; });
  return it != entries_.end() && it->name == name;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), name, [](const auto& e, const std::string& n) { return e.name < n; });
  if (it == entries_.end() || it->name != name) throw UserError(path_ + ": no tensor named " + name);
  return *it;
}

namespace {

#ifdef MADV_POPULATE_READ
constexpr int kPopulateRead = MADV_POPULATE_READ;
#else
constexpr int kPopulateRead = 22;  // Linux's value, where the C library's headers predate it
#endif

// madvise over the pages that hold [from, from + bytes) of a mapping; its result.
int advise_pages(const uint8_t* from, uint64_t bytes, int advice) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(from) / page * page;
  return ::madvise(reinterpret_cast<void*>(first), reinterpret_cast<uintptr_t>(from) + bytes - first, advice);
}

// The mapped pages read are the page cache's, not this process's: dropped from the mapping so that
// reading a model tensor by tensor does not hold the whole file resident (in RSS) meanwhile.
void drop_mapped_pages(const uint8_t* from, uint64_t bytes) { advise_pages(from, bytes, MADV_DONTNEED); }

// A view's storage: its pages, dropped from the mapping when the last tensor on them goes.
struct MappedRange {
  const uint8_t* from;
  uint64_t bytes;
};
void release_mapped_view(void* context) {
  std::unique_ptr<MappedRange> range(static_cast<MappedRange*>(context));
  drop_mapped_pages(range->from, range->bytes);
}

}  // namespace

torch::Tensor SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  uint8_t* from = static_cast<uint8_t*>(map_) + data_start_ + e.begin;
  const uint64_t bytes = e.end - e.begin;
  if (bytes == 0 || reinterpret_cast<uintptr_t>(from) % c10::elementSize(e.dtype) != 0) return tensor(name);
  return at::for_blob(from, e.shape)
      .context(new MappedRange{from, bytes}, &release_mapped_view)
      .options(torch::TensorOptions().dtype(e.dtype))
      .make_tensor();
}

bool is_mapped_view(const torch::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &release_mapped_view;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  if (e.end > e.begin) {
    const uint8_t* from = static_cast<const uint8_t*>(map_) + data_start_ + e.begin;
    // Copied over the threads, 16 MiB a piece: the page faults of the mapping and of the new tensor, and
    // the copy itself, are no longer one core's.
    constexpr int64_t kPiece = int64_t(16) << 20;
    const int64_t n = static_cast<int64_t>(e.end - e.begin);
    uint8_t* to = static_cast<uint8_t*>(t.data_ptr());
    at::parallel_for(0, (n + kPiece - 1) / kPiece, 1, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) std::memcpy(to + i * kPiece, from + i * kPiece, std::min(kPiece, n - i * kPiece));
    });
    drop_mapped_pages(from, e.end - e.begin);
  }
  return t;
}

void SafetensorsFile::prefetch(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const uint8_t* from = static_cast<const uint8_t*>(map_) + data_start_ + e.begin;
  // The pages read and mapped in one call (Linux 5.14+): the kernel's readahead widens the reads as they
  // go on in order, and no page faults one at a time. madvise's WILLNEED would not do: it starts a
  // readahead window's worth, not the tensor.
  if (advise_pages(from, e.end - e.begin, kPopulateRead) == 0) return;
  // An older kernel: a byte of every page read, the page faults read the file.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const volatile uint8_t* at_page = from;
  uint8_t sink = 0;
  for (uint64_t at = 0; at < e.end - e.begin; at += page) sink ^= at_page[at];
  (void)sink;
}

NamedTensors read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  SafetensorsFile f(path);
  NamedTensors out;
  for (const auto& e : f.entries()) out.emplace_back(e.name, f.tensor(e.name));
  if (metadata) *metadata = f.metadata();
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  if (!little_endian()) throw UserError("safetensors: this machine is big-endian; the format is little-endian");
  std::vector<std::pair<std::string, torch::Tensor>> sorted;
  for (const auto& [name, t] : tensors) sorted.emplace_back(name, t.detach().to(torch::kCPU).contiguous());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const auto& [name, t] = sorted[i];
    if (name == "__metadata__" || (i > 0 && sorted[i - 1].first == name))
      throw std::logic_error("write_safetensors: tensor name \"" + name + "\" is reserved or repeated");
    const uint64_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", safetensors_dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()},
                    {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  const uint64_t n = text.size();
  std::vector<std::pair<const void*, size_t>> pieces = {{&n, 8}, {text.data(), text.size()}};
  for (const auto& [name, t] : sorted) pieces.emplace_back(t.data_ptr(), t.numel() * t.element_size());
  write_file_atomic(path, pieces);  // straight from the tensors: no copy of the file in memory
}

std::string hf_shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

bool is_hf_shard_name(const std::string& name) {  // model-DDDDD-of-DDDDD.safetensors
  const std::string pattern = "model-#####-of-#####.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t k = 0; k < name.size(); ++k)
    if (pattern[k] == '#' ? !std::isdigit(static_cast<unsigned char>(name[k])) : name[k] != pattern[k]) return false;
  return true;
}

std::vector<std::string> write_safetensors_model(const std::string& dir, const NamedTensors& tensors,
                                                 const std::map<std::string, std::string>& metadata,
                                                 uint64_t max_shard_bytes) {
  // transformers' rule (huggingface_hub's split_state_dict_into_shards): in order, a tensor opens a new
  // shard when it would take the current one past the limit; one larger than the limit is a shard alone.
  std::vector<NamedTensors> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(name, t);
    in_shard += bytes;
    total += bytes;
  }
  if (shards.size() == 1) {
    write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, metadata);
    return {"model.safetensors"};
  }
  std::vector<std::string> files;
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    files.push_back(hf_shard_name(i + 1, shards.size()));
    write_safetensors((fs::path(dir) / files.back()).string(), shards[i], metadata);
    for (const auto& [name, t] : shards[i]) weight_map[name] = files.back();
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};  // nlohmann sorts the keys
  write_file_atomic((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  files.push_back("model.safetensors.index.json");
  return files;
}

SafetensorsModel::SafetensorsModel(const std::string& dir) : dir_(dir) {
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    for (const auto& e : files_.back()->entries()) file_of_[e.name] = 0;
    return;
  }
  if (!fs::exists(index))
    throw UserError(dir + " has neither model.safetensors nor model.safetensors.index.json (only safetensors weights "
                    "are read: a pytorch_model.bin can be converted with transformers' save_pretrained)");
  json j = read_json_file(index.string(), "the model directory is damaged; save it again with save_pretrained");
  if (!j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    throw UserError(index.string() + ": no weight_map object naming each tensor's file");
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw UserError(index.string() + ": weight_map[\"" + name + "\"] is not a file name");
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      throw UserError(index.string() + ": weight_map[\"" + name + "\"] = \"" + f + "\" is not a file in " + dir);
    by_file[f].push_back(name);
  }
  for (const auto& [file, names] : by_file) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / file).string()));
    const SafetensorsFile& shard = *files_.back();
    for (const auto& name : names) {
      if (!shard.contains(name))
        throw UserError(index.string() + " puts tensor " + name + " in " + file + ", which does not hold it");
      file_of_[name] = files_.size() - 1;
    }
    for (const auto& e : shard.entries())
      if (!std::binary_search(names.begin(), names.end(), e.name))  // names: in key order, as json's map iterates
        throw UserError(shard.path() + " holds tensor " + e.name + ", which " + index.string() + " does not map to it");
  }
}

SafetensorsModel::~SafetensorsModel() {
  if (prefetching_.valid()) prefetching_.wait();  // before the files it reads are unmapped
}

std::vector<SafetensorsEntry> SafetensorsModel::entries() const {
  std::vector<SafetensorsEntry> out;
  for (const auto& [name, file] : file_of_) out.push_back(files_[file]->entry(name));
  return out;
}

bool SafetensorsModel::contains(const std::string& name) const { return file_of_.count(name) > 0; }

const SafetensorsEntry& SafetensorsModel::entry(const std::string& name) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) throw UserError(dir_ + ": no tensor " + name + " in its safetensors files");
  return files_[it->second]->entry(name);
}

torch::Tensor SafetensorsModel::tensor(const std::string& name) const {
  entry(name);  // a UserError when absent
  return files_[file_of_.at(name)]->tensor(name);
}

torch::Tensor SafetensorsModel::view(const std::string& name) const {
  entry(name);  // a UserError when absent
  return files_[file_of_.at(name)]->view(name);
}

void SafetensorsModel::prefetch(const std::string& name) const {
  entry(name);
  if (prefetching_.valid()) prefetching_.wait();
  const SafetensorsFile* file = files_[file_of_.at(name)].get();
  prefetching_ = std::async(std::launch::async, [file, name] { file->prefetch(name); });
}

uint64_t SafetensorsModel::bytes() const {
  uint64_t n = 0;
  for (const auto& [name, file] : file_of_) {
    const SafetensorsEntry& e = files_[file]->entry(name);
    n += e.end - e.begin;
  }
  return n;
}

NamedTensors read_safetensors_model(const std::string& dir) {
  const SafetensorsModel model(dir);
  NamedTensors out;
  for (const auto& e : model.entries()) out.emplace_back(e.name, model.tensor(e.name));
  return out;
}

}  // namespace lt
