#pragma once
// Shared by the GPU tests: checked CUDA calls, a fixture that skips where no GPU exists (CI
// compiles these tests; scripts/gpu-check.sh runs them on the H200), one that also seeds fresh
// random inputs, and a poisoned device array.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "base/half.h"

#define CUDA_OK(expr)                                                             \
  do {                                                                            \
    const cudaError_t err_ = (expr);                                              \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);   \
  } while (0)

namespace spin {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no GPU";
  }
};

// Fresh random inputs each run from `rng_`: the seed is printed and recorded, so a failure can be
// replayed.
template <typename Rng>
class SeededGpuTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    seed_ = std::random_device{}();
    std::printf("seed %u\n", seed_);
    RecordProperty("seed", static_cast<int>(seed_ & 0x7fffffff));
    rng_.seed(seed_);
  }

  // n bf16 values (their bits, as base/half.h keeps them) drawn from N(0, stddev).
  std::vector<uint16_t> random_bf16(size_t n, float stddev) {
    std::normal_distribution<float> normal(0.0f, stddev);
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) x = f32_to_bf16(normal(rng_));
    return v;
  }

  uint32_t seed_ = 0;
  Rng rng_;
};

// Device copy of a host vector, or `n` elements poisoned with 0xFF bytes (NaN in bf16/fp32, -1 in
// integers) so unwritten outputs fail; freed on scope exit so a failed assertion leaks nothing.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    status_ = cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T));
    if (status_ == cudaSuccess) status_ = cudaMemset(ptr_, 0xff, std::max<size_t>(n, 1) * sizeof(T));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (status_ == cudaSuccess && n_ > 0)
      status_ = cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr_); }
  T* get() const { return ptr_; }
  cudaError_t status() const { return status_; }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
      host.assign(n_, T{});
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
  cudaError_t status_ = cudaSuccess;
};

// A bf16 array kept as its bits (base/half.h's conversions work on uint16_t), as the kernels take it.
inline __nv_bfloat16* bf16_ptr(const DeviceArray<uint16_t>& a) { return reinterpret_cast<__nv_bfloat16*>(a.get()); }

}  // namespace spin
