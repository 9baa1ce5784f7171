#include "kernels/cuda/seer_gate.h"

#include <algorithm>
#include <climits>

#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/sparse_select.h"
#include "kernels/cuda/launch.cuh"

// Index: one warp per page; lane l owns RoPE pairs l and l + 32 (head_dim 128) or l (64), and sums
// each token's pair turned back by the token's position. The cos and sin come from the angle in
// double, as in the model's RoPE kernel, so positions of 100K+ lose nothing to the angle.
//
// Score: one warp per (item, block); lane l owns head_dim / 32 consecutive dimensions of the block
// key, read from each page's entry as one vector load. With neox pairs (i, i + head_dim / 2) the
// two halves of a pair sit 16 lanes apart, one shuffle away; adjacent pairs sit in one lane. Each
// query head's dot product is a warp all-reduce. The block's score is then written to its
// candidate pages (at most block_pages of them).
//
// Trained Index: one warp per run, the lanes' pairs as in Index; the finished block's pooled
// vector goes through the warp's shared memory, and lane l computes head_dim / 32 consecutive
// dimensions of the compressed key (one row of k_gate per step, a vector load per lane), turned
// as the score's block key. Trained Score: the block key is one vector load per lane; the gate
// query (seer_gate_queries: a block per item, its threads splitting the group's query rows, a
// shared-memory sum) another.
namespace spin::cuda {

namespace {

constexpr int kWarps = 8;  // warps per block, both kernels
constexpr unsigned kFull = 0xffffffffu;

// The RoPE pairs lane `lane` owns: pair lane + 32 j (j < kPairs) is dimensions dim[j] and
// dim[kPairs + j], turned by freq[j] per position.
template <int D>
struct LanePairs {
  static constexpr int kPairs = D / 64;
  int dim[2 * kPairs];
  double freq[kPairs];

  __device__ LanePairs(int lane, const float* inv_freq, bool neox) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int pair = lane + 32 * j;
      dim[j] = neox ? pair : 2 * pair;
      dim[kPairs + j] = neox ? pair + D / 2 : 2 * pair + 1;
      freq[j] = static_cast<double>(inv_freq[pair]);
    }
  }

  // fold(k, x) for each token of the page at `keys` (positions pos0, pos0 + 1, ..) and each of the
  // lane's dimensions dim[k]: x is the stored key turned back to position 0.
  template <typename Fold>
  __device__ void turn_back_page(const __nv_bfloat16* keys, int64_t pos0, int page_size, Fold fold) const {
    for (int t = 0; t < page_size; ++t) {
      const __nv_bfloat16* row = keys + static_cast<int64_t>(t) * D;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        double s, c;
        sincos(static_cast<double>(pos0 + t) * freq[j], &s, &c);
        const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
        const float k0 = __bfloat162float(row[dim[j]]), k1 = __bfloat162float(row[dim[kPairs + j]]);
        // k = R(angle) x, so x = R(-angle) k.
        fold(j, k0 * cf + k1 * sf);
        fold(kPairs + j, k1 * cf - k0 * sf);
      }
    }
  }
};

template <int D>
__global__ void __launch_bounds__(kWarps * 32) seer_index_kernel(SeerIndexParams p) {
  enter_dependent_grid();
  const int lane = threadIdx.x % 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= p.num_pages) return;  // whole warp
  const int32_t src = p.src_pages[i];
  const int32_t dst = p.dst_entries[i];
  if (src < 0 || dst < 0) return;  // whole warp
  const LanePairs<D> pairs(lane, p.inv_freq, p.neox);
  constexpr int kDims = 2 * LanePairs<D>::kPairs;
  float sum[kDims];
#pragma unroll
  for (int k = 0; k < kDims; ++k) sum[k] = 0.0f;
  pairs.turn_back_page(p.kv_pool + static_cast<int64_t>(src) * 2 * p.page_size * D,
                       static_cast<int64_t>(p.logical_pages[i]) * p.page_size, p.page_size,
                       [&](int k, float x) { sum[k] += x; });
  float* out = reinterpret_cast<float*>(p.summaries + static_cast<int64_t>(dst) * 2 * D);
