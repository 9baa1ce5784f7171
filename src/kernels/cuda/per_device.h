#pragma once
// Once-per-device setup for kernel launchers. Function attributes (the dynamic shared-memory
// limit) and occupancy belong to a device, not the process: a value computed once per process on
// GPU 0 is wrong on GPU 1, where the launch then fails (tensor parallelism runs one thread per
// GPU in one process).
#include <cuda_runtime.h>

#include <array>
#include <mutex>

namespace spin::cuda {

inline constexpr int kMaxDevices = 64;

// init() run once per device (the calling thread's current one) and its result, kept per call
// site: the statics belong to the instantiation, and every lambda has its own type.
template <typename T, typename Init>
T per_device(Init init) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<T, kMaxDevices> values;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return init();
  std::call_once(once[static_cast<size_t>(device)], [&] { values[static_cast<size_t>(device)] = init(); });
  return values[static_cast<size_t>(device)];
}

// Whether the calling thread's device is sm_90 or newer (programmatic launch, clusters).
inline bool sm90_or_newer() {
  return per_device<bool>([] {
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
           major >= 9;
  });
}

// Multiprocessors of the calling thread's device.
inline int multiprocessor_count() {
  return per_device<int>([] {
    int device = 0, sms = 132;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
  });
}

}  // namespace spin::cuda
