#include "kernels/cuda/rmsnorm.h"

#include <cub/block/block_reduce.cuh>

namespace spin::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ float to_float(T v);
template <>
__device__ float to_float(float v) { return v; }
template <>
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ T from_float(float v);
template <>
__device__ float from_float(float v) { return v; }
template <>
__device__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }

// One block per row. With a residual, the sum is written back to it first, and the norm reads it.
template <typename T>
__global__ void rmsnorm_kernel(const T* __restrict__ x, T* __restrict__ residual,
                               const T* __restrict__ w, T* __restrict__ y, int64_t n, float eps) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  T* rr = residual ? residual + row * n : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    float v = to_float(xr[i]);
    if (rr) {
      v += to_float(rr[i]);
      rr[i] = from_float<T>(v);
      v = to_float(rr[i]);  // normalise what was stored, as the unfused sequence would
    }
    ss += v * v;
  }
  const float total = Reduce(temp).Sum(ss);
  if (threadIdx.x == 0) scale = rsqrtf(total / static_cast<float>(n) + eps);
  __syncthreads();
  const T* src = rr ? rr : xr;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    y[row * n + i] = from_float<T>(to_float(src[i]) * scale * to_float(w[i]));
  }
}

}  // namespace

cudaError_t rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps,
                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_kernel<float><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, nullptr, w, y, n, eps);
  return cudaGetLastError();
}

cudaError_t rmsnorm_residual_bf16(const __nv_bfloat16* x, __nv_bfloat16* residual,
                                  const __nv_bfloat16* w, __nv_bfloat16* y, int64_t rows,
                                  int64_t n, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rmsnorm_kernel<__nv_bfloat16>
      <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, residual, w, y, n, eps);
  return cudaGetLastError();
}

}  // namespace spin::cuda