#pragma unroll
  for (int k = 0; k < kDims; ++k) out[pairs.dim[k]] = sum[k];
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

// Turns a head_dim vector, of which lane l holds dimensions l * V .. l * V + V - 1, by pos *
// inv_freq (the angle in double). With neox pairs (i, i + head_dim / 2) the two halves of a pair sit
// 16 lanes apart; adjacent pairs sit in one lane. All 32 lanes take part.
template <int V>
__device__ void rotate_lane_dims(const float (&x)[V], double pos, const float* inv_freq, bool neox, int lane,
                                 float (&out)[V]) {
  if (neox) {
    const bool upper = lane >= 16;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float other = __shfl_xor_sync(kFull, x[e], 16);
      double s, c;
      sincos(pos * static_cast<double>(inv_freq[(lane % 16) * V + e]), &s, &c);
      const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
      // a' = a cos - b sin (lower lanes hold a), b' = a sin + b cos (upper lanes hold b).
      out[e] = upper ? other * sf + x[e] * cf : x[e] * cf - other * sf;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      double s, c;
      sincos(pos * static_cast<double>(inv_freq[(lane * V + e) / 2]), &s, &c);
      const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
      out[e] = x[e] * cf - x[e + 1] * sf;
      out[e + 1] = x[e] * sf + x[e + 1] * cf;
    }
  }
}

// V consecutive bf16 (V = 2 or 4, aligned to V * 2 bytes) as floats.
template <int V>
__device__ void load_bf16(const __nv_bfloat16* src, float (&dst)[V]) {
  if constexpr (V == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    dst[0] = a.x;
    dst[1] = a.y;
    dst[2] = b.x;
    dst[3] = b.y;
  } else {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src));
    dst[0] = a.x;
    dst[1] = a.y;
  }
}

template <int D, int G, bool kTrained>
__global__ void __launch_bounds__(kWarps * 32) seer_score_kernel(SeerScoreParams p) {
  enter_dependent_grid();
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
  float q[kTrained ? 1 : G][V];
  if constexpr (kTrained) {
#pragma unroll
    for (int e = 0; e < V; ++e) q[0][e] = 0.0f;
    FloatVec<V>::add(p.gate_queries + static_cast<int64_t>(item) * D + lane * V, q[0]);
  } else {
    const __nv_bfloat16* qh = p.q + static_cast<int64_t>(item) * G * D + lane * V;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < V; ++e) q[g][e] = __bfloat162float(qh[g * D + e]);
  }
  float* out = p.scores + static_cast<int64_t>(item) * p.max_candidates - first;
  for (int blk = first / bp + static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
       blk < end_block; blk += static_cast<int>(gridDim.x) * kWarps) {  // uniform per warp
    const int p0 = blk * bp, p1 = min(end, p0 + bp);
    float score = INFINITY;
    if (blk == current_block) {
      // The block being decoded: always taken.
    } else if constexpr (kTrained) {
      float key[V];
#pragma unroll
      for (int e = 0; e < V; ++e) key[e] = 0.0f;
      FloatVec<V>::add(summaries + summary_entry(dir[p0 / kSummaryChunkPages], p.num_kv_heads, h, p0) * D + lane * V,
                       key);
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) dot = fmaf(q[0][e], key[e], dot);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(kFull, dot, offset);
      score = dot;
    } else {
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
      rotate_lane_dims<V>(key, centre, p.inv_freq, p.neox, lane, rot);
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
  if (p.gate_queries != nullptr) {
    launch(seer_score_kernel<D, 1, true>, grid, kThreads, 0, stream, p);
  } else {
    with_group(p.group,
               [&](auto g) { launch(seer_score_kernel<D, decltype(g)::value, false>, grid, kThreads, 0, stream, p); });
  }
  return cudaGetLastError();
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) seer_trained_index_kernel(SeerTrainedIndexParams p) {
  enter_dependent_grid();
  constexpr int V = D / 32;  // key dimensions per lane
  constexpr int kDims = 2 * LanePairs<D>::kPairs;
  __shared__ float pooled_of[kWarps][3 * D];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= p.num_runs) return;  // whole warp
  const int begin = p.run_offsets ? p.run_offsets[r] : static_cast<int>(r);
  const int end = p.run_offsets ? p.run_offsets[r + 1] : static_cast<int>(r) + 1;
  if (begin >= end || p.src_pages[begin] < 0) return;  // whole warp
  const int bp = p.block_pages;
  const int32_t first_page = p.logical_pages[begin];
  const int64_t block_entry = p.dst_entries[begin] - first_page % bp;  // the entry of the block's first page
  const int h = static_cast<int>((p.dst_entries[begin] / kSummaryChunkPages) % p.num_kv_heads);
  auto* entries = reinterpret_cast<float*>(p.summaries);  // entry e: D floats at e * D
  const LanePairs<D> pairs(lane, p.inv_freq, p.neox);
  const int* dim = pairs.dim;
  float hi[kDims], lo[kDims], sum[kDims];
  const bool fresh = first_page % bp == 0;
