#include "kernels/cuda/sparse_select.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>

#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/per_device.h"

// Index: one warp per page; each lane reads 16-byte vectors of key rows (a row is head_dim / 8
// vectors, so a warp covers 2 or 4 rows at once), keeps their elementwise min and max, and the
// lanes holding the same columns combine theirs by shuffles.
//
// Score: lanes are grouped head_dim / 8 per candidate page, 8 dimensions each, so one page's
// summary row (2 * head_dim bf16) is read by one coalesced 16-byte load per lane for the minimum
// and one for the maximum. The group's queries stay in registers, split by sign: with lo <= hi,
// max(q * hi, q * lo) = max(q, 0) * hi + min(q, 0) * lo exactly (a product of two bf16 is exact in
// fp32), i.e. two FMAs per dimension and head. The per-head partial sums are then reduced across
// the page's lanes by a butterfly that halves the number of heads each lane carries at each step
// (so G heads cost about G shuffles instead of G * log2(lanes)), and the maximum over heads is
// taken with a few more.
//
// Select: one block per item. An exact radix select, 8 bits per pass over order-preserving keys
// of the scores (NaN lowest, -0 equal to +0), finds the k-th key and how many candidates at that
// key to take; a last pass walks the candidates in index order and a block-wide prefix sum of
// (above the key, at the key) gives each chosen candidate its output position, which is
// ascending page order and takes the lowest pages among the ties.
namespace spin::cuda {

namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// ---------------------------------------------------------------------------------------------
// Index

constexpr int kIndexWarps = 4;

__device__ __forceinline__ uint32_t bf16x2_min(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmin2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint4 min8(uint4 a, uint4 b) {
  return {bf16x2_min(a.x, b.x), bf16x2_min(a.y, b.y), bf16x2_min(a.z, b.z), bf16x2_min(a.w, b.w)};
}

__device__ __forceinline__ uint4 max8(uint4 a, uint4 b) {
  return {bf16x2_max(a.x, b.x), bf16x2_max(a.y, b.y), bf16x2_max(a.z, b.z), bf16x2_max(a.w, b.w)};
}

__device__ __forceinline__ uint4 shfl_xor8(uint4 v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.x, offset), __shfl_xor_sync(0xffffffffu, v.y, offset),
          __shfl_xor_sync(0xffffffffu, v.z, offset), __shfl_xor_sync(0xffffffffu, v.w, offset)};
}

template <int D>
__global__ void __launch_bounds__(kIndexWarps * 32) quest_index_kernel(QuestIndexParams p) {
  enter_dependent_grid();
  constexpr int kCols = D / 8;           // 16-byte vectors per key row
  constexpr int kRowLanes = 32 / kCols;  // rows a warp reads side by side (2 or 4 <= page_size)
  const int lane = threadIdx.x % 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kIndexWarps + threadIdx.x / 32;
  if (i >= p.num_pages) return;  // whole warp
  const int32_t src = p.src_pages[i];
  const int32_t dst = p.dst_entries[i];
  if (src < 0 || dst < 0) return;  // whole warp
  const int col = lane % kCols;
  const uint4* keys =
      reinterpret_cast<const uint4*>(p.kv_pool + static_cast<int64_t>(src) * 2 * p.page_size * D) +
      col;
  int row = lane / kCols;
  uint4 lo = __ldg(keys + row * kCols);
  uint4 hi = lo;
#pragma unroll 4
  for (row += kRowLanes; row < p.page_size; row += kRowLanes) {
    const uint4 v = __ldg(keys + row * kCols);
    lo = min8(lo, v);
    hi = max8(hi, v);
  }
#pragma unroll
  for (int offset = kCols; offset < 32; offset <<= 1) {
    lo = min8(lo, shfl_xor8(lo, offset));
    hi = max8(hi, shfl_xor8(hi, offset));
  }
  if (lane < kCols) {
    uint4* out = reinterpret_cast<uint4*>(p.summaries + static_cast<int64_t>(dst) * 2 * D) + lane;
    out[0] = lo;
    out[kCols] = hi;
  }
}

// ---------------------------------------------------------------------------------------------
// Score

constexpr int kScoreThreads = 256;
// Candidates per block (per grid-stride step): the most, up to kMaxScoreTile, that still give the
// launch kScoreBlocksPerSm blocks per SM. At batch 1 a layer's scores are a few MB, and 256-page
// tiles left most SMs idle while each block waited on its loads.
constexpr int kMaxScoreTile = 256;
constexpr int kMinScoreTile = 32;
constexpr int kScoreBlocksPerSm = 2;
constexpr int kMaxGridY = 65535;

__host__ __device__ constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

__device__ __forceinline__ void bf16x8_to_float(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[2 * e] = __uint_as_float(w[e] << 16);
    f[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
  }
}

