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
  // n = 5120 runs the 16-byte vector kernel, with and without a residual; n = 1001 (not a
  // multiple of 8) and any one pointer off 16-byte alignment run the element-wise one.
  struct Case {
    int64_t rows, n;
    bool residual;
    int64_t offset;    // elements past the allocation's start: x, residual and y
    int64_t w_offset;  // the same for w
  };
  for (const Case c : {Case{19, 5120, true, 0, 0}, Case{3, 5120, false, 0, 0}, Case{5, 1001, true, 0, 0},
                       Case{2, 5120, true, 1, 0}, Case{2, 5120, true, 0, 1}}) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " n " << c.n << " residual " << c.residual
                                    << " offset " << c.offset << " w offset " << c.w_offset);
    const int64_t rows = c.rows, n = c.n, count = rows * n;
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<uint16_t> x(count), res(count), w(n);
    std::vector<float> sum(count), wf(n), ref(count);
    for (int64_t i = 0; i < count; ++i) {
      x[i] = f32_to_bf16(dist(rng));
      res[i] = f32_to_bf16(dist(rng));
      sum[i] = c.residual ? bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]))) : bf16_to_f32(x[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      w[i] = f32_to_bf16(1.0f + 0.1f * dist(rng));
      wf[i] = bf16_to_f32(w[i]);
    }
    cpu::rmsnorm(sum.data(), wf.data(), ref.data(), rows, n, 1e-6f);
    // Poisoned buffers (NaN) with room for the offsets; inputs copied in past them.
    DeviceArray<uint16_t> bx(count + c.offset), br(count + c.offset), bw(n + c.w_offset), by(count + c.offset);
    ASSERT_TRUE(!bx.status() && !br.status() && !bw.status() && !by.status());
    auto at = [](const DeviceArray<uint16_t>& a, int64_t offset) {
      return reinterpret_cast<__nv_bfloat16*>(a.get() + offset);
    };
    __nv_bfloat16 *dx = at(bx, c.offset), *dr = at(br, c.offset), *dw = at(bw, c.w_offset), *dy = at(by, c.offset);
    CUDA_OK(cudaMemcpy(dx, x.data(), count * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dr, res.data(), count * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dw, w.data(), n * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cuda::rmsnorm_residual_bf16(dx, c.residual ? dr : nullptr, dw, dy, rows, n, 1e-6f, nullptr));
    std::vector<uint16_t> y(count), r2(count);
    CUDA_OK(cudaMemcpy(y.data(), dy, count * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r2.data(), dr, count * 2, cudaMemcpyDeviceToHost));
    std::vector<float> yf(count), rf(count), res_f(count);
    for (int64_t i = 0; i < count; ++i) {
      yf[i] = bf16_to_f32(y[i]);
      rf[i] = bf16_to_f32(r2[i]);
      res_f[i] = bf16_to_f32(res[i]);
    }
    // The residual holds exactly the rounded sum, or is left alone without one.
    EXPECT_LE(rel_error(rf, c.residual ? sum : res_f), 1e-6);
    EXPECT_LE(rel_error(yf, ref), 1e-2);  // bf16 output
  }
}

}  // namespace
}  // namespace spin
