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

// The bf16 rows of the model (n a multiple of 8, 16-byte aligned) in 16-byte vectors: at batch 1
// one block does a whole row, so the fewer, wider loads are what its time is made of.
__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint4 u;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return u;
}

__global__ void rmsnorm_bf16x8_kernel(const uint4* __restrict__ x, uint4* __restrict__ residual,
                                      const uint4* __restrict__ w, uint4* __restrict__ y, int64_t n8, float eps) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  const int64_t row = blockIdx.x;
  const uint4* xr = x + row * n8;
  uint4* rr = residual ? residual + row * n8 : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n8; i += kThreads) {
    float v[8];
    unpack8(xr[i], v);
    if (rr) {
      float r[8];
      unpack8(rr[i], r);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] += r[k];
      const uint4 sum = pack8(v);
      rr[i] = sum;
      unpack8(sum, v);  // normalise what was stored, as the unfused sequence would
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
  }
  const float total = Reduce(temp).Sum(ss);
  if (threadIdx.x == 0) scale = rsqrtf(total / static_cast<float>(n8 * 8) + eps);
  __syncthreads();
  const uint4* src = rr ? rr : xr;
  for (int64_t i = threadIdx.x; i < n8; i += kThreads) {
    float v[8], g[8];
    unpack8(src[i], v);
    unpack8(w[i], g);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = v[k] * scale * g[k];
    y[row * n8 + i] = pack8(v);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

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
  if (n % 8 == 0 && aligned16(x) && (!residual || aligned16(residual)) && aligned16(w) && aligned16(y)) {
    rmsnorm_bf16x8_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(residual), reinterpret_cast<const uint4*>(w),
        reinterpret_cast<uint4*>(y), n / 8, eps);
  } else {
    rmsnorm_kernel<__nv_bfloat16>
        <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, residual, w, y, n, eps);
  }
  return cudaGetLastError();
}

}  // namespace spin::cuda
