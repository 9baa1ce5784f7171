#include "kernels/cuda/paged_attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/copy_async.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/per_device.h"

namespace spin::cuda {

namespace {

// A block is kWarps warps; each warp walks tiles of 16 tokens (two 8-token row groups) with
// tensor-core products:
//   S^T[16 tok x 8 q]  = K[16 tok x 16 d] * Q^T[16 d x 8 q]      (mma m16n8k16, per 16 dims)
//   O^T[16 d x 8 q]   += V^T[16 d x 16 tok] * P^T[16 tok x 8 q]   (per 16 output dims)
// Each thread takes 16 contiguous bytes of a K row as its A fragment: the sum over head dims
// does not care about order, so Q is loaded with the same dim permutation as K. V reaches the
// A-operand layout through movmatrix (an in-register 8x8 transpose), as does P.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;
constexpr int kSplitQuantum = kWarps * kTile;  // tokens_per_split is a multiple of this
constexpr int kMaxGroup = 8;
constexpr int kMaxSplits = 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Where the launch picks the splits (tokens_per_split == 0), the blocks of an item and the
// partials they leave follow one policy, measured on the H200 (docs/results/gpu-kernels.md):
// - few items (small batch): one wave of resident blocks (2 per SM at d=128 hide one block's
//   compute between its loads) while blocks still stream >= 1024 tokens, else about one block
//   per SM;
// - many items: about four waves even out blocks that finish at different times, but only while
//   blocks stay long (>= 2048 tokens); shorter lists (sparse budgets) do best with one wave.
// The host applies it to max_tokens to size the grid; each block applies it to its own item's
// length, never going below an even spread over the grid's splits. The engine sizes max_tokens
// by a power-of-two context bucket, and sparse lists are far shorter than the context, so an
// item's own length is what sets how many blocks it should use.
//
// The blocks and the merge work it out before their first load, so the quotients that hold for
// the whole launch come from the host, and the kernels divide in 32 bits (I = uint32_t): 64-bit
// divisions there cost about a microsecond a launch (docs/results/h200/session41/).
template <typename I>
__host__ __device__ constexpr I at_least(I v, I floor) {
  return v > floor ? v : floor;
}
template <typename I>
__host__ __device__ constexpr I ceil_div(I a, I b) {
  return (a + b - 1) / b;
}

struct SplitPolicy {
  int items = 1;       // (request, KV head) items of the launch
  int one_wave = 1;    // splits per item that fill one wave of resident blocks (at least 1)
  int four_waves = 1;  // ... four waves
  int per_sm = 1;      // ... one block per SM

  SplitPolicy() = default;
  SplitPolicy(int sms, int wave, int num_items)
      : items(num_items),
        one_wave(std::max(wave / num_items, 1)),
        four_waves(std::max(4 * wave / num_items, 1)),
        per_sm(std::max(sms / num_items, 1)) {}

