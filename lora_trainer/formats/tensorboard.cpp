#include "lora_trainer/formats/tensorboard.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

namespace {

constexpr const char* kPrefix = "events.out.tfevents.";
constexpr const char* kSuffix = ".lora_trainer";
constexpr const char* kFileVersion = "brain.Event:2";
constexpr const char* kWriteHint =
    "the run stopped: free space (or raise the file size limit) and run the same command again, which continues from the "
    "job's latest checkpoint if it has one (logging/tensorboard=false writes no event file)";

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    table[i] = c;
  }
  return table;
}

// Protobuf's wire format: a key is (field number << 3 | wire type), varints little-endian base 128.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, (uint64_t(field) << 3) | wire_type); }
template <class T>
void put_fixed(std::string& out, T v) {  // little-endian: this is an x86-64/aarch64 project
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

bool get_varint(const std::string& s, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && at < s.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(s[at++]);
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// An Event's step (field 2), 0 where it has none or the payload does not parse; `file_version` (if given)
// says whether it has field 3 (the file's first record).
int64_t step_of_event(const std::string& payload, bool* file_version = nullptr) {
  size_t at = 0;
  uint64_t key = 0, v = 0;
  int64_t step = 0;
  if (file_version) *file_version = false;
  while (at < payload.size() && get_varint(payload, at, key)) {
    const int field = int(key >> 3), type = int(key & 7);
    if (type == 0) {
      if (!get_varint(payload, at, v)) return 0;
      if (field == 2) step = static_cast<int64_t>(v);
    } else if (type == 1) {
      at += 8;
    } else if (type == 5) {
      at += 4;
    } else if (type == 2) {
      if (!get_varint(payload, at, v) || v > payload.size() - at) return step;
      if (field == 3 && file_version) *file_version = true;
      at += v;
    } else {
      return 0;
    }
  }
  return step;
}

// The length of the intact record at `at` (both CRCs match, the payload within the file), or 0.
uint64_t intact_record(const std::string& bytes, size_t at) {
  if (bytes.size() - at < 16) return 0;
  uint64_t length = 0;
  uint32_t length_crc = 0, payload_crc = 0;
  std::memcpy(&length, bytes.data() + at, 8);
  std::memcpy(&length_crc, bytes.data() + at + 8, 4);
  if (length_crc != masked_crc32c(bytes.data() + at, 8) || length > bytes.size() - at - 16) return 0;
  std::memcpy(&payload_crc, bytes.data() + at + 12 + length, 4);
  return payload_crc == masked_crc32c(bytes.data() + at + 12, length) ? 16 + length : 0;
}

// Whether the bytes from `at` to the end are the start of one record cut short (what a killed writer
// leaves): an intact length, its record reaching past the end.
bool cut_record(const std::string& bytes, size_t at) {
  if (bytes.size() - at < 12) return true;
  uint64_t length = 0;
  uint32_t length_crc = 0;
  std::memcpy(&length, bytes.data() + at, 8);
  std::memcpy(&length_crc, bytes.data() + at + 8, 4);
  return length_crc == masked_crc32c(bytes.data() + at, 8) && length > bytes.size() - at - 16;
}

double now_unix_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || !name[0]) return "localhost";
  std::string s(name);
  std::replace(s.begin(), s.end(), '/', '_');
  return s;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<ScalarValue>& scalars) {
  std::string event;
  put_key(event, 1, 1);
  put_fixed(event, wall_time);
  if (step != 0) {  // proto3: a zero is left out
    put_key(event, 2, 0);
    put_varint(event, static_cast<uint64_t>(step));
  }
  if (!file_version.empty()) put_bytes(event, 3, file_version);
  if (!scalars.empty()) {
    std::string summary;
    for (const auto& s : scalars) {
      std::string value;
      put_bytes(value, 1, s.tag);
      put_key(value, 2, 5);
      put_fixed(value, s.value);
      put_bytes(summary, 1, value);
    }
    put_bytes(event, 5, summary);
  }
  return event;
}

