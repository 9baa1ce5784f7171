#pragma once
// Programmatic dependent launch (sm_90+). A decode step is a chain of short kernels; launched
// plainly, each one's blocks are scheduled only after the kernel before it has drained, a few
// microseconds per link at batch 1. `launch` lets a kernel's blocks be scheduled while the one
// before it finishes. Every kernel it launches calls `wait_for_prior_grids()` before its first
// access to global memory, which returns once the grid before it has completed and its writes are
// visible, so memory still sees plain stream order. `allow_next_grid()` lets the following kernel
// be scheduled early (it still waits for this one to complete before touching memory).
// SPIN_PROGRAMMATIC_LAUNCH=0 in the environment launches every kernel plainly.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cuda/per_device.h"

namespace spin::cuda {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of every kernel that `launch` runs: wait for the grid before, then let the next one
// be scheduled.
__device__ __forceinline__ void enter_dependent_grid() {
  wait_for_prior_grids();
  allow_next_grid();
}

// Whether launches overlap (sm_90+, not switched off).
inline bool programmatic_launch_enabled() {
  static const bool switched_off = [] {
    const char* env = std::getenv("SPIN_PROGRAMMATIC_LAUNCH");
    return env && std::strcmp(env, "0") == 0;
  }();
  return !switched_off && sm90_or_newer();
}

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster_blocks` blocks along x
// (1: no clusters), as a programmatic dependent of the stream's previous kernel. The kernel must
// start with wait_for_prior_grids() (enter_dependent_grid()).
template <typename... Params, typename... Args>
cudaError_t launch_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, unsigned cluster_blocks,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (programmatic_launch_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_blocks > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {cluster_blocks, 1, 1};
  }
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  return launch_in_clusters(kernel, grid, block, smem, 1, stream, std::forward<Args>(args)...);
}

}  // namespace spin::cuda