  // Tokens per split when `tokens` are cut into `splits`: a multiple of the quantum, and at most
  // kMaxSplits splits.
  template <typename I>
  __host__ __device__ I per_split(I tokens, I splits) const {
    const I tps = at_least(ceil_div(tokens, splits), ceil_div(tokens, static_cast<I>(kMaxSplits)));
    return at_least(ceil_div(tps, static_cast<I>(kSplitQuantum)), I{1}) * kSplitQuantum;
  }
  template <typename I>
  __host__ __device__ I split_tokens(I tokens) const {
    if (items < 32) {
      const I full = per_split(tokens, static_cast<I>(one_wave));
      return full >= 1024 ? full : per_split(tokens, static_cast<I>(per_sm));
    }
    return per_split(tokens, static_cast<I>(tokens / static_cast<I>(four_waves) < 2048 ? one_wave : four_waves));
  }
  // Tokens per block of an item with n_tok tokens under a grid of num_splits: the policy for the
  // item's own length, but no fewer than an even spread (so it never needs more splits).
  template <typename I>
  __host__ __device__ I item_split_tokens(I n_tok, I num_splits) const {
    return at_least(split_tokens(n_tok), per_split(n_tok, num_splits));
  }
};

// Splits with tokens for an item of n_tok tokens at tps tokens per split (at least one: an empty
// item's first block writes its zeros), at most the grid's: a list longer than max_tokens (a
// caller's error) must not read past the workspace. int in the kernels, int64_t on the host.
template <typename I>
__host__ __device__ inline I splits_used(I n_tok, I tps, I num_splits) {
  return min(num_splits, at_least(ceil_div(n_tok, tps), I{1}));
}

// Tokens per block of an item with n_tok tokens (a negative count reads as none): the caller's
// fixed size, else the policy's.
__device__ __forceinline__ int split_tokens(int n_tok, int fixed, int num_splits, const SplitPolicy& policy) {
  return fixed > 0 ? fixed
                   : static_cast<int>(policy.item_split_tokens(static_cast<uint32_t>(max(n_tok, 0)),
                                                               static_cast<uint32_t>(num_splits)));
}

// Natural-log log-sum-exp from the kernel's log2-domain state: running max m (0 when every score
// was -inf) and the sum of exp2(score - m); -inf when nothing was summed (an item with 0 tokens).
__device__ __forceinline__ float natural_lse(float m, float sum) {
  return sum > 0.0f ? (m + log2f(sum)) * kLn2 : -INFINITY;
}

// Loads run through a ring of kStages tiles (8 KB each at d=128) per warp in shared memory,
// filled by cp.async; shared memory bounds the bytes in flight (2 blocks of 4 warps per SM at
// d=128). Paths 0/1 copy each thread's own fragment pieces (no barrier; kStages - 1 tiles in
// flight); path 2 copies whole lines per warp instruction (__syncwarp; all kStages in flight).
template <int D>
constexpr int kStages = D == 128 ? 3 : 4;
template <int D>
constexpr int kChunks = D / 8;  // 16-byte pieces per thread per tile (K and V, two token rows)
template <int D>
constexpr size_t kSmemBytes = static_cast<size_t>(kWarps) * kStages<D> * kChunks<D> * 32 * 16;

// copy_async with the hint that L2 fetch the 256 bytes around it.
__device__ __forceinline__ void copy_async_l2_256(uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(smem_addr),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }

// Registers of one 16-token tile for one thread: row group rr (tokens r and r+8), 32-dim chunk c,
// 8 consecutive dims c*32 + t4*8 .. +8.
template <int D>
struct Tile {
  uint4 k[2][D / 32];
  uint4 v[2][D / 32];
};

// Output dim held by O^T fragment row m (0..15) of 32-dim chunk c and pair jp (see the kernel).
__device__ __forceinline__ int out_dim(int c, int jp, int m) {
  const int mm = m & 7;
  return c * 32 + (mm >> 1) * 8 + 4 * jp + ((m >> 3) << 1) + (mm & 1);
}

// How tiles reach shared memory.
enum class Copy {
  kThread16 = 0,    // cp.async, each thread its own 16-byte fragment pieces
  kThread16L2 = 1,  // the same with a 256-byte L2 prefetch hint
  kWarp512 = 2,     // cp.async with the warp's 32 lanes on 512 contiguous bytes (whole 128-byte
                    // lines per instruction), swizzled in shared memory, no L2 prefetch hint (it
                    // cost 4-6% of the bandwidth at batch 8-32 here)
};

// The load path used unless PagedDecodeParams::load_path says otherwise.
constexpr Copy kDefaultCopy = Copy::kWarp512;

// First element of page `id`: in the device pool, or (id < 0) page ~id of the host pool.
__device__ __forceinline__ const __nv_bfloat16* page_start(const PagedDecodeParams& p, int id, size_t page_elems) {
  return id >= 0 ? p.kv_pool + static_cast<size_t>(id) * page_elems
                 : p.host_pool + static_cast<size_t>(~id) * page_elems;
}

template <int D, typename OutT, Copy kCopy>
__global__ void __launch_bounds__(kThreads)
    paged_decode_kernel(PagedDecodeParams p, int fixed_split, int num_splits, SplitPolicy policy, OutT* out,
                        float* ws_out, float2* ws_ml) {
  wait_for_prior_grids();
  const int item = blockIdx.x;
  const int split = blockIdx.y;
  const int n_tok = p.num_tokens[item];
  const int tokens_per_split = split_tokens(n_tok, fixed_split, num_splits, policy);
  const int t_begin = split * tokens_per_split;
  if (split > 0 && t_begin >= n_tok) return;  // the merge counts only splits with tokens
  const int t_end = min(n_tok, t_begin + tokens_per_split);

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int r = lane >> 2;  // mma group id: token row, query column or dim row
  const int t4 = lane & 3;  // thread in group
  const int ps = p.page_size;
  const size_t page_elems = static_cast<size_t>(2) * ps * D;
  const int32_t* ids = p.page_ids + p.list_offsets[item];
  const int seq = item / p.num_kv_heads;
  const int kv_head = item - seq * p.num_kv_heads;
  const int num_q_heads = p.num_kv_heads * p.group;
  const __nv_bfloat16* q_base =
      p.q + (static_cast<size_t>(seq) * num_q_heads + static_cast<size_t>(kv_head) * p.group) * D;

  // Q^T as the B operand: query r, dims c*32 + t4*8 .. +8 (same permutation as K).
  uint4 qf[D / 32];
#pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    qf[c] = r < p.group ? *reinterpret_cast<const uint4*>(q_base + r * D + c * 32 + t4 * 8)
                        : make_uint4(0, 0, 0, 0);
  }