// The page's Quest bound maximised over the G heads, given this lane's 8 dimensions of the
// summary; every lane of the page's kLanes-lane group must call it (shuffles), and every lane of
// the group gets the result.
template <int kLanes, int G>
__device__ __forceinline__ float page_bound(uint4 lo_bits, uint4 hi_bits, const float (&q_pos)[G][8],
                                            const float (&q_neg)[G][8]) {
  constexpr int kHeads = pow2_at_least(G);  // padded so the butterfly halves evenly
  static_assert(kHeads <= kLanes, "each head's sum must end in its own lanes");
  float lo[8], hi[8];
  bf16x8_to_float(lo_bits, lo);
  bf16x8_to_float(hi_bits, hi);
  float sum[kHeads];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    sum[g] = 0.0f;
    if (g < G) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sum[g] = fmaf(q_pos[g][e], hi[e], sum[g]);
        sum[g] = fmaf(q_neg[g][e], lo[e], sum[g]);
      }
    }
  }
  // Reduce-scatter: at each step a lane keeps half of its heads (the upper half where its lane
  // bit `offset` is set) and adds the partner's partial sums of those; once one head is left,
  // the remaining steps are a plain all-reduce. `head` tracks which head the lane ends with.
  const int lane = threadIdx.x % kLanes;
  int head = 0;
#pragma unroll
  for (int offset = kLanes / 2, carried = kHeads; offset >= 1; offset /= 2) {
    if (carried > 1) {
      const int half = carried / 2;
      const bool upper = (lane & offset) != 0;
#pragma unroll
      for (int j = 0; j < half; ++j) {
        const float send = upper ? sum[j] : sum[j + half];
        const float keep = upper ? sum[j + half] : sum[j];
        sum[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
      }
      if (upper) head += half;
      carried = half;
    } else {
      sum[0] += __shfl_xor_sync(0xffffffffu, sum[0], offset);
    }
  }
  // The heads sit in the lanes that differ in the top log2(kHeads) bits of the group.
  float best = head < G ? sum[0] : -INFINITY;
#pragma unroll
  for (int offset = kLanes / 2; offset >= kLanes / kHeads; offset /= 2)
    best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, offset));
  return best;
}

template <int D, int G>
__global__ void __launch_bounds__(kScoreThreads) quest_score_kernel(QuestScoreParams p, int tile_pages) {
  enter_dependent_grid();
  constexpr int kLanes = D / 8;                   // lanes per page, 8 dimensions each
  constexpr int kSlots = kScoreThreads / kLanes;  // pages side by side in the block
  constexpr int kUnroll = G > 4 ? 2 : 4;          // pages in flight per lane (registers: q is big)
  const int item = blockIdx.x;
  const int seq = item / p.num_kv_heads;
  const int kv_head = item % p.num_kv_heads;
  const int32_t first = p.first_candidate[seq];
  const int32_t count = min(max(p.end_candidate[seq] - first, 0), p.max_candidates);
  if (static_cast<int64_t>(blockIdx.y) * tile_pages >= count) return;  // whole block

  const int lane = threadIdx.x % kLanes;
  const int slot = threadIdx.x / kLanes;
  float q_pos[G][8], q_neg[G][8];
  const __nv_bfloat16* q =
      p.q + (static_cast<int64_t>(seq) * p.num_kv_heads + kv_head) * G * D + lane * 8;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float x[8];
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(q + g * D)), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q_pos[g][e] = fmaxf(x[e], 0.0f);
      q_neg[g][e] = fminf(x[e], 0.0f);
    }
  }
  const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
  const uint4* rows = reinterpret_cast<const uint4*>(p.summaries) + lane;
  float* out = p.scores + static_cast<int64_t>(item) * p.max_candidates;

  for (int64_t tile = static_cast<int64_t>(blockIdx.y) * tile_pages; tile < count;
       tile += static_cast<int64_t>(gridDim.y) * tile_pages) {
    const int tile_end = static_cast<int>(min(tile + tile_pages, static_cast<int64_t>(count)));
    // The trip count is the same for the whole block, so every lane reaches every shuffle.
    for (int base = static_cast<int>(tile); base < tile_end; base += kSlots * kUnroll) {
      uint4 lo[kUnroll], hi[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kSlots + slot;
        lo[u] = hi[u] = make_uint4(0, 0, 0, 0);
        if (j < tile_end) {
          const int32_t page = first + j;
          const int64_t chunk = __ldg(dir + page / kSummaryChunkPages);
          const int64_t entry = summary_entry(chunk, p.num_kv_heads, kv_head, page);
          const uint4* row = rows + entry * (2 * kLanes);
          lo[u] = __ldg(row);
          hi[u] = __ldg(row + kLanes);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kSlots + slot;
        const float score = page_bound<kLanes, G>(lo[u], hi[u], q_pos, q_neg);
        if (j < tile_end && lane == 0) out[j] = score;
      }
    }
  }
}

