#pragma once
// Shared by the GPU tests: checked CUDA calls and a fixture that skips where no GPU exists
// (CI compiles these tests; scripts/gpu-check.sh runs them on the H200).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

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

}  // namespace spin
