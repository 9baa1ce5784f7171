#pragma once
// A CUDA driver function through the runtime's entry-point query: no link-time dependency on
// libcuda, so the binaries still start on machines without a GPU driver.
#include <cuda_runtime.h>

namespace spin::cuda {

// The driver's `name` (its CUDA 12.0 version) as Fn, or null where the driver has none.
template <typename Fn>
Fn driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t status = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  return status == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<Fn>(fn) : nullptr;
}

}  // namespace spin::cuda
