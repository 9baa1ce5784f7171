#include "kernels/cuda/sparse_select.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/per_device.h"

// Index: one warp per page; each lane reads 16-byte vectors of key rows (a row is head_dim / 8
// vectors, so a warp covers 2 or 4 rows at once), keeps their elementwise min and max, and the
// lanes holding the same columns combine theirs by shuffles.
//
// Score: with lo <= hi, max(q * hi, q * lo) = min(q, 0) * lo + max(q, 0) * hi exactly, so a page's
// bound for one query head is the dot product of its summary row [lo | hi] (2 * head_dim bf16, as
// stored) with [min(q, 0) | max(q, 0)] (exact in bf16), and a tile of 16 pages against the group's
// heads is a 16 x 2 head_dim by 2 head_dim x 8 product on the tensor cores (bf16 products are exact
// in the fp32 sums). Each thread loads 16 contiguous bytes of a row per 32 columns as its A
// fragment (the sum does not care about column order), and the query is loaded with the same
// permutation, as in the decode attention. The maximum over heads is taken with two shuffles. The
// per-element form, two FMAs per dimension and head, issued too many instructions to keep up with
// the summaries' bytes (docs/results/gpu.md, session 32).
//
// Select: one block per item. An exact radix select, 8 bits per pass over order-preserving keys
// of the scores (NaN lowest, -0 equal to +0) from the highest bit where they differ down, finds
// the k-th key and how many candidates at that key to take; a block-wide prefix sum of (above the
// key, at the key) over the candidates in index order gives each chosen one its output position,
// which is ascending page order and takes the lowest pages among the ties.
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

constexpr int kScoreWarps = 8;
constexpr int kScoreTile = 16;  // pages per warp product: the MMA's 16 rows
static_assert(kSummaryChunkPages % kScoreTile == 0, "a tile never straddles a summary chunk");
constexpr int kScoreBlocksPerSm = 2;
constexpr int kMaxGridY = 65535;

__host__ __device__ constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// Block y of item i: its warps take the item's 16-page tiles (aligned to 16 in page number, so a
// tile is one contiguous run of a chunk's entries) in turn, over every block of the item.
template <int D>
__global__ void __launch_bounds__(kScoreWarps * 32, kScoreBlocksPerSm) quest_score_kernel(QuestScoreParams p) {
  enter_dependent_grid();
  constexpr int kChunks = 2 * D / 32;  // 32-column slices of the [min | max] row
  const int item = blockIdx.x;
  const int seq = item / p.num_kv_heads;
  const int kv_head = item % p.num_kv_heads;
  const int32_t first = p.first_candidate[seq];
  const int32_t count = min(max(p.end_candidate[seq] - first, 0), p.max_candidates);
  if (count == 0) return;  // whole block
  const int32_t first_tile = first / kScoreTile;
  const int32_t tiles = (first + count + kScoreTile - 1) / kScoreTile - first_tile;
  const int warp = static_cast<int>(blockIdx.y) * kScoreWarps + static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(gridDim.y) * kScoreWarps;
  if (warp >= tiles) return;  // whole warp
  const int lane = threadIdx.x % 32;
  const int r = lane / 4;   // MMA group: page row r (and r + 8), query head r
  const int t4 = lane % 4;  // thread in group: columns t4 * 8 .. + 8 of each 32-column slice

  // B operand: head r's query over the row's columns, min(q, 0) against the minimum and max(q, 0)
  // against the maximum (exact in bf16), in the same column order as the page rows below.
  uint4 qf[kChunks];
  const __nv_bfloat16* q = p.q + ((static_cast<int64_t>(seq) * p.num_kv_heads + kv_head) * p.group + r) * D;
#pragma unroll
  for (int c = 0; c < kChunks / 2; ++c) {
    const uint4 x = r < p.group ? __ldg(reinterpret_cast<const uint4*>(q + c * 32 + t4 * 8)) : make_uint4(0, 0, 0, 0);
    qf[c] = min8(x, make_uint4(0, 0, 0, 0));  // bf16 +0 is all zero bits
    qf[kChunks / 2 + c] = max8(x, make_uint4(0, 0, 0, 0));
  }
  const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
  float* out = p.scores + static_cast<int64_t>(item) * p.max_candidates;

  for (int t = warp; t < tiles; t += warps) {
    const int32_t page0 = (first_tile + t) * kScoreTile;
    const int64_t entry = summary_entry(__ldg(dir + page0 / kSummaryChunkPages), p.num_kv_heads, kv_head, page0);
    // A operand: rows r and r + 8 of the tile, 16 bytes of each 32-column slice per thread.
    const uint4* row0 = reinterpret_cast<const uint4*>(p.summaries + (entry + r) * 2 * D) + t4;
    const uint4* row8 = row0 + 8 * (2 * D / 8);
    uint4 a0[kChunks], a8[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      a0[c] = __ldcs(row0 + c * 4);
      a8[c] = __ldcs(row8 + c * 4);
    }
    // Two chains of accumulation (one per half of each 32-column slice), summed at the end.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float s_hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t lo[4] = {component(a0[c], 0), component(a8[c], 0), component(a0[c], 1), component(a8[c], 1)};
      const uint32_t hi[4] = {component(a0[c], 2), component(a8[c], 2), component(a0[c], 3), component(a8[c], 3)};
      mma_bf16(s, lo, component(qf[c], 0), component(qf[c], 1));
      mma_bf16(s_hi, hi, component(qf[c], 2), component(qf[c], 3));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += s_hi[i];
    // s: pages r and r + 8 against heads 2 t4 and 2 t4 + 1; the bound is the maximum over heads.
    const bool h0 = 2 * t4 < p.group, h1 = 2 * t4 + 1 < p.group;
    float m0 = fmaxf(h0 ? s[0] : -INFINITY, h1 ? s[1] : -INFINITY);
    float m8 = fmaxf(h0 ? s[2] : -INFINITY, h1 ? s[3] : -INFINITY);
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, offset));
      m8 = fmaxf(m8, __shfl_xor_sync(0xffffffffu, m8, offset));
    }
    const int32_t j0 = page0 + r - first, j8 = j0 + 8;
    if (t4 == 0 && j0 >= 0 && j0 < count) out[j0] = m0;
    if (t4 == 1 && j8 >= 0 && j8 < count) out[j8] = m8;
  }
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
  uint32_t warp_max[kSelectThreads / 32];
  uint32_t warp_min[kSelectThreads / 32];
  uint32_t prefix;
  uint32_t need;
  uint32_t in_bin;
};