  extern __shared__ __align__(16) uint4 ring[];  // [warp][stage][chunk][lane]
  uint4* my_ring = ring + static_cast<size_t>(warp) * kStages<D> * kChunks<D> * 32 + lane;
  const uint32_t my_ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(my_ring));
  // Physical pages of the tile's token rows r and r+8, fetched one iteration before the copy
  // that needs them, so the page-table read is off each warp's critical path.
  auto fetch_pages = [&](int tb) {
    int2 pg = make_int2(0, 0);
    if (tb + r < t_end) pg.x = ids[(tb + r) / ps];
    if (tb + r + 8 < t_end) pg.y = ids[(tb + r + 8) / ps];
    return pg;
  };
  // Chunk order in the ring: (rr, c, K/V) -> (rr * D/32 + c) * 2 + kv.
  auto issue = [&](int tb, int stage, int2 pg) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int tok = tb + r + rr * 8;
      const bool valid = tok < t_end;
      const __nv_bfloat16* kp = p.kv_pool;
      if (valid) {
        const int slot = tok % ps;
        kp = page_start(p, rr == 0 ? pg.x : pg.y, page_elems) + slot * D + t4 * 8;
      }
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        const int j = (rr * (D / 32) + c) * 2;
        const uint32_t dst = my_ring_addr + ((stage * kChunks<D> + j) * 32) * 16;
        if constexpr (kCopy == Copy::kThread16L2) {
          copy_async_l2_256(dst, kp + (valid ? c * 32 : 0), valid ? 16 : 0);
          copy_async_l2_256(dst + 32 * 16, kp + (valid ? ps * D + c * 32 : 0), valid ? 16 : 0);
        } else {
          copy_async(dst, kp + (valid ? c * 32 : 0), valid ? 16 : 0);
          copy_async(dst + 32 * 16, kp + (valid ? ps * D + c * 32 : 0), valid ? 16 : 0);
        }
      }
    }
  };
  // Warp-coalesced layout of a stage: parts [K rows 0-7][K rows 8-15][V rows 0-7][V rows 8-15],
  // each 8 x D bf16 and contiguous in the pool (8-token groups never straddle a page, since
  // page_size is a multiple of 8). Lane l copies bytes l*16.. of each 512-byte block. The 16-byte
  // chunk index within a row is XORed with 4 on odd rows, so the fragment reads (8 rows x 4
  // lanes at a 2*D-byte row stride) spread over all banks.
  const uint4* warp_ring = ring + static_cast<size_t>(warp) * kStages<D> * kChunks<D> * 32;
  const uint32_t warp_ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(warp_ring));
  constexpr int kPart = 8 * D * 2;  // bytes of one 8-row part
  auto swizzled = [](int row, int chunk) { return row * (2 * D) + ((chunk ^ ((row & 1) << 2)) << 4); };
  auto fetch_groups = [&](int tb) {  // pages of the tile's two 8-token groups (same in all lanes)
    int2 pg = make_int2(0, 0);
    if (tb < t_end) pg.x = ids[tb / ps];
    if (tb + 8 < t_end) pg.y = ids[(tb + 8) / ps];
    return pg;
  };
  auto issue_warp = [&](int tb, int stage, int2 pg) {
    const uint32_t base = warp_ring_addr + stage * 4 * kPart;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int group_first = tb + rr * 8;
      const __nv_bfloat16* src = p.kv_pool;
      if (group_first < t_end)
        src = page_start(p, rr == 0 ? pg.x : pg.y, page_elems) + (group_first % ps) * D;
#pragma unroll
      for (int blk = 0; blk < kPart / 512; ++blk) {
        const int off = blk * 512 + lane * 16;  // byte offset inside the part
        const int row = off / (2 * D);
        const bool valid = group_first + row < t_end;
        const uint32_t dst = base + rr * kPart + swizzled(row, (off % (2 * D)) >> 4);
        copy_async(dst, src + (valid ? off / 2 : 0), valid ? 16 : 0);
        copy_async(dst + 2 * kPart, src + (valid ? ps * D + off / 2 : 0), valid ? 16 : 0);
      }
    }
  };
  auto read_warp = [&](Tile<D>& t, int stage) {
    const char* base = reinterpret_cast<const char*>(warp_ring) + stage * 4 * kPart;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        const int at = swizzled(r, c * 4 + t4);
        t.k[rr][c] = *reinterpret_cast<const uint4*>(base + rr * kPart + at);
        t.v[rr][c] = *reinterpret_cast<const uint4*>(base + (2 + rr) * kPart + at);
      }
  };
  // The tile's rows from host pages that have a fill page: written back out of the stage (still
  // swizzled in shared memory) to the device page, so this read is the page's only trip over the
  // link. Both 8-token groups of a tile come from one or two pages, each wholly host or device.
  const int32_t* fills = p.fill_pages ? p.fill_pages + p.list_offsets[item] : nullptr;
  auto fill_warp = [&](int tb, int stage) {
    const char* base = reinterpret_cast<const char*>(warp_ring) + stage * 4 * kPart;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int group_first = tb + rr * 8;
      if (group_first >= t_end) continue;
      const int j = group_first / ps;
      if (ids[j] >= 0) continue;
      const int dst_page = fills[j];
      if (dst_page < 0) continue;
      __nv_bfloat16* dst = p.fill_pool + static_cast<size_t>(dst_page) * page_elems + (group_first % ps) * D;
#pragma unroll
      for (int blk = 0; blk < kPart / 512; ++blk) {
        const int off = blk * 512 + lane * 16;
        if (group_first + off / (2 * D) >= t_end) continue;
        const int at = rr * kPart + swizzled(off / (2 * D), (off % (2 * D)) >> 4);
        *reinterpret_cast<uint4*>(dst + off / 2) = *reinterpret_cast<const uint4*>(base + at);
        *reinterpret_cast<uint4*>(dst + ps * D + off / 2) = *reinterpret_cast<const uint4*>(base + 2 * kPart + at);
      }
    }
  };
  auto read = [&](Tile<D>& t, int stage) {
    const uint4* src = my_ring + stage * kChunks<D> * 32;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        const int j = (rr * (D / 32) + c) * 2;
        t.k[rr][c] = src[j * 32];
        t.v[rr][c] = src[(j + 1) * 32];
      }
  };

  const float scale_log2 = p.scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY};  // per query column t4*2+e, log2 domain
  float l_run[2] = {0.0f, 0.0f};            // this thread's partial sums
  float o[D / 32][2][4];                    // O^T fragments: chunk c, pair jp
