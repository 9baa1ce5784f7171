#include "kernels/cuda/seer_gate.h"

#include <algorithm>
#include <climits>

#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/sparse_select.h"

// Index: one warp per page; lane l owns RoPE pairs l and l + 32 (head_dim 128) or l (64), and sums
// each token's pair turned back by the token's position. The cos and sin come from the angle in
// double, as in the model's RoPE kernel, so positions of 100K+ lose nothing to the angle.
//
// Score: one warp per (item, block); lane l owns head_dim / 32 consecutive dimensions of the block
// key, read from each page's entry as one vector load. With neox pairs (i, i + head_dim / 2) the
// two halves of a pair sit 16 lanes apart, one shuffle away; adjacent pairs sit in one lane. Each
// query head's dot product is a warp all-reduce. The block's score is then written to its
// candidate pages (at most block_pages of them).
namespace spin::cuda {

namespace {

constexpr int kWarps = 8;  // warps per block, both kernels
constexpr unsigned kFull = 0xffffffffu;

template <int D>
__global__ void __launch_bounds__(kWarps * 32) seer_index_kernel(SeerIndexParams p) {
  constexpr int kHalf = D / 2;
  constexpr int kPairs = kHalf / 32;  // pairs per lane
  const int lane = threadIdx.x % 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= p.num_pages) return;  // whole warp
  const int32_t src = p.src_pages[i];
  const int32_t dst = p.dst_entries[i];
  if (src < 0 || dst < 0) return;  // whole warp
  const __nv_bfloat16* keys = p.kv_pool + static_cast<int64_t>(src) * 2 * p.page_size * D;
  const int64_t pos0 = static_cast<int64_t>(p.logical_pages[i]) * p.page_size;
  int a[kPairs], b[kPairs];
  double freq[kPairs];
  float sum_a[kPairs], sum_b[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int pair = lane + 32 * j;
    a[j] = p.neox ? pair : 2 * pair;
    b[j] = p.neox ? pair + kHalf : 2 * pair + 1;
    freq[j] = static_cast<double>(p.inv_freq[pair]);
    sum_a[j] = sum_b[j] = 0.0f;
  }
  for (int t = 0; t < p.page_size; ++t) {
    const __nv_bfloat16* row = keys + static_cast<int64_t>(t) * D;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      double s, c;
      sincos(static_cast<double>(pos0 + t) * freq[j], &s, &c);
      const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
      const float k0 = __bfloat162float(row[a[j]]), k1 = __bfloat162float(row[b[j]]);
      // k = R(angle) x, so x = R(-angle) k.
      sum_a[j] += k0 * cf + k1 * sf;
      sum_b[j] += k1 * cf - k0 * sf;
    }
  }
  float* out = reinterpret_cast<float*>(p.summaries + static_cast<int64_t>(dst) * 2 * D);
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    out[a[j]] = sum_a[j];
    out[b[j]] = sum_b[j];
  }
}

template <int V>
struct FloatVec;
template <>
struct FloatVec<4> {
  __device__ static void add(const float* src, float (&dst)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] += v.x;
    dst[1] += v.y;
    dst[2] += v.z;
    dst[3] += v.w;
  }
};
template <>
struct FloatVec<2> {
  __device__ static void add(const float* src, float (&dst)[2]) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    dst[0] += v.x;
    dst[1] += v.y;
  }
};

