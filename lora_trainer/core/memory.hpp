// Memory as the kernel counts it: the machine's (/proc/meminfo) and this process's (/proc/self/status).
// The memory plan (training/memory_plan.hpp) sets its totals beside machine_memory(); a run reports its
// measured peak beside the plan with ProcessMemory.
#pragma once

#include <cstdint>
#include <string>

namespace lt {

// This machine's physical memory (MemTotal), in bytes.
int64_t machine_memory();
// The memory the kernel says a new allocation can take now without swapping (MemAvailable), in bytes.
int64_t available_memory();

// This process's resident memory now, and its peak.
struct ProcessMemory {
  int64_t peak = 0;       // VmHWM: the peak resident set, every kind of page
  int64_t anonymous = 0;  // RssAnon: heap, stacks, tensors
  int64_t file = 0;       // RssFile: mapped files' pages (libraries, a mapped safetensors file)
  int64_t shared = 0;     // RssShmem
  static ProcessMemory now();
  // The peak of the memory the process allocated: the peak resident set less the file-backed and shared
  // pages resident now (the libraries' pages, which stay resident once read). The kernel keeps no peak
  // of anonymous memory alone; this bounds it from above as long as the file-backed pages resident at
  // the peak were no more than now.
  int64_t peak_allocated() const { return peak - file - shared; }
  // The resident set now, every kind of page (VmRSS).
  int64_t resident() const { return anonymous + file + shared; }
};

// "1.23 GB" (decimal gigabytes, two decimals; MB below 1 GB).
std::string format_bytes(int64_t bytes);
// A size as written on a command line: 24GB, 24G, 16GiB, 512MB, 1.5TB, or a count of bytes.
// std::invalid_argument for anything else.
int64_t parse_bytes(const std::string& text);

}  // namespace lt