#pragma unroll
  for (int c = 0; c < D / 32; ++c)
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[c][jp][i] = 0.0f;

  // consumed() runs once every register of the tile has been read by an instruction (V by its
  // transposes, K by the score products): the stage it came from may then be overwritten.
  auto compute = [&](const Tile<D>& t, int tb, auto consumed) {
    uint32_t vt[D / 32][2][4];  // V^T A-operand fragments
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        vt[c][jp][0] = transpose8x8(component(t.v[0][c], 2 * jp));
        vt[c][jp][1] = transpose8x8(component(t.v[0][c], 2 * jp + 1));
        vt[c][jp][2] = transpose8x8(component(t.v[1][c], 2 * jp));
        vt[c][jp][3] = transpose8x8(component(t.v[1][c], 2 * jp + 1));
      }
    // Two chains of accumulation (one per half of each 32-dim chunk), summed at the end: a warp
    // works through its tiles one after another, so each product's latency is on its path.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float s_hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      mma_bf16(s, component(t.k[0][c], 0), component(t.k[1][c], 0), component(t.k[0][c], 1),
               component(t.k[1][c], 1), component(qf[c], 0), component(qf[c], 1));
      mma_bf16(s_hi, component(t.k[0][c], 2), component(t.k[1][c], 2), component(t.k[0][c], 3),
               component(t.k[1][c], 3), component(qf[c], 2), component(qf[c], 3));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += s_hi[i];
    consumed();
    // s[e]: token tb+r, query t4*2+e; s[2+e]: token tb+r+8.
    const bool valid0 = tb + r < t_end;
    const bool valid1 = tb + r + 8 < t_end;
    float pr[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float s0 = valid0 ? s[e] * scale_log2 : -INFINITY;
      const float s1 = valid1 ? s[2 + e] * scale_log2 : -INFINITY;
      float mx = fmaxf(s0, s1);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run[e], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m_run[e] - m_use);
      pr[e] = exp2f(s0 - m_use);
      pr[2 + e] = exp2f(s1 - m_use);
      l_run[e] = l_run[e] * alpha + pr[e] + pr[2 + e];
      m_run[e] = m_new;