template <int D, int G>
__global__ void __launch_bounds__(kWarps * 32) seer_score_kernel(SeerScoreParams p) {
  constexpr int V = D / 32;  // dimensions per lane
  const int lane = threadIdx.x % 32;
  const int item = static_cast<int>(blockIdx.y);
  const int seq = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int first = p.first_candidate[seq], end = p.end_candidate[seq];
  if (end <= first) return;  // whole block
  const int bp = p.block_pages;
  const int block_tokens = bp * p.page_size;
  const int end_block = (end + bp - 1) / bp;
  const int current_block = p.current_page[seq] / bp;
  const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
  const auto* summaries = reinterpret_cast<const float*>(p.summaries);
  float q[G][V];
  const __nv_bfloat16* qh = p.q + static_cast<int64_t>(item) * G * D + lane * V;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < V; ++e) q[g][e] = __bfloat162float(qh[g * D + e]);
  float* out = p.scores + static_cast<int64_t>(item) * p.max_candidates - first;
  for (int blk = first / bp + static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
       blk < end_block; blk += static_cast<int>(gridDim.x) * kWarps) {  // uniform per warp
    const int p0 = blk * bp, p1 = min(end, p0 + bp);
    float score = INFINITY;
    if (blk != current_block) {
      float key[V];
#pragma unroll
      for (int e = 0; e < V; ++e) key[e] = 0.0f;
      for (int pg = p0; pg < p1; ++pg) {
        const int64_t entry = summary_entry(dir[pg / kSummaryChunkPages], p.num_kv_heads, h, pg);
        FloatVec<V>::add(summaries + entry * D + lane * V, key);
      }
      const auto count = static_cast<float>((p1 - p0) * p.page_size);
#pragma unroll
      for (int e = 0; e < V; ++e) key[e] /= count;
      const double centre = static_cast<double>(static_cast<int64_t>(blk) * block_tokens + block_tokens / 2);
      float rot[V];
      if (p.neox) {
        const bool upper = lane >= 16;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float other = __shfl_xor_sync(kFull, key[e], 16);
          double s, c;
          sincos(centre * static_cast<double>(p.inv_freq[(lane % 16) * V + e]), &s, &c);
          const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
          // a' = a cos - b sin (lower lanes hold a), b' = a sin + b cos (upper lanes hold b).
          rot[e] = upper ? other * sf + key[e] * cf : key[e] * cf - other * sf;
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; e += 2) {
          double s, c;
          sincos(centre * static_cast<double>(p.inv_freq[(lane * V + e) / 2]), &s, &c);
          const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
          rot[e] = key[e] * cf - key[e + 1] * sf;
          rot[e + 1] = key[e] * sf + key[e + 1] * cf;
        }
      }
      score = -INFINITY;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < V; ++e) dot = fmaf(q[g][e], rot[e], dot);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(kFull, dot, offset);
        score = fmaxf(score, dot);
      }
    }
    for (int pg = max(first, p0) + lane; pg < p1; pg += 32) out[pg] = score;
  }
}

template <int D>
cudaError_t launch_score(const SeerScoreParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kThreads = kWarps * 32;
  with_group(p.group, [&](auto g) { seer_score_kernel<D, decltype(g)::value><<<grid, kThreads, 0, stream>>>(p); });
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

cudaError_t seer_index_pages(const SeerIndexParams& p, cudaStream_t stream) {
  if (p.num_pages < 0 || (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 8 || p.page_size > 64 ||
      p.page_size % 8 != 0)
    return cudaErrorInvalidValue;
  if (p.num_pages == 0) return cudaSuccess;
  if (!p.kv_pool || !p.src_pages || !p.dst_entries || !p.logical_pages || !p.inv_freq || !p.summaries ||
      !aligned16(p.summaries))
    return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((p.num_pages + kWarps - 1) / kWarps);
  if (p.head_dim == 64)
    seer_index_kernel<64><<<blocks, kWarps * 32, 0, stream>>>(p);
  else
    seer_index_kernel<128><<<blocks, kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t seer_score_pages(const SeerScoreParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || p.group < 1 || p.group > 8 ||
      (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 1 || p.block_pages < 1 || p.max_candidates < 0)
    return cudaErrorInvalidValue;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > 65535 || int64_t{p.block_pages} * p.page_size > INT_MAX / 4) return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  if (!p.q || !p.summaries || !p.summary_dir || !p.dir_offsets || !p.first_candidate || !p.end_candidate ||
      !p.current_page || !p.inv_freq || !p.scores || !aligned16(p.summaries))
    return cudaErrorInvalidValue;
  // Blocks that can meet max_candidates pages: one more at each end when unaligned.
  const int64_t blocks = p.max_candidates / p.block_pages + 2;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((blocks + kWarps - 1) / kWarps, 1024)),
                  static_cast<unsigned>(items));
  return p.head_dim == 64 ? launch_score<64>(p, grid, stream) : launch_score<128>(p, grid, stream);
}

}  // namespace spin::cuda