#pragma unroll
  for (int k = 0; k < kDims; ++k) {
    hi[k] = fresh ? -INFINITY : entries[block_entry * D + dim[k]];
    lo[k] = fresh ? INFINITY : entries[(block_entry + 1) * D + dim[k]];
    sum[k] = fresh ? 0.0f : entries[(block_entry + 2) * D + dim[k]];
  }
  for (int i = begin; i < end; ++i) {
    pairs.turn_back_page(p.kv_pool + static_cast<int64_t>(p.src_pages[i]) * 2 * p.page_size * D,
                         static_cast<int64_t>(p.logical_pages[i]) * p.page_size, p.page_size, [&](int k, float x) {
                           hi[k] = fmaxf(hi[k], x);
                           lo[k] = fminf(lo[k], x);
                           sum[k] += x;
                         });
  }
  const int32_t last_page = p.logical_pages[end - 1];
  if (last_page % bp != bp - 1) {  // the block goes on: keep its running pools
#pragma unroll
    for (int k = 0; k < kDims; ++k) {
      entries[block_entry * D + dim[k]] = hi[k];
      entries[(block_entry + 1) * D + dim[k]] = lo[k];
      entries[(block_entry + 2) * D + dim[k]] = sum[k];
    }
    return;
  }
  float* pooled = pooled_of[warp];
  const float count = static_cast<float>(bp * p.page_size);
#pragma unroll
  for (int k = 0; k < kDims; ++k) {
    pooled[dim[k]] = hi[k];
    pooled[D + dim[k]] = lo[k];
    pooled[2 * D + dim[k]] = sum[k] / count;
  }
  __syncwarp();
  float key[V];
#pragma unroll
  for (int e = 0; e < V; ++e) key[e] = 0.0f;
  const __nv_bfloat16* w = p.k_gate + static_cast<int64_t>(h) * 3 * D * D + lane * V;
  for (int i = 0; i < 3 * D; ++i) {
    float row[V];
    load_bf16<V>(w + static_cast<int64_t>(i) * D, row);
    const float x = pooled[i];
#pragma unroll
    for (int e = 0; e < V; ++e) key[e] = fmaf(x, row[e], key[e]);
  }
  float rot[V];
  rotate_lane_dims<V>(key, static_cast<double>(static_cast<int64_t>(last_page - (bp - 1)) * p.page_size), p.inv_freq,
                      p.neox, lane, rot);
#pragma unroll
  for (int e = 0; e < V; ++e) entries[block_entry * D + lane * V + e] = rot[e];
}

constexpr int kQueryThreads = 512;

