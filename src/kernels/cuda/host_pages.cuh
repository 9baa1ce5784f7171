#pragma once
// Device-side copy of whole pages out of pinned host memory (zero-copy reads over the host link),
// shared by the Retrieve gather (gather.cu) and the page cache's miss fetch (page_cache.cu).
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

// A 16-byte load that bypasses L1: host memory is read once.
__device__ __forceinline__ uint4 load_host(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// The page list is one flat range of 16-byte vectors [0, total): vector idx is vector
// idx % vecs_per_page of page idx / vecs_per_page, read from src page src_id(page) and written to
// dst page dst_id(page). A thread takes vectors `first`, first + stride, ..., kUnroll loads in
// flight before its first store, so many PCIe reads are outstanding whatever the page size.
template <int kUnroll, typename SrcId, typename DstId>
__device__ __forceinline__ void copy_host_pages(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t first,
                                                int64_t total, int64_t stride, int64_t vecs_per_page, SrcId src_id,
                                                DstId dst_id) {
  for (int64_t base = first; base < total; base += stride * kUnroll) {
    uint4 v[kUnroll];
    int64_t to[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = base + u * stride;
      to[u] = -1;
      if (idx < total) {
        const int64_t page = idx / vecs_per_page;
        const int64_t off = idx - page * vecs_per_page;
        v[u] = load_host(src + static_cast<int64_t>(src_id(page)) * vecs_per_page + off);
        to[u] = static_cast<int64_t>(dst_id(page)) * vecs_per_page + off;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (to[u] >= 0) dst[to[u]] = v[u];
  }
}

}  // namespace spin::cuda
