#pragma once
// Eight bf16 values in 16 bytes: the unit of the vectorised element-wise and row kernels, with its
// fp32 conversions (round to nearest even, as __float2bfloat16).
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

struct alignas(16) Bf16x8 {
  __nv_bfloat162 pair[4];
};

__device__ __forceinline__ void to_floats(const Bf16x8& u, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(u.pair[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ Bf16x8 to_bf16x8(const float (&v)[8]) {
  Bf16x8 u;
#pragma unroll
  for (int i = 0; i < 4; ++i) u.pair[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return u;
}

inline bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace spin::cuda
