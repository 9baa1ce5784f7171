#include "kernels/cuda/seer_gate.h"

#include <algorithm>
#include <climits>

#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/sparse_select.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/per_device.h"

// Index: one warp per run; lane l owns RoPE pairs l and l + 32 (head_dim 128) or l (64), and sums
// each token's pair turned back by the token's position. The cos and sin come from the angle in
// double, as in the model's RoPE kernel, so positions of 100K+ lose nothing to the angle. A lane
// holds whole pairs, so turning a complete block's mean to its centre needs no other lane.
//
// Score: one warp per (item, tile of 1 or kTileBlocks blocks), a tile's key loads in flight
// together; lane l owns head_dim / 32 consecutive dimensions of a block key, one vector load.
// Keeping complete blocks' keys ready in the Index makes a block one 512-byte read (head_dim 128)
// and no sin or cos, where summing its pages' entries and turning them here read block_pages times
// that. Only the block the candidates' end cuts is turned here: with neox pairs (i, i + head_dim /
// 2) the two halves of a pair sit 16 lanes apart, one shuffle away; adjacent pairs sit in one
// lane. Each query head's dot product is a warp all-reduce. The block's score is then written to
// its candidate pages (at most block_pages of them).
//
// Trained Index: one warp per run, the lanes' pairs as in Index; the finished block's pooled
// vector goes through the warp's shared memory, and lane l computes head_dim / 32 consecutive
// dimensions of the compressed key (one row of k_gate per step, a vector load per lane), turned
// as the score's block key. Trained Score: the block key is one vector load per lane; the gate
// query (seer_gate_queries: a block per item, its threads splitting the group's query rows, a
// shared-memory sum) another.
namespace spin::cuda {

namespace {

constexpr int kWarps = 8;       // warps per block of Index and Score
constexpr int kTileBlocks = 4;  // Seer blocks a warp of Score takes at once
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

  // The lane's dimensions x[k] (of dim[k]) turned by position pos, stored to out[dim[k]].
  __device__ void store_turned(const float (&x)[2 * kPairs], double pos, float* out) const {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      double s, c;
      sincos(pos * freq[j], &s, &c);
      const auto cf = static_cast<float>(c), sf = static_cast<float>(s);
      out[dim[j]] = x[j] * cf - x[kPairs + j] * sf;
      out[dim[kPairs + j]] = x[j] * sf + x[kPairs + j] * cf;
    }
  }
};

