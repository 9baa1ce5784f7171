#include "kernels/cuda/rmsnorm.h"

#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/launch.cuh"

namespace spin::cuda {

namespace {

constexpr int kThreads = 256;

// How a row is read and written: units of kWidth elements, each converted to and from fp32.
// One element at a time for any row; 8 bf16 in 16 bytes for the model's rows (n a multiple of 8,
// 16-byte aligned), where at batch 1 one block does a whole row and fewer, wider loads are what
// its time is made of.
struct Fp32Io {
  using Unit = float;
  static constexpr int kWidth = 1;
  __device__ static void load(Unit u, float (&v)[1]) { v[0] = u; }
  __device__ static Unit store(const float (&v)[1]) { return v[0]; }
};
struct Bf16Io {
  using Unit = __nv_bfloat16;
  static constexpr int kWidth = 1;
  __device__ static void load(Unit u, float (&v)[1]) { v[0] = __bfloat162float(u); }
  __device__ static Unit store(const float (&v)[1]) { return __float2bfloat16(v[0]); }
};
struct Bf16x8Io {
  using Unit = Bf16x8;
  static constexpr int kWidth = 8;
  __device__ static void load(const Unit& u, float (&v)[8]) { to_floats(u, v); }
  __device__ static Unit store(const float (&v)[8]) { return to_bf16x8(v); }
};

// One block per row of `units` units. With a residual, the sum is written back to it first, and
// the norm reads it.
template <typename Io>
__global__ void rmsnorm_kernel(const typename Io::Unit* __restrict__ x, typename Io::Unit* __restrict__ residual,
                               const typename Io::Unit* __restrict__ w, typename Io::Unit* __restrict__ y,
                               int64_t units, float eps) {
  enter_dependent_grid();
  constexpr int W = Io::kWidth;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float scale;
  const int64_t row = blockIdx.x;
  const typename Io::Unit* xr = x + row * units;
  typename Io::Unit* rr = residual ? residual + row * units : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < units; i += kThreads) {
    float v[W];
    Io::load(xr[i], v);
    if (rr) {
      float r[W];
      Io::load(rr[i], r);
#pragma unroll
      for (int k = 0; k < W; ++k) v[k] += r[k];
      const typename Io::Unit sum = Io::store(v);
      rr[i] = sum;
      Io::load(sum, v);  // normalise what was stored, as the unfused sequence would
    }
#pragma unroll
    for (int k = 0; k < W; ++k) ss += v[k] * v[k];
  }
  const float total = Reduce(temp).Sum(ss);
  if (threadIdx.x == 0) scale = rsqrtf(total / static_cast<float>(units * W) + eps);
  __syncthreads();
  const typename Io::Unit* src = rr ? rr : xr;
  for (int64_t i = threadIdx.x; i < units; i += kThreads) {
    float v[W], g[W];
    Io::load(src[i], v);
    Io::load(w[i], g);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = v[k] * scale * g[k];
    y[row * units + i] = Io::store(v);
  }
}

}  // namespace

cudaError_t rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps,
                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  launch(rmsnorm_kernel<Fp32Io>, static_cast<unsigned>(rows), kThreads, 0, stream, x, nullptr, w, y, n, eps);
  return cudaGetLastError();
}

cudaError_t rmsnorm_residual_bf16(const __nv_bfloat16* x, __nv_bfloat16* residual,
                                  const __nv_bfloat16* w, __nv_bfloat16* y, int64_t rows,
                                  int64_t n, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (n % 8 == 0 && aligned(x, 16) && (!residual || aligned(residual, 16)) && aligned(w, 16) && aligned(y, 16)) {
    launch(rmsnorm_kernel<Bf16x8Io>, static_cast<unsigned>(rows), kThreads, 0, stream,
        reinterpret_cast<const Bf16x8*>(x), reinterpret_cast<Bf16x8*>(residual), reinterpret_cast<const Bf16x8*>(w),
        reinterpret_cast<Bf16x8*>(y), n / 8, eps);
  } else {
    launch(rmsnorm_kernel<Bf16Io>, static_cast<unsigned>(rows), kThreads, 0, stream, x, residual, w, y, n, eps);
  }
  return cudaGetLastError();
}

}  // namespace spin::cuda