#pragma unroll
      for (int c = 0; c < D / 32; ++c)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          o[c][jp][e] *= alpha;
          o[c][jp][2 + e] *= alpha;
        }
    }
    // P^T as the B operand: tokens (lane%4)*2.. (+8), query lane/4.
    const uint32_t b0 = transpose8x8(pack_bf16(pr[0], pr[1]));
    const uint32_t b1 = transpose8x8(pack_bf16(pr[2], pr[3]));
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
        mma_bf16(o[c][jp], vt[c][jp][0], vt[c][jp][1], vt[c][jp][2], vt[c][jp][3], b0, b1);
  };

  constexpr int stride = kWarps * kTile;
  constexpr int stages = kStages<D>;
  const int first = t_begin + warp * kTile;
  if constexpr (kCopy == Copy::kWarp512) {
    // All kStages tiles in flight: a stage is refilled as soon as its tile is consumed.
#pragma unroll
    for (int st = 0; st < stages; ++st) {
      if (first + st * stride < t_end) issue_warp(first + st * stride, st, fetch_groups(first + st * stride));
      copy_async_commit();
    }
    int2 pending = fetch_groups(first + stages * stride);
    int stage = 0;
    for (int tb = first; tb < t_end; tb += stride) {
      copy_async_wait<stages - 1>();  // this lane's part of the tile at tb has landed
      __syncwarp();                   // and every other lane's part
      Tile<D> cur;
      read_warp(cur, stage);
      if (fills) fill_warp(tb, stage);
      compute(cur, tb, [&] {
        __syncwarp();  // every lane is done reading this stage
        const int ahead = tb + stages * stride;
        if (ahead < t_end) issue_warp(ahead, stage, pending);
        copy_async_commit();
        pending = fetch_groups(ahead + stride);
      });
      stage = stage == stages - 1 ? 0 : stage + 1;
    }
    copy_async_wait<0>();
    __syncwarp();
  } else {
#pragma unroll
  for (int st = 0; st < stages - 1; ++st) {
    if (first + st * stride < t_end) issue(first + st * stride, st, fetch_pages(first + st * stride));
    copy_async_commit();
  }
  int2 pending = fetch_pages(first + (stages - 1) * stride);
  int stage = 0;
  for (int tb = first; tb < t_end; tb += stride) {
    copy_async_wait<stages - 2>();  // this warp's tile at tb has landed
    Tile<D> cur;
    read(cur, stage);
    // Refill the stage read one iteration ago (its values were consumed by that compute).
    const int ahead = tb + (stages - 1) * stride;
    if (ahead < t_end) issue(ahead, stage == 0 ? stages - 1 : stage - 1, pending);
    copy_async_commit();
    pending = fetch_pages(ahead + stride);
    compute(cur, tb, [] {});
    stage = stage == stages - 1 ? 0 : stage + 1;
  }
  copy_async_wait<0>();

  }

  // The merge grid may be scheduled now; it waits for this grid's completion before reading.
  allow_next_grid();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
  }

  // Combine the warps' states in shared memory.
  __shared__ float sm_m[kWarps][kMaxGroup];
  __shared__ float sm_l[kWarps][kMaxGroup];
  // The per-warp outputs reuse the ring: each warp writes only its own part, after its loop.
  static_assert(kMaxGroup * D * sizeof(float) <= kStages<D> * kChunks<D> * 32 * 16);
  auto sm_o = [&](int w, int qi) {
    return reinterpret_cast<float*>(ring + static_cast<size_t>(w) * kStages<D> * kChunks<D> * 32) +
           qi * D;
  };
  if (r == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      sm_m[warp][t4 * 2 + e] = m_run[e];
      sm_l[warp][t4 * 2 + e] = l_run[e];
    }
  }
