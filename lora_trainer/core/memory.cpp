#include "lora_trainer/core/memory.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace lt {

namespace {

// The value of `key` (in kB) in a /proc file of "Key:   value kB" lines, in bytes; -1 when absent.
int64_t proc_field(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0 || line.size() <= key.size() || line[key.size()] != ':') continue;
    return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  return -1;
}

}  // namespace

int64_t machine_memory() { return proc_field("/proc/meminfo", "MemTotal"); }

int64_t available_memory() { return proc_field("/proc/meminfo", "MemAvailable"); }

ProcessMemory ProcessMemory::now() {
  ProcessMemory m;
  m.peak = proc_field("/proc/self/status", "VmHWM");
  m.anonymous = proc_field("/proc/self/status", "RssAnon");
  m.file = proc_field("/proc/self/status", "RssFile");
  m.shared = proc_field("/proc/self/status", "RssShmem");
  return m;
}

std::string format_bytes(int64_t bytes) {
  char b[32];
  if (std::llabs(bytes) >= 1000000000LL) std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  else std::snprintf(b, sizeof b, "%.0f MB", bytes / 1e6);
  return b;
}

int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("\"" + text + "\" is not a size (e.g. 24GB, 16GiB, 512MB)");
  }
  std::string unit = text.substr(used);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KB" || unit == "K") scale = 1e3;
  else if (unit == "MB" || unit == "M") scale = 1e6;
  else if (unit == "GB" || unit == "G") scale = 1e9;
  else if (unit == "TB" || unit == "T") scale = 1e12;
  else if (unit == "KIB") scale = 1024.0;
  else if (unit == "MIB") scale = 1024.0 * 1024;
  else if (unit == "GIB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "TIB") scale = 1024.0 * 1024 * 1024 * 1024;
  if (scale == 0 || !(value >= 0) || !std::isfinite(value * scale) || value * scale > 9e18)
    throw std::invalid_argument("\"" + text + "\" is not a size (e.g. 24GB, 16GiB, 512MB)");
  return static_cast<int64_t>(std::llround(value * scale));
}

}  // namespace lt
