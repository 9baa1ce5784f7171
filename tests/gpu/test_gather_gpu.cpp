// Retrieve gather (pinned host pages -> device slots) checked byte for byte on fresh random pages,
// random source/destination lists, several page sizes and block bounds; slots not in the list
// must keep their poison.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "base/error.h"
#include "engine/cuda/repeated_host_memory.h"
#include "kernels/cuda/gather.h"

namespace spin {
namespace {

constexpr unsigned char kPoison = 0xA5;

class GpuGather : public GpuTest {
 protected:

  // host: pinned pool of host_pages pages (already filled); device pool of device_pages slots.
  void check(const unsigned char* host, const void* host_dev_ptr, int host_pages, int device_pages,
             int count, size_t page_bytes, int max_blocks) {
    std::vector<int32_t> src(count), dst(device_pages);
    std::uniform_int_distribution<int32_t> pick(0, host_pages - 1);
    for (int32_t& s : src) s = pick(rng);  // sources may repeat
    std::iota(dst.begin(), dst.end(), 0);
    std::shuffle(dst.begin(), dst.end(), rng);  // distinct destinations
    dst.resize(count);

    const size_t dev_bytes = page_bytes * device_pages;
    void* d_pool = nullptr;
    int32_t *d_src = nullptr, *d_dst = nullptr;
    CUDA_OK(cudaMalloc(&d_pool, dev_bytes));
    CUDA_OK(cudaMalloc(&d_src, std::max(count, 1) * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&d_dst, std::max(count, 1) * sizeof(int32_t)));
    CUDA_OK(cudaMemset(d_pool, kPoison, dev_bytes));
    CUDA_OK(cudaMemcpy(d_src, src.data(), count * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_dst, dst.data(), count * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_OK(cuda::gather_pages(host_dev_ptr, d_pool, d_src, d_dst, count, page_bytes, max_blocks,
                               nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<unsigned char> got(dev_bytes);
    CUDA_OK(cudaMemcpy(got.data(), d_pool, dev_bytes, cudaMemcpyDeviceToHost));

    std::vector<unsigned char> expect(dev_bytes, kPoison);
    for (int i = 0; i < count; ++i)
      std::memcpy(expect.data() + dst[i] * page_bytes, host + src[i] * page_bytes, page_bytes);
    EXPECT_TRUE(got == expect) << "page_bytes " << page_bytes << " count " << count << " blocks "
                               << max_blocks;
    cudaFree(d_pool);
    cudaFree(d_src);
    cudaFree(d_dst);
  }

  void fill(unsigned char* p, size_t n) {
    std::uniform_int_distribution<int> byte(0, 255);
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(byte(rng));
  }

  std::mt19937 rng{std::random_device{}()};
};

TEST_F(GpuGather, MappedHostAllocIsByteExact) {
  for (size_t page_bytes : {16u, 48u, 4096u, 8192u, 16384u}) {
    const int host_pages = 300;
    unsigned char* host = nullptr;
    CUDA_OK(cudaHostAlloc(&host, page_bytes * host_pages, cudaHostAllocMapped));
    fill(host, page_bytes * host_pages);
    void* dev_view = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&dev_view, host, 0));
    for (int max_blocks : {1, 3, 16})
      for (int count : {1, 37, 200}) check(host, dev_view, host_pages, 211, count, page_bytes, max_blocks);
    cudaFreeHost(host);
  }
}

TEST_F(GpuGather, RegisteredHostMemoryIsByteExact) {
  const size_t page_bytes = 8192;
  const int host_pages = 128;
  void* raw = std::aligned_alloc(4096, page_bytes * host_pages);
  ASSERT_NE(raw, nullptr);
  auto* host = static_cast<unsigned char*>(raw);
  fill(host, page_bytes * host_pages);
  CUDA_OK(cudaHostRegister(host, page_bytes * host_pages, cudaHostRegisterMapped));
  void* dev_view = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&dev_view, host, 0));
  check(host, dev_view, host_pages, 100, 77, page_bytes, 8);
  CUDA_OK(cudaHostUnregister(host));
  std::free(raw);
}

// The benchmarks' host tier larger than RAM: every copy of the backing reads as the bytes last
// written through any copy, by Retrieve's gather over the whole range.
TEST_F(GpuGather, RepeatedHostMemoryServesEveryCopy) {
  const size_t page_bytes = 8192;
  RepeatedHostMemory memory(size_t{10} << 20, size_t{4} << 20);
  ASSERT_GE(memory.backing(), size_t{4} << 20);
  ASSERT_EQ(memory.backing() % page_bytes, 0u);
  ASSERT_EQ(memory.size() % memory.backing(), 0u);
  ASSERT_GE(memory.size(), size_t{10} << 20);
  const size_t copies = memory.size() / memory.backing();
  ASSERT_GE(copies, 2u);
  std::vector<unsigned char> backing(memory.backing());
  fill(backing.data(), backing.size());
  auto* base = static_cast<unsigned char*>(memory.data());
  CUDA_OK(cudaMemcpy(base + (copies - 1) * memory.backing(), backing.data(), backing.size(), cudaMemcpyDefault));
  std::vector<unsigned char> expect(memory.size());
  for (size_t c = 0; c < copies; ++c) std::memcpy(expect.data() + c * backing.size(), backing.data(), backing.size());
  const auto pages = static_cast<int>(memory.size() / page_bytes);
  check(expect.data(), memory.data(), pages, 200, 180, page_bytes, 8);
}

TEST_F(GpuGather, RepeatedHostMemoryRejectsBadSizes) {
  EXPECT_THROW(RepeatedHostMemory(size_t{1} << 20, 0), Error);
  EXPECT_THROW(RepeatedHostMemory(size_t{1} << 20, size_t{2} << 20), Error);
  EXPECT_THROW(RepeatedHostMemory(0, 0), Error);
}

TEST_F(GpuGather, RejectsBadArguments) {
  alignas(16) static unsigned char buf[64];
  EXPECT_EQ(cuda::gather_pages(buf, buf, nullptr, nullptr, 1, 24, 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gather_pages(buf, buf, nullptr, nullptr, 1, 32, 0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gather_pages(buf + 8, buf, nullptr, nullptr, 1, 32, 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gather_pages(buf, buf, nullptr, nullptr, 0, 32, 4, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace spin