#pragma unroll
  for (int c = 0; c < D / 32; ++c)
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = r + (i >> 1) * 8;
        sm_o(warp, t4 * 2 + (i & 1))[out_dim(c, jp, m)] = o[c][jp][i];
      }
  __syncthreads();

  const int group = p.group;
  for (int idx = threadIdx.x; idx < group * D; idx += kThreads) {
    const int qi = idx / D;
    const int d = idx - qi * D;
    float m_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_max = fmaxf(m_max, sm_m[w][qi]);
    const float m_use = m_max == -INFINITY ? 0.0f : m_max;
    float acc = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(sm_m[w][qi] - m_use);
      acc += wt * sm_o(w, qi)[d];
      sum += wt * sm_l[w][qi];
    }
    if (num_splits == 1) {
      const size_t row = static_cast<size_t>(seq) * num_q_heads + kv_head * group + qi;
      out[row * D + d] = from_float<OutT>(sum > 0.0f ? acc / sum : 0.0f);
      if (p.lse != nullptr && d == 0) p.lse[row] = natural_lse(m_use, sum);  // one thread per row
    } else {
      const size_t slot = (static_cast<size_t>(item) * num_splits + split) * group + qi;
      ws_out[slot * D + d] = acc;
      if (d == 0) ws_ml[slot] = make_float2(m_max, sum);
    }
  }
}

// One block of D threads per (item, query head): each thread sums its output dim over the
// splits, weighted by exp2(m_split - m_max) / sum, which warp 0 computes into shared memory. The
// partials were just written by the main grid, which may still be finishing when this one starts
// (programmatic launch), so they are read through L2 (ld.global.cg), never the read-only path.
// The merge is bound by load latency: each thread loads its first kMergeInline partials before the
// weights are known, in one round with warp 0's loads.
constexpr int kMergeInline = 32;