// The list entries [begin, end) that run r of an Index folds; false when it folds nothing (past
// the runs, an empty run, or a decode row that completes no page).
__device__ bool run_bounds(const SeerIndexParams& p, int64_t r, int& begin, int& end) {
  if (r >= p.num_runs) return false;
  begin = p.run_offsets ? p.run_offsets[r] : static_cast<int>(r);
  end = p.run_offsets ? p.run_offsets[r + 1] : static_cast<int>(r) + 1;
  return begin < end && p.src_pages[begin] >= 0;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) seer_index_kernel(SeerIndexParams p) {
  enter_dependent_grid();
  const int lane = threadIdx.x % 32;
  int begin, end;
  if (!run_bounds(p, static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32, begin, end)) return;  // whole warp
  const int bp = p.block_pages;
  const LanePairs<D> pairs(lane, p.inv_freq, p.neox);
  constexpr int kDims = 2 * LanePairs<D>::kPairs;
  const int* dim = pairs.dim;
  auto* entries = reinterpret_cast<float*>(p.summaries);  // entry e: D floats at e * D
  const bool fresh = p.logical_pages[begin] % bp == 0;
  float sum[kDims];
#pragma unroll
  for (int k = 0; k < kDims; ++k) sum[k] = fresh ? 0.0f : entries[(p.dst_entries[begin] - 1) * int64_t{D} + dim[k]];
  for (int i = begin; i < end; ++i) {
    const int32_t page = p.logical_pages[i];
    pairs.turn_back_page(p.kv_pool + static_cast<int64_t>(p.src_pages[i]) * 2 * p.page_size * D,
                         static_cast<int64_t>(page) * p.page_size, p.page_size, [&](int k, float x) { sum[k] += x; });
    float* out = entries + static_cast<int64_t>(p.dst_entries[i]) * D;
    if (page % bp != bp - 1) {  // the block so far
#pragma unroll
      for (int k = 0; k < kDims; ++k) out[dim[k]] = sum[k];
      continue;
    }
    // The block is complete: its mean, turned to the block's centre.
    const int64_t block_tokens = int64_t{bp} * p.page_size;
    float mean[kDims];
#pragma unroll
    for (int k = 0; k < kDims; ++k) mean[k] = sum[k] / static_cast<float>(block_tokens);
    pairs.store_turned(mean, static_cast<double>((page - (bp - 1)) * int64_t{p.page_size} + block_tokens / 2), out);
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

template <int D, int G, bool kTrained, int kTile>
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
  const int first_block = first / bp;
  for (int b0 = first_block + (static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32) * kTile;
       b0 < end_block; b0 += static_cast<int>(gridDim.x) * kWarps * kTile) {  // uniform per warp
    // The tile's keys first, all loads in flight at once. The trained key sits in the block's first
    // entry; the training-free one in its last, or, for a block the candidates' end cuts, the sum
    // so far in the entry of page p1 - 1.
    float key[kTile][V];
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int blk = b0 + j, p0 = blk * bp, p1 = min(end, p0 + bp);
      const int key_page = kTrained ? p0 : p1 - 1;
#pragma unroll
      for (int e = 0; e < V; ++e) key[j][e] = 0.0f;
      if (blk < end_block && blk != current_block)
        FloatVec<V>::add(summaries + summary_entry(dir[key_page / kSummaryChunkPages], p.num_kv_heads, h, key_page) * D +
                             lane * V,
                         key[j]);
    }
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const int blk = b0 + j, p0 = blk * bp, p1 = min(end, p0 + bp);
      if (blk >= end_block) break;
      float score = INFINITY;  // the block being decoded: always taken
      if (blk != current_block) {
        if (!kTrained && p1 - p0 < bp) {
          const auto count = static_cast<float>((p1 - p0) * p.page_size);
#pragma unroll
          for (int e = 0; e < V; ++e) key[j][e] /= count;
          const double centre = static_cast<double>(static_cast<int64_t>(blk) * block_tokens + block_tokens / 2);
          float rot[V];
          rotate_lane_dims<V>(key[j], centre, p.inv_freq, p.neox, lane, rot);
#pragma unroll
          for (int e = 0; e < V; ++e) key[j][e] = rot[e];
        }
        score = -INFINITY;
#pragma unroll
        for (int g = 0; g < (kTrained ? 1 : G); ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < V; ++e) dot = fmaf(q[g][e], key[j][e], dot);
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(kFull, dot, offset);
          score = fmaxf(score, dot);
        }
      }
      for (int pg = max(first, p0) + lane; pg < p1; pg += 32) out[pg] = score;
    }
  }
}

template <int D, int kTile>
cudaError_t launch_score(const SeerScoreParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int kThreads = kWarps * 32;
  if (p.gate_queries != nullptr) {
    launch(seer_score_kernel<D, 1, true, kTile>, grid, kThreads, 0, stream, p);
  } else {
    with_group(p.group, [&](auto g) {
      launch(seer_score_kernel<D, decltype(g)::value, false, kTile>, grid, kThreads, 0, stream, p);
    });
  }
  return cudaGetLastError();
}

