#pragma once
// Shared by the paged attention tests (decode and prefill): device buffers and the page pool's
// layout. A pool page holds one (layer, KV head)'s K rows of `page_size` x `head_dim` bf16, then
// its V rows; a page list names pool pages in token order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace spin::gpu_test {

constexpr uint16_t kBf16Nan = 0x7fc1;

// An uninitialised device allocation of `count` elements (ptr is null if it failed).
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(size_t count) {
    if (cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// `used_pages` distinct pool pages in random order, out of a pool of `pool_pages`.
inline std::vector<int32_t> random_page_ids(int used_pages, int pool_pages, std::mt19937& rng) {
  std::vector<int32_t> ids(pool_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(used_pages);
  return ids;
}

// Where token `t` of a page list starting at ids[list_offset] keeps its K row in the pool
// (its V row is page_size * head_dim elements further).
inline size_t key_offset(const std::vector<int32_t>& ids, int32_t list_offset, int t, int page_size, int head_dim) {
  const size_t page_elems = static_cast<size_t>(2) * page_size * head_dim;
  return ids[list_offset + t / page_size] * page_elems + static_cast<size_t>(t % page_size) * head_dim;
}

}  // namespace spin::gpu_test