template <int D>
cudaError_t launch_score(const QuestScoreParams& p, dim3 grid, int tile_pages, cudaStream_t stream) {
  with_group(p.group, [&](auto g) {
    launch(quest_score_kernel<D, decltype(g)::value>, grid, kScoreThreads, 0, stream, p, tile_pages);
  });
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Select

constexpr int kSelectThreads = 512;
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
static_assert(kRadixBins <= kSelectThreads, "one thread per bin in the bin scan");

// a ranks above b <=> rank_key(a) > rank_key(b); NaN is 0, below every number; -0 reads as +0.
__device__ __forceinline__ uint32_t rank_key(float x) {
  if (isnan(x)) return 0;
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct SelectShared {
  union {
    typename cub::BlockScan<uint32_t, kSelectThreads>::TempStorage bins;
    typename cub::BlockScan<uint64_t, kSelectThreads>::TempStorage flags;
  } scan;
  uint32_t histogram[kRadixBins];
  uint32_t prefix;
  uint32_t need;
  uint32_t in_bin;
};

// kHeld > 0: the item's keys sit in registers, kHeld per thread (striped: key j in thread
// j % kSelectThreads), read once: a layer's select at small batches is a chain of block-wide
// passes, and reloading the scores made each one wait on memory. 0 (over 8 keys per thread): each
// pass reads them. 16 keys took 80 registers, one block per SM, and lost at batch 32.
template <int kHeld>
__global__ void __launch_bounds__(kSelectThreads) select_top_kernel(SelectTopParams p) {
  enter_dependent_grid();
  __shared__ SelectShared sh;
  const int item = blockIdx.x;
  const int seq = item / p.num_kv_heads;
  const int32_t first = p.first_candidate[seq];
  const int32_t n = min(max(p.end_candidate[seq] - first, 0), p.max_candidates);
  const int32_t k = min(max(p.counts[item], 0), n);
  if (k == 0) return;  // whole block
  const float* scores = p.scores + static_cast<int64_t>(item) * p.max_candidates;
  int32_t* out = p.out_pages + p.out_offsets[item];
  const int tid = threadIdx.x;
  if (k == n) {
    for (int32_t j = tid; j < n; j += kSelectThreads) out[j] = first + j;
    return;
  }
  uint32_t held[kHeld > 0 ? kHeld : 1];
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int32_t j = tid + i * kSelectThreads;
      held[i] = j < n ? rank_key(__ldg(scores + j)) : 0;
    }
  }
  // f(key) for this thread's candidates j < n, in increasing j.
  const auto for_each_key = [&](auto f) {
    if constexpr (kHeld > 0) {
#pragma unroll
      for (int i = 0; i < kHeld; ++i)
        if (tid + i * kSelectThreads < n) f(held[i]);
    } else {
      for (int32_t j = tid; j < n; j += kSelectThreads) f(rank_key(__ldg(scores + j)));
    }
  };

  // Radix descent: after the pass at `shift`, `prefix` holds the top bits of the k-th largest key
  // (bits under `mask`) and `need` how many of the keys with that prefix still belong to the top k.
  // Once the k-th key's bin is taken whole, the lower bits change nothing and the descent stops.
  uint32_t prefix = 0;
  uint32_t mask = 0;
  uint32_t need = static_cast<uint32_t>(k);
  for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
    for (int b = tid; b < kRadixBins; b += kSelectThreads) sh.histogram[b] = 0;
    __syncthreads();
    for_each_key([&](uint32_t key) {
      if ((key & mask) == prefix) atomicAdd(&sh.histogram[(key >> shift) & (kRadixBins - 1)], 1u);
    });
    __syncthreads();
    // Thread t holds bin kRadixBins - 1 - t, so the exclusive sum counts the keys in higher bins.
    const uint32_t in_bin = tid < kRadixBins ? sh.histogram[kRadixBins - 1 - tid] : 0;
    uint32_t above = 0;
    cub::BlockScan<uint32_t, kSelectThreads>(sh.scan.bins).ExclusiveSum(in_bin, above);
    if (tid < kRadixBins && above < need && need <= above + in_bin) {
      sh.prefix = prefix | (static_cast<uint32_t>(kRadixBins - 1 - tid) << shift);
      sh.need = need - above;
      sh.in_bin = in_bin;
    }
    __syncthreads();
    prefix = sh.prefix;
    need = sh.need;
    mask |= static_cast<uint32_t>(kRadixBins - 1) << shift;
    if (need == sh.in_bin) break;
  }

  // Take every key above `prefix` (under `mask`) and the first `need` keys equal to it, in index
  // order, a tile of kSelectThreads candidates at a time. Returns whether the top k are all out.
  uint32_t done_above = 0;
  uint32_t done_ties = 0;
  const auto take_tile = [&](int32_t j, uint32_t key) {
    key &= mask;
    const bool above = j < n && key > prefix;
    const bool tie = j < n && key == prefix;
    // Packed (above, tie) counts: a tile's tie count never carries into the high word.
    const uint64_t flags = (static_cast<uint64_t>(above) << 32) | static_cast<uint64_t>(tie);
    uint64_t before = 0;
    uint64_t tile_total = 0;
    cub::BlockScan<uint64_t, kSelectThreads>(sh.scan.flags).ExclusiveSum(flags, before, tile_total);
    const uint32_t above_before = done_above + static_cast<uint32_t>(before >> 32);
    const uint32_t ties_before = done_ties + static_cast<uint32_t>(before & 0xffffffffu);
    if (above || (tie && ties_before < need)) out[above_before + min(ties_before, need)] = first + j;
    done_above += static_cast<uint32_t>(tile_total >> 32);
    done_ties += static_cast<uint32_t>(tile_total & 0xffffffffu);
    __syncthreads();  // the scan's storage is reused
    return done_above + min(done_ties, need) == static_cast<uint32_t>(k);  // the same for the block
  };
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      if (i * kSelectThreads < n && take_tile(tid + i * kSelectThreads, held[i])) return;
  } else {
    for (int32_t base = 0; base < n; base += kSelectThreads) {
      const int32_t j = base + tid;
      if (take_tile(j, j < n ? rank_key(__ldg(scores + j)) : 0)) return;
    }
  }
}

}  // namespace

