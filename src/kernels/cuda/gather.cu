#include "kernels/cuda/gather.h"

namespace spin::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 8;  // 16-byte loads in flight per thread before the first store

__device__ __forceinline__ uint4 load_host(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// The list is one flat range of 16-byte vectors (page i, vector j); each thread takes vectors
// a grid stride apart, kUnroll at a time, so the whole grid keeps many PCIe reads in flight
// whatever the page size.
__global__ void __launch_bounds__(kThreads)
    gather_pages_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                        const int32_t* __restrict__ src_ids, const int32_t* __restrict__ dst_ids,
                        int64_t total_vecs, int64_t vecs_per_page) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < total_vecs;
       base += stride * kUnroll) {
    uint4 v[kUnroll];
    int64_t to[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = base + u * stride;
      to[u] = -1;
      if (idx < total_vecs) {
        const int64_t page = idx / vecs_per_page;
        const int64_t off = idx - page * vecs_per_page;
        v[u] = load_host(src + static_cast<int64_t>(src_ids[page]) * vecs_per_page + off);
        to[u] = static_cast<int64_t>(dst_ids[page]) * vecs_per_page + off;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (to[u] >= 0) dst[to[u]] = v[u];
  }
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
