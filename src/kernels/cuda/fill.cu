#include "kernels/cuda/fill.h"

#include <algorithm>

namespace spin::cuda {

namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kBlockStride = 0x632be59bd9b4e019ull;
constexpr int kBlockShift = 16;  // values per independent stream: 2^16, as on the host

__host__ __device__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// splitmix64 adds the golden gamma before mixing, so its k-th output (k from 1) of a stream
// starting at s is mix64(s + k * gamma): any element can be computed on its own.
__global__ void fill_dummy_kernel(__nv_bfloat16* out, int64_t n, uint64_t tensor_seed, float center,
                                  float half_width) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t block = static_cast<uint64_t>(i) >> kBlockShift;
    const uint64_t k = (static_cast<uint64_t>(i) & ((uint64_t{1} << kBlockShift) - 1)) + 1;
    const uint64_t z = mix64(tensor_seed + block * kBlockStride + k * kGolden);
    const float u = __fmul_rn(static_cast<float>(z >> 40), 1.0f / 16777216.0f);
    // Rounded step by step like the host's `center + half_width * (2u - 1)` (no FMA contraction).
    const float value = __fadd_rn(center, __fmul_rn(half_width, __fsub_rn(__fmul_rn(2.0f, u), 1.0f)));
    out[i] = __float2bfloat16_rn(value);
  }
}

}  // namespace

cudaError_t fill_dummy_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, uint64_t tensor_id,
                            float center, float half_width, cudaStream_t stream) {
  if (n < 0 || (n > 0 && out == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const uint64_t tensor_seed = mix64((seed ^ (tensor_id * 0xd1b54a32d192ed03ull)) + kGolden);
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  fill_dummy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, n, tensor_seed, center,
                                                                            half_width);
  return cudaGetLastError();
}

}  // namespace spin::cuda