std::string frame_record(const std::string& payload) {
  std::string record;
  put_fixed(record, uint64_t(payload.size()));
  put_fixed(record, masked_crc32c(record.data(), 8));
  record += payload;
  put_fixed(record, masked_crc32c(payload.data(), payload.size()));
  return record;
}

std::vector<std::string> read_event_records(const std::string& path, std::vector<int64_t>* step_of,
                                           std::vector<std::string>* damage) {
  const std::string bytes = read_file(path);
  std::vector<std::string> records;
  size_t at = 0;
  while (at < bytes.size()) {
    if (const uint64_t n = intact_record(bytes, at)) {
      std::string payload = bytes.substr(at + 12, n - 16);
      if (step_of) step_of->push_back(step_of_event(payload));
      records.push_back(std::move(payload));
      at += n;
      continue;
    }
    // Damaged bytes: the next intact record starts where both its CRCs match again (a false match is a
    // chance of 2^-64). The records after the damage are as good as those before it.
    size_t next = at + 1;
    while (next < bytes.size() && !intact_record(bytes, next)) ++next;
    if (damage) {
      const std::string where = "byte " + std::to_string(at) +
                                (records.empty() ? " (the file's first record)" : " (after record " + std::to_string(records.size()) + ")");
      if (next == bytes.size() && cut_record(bytes, at))
        damage->push_back("a record cut short at " + where + ", " + std::to_string(bytes.size() - at) + " bytes: what a killed writer leaves");
      else
        damage->push_back(std::to_string(next - at) + " damaged bytes at " + where + ", which fail their CRC-32C");
    }
    at = next;
  }
  return records;
}

EventFileWriter::EventFileWriter(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::string newest;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kPrefix, 0) == 0 && ends_with(name, kSuffix) && entry.is_regular_file() && name > newest)
      newest = name;
  }
  if (!newest.empty()) {
    path_ = (fs::path(dir_) / newest).string();
    return;
  }
  // Seconds zero-padded, so that the names sort by time as TensorBoard orders a directory's files.
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%010lld", static_cast<long long>(std::time(nullptr)));
  path_ = (fs::path(dir_) / (std::string(kPrefix) + stamp + "." + host_name() + kSuffix)).string();
}

void EventFileWriter::append(const std::string& record) {
  fs::create_directories(dir_);
  std::string bytes;
  std::error_code ec;
  if (!fs::exists(path_, ec) || fs::file_size(path_, ec) == 0)
    bytes = frame_record(encode_event(now_unix_seconds(), 0, kFileVersion, {}));
  bytes += record;
  append_file(path_, bytes, kWriteHint);
}

void EventFileWriter::add_scalars(int64_t step, const std::vector<ScalarValue>& scalars) {
  if (scalars.empty()) return;
  append(frame_record(encode_event(now_unix_seconds(), step, "", scalars)));
}

void EventFileWriter::truncate_after(int64_t step) {
  std::error_code ec;
  if (!fs::exists(path_, ec)) return;
  std::vector<int64_t> steps;
  std::vector<std::string> damage;
  const auto records = read_event_records(path_, &steps, &damage);
  // TensorBoard stops reading a file at a record that fails its CRC, so damaged bytes are not kept: the
  // file is rewritten from the intact records, said here.
  for (const auto& d : damage) std::printf("warning: %s: dropped %s\n", path_.c_str(), d.c_str());
  std::string kept;
  bool version = false;
  if (!records.empty()) step_of_event(records[0], &version);
  if (!version && !records.empty())  // the first record was damaged: a reader still needs it first
    kept = frame_record(encode_event(now_unix_seconds(), 0, kFileVersion, {}));
  for (size_t i = 0; i < records.size(); ++i)
    if (steps[i] <= step) kept += frame_record(records[i]);
  write_file_atomic(path_, kept);
}

}  // namespace lt
