// Decode-sized products (kernels/cuda/gemv.h) against a double-precision reference on the same bf16
// inputs, fresh random each run (seed printed): 1..kMaxGemvRows rows, outputs odd and even in
// number, rows of w from one 16-byte piece to several rounds of the block's loads (8, 2056, 5120 +
// 8 and 17408 values), bf16 and fp32 output. Output buffers are poisoned, one row wider than the
// product, and the extra column must keep its poison. Tolerance: |gpu - ref| <= 1e-4 * sum |a w|
// for fp32 output (fp32 sums of exact bf16 products) and that plus 2^-8 |ref| for bf16 output (its
// rounding). Also: a product right after the kernel that writes its activations (the product loads
// its weights before it waits for that kernel) reads the new activations; bad shapes and misaligned
// operands are refused with cudaErrorInvalidValue.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/model_ops.h"

namespace spin {
namespace {

class GpuGemv : public SeededGpuTest<std::mt19937> {
 protected:
  // Checks out[r][o] at got[r * stride + o] against the reference; with stride > n, column n
  // (poisoned) must be untouched.
  static void check(const std::vector<float>& got, int64_t stride, const std::vector<uint16_t>& a,
                    const std::vector<uint16_t>& w, int64_t rows, int64_t n, int64_t k, bool bf16_out) {
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < n; ++o) {
        double ref = 0.0, mag = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          const double t = double{bf16_to_f32(a[r * k + i])} * bf16_to_f32(w[o * k + i]);
          ref += t;
          mag += std::abs(t);
        }
        const double g = got[r * stride + o];
        const double tol = 1e-4 * mag + (bf16_out ? std::ldexp(std::abs(ref), -8) : 0.0) + 1e-30;
        if (!(std::abs(g - ref) <= tol) && bad++ < 8)
          ADD_FAILURE() << rows << "x" << k << " by " << n << " out " << (bf16_out ? "bf16" : "fp32") << ": [" << r
                        << "][" << o << "] = " << g << ", expected " << ref << " (tolerance " << tol << ")";
      }
      if (stride > n) {
        EXPECT_TRUE(std::isnan(got[r * stride + n])) << "row " << r << " wrote past its " << n << " outputs";
      }
    }
  }

  // Runs the product into a poisoned [rows][n + 1] buffer and returns it widened to float.
  std::vector<float> run(const std::vector<uint16_t>& a, const std::vector<uint16_t>& w, int64_t rows, int64_t n,
                         int64_t k, bool bf16_out) {
    const DeviceArray<uint16_t> da(a), dw(w);
    std::vector<float> got(static_cast<size_t>(rows * (n + 1)));
    EXPECT_EQ(da.status(), cudaSuccess);
    EXPECT_EQ(dw.status(), cudaSuccess);
    if (bf16_out) {
      const DeviceArray<uint16_t> out(got.size());
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ(cuda::gemv_nt(bf16_ptr(da) + r * k, bf16_ptr(dw), bf16_ptr(out) + r * (n + 1), 1, n, k, nullptr),
                  cudaSuccess);
      }
      // The whole product once more, rows together, into a dense [rows][n] buffer.
      const DeviceArray<uint16_t> dense(static_cast<size_t>(rows * n));
      EXPECT_EQ(cuda::gemv_nt(bf16_ptr(da), bf16_ptr(dw), bf16_ptr(dense), rows, n, k, nullptr), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint16_t> bits = out.download(), together = dense.download();
      for (size_t i = 0; i < bits.size(); ++i) got[i] = bf16_to_f32(bits[i]);
      // One row at a time and all rows together give the same sums in the same order.
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < n; ++o)
          EXPECT_EQ(together[r * n + o], bits[r * (n + 1) + o]) << "row " << r << " output " << o;
    } else {
      const DeviceArray<float> out(got.size());
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ(cuda::gemv_nt(bf16_ptr(da) + r * k, bf16_ptr(dw), out.get() + r * (n + 1), 1, n, k,
                                nullptr),
                  cudaSuccess);
      }
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      got = out.download();
    }
    return got;
  }
};

