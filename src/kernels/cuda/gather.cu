#include "kernels/cuda/gather.h"

#include "kernels/cuda/host_pages.cuh"

namespace spin::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 8;  // 16-byte loads in flight per thread before the first store

// One flat range of 16-byte vectors over the whole list, a grid stride apart per thread.
__global__ void __launch_bounds__(kThreads)
    gather_pages_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                        const int32_t* __restrict__ src_ids, const int32_t* __restrict__ dst_ids,
                        int64_t total_vecs, int64_t vecs_per_page) {
  copy_host_pages<kUnroll>(
      src, dst, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, total_vecs,
      static_cast<int64_t>(gridDim.x) * kThreads, vecs_per_page, [&](int64_t page) { return src_ids[page]; },
      [&](int64_t page) { return dst_ids[page]; });
}

}  // namespace

cudaError_t gather_pages(const void* host_pool, void* device_pool, const int32_t* src_ids,
                         const int32_t* dst_ids, int num_pages, size_t page_bytes, int max_blocks,
                         cudaStream_t stream) {
  if (num_pages < 0 || max_blocks <= 0 || page_bytes == 0 || page_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(host_pool) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(device_pool) % 16 != 0)
    return cudaErrorInvalidValue;
  if (num_pages == 0) return cudaSuccess;
  const int64_t vecs_per_page = static_cast<int64_t>(page_bytes / 16);
  const int64_t total = vecs_per_page * num_pages;
  const int64_t needed = (total + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(needed < max_blocks ? needed : max_blocks);
  gather_pages_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(host_pool),
                                                       static_cast<uint4*>(device_pool), src_ids,
                                                       dst_ids, total, vecs_per_page);
  return cudaGetLastError();
}

}  // namespace spin::cuda