template <int D>
__global__ void __launch_bounds__(kQueryThreads) seer_gate_query_kernel(SeerGateQueryParams p) {
  enter_dependent_grid();
  constexpr int kParts = kQueryThreads / D;
  __shared__ float q[8 * D];
  __shared__ float partial[kParts][D];
  const int item = static_cast<int>(blockIdx.x), h = item % p.num_kv_heads;
  const int rows = p.group * D;
  for (int i = static_cast<int>(threadIdx.x); i < rows; i += kQueryThreads)
    q[i] = __bfloat162float(p.q[static_cast<int64_t>(item) * rows + i]);
  __syncthreads();
  const int d = static_cast<int>(threadIdx.x) % D, part = static_cast<int>(threadIdx.x) / D;
  const __nv_bfloat16* w = p.q_gate + static_cast<int64_t>(h) * rows * D + d;
  float acc = 0.0f;
  for (int i = part; i < rows; i += kParts) acc = fmaf(q[i], __bfloat162float(w[static_cast<int64_t>(i) * D]), acc);
  partial[part][d] = acc;
  __syncthreads();
  if (part != 0) return;
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < kParts; ++k) total += partial[k][d];
  p.out[static_cast<int64_t>(item) * D + d] = total;
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
    launch(seer_index_kernel<64>, blocks, kWarps * 32, 0, stream, p);
  else
    launch(seer_index_kernel<128>, blocks, kWarps * 32, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t seer_trained_index_pages(const SeerTrainedIndexParams& p, cudaStream_t stream) {
  if (p.num_runs < 0 || (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 8 || p.page_size > 64 ||
      p.page_size % 8 != 0 || p.block_pages < 3 || kSummaryChunkPages % p.block_pages != 0 || p.num_kv_heads < 1)
    return cudaErrorInvalidValue;
  if (p.num_runs == 0) return cudaSuccess;
  if (!p.kv_pool || !p.src_pages || !p.dst_entries || !p.logical_pages || !p.inv_freq || !p.k_gate || !p.summaries ||
      !aligned16(p.summaries) || !aligned16(p.k_gate))
    return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((p.num_runs + kWarps - 1) / kWarps);
  if (p.head_dim == 64)
    launch(seer_trained_index_kernel<64>, blocks, kWarps * 32, 0, stream, p);
  else
    launch(seer_trained_index_kernel<128>, blocks, kWarps * 32, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t seer_gate_queries(const SeerGateQueryParams& p, cudaStream_t stream) {
  if (p.num_items < 0 || p.num_kv_heads < 1 || p.group < 1 || p.group > 8 || (p.head_dim != 64 && p.head_dim != 128))
    return cudaErrorInvalidValue;
  if (p.num_items == 0) return cudaSuccess;
  if (!p.q || !p.q_gate || !p.out) return cudaErrorInvalidValue;
  if (p.head_dim == 64)
    launch(seer_gate_query_kernel<64>, p.num_items, kQueryThreads, 0, stream, p);
  else
    launch(seer_gate_query_kernel<128>, p.num_items, kQueryThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t seer_score_pages(const SeerScoreParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || p.group < 1 || p.group > 8 ||
      (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 1 || p.block_pages < 1 || p.max_candidates < 0)
    return cudaErrorInvalidValue;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > 65535 || int64_t{p.block_pages} * p.page_size > INT_MAX / 4) return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  const bool trained = p.gate_queries != nullptr;
  if (!p.summaries || !p.summary_dir || !p.dir_offsets || !p.first_candidate || !p.end_candidate || !p.current_page ||
      !p.scores || !aligned16(p.summaries) || (!trained && (!p.q || !p.inv_freq)) ||
      (trained && !aligned16(p.gate_queries)))
    return cudaErrorInvalidValue;
  // Blocks that can meet max_candidates pages: one more at each end when unaligned.
  const int64_t blocks = p.max_candidates / p.block_pages + 2;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((blocks + kWarps - 1) / kWarps, 1024)),
                  static_cast<unsigned>(items));
  return p.head_dim == 64 ? launch_score<64>(p, grid, stream) : launch_score<128>(p, grid, stream);
}

}  // namespace spin::cuda