TEST_F(GpuGemv, ProductsMatchTheReference) {
  for (const int64_t k : {int64_t{8}, int64_t{2056}, int64_t{5128}, int64_t{17408}})
    for (const int64_t n : {int64_t{1}, int64_t{37}, int64_t{256}}) {
      const int64_t rows = std::uniform_int_distribution<int64_t>(1, cuda::kMaxGemvRows)(rng_);
      const std::vector<uint16_t> a = random_bf16(static_cast<size_t>(rows * k), 1.0f);
      const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n * k), 0.02f);
      for (const bool bf16_out : {true, false})
        check(run(a, w, rows, n, k, bf16_out), n + 1, a, w, rows, n, k, bf16_out);
    }
}

TEST_F(GpuGemv, EveryRowCountMatchesTheReference) {
  constexpr int64_t n = 129, k = 1024;
  const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n * k), 0.02f);
  for (int64_t rows = 1; rows <= cuda::kMaxGemvRows; ++rows) {
    const std::vector<uint16_t> a = random_bf16(static_cast<size_t>(rows * k), 1.0f);
    const DeviceArray<uint16_t> da(a), dw(w);
    const DeviceArray<float> out(static_cast<size_t>(rows * n));
    CUDA_OK(cuda::gemv_nt(bf16_ptr(da), bf16_ptr(dw), out.get(), rows, n, k, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    check(out.download(), n, a, w, rows, n, k, false);
  }
}

TEST_F(GpuGemv, ReadsTheActivationsTheKernelBeforeItWrote) {
  // The activations are the last rows of a large conversion, so the product is scheduled while
  // that kernel still runs; it must still read what the conversion wrote, not the poison before.
  constexpr int64_t rows = 4, n = 4096, k = 5120, big = int64_t{64} << 20;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> tail(static_cast<size_t>(rows * k));
  for (float& x : tail) x = normal(rng_);
  const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n * k), 0.02f);
  const DeviceArray<float> source(static_cast<size_t>(big));
  const DeviceArray<uint16_t> converted(static_cast<size_t>(big)), dw(w);
  const DeviceArray<float> out(static_cast<size_t>(rows * n));
  CUDA_OK(cudaMemset(source.get(), 0, static_cast<size_t>(big) * sizeof(float)));
  CUDA_OK(cudaMemcpy(source.get() + big - rows * k, tail.data(), tail.size() * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto* a = bf16_ptr(converted) + big - rows * k;
  const cudaError_t convert = cuda::convert_f32_to_bf16(source.get(), bf16_ptr(converted), big, stream);
  const cudaError_t product = cuda::gemv_nt(a, bf16_ptr(dw), out.get(), rows, n, k, stream);
  const cudaError_t done = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  CUDA_OK(convert);
  CUDA_OK(product);
  CUDA_OK(done);
  std::vector<uint16_t> a_host(tail.size());
  for (size_t i = 0; i < tail.size(); ++i) a_host[i] = f32_to_bf16(tail[i]);
  check(out.download(), n, a_host, w, rows, n, k, false);
}

TEST_F(GpuGemv, RefusesWhatItCannotTake) {
  const DeviceArray<uint16_t> a(64), w(64);
  const DeviceArray<float> out(64);
  const auto* pa = bf16_ptr(a);
  const auto* pw = bf16_ptr(w);
  EXPECT_TRUE(cuda::gemv_fits(pa, pw, 1, 1, 8));
  for (const int64_t rows : {int64_t{0}, cuda::kMaxGemvRows + 1})
    EXPECT_EQ(cuda::gemv_nt(pa, pw, out.get(), rows, 1, 8, nullptr), cudaErrorInvalidValue) << rows << " rows";
  for (const int64_t k : {int64_t{0}, int64_t{4}, int64_t{12}})
    EXPECT_EQ(cuda::gemv_nt(pa, pw, out.get(), 1, 1, k, nullptr), cudaErrorInvalidValue) << "in " << k;
  EXPECT_EQ(cuda::gemv_nt(pa, pw, out.get(), 1, 0, 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::gemv_nt(pa + 1, pw, out.get(), 1, 1, 8, nullptr), cudaErrorInvalidValue) << "a misaligned";
  EXPECT_EQ(cuda::gemv_nt(pa, pw + 4, out.get(), 1, 1, 8, nullptr), cudaErrorInvalidValue) << "w misaligned";
  EXPECT_EQ(cuda::gemv_nt(pa, pw, static_cast<float*>(nullptr), 1, 1, 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace spin
