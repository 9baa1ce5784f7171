#pragma once
// Softmax over many candidates in two passes, for score kernels whose blocks each take a chunk of
// the candidates (a thread per candidate) for the G query heads of one KV head: pass 1 writes each
// block's (max, sum of exp) per head, pass 2 merges an item's blocks into the normalisers. Used by
// RetroInfer's cluster scores; ShadowKV's chunk scores, whose threads hold tensor-core tiles,
// reduce their warps themselves and use the block half.
#include <cstdint>

namespace spin::cuda {

// Pass 1's block half, called by every thread of the block once each warp w has put its max of
// head g in warp_max[w][g] and its sum of exp(x - that max) in warp_total[w][g] (shared memory):
// thread g < G writes the block's max and sum of exp(x - max) of head g to partial[2 g] and
// partial[2 g + 1] (max -inf and sum 0 when no warp has a value).
template <int G, int Warps>
__device__ __forceinline__ void block_partials_from_warps(const float (&warp_max)[Warps][G],
                                                          const float (&warp_total)[Warps][G], float* partial) {
  __syncthreads();
  if (threadIdx.x < G) {
    float m = -INFINITY, sum = 0.0f;
    for (int w = 0; w < Warps; ++w) m = fmaxf(m, warp_max[w][threadIdx.x]);
    for (int w = 0; w < Warps; ++w)
      if (warp_max[w][threadIdx.x] != -INFINITY) sum += warp_total[w][threadIdx.x] * __expf(warp_max[w][threadIdx.x] - m);
    partial[2 * threadIdx.x] = m;
    partial[2 * threadIdx.x + 1] = sum;
  }
}

// Pass 1, called by every thread of the block: x[g] is the thread's value for head g (-inf for
// none); writes the block's partials as block_partials_from_warps.
template <int G, int Warps>
__device__ __forceinline__ void block_softmax_partials(const float (&x)[G], float* partial) {
  __shared__ float warp_max[Warps][G], warp_total[Warps][G];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float m = x[g];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    float e = m == -INFINITY ? 0.0f : __expf(x[g] - m);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) e += __shfl_xor_sync(0xffffffffu, e, offset);
    if (lane == 0) warp_max[warp][g] = m, warp_total[warp][g] = e;
  }
  block_partials_from_warps<G, Warps>(warp_max, warp_total, partial);
}

// Pass 2, one thread per head: the max and 1 / sum of exp over `blocks` partials of the head,
// block b's at partial[b * stride] (max) and partial[b * stride + 1] (sum). A block with no value
// adds nothing; with none at all the scale is 0.
__device__ __forceinline__ void merge_softmax_partials(const float* partial, int blocks, int64_t stride, float& max,
                                                       float& scale) {
  float m = -INFINITY, sum = 0.0f;
  for (int b = 0; b < blocks; ++b) m = fmaxf(m, partial[b * stride]);
  for (int b = 0; b < blocks; ++b)
    if (partial[b * stride] != -INFINITY) sum += partial[b * stride + 1] * __expf(partial[b * stride] - m);
  max = m;
  scale = sum > 0.0f ? 1.0f / sum : 0.0f;
}

}  // namespace spin::cuda