cudaError_t quest_index_pages(const QuestIndexParams& p, cudaStream_t stream) {
  if (p.num_pages < 0 || (p.head_dim != 64 && p.head_dim != 128) || p.page_size < 8 ||
      p.page_size > 64 || p.page_size % 8 != 0)
    return cudaErrorInvalidValue;
  if (p.num_pages == 0) return cudaSuccess;
  if (!p.kv_pool || !p.src_pages || !p.dst_entries || !p.summaries || !aligned16(p.kv_pool) ||
      !aligned16(p.summaries))
    return cudaErrorInvalidValue;
  const int blocks = (p.num_pages + kIndexWarps - 1) / kIndexWarps;
  if (p.head_dim == 64)
    launch(quest_index_kernel<64>, blocks, kIndexWarps * 32, 0, stream, p);
  else
    launch(quest_index_kernel<128>, blocks, kIndexWarps * 32, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t quest_score_pages(const QuestScoreParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || p.group < 1 || p.group > 8 ||
      (p.head_dim != 64 && p.head_dim != 128) || p.max_candidates < 0)
    return cudaErrorInvalidValue;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > INT_MAX) return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  if (!p.q || !p.summaries || !p.summary_dir || !p.dir_offsets || !p.first_candidate ||
      !p.end_candidate || !p.scores || !aligned16(p.q) || !aligned16(p.summaries))
    return cudaErrorInvalidValue;
  const auto tiles = [&](int tile_pages) { return (p.max_candidates + tile_pages - 1) / tile_pages; };
  int tile_pages = kMaxScoreTile;
  while (tile_pages > kMinScoreTile && items * tiles(tile_pages) < kScoreBlocksPerSm * multiprocessor_count())
    tile_pages /= 2;
  const dim3 grid(static_cast<unsigned>(items), std::min(tiles(tile_pages), kMaxGridY));
  return p.head_dim == 64 ? launch_score<64>(p, grid, tile_pages, stream)
                          : launch_score<128>(p, grid, tile_pages, stream);
}

cudaError_t select_top_pages(const SelectTopParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || p.max_candidates < 0) return cudaErrorInvalidValue;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > INT_MAX) return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  if (!p.scores || !p.first_candidate || !p.end_candidate || !p.counts || !p.out_offsets ||
      !p.out_pages)
    return cudaErrorInvalidValue;
  // The widest candidate range decides how many keys each thread holds.
  const int held = pow2_at_least((p.max_candidates + kSelectThreads - 1) / kSelectThreads);
  const auto kernel = held == 1   ? select_top_kernel<1>
                      : held == 2 ? select_top_kernel<2>
                      : held == 4 ? select_top_kernel<4>
                      : held == 8 ? select_top_kernel<8>
                                  : select_top_kernel<0>;
  return launch(kernel, static_cast<unsigned>(items), kSelectThreads, 0, stream, p);
}

}  // namespace spin::cuda
