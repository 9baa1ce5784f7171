// RMSNorm on the GPU against the CPU reference kernel, on fresh random inputs, outputs poisoned.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <cmath>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/rmsnorm.h"

namespace spin {
namespace {

double rel_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - ref[i]) * static_cast<double>(a[i] - ref[i]);
    den += ref[i] * static_cast<double>(ref[i]);
  }
  return std::sqrt(num / den);
}

class GpuRmsNorm : public GpuTest {
 protected:
  std::mt19937 rng{std::random_device{}()};
};

TEST_F(GpuRmsNorm, Fp32MatchesCpu) {
  for (int64_t n : {64, 576, 4096, 5120}) {
    const int64_t rows = 37;
    std::normal_distribution<float> dist(0.0f, 2.0f);
    std::vector<float> x(rows * n), w(n), ref(rows * n), out(rows * n);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = 1.0f + 0.1f * dist(rng);
    cpu::rmsnorm(x.data(), w.data(), ref.data(), rows, n, 1e-5f);
    float *dx, *dw, *dy;
    CUDA_OK(cudaMalloc(&dx, x.size() * 4));
    CUDA_OK(cudaMalloc(&dw, w.size() * 4));
    CUDA_OK(cudaMalloc(&dy, out.size() * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dy, 0xff, out.size() * 4));  // NaN poison: unwritten outputs fail
    CUDA_OK(cuda::rmsnorm(dx, dw, dy, rows, n, 1e-5f, nullptr));
    CUDA_OK(cudaMemcpy(out.data(), dy, out.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_LE(rel_error(out, ref), 1e-6) << "n=" << n;
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dy);
  }
}

TEST_F(GpuRmsNorm, Bf16ResidualMatchesCpu) {
  const int64_t rows = 19, n = 5120;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> x(rows * n), res(rows * n), w(n);
  std::vector<float> sum(rows * n), wf(n), ref(rows * n);
  for (int64_t i = 0; i < rows * n; ++i) {
    x[i] = f32_to_bf16(dist(rng));
    res[i] = f32_to_bf16(dist(rng));
    sum[i] = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i])));
  }
  for (int64_t i = 0; i < n; ++i) {
    w[i] = f32_to_bf16(1.0f + 0.1f * dist(rng));
    wf[i] = bf16_to_f32(w[i]);
  }
  cpu::rmsnorm(sum.data(), wf.data(), ref.data(), rows, n, 1e-6f);
  __nv_bfloat16 *dx, *dr, *dw, *dy;
  const size_t bytes = x.size() * 2;
  CUDA_OK(cudaMalloc(&dx, bytes));
  CUDA_OK(cudaMalloc(&dr, bytes));
  CUDA_OK(cudaMalloc(&dw, n * 2));
  CUDA_OK(cudaMalloc(&dy, bytes));
  CUDA_OK(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dr, res.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dw, w.data(), n * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dy, 0xff, bytes));
  CUDA_OK(cuda::rmsnorm_residual_bf16(dx, dr, dw, dy, rows, n, 1e-6f, nullptr));
  std::vector<uint16_t> y(rows * n), r2(rows * n);
  CUDA_OK(cudaMemcpy(y.data(), dy, bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(r2.data(), dr, bytes, cudaMemcpyDeviceToHost));
  std::vector<float> yf(rows * n), rf(rows * n);
  for (int64_t i = 0; i < rows * n; ++i) {
    yf[i] = bf16_to_f32(y[i]);
    rf[i] = bf16_to_f32(r2[i]);
  }
  EXPECT_LE(rel_error(rf, sum), 1e-6);   // the residual holds exactly the rounded sum
  EXPECT_LE(rel_error(yf, ref), 1e-2);   // bf16 output
  cudaFree(dx);
  cudaFree(dr);
  cudaFree(dw);
  cudaFree(dy);
}

}  // namespace
}  // namespace spin