// Unless the caller pins it, a warp takes kTileBlocks blocks once there are enough to give every
// warp the GPU holds at least one anyway, so their loads overlap; with fewer, one block a warp
// spreads them over more warps (session 33 call 2, an H200: Seer's index and scores took 0.39 ms a
// step with one block a warp against 0.57 with four at batch 1, 1.12 against 0.98 at batch 8).
template <int D>
cudaError_t launch_score(const SeerScoreParams& p, int64_t items, cudaStream_t stream) {
  constexpr int kWarpsPerSm = 64;
  // Blocks that can meet max_candidates pages: one more at each end when unaligned.
  const int64_t item_blocks = p.max_candidates / p.block_pages + 2;
  const int tile = p.tile_blocks != 0                                                   ? p.tile_blocks
                   : items * item_blocks >= int64_t{kWarpsPerSm} * multiprocessor_count() ? kTileBlocks
                                                                                          : 1;
  const int64_t tiles = (item_blocks + tile - 1) / tile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((tiles + kWarps - 1) / kWarps, 1024)),
                  static_cast<unsigned>(items));
  return tile == kTileBlocks ? launch_score<D, kTileBlocks>(p, grid, stream) : launch_score<D, 1>(p, grid, stream);
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) seer_trained_index_kernel(SeerTrainedIndexParams p) {
  enter_dependent_grid();
  constexpr int V = D / 32;  // key dimensions per lane
  constexpr int kDims = 2 * LanePairs<D>::kPairs;
  __shared__ float pooled_of[kWarps][3 * D];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int begin, end;
  if (!run_bounds(p, static_cast<int64_t>(blockIdx.x) * kWarps + warp, begin, end)) return;  // whole warp
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

// What both Indexes need of their parameters.
bool valid_index(const SeerIndexParams& p) {
  return p.num_runs >= 0 && (p.head_dim == 64 || p.head_dim == 128) && p.page_size >= 8 && p.page_size <= 64 &&
         p.page_size % 8 == 0 && p.block_pages >= 1 && kSummaryChunkPages % p.block_pages == 0 &&
         (p.num_runs == 0 || (p.kv_pool && p.src_pages && p.dst_entries && p.logical_pages && p.inv_freq &&
                              p.summaries && aligned16(p.summaries)));
}

}  // namespace

cudaError_t seer_index_pages(const SeerIndexParams& p, cudaStream_t stream) {
  if (!valid_index(p)) return cudaErrorInvalidValue;
  if (p.num_runs == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((p.num_runs + kWarps - 1) / kWarps);
  if (p.head_dim == 64)
    launch(seer_index_kernel<64>, blocks, kWarps * 32, 0, stream, p);
  else
    launch(seer_index_kernel<128>, blocks, kWarps * 32, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t seer_trained_index_pages(const SeerTrainedIndexParams& p, cudaStream_t stream) {
  if (!valid_index(p) || p.block_pages < 3 || p.num_kv_heads < 1) return cudaErrorInvalidValue;
  if (p.num_runs == 0) return cudaSuccess;
  if (!p.k_gate || !aligned16(p.k_gate)) return cudaErrorInvalidValue;
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
      (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 1 || p.block_pages < 1 ||
      kSummaryChunkPages % p.block_pages != 0 || p.max_candidates < 0 ||
      (p.tile_blocks != 0 && p.tile_blocks != 1 && p.tile_blocks != kTileBlocks))
    return cudaErrorInvalidValue;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > 65535 || int64_t{p.block_pages} * p.page_size > INT_MAX / 4) return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  const bool trained = p.gate_queries != nullptr;
  if (!p.summaries || !p.summary_dir || !p.dir_offsets || !p.first_candidate || !p.end_candidate || !p.current_page ||
      !p.scores || !aligned16(p.summaries) || (!trained && (!p.q || !p.inv_freq)) ||
      (trained && !aligned16(p.gate_queries)))
    return cudaErrorInvalidValue;
  return p.head_dim == 64 ? launch_score<64>(p, items, stream) : launch_score<128>(p, items, stream);
}

}  // namespace spin::cuda