template <int D, typename OutT>
__global__ void __launch_bounds__(D)
    paged_decode_merge_kernel(PagedDecodeParams p, int fixed_split, int num_splits, SplitPolicy policy,
                              OutT* out, const float* ws_out, const float2* ws_ml) {
  extern __shared__ float weights[];  // [num_splits]
  enter_dependent_grid();  // the partials of the main kernel are complete
  const int item = blockIdx.x;
  const int qi = blockIdx.y;
  const int n_tok = p.num_tokens[item];
  const int tokens_per_split = split_tokens(n_tok, fixed_split, num_splits, policy);
  const int used = splits_used(n_tok, tokens_per_split, num_splits);
  const int group = p.group;
  const int seq = item / p.num_kv_heads;
  const int kv_head = item - seq * p.num_kv_heads;
  const size_t row = static_cast<size_t>(seq) * p.num_kv_heads * group + kv_head * group + qi;
  const size_t first_slot = static_cast<size_t>(item) * num_splits * group + qi;  // split 0's
  const float* src = ws_out + first_slot * D + threadIdx.x;
  const size_t stride = static_cast<size_t>(group) * D;  // from one split's partial to the next
  float v[kMergeInline];
#pragma unroll
  for (int k = 0; k < kMergeInline; ++k) v[k] = k < used ? __ldcg(src + k * stride) : 0.0f;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float m_max = -INFINITY;
    for (int s = lane; s < used; s += 32) m_max = fmaxf(m_max, __ldcg(&ws_ml[first_slot + s * group]).x);
    for (int off = 16; off > 0; off >>= 1) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, off));
    const float m_use = m_max == -INFINITY ? 0.0f : m_max;
    float sum = 0.0f;
    for (int s = lane; s < used; s += 32) {
      const float2 ml = __ldcg(&ws_ml[first_slot + s * group]);
      const float wt = exp2f(ml.x - m_use);
      weights[s] = wt;
      sum += wt * ml.y;
    }
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (p.lse != nullptr && lane == 0) p.lse[row] = natural_lse(m_use, sum);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int s = lane; s < used; s += 32) weights[s] *= inv;
  }
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < kMergeInline; ++k)
    if (k < used) acc += weights[k] * v[k];
  for (int s = kMergeInline; s < used; ++s) acc += weights[s] * __ldcg(src + s * stride);
  out[row * D + threadIdx.x] = from_float<OutT>(acc);
}

bool valid_shape(const PagedDecodeParams& p) {
  return p.num_seqs >= 0 && p.num_kv_heads > 0 && p.group >= 1 && p.group <= kMaxGroup &&
         (p.head_dim == 64 || p.head_dim == 128) && p.page_size >= 8 && p.page_size <= 64 &&
         p.page_size % 8 == 0 && p.max_tokens >= 0 && p.tokens_per_split >= 0 &&
         p.tokens_per_split % kSplitQuantum == 0 && p.load_path >= -1 && p.load_path <= 2 &&
         static_cast<int64_t>(p.num_seqs) * p.num_kv_heads <= INT32_MAX &&
         (p.fill_pages == nullptr ||
          (p.fill_pool != nullptr && reinterpret_cast<uintptr_t>(p.fill_pool) % 16 == 0 &&
           (p.load_path < 0 ? kDefaultCopy : static_cast<Copy>(p.load_path)) == Copy::kWarp512));
}

// Lets one instantiation use kSmemBytes<D> of dynamic shared memory.
template <int D, typename OutT, Copy kCopy>
bool allow_smem() {
  return cudaFuncSetAttribute(paged_decode_kernel<D, OutT, kCopy>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(kSmemBytes<D>)) == cudaSuccess;
}

// Blocks of the kernel for head dim D that fit on one SM (shared memory bounds it); also lets
// every variant use that much dynamic shared memory. Computed once per head dim and device.
template <int D>
int blocks_per_sm() {
  return per_device<int>([] {
    int n = 0;
    const bool ok = allow_smem<D, float, Copy::kThread16>() &&
                    allow_smem<D, float, Copy::kThread16L2>() && allow_smem<D, float, Copy::kWarp512>() &&
                    allow_smem<D, __nv_bfloat16, Copy::kThread16>() &&
                    allow_smem<D, __nv_bfloat16, Copy::kThread16L2>() &&
                    allow_smem<D, __nv_bfloat16, Copy::kWarp512>();
    if (!ok || cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                   &n, paged_decode_kernel<D, float, Copy::kThread16>, kThreads, kSmemBytes<D>) !=
                   cudaSuccess)
      n = 0;
    return n;
  });
}

Copy load_path(const PagedDecodeParams& p) {
  return p.load_path >= 0 ? static_cast<Copy>(p.load_path) : kDefaultCopy;
}

SplitPolicy split_policy(const PagedDecodeParams& p) {
  const int sms = multiprocessor_count();
  const int wave = sms * std::max(1, p.head_dim == 64 ? blocks_per_sm<64>() : blocks_per_sm<128>());
  const int64_t items = std::max<int64_t>(1, static_cast<int64_t>(p.num_seqs) * p.num_kv_heads);
  return SplitPolicy(sms, wave, static_cast<int>(items));
}

