#pragma once
// cp.async (sm_80+): 16-byte global->shared copies that bypass L1 and land while the thread goes
// on; a thread commits the copies it issued as a group and waits until at most Pending of its
// groups are still in flight (then a __syncthreads() makes every thread's copies visible).
#include <cstdint>

namespace spin::cuda {

// src_bytes 0 writes zeros without reading.
__device__ __forceinline__ void copy_async(uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
}

}  // namespace spin::cuda
