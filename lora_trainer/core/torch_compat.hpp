// The one place that knows which LibTorch this is built against. Everything that differs between
// LibTorch 1.13 (Debian 12) and 2.x (Debian 13's 2.6, PyTorch's pip and pytorch.org builds) lives
// here, so the rest of the code calls one spelling:
//   - autocast state: 2.4 replaced the per-device functions (set_cpu_enabled, set_autocast_gpu_dtype,
//     ...) with ones taking a device type, and deprecates the old ones;
//   - fused attention: at::scaled_dot_product_attention is public from 2.0 (1.13 has none);
//   - the fused AdamW kernel (at::_fused_adamw_, CUDA) is there from 2.0;
//   - TCPStore's libuv backend, asked for by default from 2.4 (store_without_libuv);
//   - the memory reporter's totals (c10::MemoryReportingInfoBase): int64_t in 1.13, size_t in 2.x.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#define LT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention and at::_fused_adamw_ exist.
#define LT_HAS_SDPA LT_TORCH_AT_LEAST(2, 0)
#define LT_HAS_FUSED_ADAMW LT_TORCH_AT_LEAST(2, 0)

namespace lt::compat {

inline bool autocast_enabled(c10::DeviceType device) {
#if LT_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if LT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CUDA) at::autocast::set_enabled(enabled);
  else at::autocast::set_cpu_enabled(enabled);
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if LT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) at::autocast::set_autocast_gpu_dtype(dtype);
  else at::autocast::set_autocast_cpu_dtype(dtype);
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if LT_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline const char* torch_version() { return TORCH_VERSION; }

// LibTorch 2.4+ asks for TCPStore's libuv backend by default (TCPStoreOptions::useLibUV), and a
// LibTorch built without libuv (Debian 13's 2.6) then refuses to make a store. This turns the option
// off where it exists and says whether it did; LibTorch 1.13 has no such option (the overload taking
// `long` is chosen, and does nothing). Call as store_without_libuv(options, 0).
template <typename Options>
auto store_without_libuv(Options& o, int) -> decltype(o.useLibUV = false, bool()) {
  if (!o.useLibUV) return false;
  o.useLibUV = false;
  return true;
}
template <typename Options>
bool store_without_libuv(Options&, long) {
  return false;
}

// The type of the totals c10::MemoryReportingInfoBase::reportMemoryUsage takes (an override must
// spell it), read off the declaration itself rather than guessed from the version.
template <class F>
struct ReportMemoryUsageArgs;
template <class C, class Total>
struct ReportMemoryUsageArgs<void (C::*)(void*, int64_t, Total, Total, c10::Device)> {
  using type = Total;
};
using MemoryTotal = ReportMemoryUsageArgs<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

}  // namespace lt::compat