// kHeld > 0: the item's keys sit in registers, kHeld consecutive candidates per thread
// (j = tid * kHeld + i), read once: a layer's select at small batches is a chain of block-wide
// passes, and reloading the scores made each one wait on memory. Consecutive keys let one
// block-wide scan place every chosen candidate. 0 (over 8 keys per thread): each pass reads them,
// striped (key j in thread j % kSelectThreads), and a scan places a tile of them at a time. 16
// keys took 80 registers, one block per SM, and lost at batch 32.
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
      const int32_t j = tid * kHeld + i;
      held[i] = j < n ? rank_key(__ldg(scores + j)) : 0;
    }
  }
  // f(key) for this thread's candidates j < n, in increasing j.
  const auto for_each_key = [&](auto f) {
    if constexpr (kHeld > 0) {
#pragma unroll
      for (int i = 0; i < kHeld; ++i)
        if (tid * kHeld + i < n) f(held[i]);
    } else {
      for (int32_t j = tid; j < n; j += kSelectThreads) f(rank_key(__ldg(scores + j)));
    }
  };

  // The bits above the highest one where the largest and smallest keys differ are the same in
  // every key: the descent starts below them. Scores of one item tend to share their sign and top
  // exponent bits, and a pass over shared bits counts every key into one bin, each count an
  // atomic on the same word.
  uint32_t key_max = 0, key_min = ~0u;
  for_each_key([&](uint32_t key) {
    key_max = max(key_max, key);
    key_min = min(key_min, key);
  });
  key_max = __reduce_max_sync(0xffffffffu, key_max);
  key_min = __reduce_min_sync(0xffffffffu, key_min);
  if (tid % 32 == 0) {
    sh.warp_max[tid / 32] = key_max;
    sh.warp_min[tid / 32] = key_min;
  }
  if (tid < kRadixBins) sh.histogram[tid] = 0;  // each pass zeroes it again after reading
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kSelectThreads / 32; ++w) {
    key_max = max(key_max, sh.warp_max[w]);
    key_min = min(key_min, sh.warp_min[w]);
  }

  // Radix descent: after the pass at `shift`, `prefix` holds the top bits of the k-th largest key
  // (bits under `mask`) and `need` how many of the keys with that prefix still belong to the top k.
  // A pass counts the 8 bits from `shift` up; the last one starts at bit 0 and may recount bits
  // already under `mask`, which every counted key shares. Once the k-th key's bin is taken whole,
  // the lower bits change nothing and the descent stops.
  const uint32_t differ = key_max ^ key_min;
  const int top = differ == 0 ? -1 : 31 - __clz(differ);  // highest differing bit
  uint32_t mask = top < 0 ? ~0u : ~((2u << top) - 1u);  // every bit when all keys are equal
  uint32_t prefix = key_max & mask;
  uint32_t need = static_cast<uint32_t>(k);
  for (int shift = max(top - (kRadixBits - 1), 0); top >= 0; shift = max(shift - kRadixBits, 0)) {
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
    if (tid < kRadixBins) sh.histogram[kRadixBins - 1 - tid] = 0;  // for the next pass
    __syncthreads();
    prefix = sh.prefix;
    need = sh.need;
    mask |= static_cast<uint32_t>(kRadixBins - 1) << shift;
    if (need == sh.in_bin || shift == 0) break;
  }

  // Take every key above `prefix` (under `mask`) and the first `need` keys equal to it, in index
  // order: a chosen key's output position counts the keys above and the ties taken before it.
  // Its (above, tie) counts are packed in one word: a tie count never carries into the high half.
  const auto chosen_before = [&](uint64_t flags, uint64_t& total) {
    uint64_t before = 0;
    cub::BlockScan<uint64_t, kSelectThreads>(sh.scan.flags).ExclusiveSum(flags, before, total);
    return before;
  };
  if constexpr (kHeld > 0) {
    uint64_t flags = 0;
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const uint32_t key = held[i] & mask;
      if (tid * kHeld + i < n) flags += key > prefix ? uint64_t{1} << 32 : key == prefix ? 1 : 0;
    }
    uint64_t total = 0;
    const uint64_t before = chosen_before(flags, total);
    uint32_t above_before = static_cast<uint32_t>(before >> 32);
    uint32_t ties_before = static_cast<uint32_t>(before & 0xffffffffu);
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int32_t j = tid * kHeld + i;
      const uint32_t key = held[i] & mask;
      if (j >= n) break;
      if (key > prefix) {
        out[above_before + min(ties_before, need)] = first + j;
        ++above_before;
      } else if (key == prefix) {
        if (ties_before < need) out[above_before + ties_before] = first + j;
        ++ties_before;
      }
    }
  } else {
    uint32_t done_above = 0;
    uint32_t done_ties = 0;
    for (int32_t base = 0; base < n; base += kSelectThreads) {
      const int32_t j = base + tid;
      const uint32_t key = j < n ? rank_key(__ldg(scores + j)) & mask : 0;
      const bool above = j < n && key > prefix;
      const bool tie = j < n && key == prefix;
      uint64_t tile_total = 0;
      const uint64_t before = chosen_before((static_cast<uint64_t>(above) << 32) | tie, tile_total);
      const uint32_t above_before = done_above + static_cast<uint32_t>(before >> 32);
      const uint32_t ties_before = done_ties + static_cast<uint32_t>(before & 0xffffffffu);
      if (above || (tie && ties_before < need)) out[above_before + min(ties_before, need)] = first + j;
      done_above += static_cast<uint32_t>(tile_total >> 32);
      done_ties += static_cast<uint32_t>(tile_total & 0xffffffffu);
      if (done_above + min(done_ties, need) == static_cast<uint32_t>(k)) return;  // the same for the block
      __syncthreads();  // the scan's storage is reused
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
  // One wave of kScoreBlocksPerSm blocks per SM shared by the items, but no more warps per item
  // than it has tiles (its first page need not start one: one more).
  const int64_t item_tiles = (p.max_candidates + kScoreTile - 1) / kScoreTile + 1;
  const int64_t slots = int64_t{kScoreBlocksPerSm} * multiprocessor_count();
  const int64_t blocks =
      std::clamp<int64_t>(slots / items, 1, std::min<int64_t>((item_tiles + kScoreWarps - 1) / kScoreWarps, kMaxGridY));
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(blocks));
  if (p.head_dim == 64)
    launch(quest_score_kernel<64>, grid, kScoreWarps * 32, 0, stream, p);
  else
    launch(quest_score_kernel<128>, grid, kScoreWarps * 32, 0, stream, p);
  return cudaGetLastError();
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