// Splits per item of the grid: max_tokens at the caller's split size, else at the policy's.
int grid_splits(const PagedDecodeParams& p, const SplitPolicy& policy) {
  const int64_t tps = p.tokens_per_split > 0 ? p.tokens_per_split : policy.split_tokens<int64_t>(p.max_tokens);
  return static_cast<int>(at_least(ceil_div<int64_t>(p.max_tokens, tps), int64_t{1}));
}

// Workspace bytes of a grid with `splits` per item (none with one split).
size_t workspace_bytes_for(const PagedDecodeParams& p, int splits) {
  if (splits == 1) return 0;
  const size_t slots = static_cast<size_t>(p.num_seqs) * p.num_kv_heads * splits * p.group;
  return slots * (static_cast<size_t>(p.head_dim) * sizeof(float) + sizeof(float2));
}

template <int D, typename OutT>
cudaError_t launch_decode(const PagedDecodeParams& p, OutT* out, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  const SplitPolicy policy = split_policy(p);
  const int splits = grid_splits(p, policy);
  if (workspace_bytes < workspace_bytes_for(p, splits)) return cudaErrorInvalidValue;
  const int items = p.num_seqs * p.num_kv_heads;
  if (items == 0) return cudaSuccess;
  if (splits > kMaxSplits) return cudaErrorInvalidValue;
  const size_t item_splits = static_cast<size_t>(items) * splits * p.group;
  float* ws_out = splits > 1 ? static_cast<float*>(workspace) : nullptr;
  float2* ws_ml = splits > 1 ? reinterpret_cast<float2*>(ws_out + item_splits * D) : nullptr;
  if (blocks_per_sm<D>() == 0) return cudaErrorInvalidConfiguration;  // also sets the smem limit
  const dim3 grid(items, splits);
  const auto main_kernel = [&] {
    switch (load_path(p)) {
      case Copy::kThread16:
        return paged_decode_kernel<D, OutT, Copy::kThread16>;
      case Copy::kThread16L2:
        return paged_decode_kernel<D, OutT, Copy::kThread16L2>;
      case Copy::kWarp512:
        break;
    }
    return paged_decode_kernel<D, OutT, Copy::kWarp512>;
  }();
  const cudaError_t e = launch(main_kernel, grid, kThreads, kSmemBytes<D>, stream, p, p.tokens_per_split, splits,
                               policy, out, ws_out, ws_ml);
  if (e != cudaSuccess || splits == 1) return e;
  const float* partial_out = ws_out;
  const float2* partial_ml = ws_ml;
  return launch(paged_decode_merge_kernel<D, OutT>, dim3(items, p.group), D,
                static_cast<size_t>(splits) * sizeof(float), stream, p, p.tokens_per_split, splits, policy, out,
                partial_out, partial_ml);
}

template <typename OutT>
cudaError_t dispatch(const PagedDecodeParams& p, OutT* out, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  if (!valid_shape(p)) return cudaErrorInvalidValue;
  if (p.head_dim == 64) return launch_decode<64>(p, out, workspace, workspace_bytes, stream);
  return launch_decode<128>(p, out, workspace, workspace_bytes, stream);
}

}  // namespace

int paged_decode_item_splits(const PagedDecodeParams& p, int n_tok) {
  if (!valid_shape(p) || n_tok < 0) return 1;
  const SplitPolicy policy = split_policy(p);
  const int grid = grid_splits(p, policy);
  const int64_t tps =
      p.tokens_per_split > 0 ? p.tokens_per_split : policy.item_split_tokens<int64_t>(n_tok, grid);
  return static_cast<int>(splits_used<int64_t>(n_tok, tps, grid));
}

int paged_decode_splits(const PagedDecodeParams& p) { return valid_shape(p) ? grid_splits(p, split_policy(p)) : 1; }

size_t paged_decode_workspace_bytes(const PagedDecodeParams& p) { return workspace_bytes_for(p, paged_decode_splits(p)); }

cudaError_t paged_decode_attention(const PagedDecodeParams& p, __nv_bfloat16* out,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return dispatch(p, out, workspace, workspace_bytes, stream);
}

cudaError_t paged_decode_attention(const PagedDecodeParams& p, float* out, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  return dispatch(p, out, workspace, workspace_bytes, stream);
}

}  // namespace spin::cuda
