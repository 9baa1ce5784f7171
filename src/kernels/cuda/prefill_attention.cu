#include "kernels/cuda/prefill_attention.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/copy_async.cuh"
#include "kernels/cuda/driver_entry_point.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/per_device.h"
#include "kernels/cuda/wgmma.cuh"

namespace spin::cuda {

namespace {

// A thread block takes one (sequence, KV head) and a tile of 128 query rows; row r is token
// r / group, query head r % group of the KV head's group, so every KV tile is loaded once for the
// whole GQA group. It walks the sequence's keys in tiles of 64 from position 0 up to the tile's
// last position (later tiles are never loaded) with tensor-core products (mma m16n8k16, bf16 in,
// fp32 accumulate):
//   S[16 rows x 8 keys]  = Q[16 x 16 dims] * K^T[16 dims x 8 keys]   (K via ldmatrix)
//   O[16 rows x 8 dims] += P[16 x 16 keys] * V[16 keys x 8 dims]     (V via ldmatrix.trans)
// P comes straight from the S accumulators (their layout is the A operand's, rounded to bf16).
// Softmax is online in fp32, log2 domain; the causal mask is applied only on tiles that reach
// past a warp's first position. K and V tiles are double-buffered in shared memory by cp.async:
// K of the next tile loads while S is computed, V of the next tile while P*V is.
constexpr int kRows = 128;     // query rows per block
constexpr int kKeys = 64;      // keys per KV tile
constexpr int kMaxGroup = 8;
constexpr float kLog2e = 1.4426950408889634f;

template <int D, int kWarps, int kRowFrags>
struct Config {
  static_assert(kWarps * 16 * kRowFrags == kRows, "warps x rows per warp must cover the tile");
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = 16 * kRowFrags;
  static constexpr int kChunks = D / 8;  // 16-byte pieces per row
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kTileBytes = kKeys * D * 2;
  static constexpr int kSmemBytes = kQBytes + 4 * kTileBytes;  // Q, K x2, V x2
  // One warp of 16 rows keeps its Q fragments in registers; with 32 rows they would not fit
  // beside the accumulators, so they are re-read from shared memory every KV tile.
  static constexpr bool kQInRegisters = kRowFrags == 1;
  static constexpr int kMinBlocks = kRowFrags == 2 ? 2 : 1;
};

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2^x; -inf gives 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Byte offset of 16-byte piece `chunk` of row `row` in a [rows][D] bf16 tile. The piece index is
// XORed with the row's low 3 bits, so the 8 rows an ldmatrix reads (same logical piece) land in
// 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Query tile tile_x of this block's sequence (both kernels): rows r of 128 are token t0 + r / group
// of sequence blockIdx.y, query head r % group of KV head blockIdx.z. The latest tiles (the most
// keys) come first, so the short ones fill the tail. False when the sequence has no tile tile_x.
struct QueryTile {
  int tok_begin;  // the sequence's first q row
  int t0;         // the tile's first token, from tok_begin
  int t_valid;    // its tokens (rows past t_valid * group are padding)
  int pos0;       // position of token t0
  int kv_end;     // keys [0, kv_end) are read
};
__device__ __forceinline__ bool query_tile(const PagedPrefillParams& p, int rows, int tile_x, QueryTile& t) {
  const int seq = blockIdx.y;
  t.tok_begin = p.token_offsets[seq];
  const int n_new = p.token_offsets[seq + 1] - t.tok_begin;
  const int tile_tokens = rows / p.group;
  const int qtile = (n_new + tile_tokens - 1) / tile_tokens - 1 - tile_x;
  if (qtile < 0) return false;
  t.t0 = qtile * tile_tokens;
  t.t_valid = min(tile_tokens, n_new - t.t0);
  t.pos0 = p.first_pos[seq] + t.t0;
  t.kv_end = t.pos0 + t.t_valid;
  return true;
}
// Where q row `row` of the tile starts (token t0 + row / group, query head row % group of KV head
// kv_head), and whether it is a real row: padding rows (past the tile's tokens) are copied as zeros
// from p.q.
template <int D>
__device__ __forceinline__ const __nv_bfloat16* q_row_start(const PagedPrefillParams& p, const QueryTile& t,
                                                            int64_t q_row_stride, int kv_head, int row, bool& valid) {
  const int tl = row / p.group;
  valid = tl < t.t_valid;
  if (!valid) return p.q;
  return p.q + static_cast<int64_t>(t.tok_begin + t.t0 + tl) * q_row_stride +
         static_cast<int64_t>(kv_head * p.group + row - tl * p.group) * D;
}

template <int D, int kWarps, int kRowFrags>
__global__ void __launch_bounds__(Config<D, kWarps, kRowFrags>::kThreads,
                                  Config<D, kWarps, kRowFrags>::kMinBlocks)
    paged_prefill_kernel(PagedPrefillParams p, int64_t q_row_stride, uint32_t page_magic,
                         __nv_bfloat16* out) {
  using C = Config<D, kWarps, kRowFrags>;
  constexpr int MF = kRowFrags;
  QueryTile tile;
  if (!query_tile(p, kRows, static_cast<int>(blockIdx.x), tile)) return;
  const int seq = blockIdx.y;
  const int kv_head = blockIdx.z;
  const int group = p.group;
  // Keys past kv_end are zero-filled.
  const int tok_begin = tile.tok_begin, t0 = tile.t0, t_valid = tile.t_valid, pos0 = tile.pos0, kv_end = tile.kv_end;
  const int n_tiles = (kv_end + kKeys - 1) / kKeys;
  const int num_q_heads = p.num_kv_heads * group;
  const int ps = p.page_size;
  const size_t page_elems = static_cast<size_t>(2) * ps * D;
  const int32_t* ids = p.page_ids + p.list_offsets[seq * p.num_kv_heads + kv_head];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma group: fragment row
  const int t4 = lane & 3;  // thread in group: fragment column pair

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t s_k = s_q + C::kQBytes;
  const uint32_t s_v = s_k + 2 * C::kTileBytes;

  // Q rows of the tile; rows past the tile's tokens are zeros (never stored).
#pragma unroll
  for (int it = 0; it < kRows * C::kChunks / C::kThreads; ++it) {
    const int i = tid + it * C::kThreads;
    const int row = i / C::kChunks;
    const int chunk = i % C::kChunks;
    bool valid;
    const __nv_bfloat16* src = q_row_start<D>(p, tile, q_row_stride, kv_head, row, valid);
    copy_async(s_q + swizzle<D>(row, chunk), valid ? src + chunk * 8 : src, valid ? 16 : 0);
  }
  copy_async_commit();

  // K (part 0) or V (part 1) of KV tile `tile` into the buffer at `dst`. Each thread copies
  // pieces of one key row (one page look-up); the threads of a row take adjacent pieces, so each
  // warp instruction reads whole 32-byte sectors. Keys at or past kv_end are zero-filled: no
  // query row of this block attends to them, the pages may not cover them, and zeros keep the
  // masked products finite.
  constexpr int kThreadsPerKey = C::kThreads / kKeys;
  const int kv_row = tid / kThreadsPerKey;
  const int kv_piece = tid % kThreadsPerKey;
  auto load_kv = [&](int tile, uint32_t dst, int part) {
    const int key = tile * kKeys + kv_row;
    const bool valid = key < kv_end;
    const __nv_bfloat16* src = p.kv_pool;
    if (valid) {
      const int page = static_cast<int>(__umulhi(static_cast<uint32_t>(key), page_magic));
      const int slot = key - page * ps;
      src += static_cast<size_t>(ids[page]) * page_elems + static_cast<size_t>(part * ps + slot) * D;
    }
#pragma unroll
    for (int it = 0; it < C::kChunks / kThreadsPerKey; ++it) {
      const int chunk = kv_piece + it * kThreadsPerKey;
      copy_async(dst + swizzle<D>(kv_row, chunk), src + (valid ? chunk * 8 : 0), valid ? 16 : 0);
    }
  };
  load_kv(0, s_k, 0);
  copy_async_commit();
  load_kv(0, s_v, 1);
  copy_async_commit();

  // This thread's rows: warp_row0 + mf * 16 + g + 8 * h, at positions pos[mf][h].
  const int warp_row0 = warp * C::kWarpRows;
  int pos[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) pos[mf][h] = pos0 + (warp_row0 + mf * 16 + g + 8 * h) / group;
  const bool warp_active = warp_row0 / group < t_valid;  // else every row of the warp is padding
  const int warp_min_pos = pos0 + warp_row0 / group;
  const int warp_max_pos = pos0 + min((warp_row0 + C::kWarpRows - 1) / group, t_valid - 1);

  // Q fragment (A operand) of row frag mf, dims 16 kk .. +16, from shared memory.
  auto load_q = [&](uint32_t (&a)[4], int mf, int kk) {
    const int row = warp_row0 + mf * 16 + (lane & 15);
    ldmatrix_x4(a, s_q + swizzle<D>(row, 2 * kk + (lane >> 4)));
  };
  uint32_t q_regs[C::kQInRegisters ? D / 16 : 1][4];
  copy_async_wait<2>();  // Q has landed
  __syncthreads();
  if constexpr (C::kQInRegisters) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_q(q_regs[kk], 0, kk);
  }

  const float scale_log2 = p.scale * kLog2e;
  float o[MF][D / 8][4];
  float m_run[MF][2];
  float l_run[MF][2];  // this thread's partial row sums (its 16 of each tile's 64 keys)
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[mf][h] = -INFINITY;
      l_run[mf][h] = 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mf][dt][i] = 0.0f;
  }

  for (int j = 0; j < n_tiles; ++j) {
    const uint32_t k_buf = s_k + (j & 1) * C::kTileBytes;
    const uint32_t v_buf = s_v + (j & 1) * C::kTileBytes;
    copy_async_wait<1>();  // K of tile j has landed (V of tile j may still be in flight)
    __syncthreads();       // for every thread; and every warp is done with tile j - 1's K
    if (j + 1 < n_tiles) load_kv(j + 1, s_k + ((j + 1) & 1) * C::kTileBytes, 0);
    copy_async_commit();

    const int key0 = j * kKeys;
    const bool active = warp_active && key0 <= warp_max_pos;
    float s[MF][kKeys / 8][4];
    if (active) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mf][nt][i] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          if constexpr (C::kQInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mf][i] = q_regs[kk][i];
          } else {
            load_q(a[mf], mf, kk);
          }
        }
#pragma unroll
        for (int np = 0; np < kKeys / 16; ++np) {
          // b[0], b[1]: keys 16 np .. +8; b[2], b[3]: keys 16 np + 8 .. +8 (dims 16 kk, +8).
          uint32_t b[4];
          const int mat = lane >> 3;
          ldmatrix_x4(b, k_buf + swizzle<D>(16 * np + (lane & 7) + (mat >> 1) * 8, 2 * kk + (mat & 1)));
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            mma_bf16(s[mf][2 * np], a[mf], b[0], b[1]);
            mma_bf16(s[mf][2 * np + 1], a[mf], b[2], b[3]);
          }
        }
      }

      // s[mf][nt][2h + e]: row (mf, g + 8h), key key0 + 8 nt + 2 t4 + e.
      const bool masked = key0 + kKeys - 1 > warp_min_pos;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float v = s[mf][nt][2 * h + e];
              if (masked && key0 + 8 * nt + 2 * t4 + e > pos[mf][h]) v = -INFINITY;
              s[mf][nt][2 * h + e] = v;
              mx = fmaxf(mx, v);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mf][h], mx * scale_log2);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          const float alpha = fast_exp2(m_run[mf][h] - m_use);
          m_run[mf][h] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pr = fast_exp2(fmaf(s[mf][nt][2 * h + e], scale_log2, -m_use));
              s[mf][nt][2 * h + e] = pr;
              sum += pr;
            }
          l_run[mf][h] = l_run[mf][h] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            o[mf][dt][2 * h] *= alpha;
            o[mf][dt][2 * h + 1] *= alpha;
          }
        }
    }

    copy_async_wait<1>();  // V of tile j has landed (K of tile j + 1 may still be in flight)
    __syncthreads();       // for every thread; and every warp is done with tile j - 1's V
    if (j + 1 < n_tiles) load_kv(j + 1, s_v + ((j + 1) & 1) * C::kTileBytes, 1);
    copy_async_commit();

    if (active) {
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        // P (A operand) of keys 16 kk .. +16: the S accumulators of key tiles 2 kk and 2 kk + 1.
        uint32_t a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          a[mf][0] = pack_bf16(s[mf][2 * kk][0], s[mf][2 * kk][1]);
          a[mf][1] = pack_bf16(s[mf][2 * kk][2], s[mf][2 * kk][3]);
          a[mf][2] = pack_bf16(s[mf][2 * kk + 1][0], s[mf][2 * kk + 1][1]);
          a[mf][3] = pack_bf16(s[mf][2 * kk + 1][2], s[mf][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          // b[0], b[1]: dims 16 dp .. +8; b[2], b[3]: dims 16 dp + 8 .. +8 (keys 16 kk, +8).
          uint32_t b[4];
          const int mat = lane >> 3;
          ldmatrix_x4_trans(b, v_buf + swizzle<D>(16 * kk + (lane & 7) + (mat & 1) * 8, 2 * dp + (mat >> 1)));
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            mma_bf16(o[mf][2 * dp], a[mf], b[0], b[1]);
            mma_bf16(o[mf][2 * dp + 1], a[mf], b[2], b[3]);
          }
        }
      }
    }
  }
  copy_async_wait<0>();

  if (!warp_active) return;
  // o[mf][dt][2h + e]: row (mf, g + 8h), dim 8 dt + 2 t4 + e.
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mf][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = warp_row0 + mf * 16 + g + 8 * h;
      const int tl = row / group;
      if (tl >= t_valid) continue;
      __nv_bfloat16* dst = out + (static_cast<int64_t>(tok_begin + t0 + tl) * num_q_heads +
                                  kv_head * group + row - tl * group) *
                                     D +
                           2 * t4;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * dt) =
            __floats2bfloat162_rn(o[mf][dt][2 * h] * inv, o[mf][dt][2 * h + 1] * inv);
    }
}

// The warpgroup kernel (variant 2; sm_90a, head_dim 128): the same tile of 128 query rows per
// block, split over two warpgroups of 64 rows that multiply, and KV tiles of 128 keys. Per KV tile
// and warpgroup
//   S[64 x 128 keys]  = Q[64 x 128 dims] * K^T   (8 wgmma m64n128k16, both operands in shared memory)
//   O[64 x 128 dims] += P[64 x 128 keys] * V     (8 wgmma m64n128k16, P from registers)
// with the same online softmax as above. Q, K and V tiles sit in shared memory in the 128-byte
// swizzled layout of wgmma.cuh (two 64-dim halves of 128 rows each).
// A third warpgroup copies: Q by cp.async, then K and V tiles by TMA into rings of kStages slots
// each, every box counted on a "full" mbarrier as it lands. The multiplying warpgroups wait on those
// and release each slot through an "empty" mbarrier once their products have read it, so no
// block-wide barrier runs per tile. The copying warpgroup hands most of its registers to the other
// two (setmaxnreg).
// Blocks run in clusters of 2 on adjacent query tiles of one (sequence, KV head): both walk the keys
// of the longer tile, and each K/V box is read from L2 once and multicast into both (the bytes L2
// sends to the SMs are what bounded the kernel when every block read its own).
namespace wg {
constexpr int kRows = 128;
constexpr int kKeys = 128;
constexpr int kD = 128;
constexpr int kThreads = 384;
constexpr int kCopyThreads = 128;
constexpr int kCopyRegisters = 40;
constexpr int kMathRegisters = 232;  // (65536 - 128 x 40) / 256, rounded down to a multiple of 8
constexpr int kStages = 3;
constexpr int kTileBytes = kKeys * kD * 2;                         // 32 KB: K or V, or Q (128 rows)
constexpr int kSmemBytes = (1 + 2 * kStages) * kTileBytes + 1024;  // Q, K and V rings, alignment slack
constexpr int kMathWarps = (kThreads - kCopyThreads) / 32;
// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a 128-row swizzled tile.
__device__ __forceinline__ uint32_t offset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}
}  // namespace wg

__global__ void __launch_bounds__(wg::kThreads, 1)
    paged_prefill_wgmma_kernel(PagedPrefillParams p, int64_t q_row_stride, uint32_t page_magic, __nv_bfloat16* out,
                               const __grid_constant__ CUtensorMap kv_map, int box_rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = wg::kD;
  QueryTile tile;
  const bool own = query_tile(p, wg::kRows, static_cast<int>(blockIdx.x), tile);
  // The cluster's CTAs (blockIdx.x 2c and 2c + 1) walk the keys of the longer of their two tiles.
  // A CTA without a tile of its own walks its partner's with no rows (it stores nothing).
  QueryTile other;
  const bool partner = query_tile(p, wg::kRows, static_cast<int>(blockIdx.x ^ 1), other);
  if (!own && !partner) return;
  if (!own) {
    tile = other;
    tile.t_valid = 0;
  }
  const int kv_end = partner ? max(tile.kv_end, other.kv_end) : tile.kv_end;
  const int seq = blockIdx.y;
  const int kv_head = blockIdx.z;
  const int group = p.group;
  const int tok_begin = tile.tok_begin, t0 = tile.t0, t_valid = tile.t_valid, pos0 = tile.pos0;
  const int n_tiles = (kv_end + wg::kKeys - 1) / wg::kKeys;
  const int ps = p.page_size;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t s_q = (smem0 + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t s_k = s_q + wg::kTileBytes;
  const uint32_t s_v = s_k + wg::kStages * wg::kTileBytes;
  // Barriers: Q landed; per ring slot, K (V) landed and K (V) released.
  __shared__ __align__(8) uint64_t barriers[1 + 4 * wg::kStages];
  const uint32_t q_full = static_cast<uint32_t>(__cvta_generic_to_shared(barriers));
  auto k_full = [&](int slot) { return q_full + 8 * (1 + slot); };
  auto v_full = [&](int slot) { return q_full + 8 * (1 + wg::kStages + slot); };
  auto k_empty = [&](int slot) { return q_full + 8 * (1 + 2 * wg::kStages + slot); };
  auto v_empty = [&](int slot) { return q_full + 8 * (1 + 3 * wg::kStages + slot); };
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbarrier_init(q_full, wg::kCopyThreads);
    // full: lane 0's arrival with the tile's bytes; empty: one arrival per multiplying warp of both CTAs.
    for (int b = 1; b < 1 + 2 * wg::kStages; ++b) mbarrier_init(q_full + 8 * b, 1);
    for (int b = 1 + 2 * wg::kStages; b < 1 + 4 * wg::kStages; ++b) mbarrier_init(q_full + 8 * b, 2 * wg::kMathWarps);
  }
  const uint32_t rank = cluster_rank();
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  cluster_sync();  // the partner's barriers exist before any box or arrival reaches them

  if (tid < wg::kCopyThreads) {
    warpgroup_registers_decrease<wg::kCopyRegisters>();
    // Q: two threads per row (rows r and r + 64), thread pair (2r, 2r + 1) copying the row's 16-byte
    // chunks (0, 1), (2, 3), ..., so every warp instruction reads whole 32-byte sectors.
    const int row_lo = tid >> 1;
    const int odd = tid & 1;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_lo + 64 * half;
      bool valid;
      const __nv_bfloat16* src = q_row_start<D>(p, tile, q_row_stride, kv_head, row, valid);
      if (valid) src += odd * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) copy_async(s_q + wg::offset(row, odd + 2 * i), src + 16 * i, valid ? 16 : 0);
    }
    mbarrier_arrive_on_copies(q_full);

    // One warp issues K and V tiles as boxes of box_rows keys (within one page) and 64 dims: lane b
    // the 2 boxes of the tile's b-th row group if b % 2 is this CTA's rank (the partner issues the
    // others), each multicast into both CTAs; lane 0 first tells its barrier the whole tile's bytes.
    // Boxes wholly at or past kv_end are not issued; their rows keep whatever the slot held.
    if (tid >= 32) {
      copy_async_wait<0>();
      cluster_sync();  // the partner's last arrivals have reached this CTA's barriers before it exits
      return;
    }
    const int32_t* ids = p.page_ids + p.list_offsets[seq * p.num_kv_heads + kv_head];
    const int lane = tid;
    const int boxes = wg::kKeys / box_rows;
    // The page id of this lane's row group of tile t, fetched a tile ahead of its boxes.
    auto box_id = [&](int t) {
      const int key = t * wg::kKeys + lane * box_rows;
      return lane < boxes && key < kv_end ? ids[__umulhi(static_cast<uint32_t>(key), page_magic)] : 0;
    };
    // K (part 0) or V (part 1) of tile t into dst.
    auto issue_part = [&](int t, uint32_t dst, int part, int32_t id, uint32_t bar) {
      const int key0 = t * wg::kKeys;
      const int used = min(boxes, (kv_end - key0 + box_rows - 1) / box_rows);
      if (lane == 0) mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(used * box_rows * 256));
      __syncwarp();
      if (lane < used && (lane & 1) == static_cast<int>(rank)) {
        const int key = key0 + lane * box_rows;
        const int page = static_cast<int>(__umulhi(static_cast<uint32_t>(key), page_magic));
        const int row = (id * 2 + part) * ps + key - page * ps;
        const uint32_t at = dst + static_cast<uint32_t>(lane * box_rows * 128);
        tma_load_2d_multicast(at, &kv_map, 0, row, bar, 3);
        tma_load_2d_multicast(at + wg::kKeys * 128, &kv_map, 64, row, bar, 3);
      }
    };
    // Tile t's K goes out before tile t - 1's V: the products of one step read S of tile t and
    // P V of tile t - 1.
    int32_t id_prev = 0, id_cur = box_id(0), id_next = 0;
    for (int t = 0; t <= n_tiles; ++t) {
      if (t + 1 < n_tiles) id_next = box_id(t + 1);
      if (t < n_tiles) {
        const int slot = t % wg::kStages;
        mbarrier_wait(k_empty(slot), ((t / wg::kStages) & 1) ^ 1);
        issue_part(t, s_k + slot * wg::kTileBytes, 0, id_cur, k_full(slot));
      }
      if (t > 0) {
        const int slot = (t - 1) % wg::kStages;
        mbarrier_wait(v_empty(slot), (((t - 1) / wg::kStages) & 1) ^ 1);
        issue_part(t - 1, s_v + slot * wg::kTileBytes, 1, id_prev, v_full(slot));
      }
      id_prev = id_cur;
      id_cur = id_next;
    }
    copy_async_wait<0>();
    cluster_sync();
    return;
  }

  warpgroup_registers_increase<wg::kMathRegisters>();
  const int num_q_heads = p.num_kv_heads * group;
  const int mtid = tid - wg::kCopyThreads;
  const int warp = mtid >> 5;
  const int lane = mtid & 31;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int group_row0 = (warp >> 2) * 64;  // the warpgroup's rows: 64 from here
  // This thread's rows: row0 + g and row0 + g + 8, at positions pos[0], pos[1].
  const int row0 = group_row0 + (warp & 3) * 16;
  const int pos[2] = {pos0 + (row0 + g) / group, pos0 + (row0 + g + 8) / group};
  const bool group_active = group_row0 / group < t_valid;  // else every row of the warpgroup is padding
  const int group_min_pos = pos0 + group_row0 / group;

  const float scale_log2 = p.scale * kLog2e;
  float o[64];
  float s[64];
  uint32_t pk[8][4];  // P of the tile being multiplied into O, bf16 pairs (the A operand per 16 keys)
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;

  // A warpgroup of padding rows, or one whose rows see no key of a tile, computes it anyway (its
  // probabilities are 0): wgmma in a branch would be serialized.
  // S = Q K^T of the K tile in ring slot `slot` into s (8 wgmma m64n128k16 over the head dims).
  auto issue_s = [&](int slot) {
    const uint32_t k_buf = s_k + slot * wg::kTileBytes;
    wgmma_fence_operand(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t a = s_q + (kk >> 2) * (wg::kRows * 128) + group_row0 * 128 + (kk & 3) * 32;
      const uint32_t b = k_buf + (kk >> 2) * (wg::kKeys * 128) + (kk & 3) * 32;
      wgmma_m64n128k16_ss(s, wgmma_desc_sw128(a, 16, 1024), wgmma_desc_sw128(b, 16, 1024), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // O += P V of the V tile in ring slot `slot`, P from pk (8 wgmma m64n128k16: 16 keys each; V's
  // 128 dims along N in two 64-dim halves kKeys * 128 bytes apart).
  auto issue_pv = [&](int slot) {
    const uint32_t v_buf = s_v + slot * wg::kTileBytes;
    wgmma_fence_operand(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n128k16_rs(o, pk[kk], wgmma_desc_sw128(v_buf + kk * 2048, wg::kKeys * 128, 1024));
    wgmma_commit();
  };
  // Online softmax of tile j in s: s[4 nt + 2 h + e] is row (row0 + g + 8 h), key 128 j + 8 nt +
  // 2 t4 + e. Returns through alpha the rescale of what O holds.
  auto softmax = [&](int j, float (&alpha)[2]) {
    wgmma_fence_operand(s);
    // The causal mask, on the tiles that reach past the warpgroup's first position only (the
    // branch is uniform in the warpgroup). Key 8 nt + e of this thread's columns lies past the
    // row's position when 8 nt + e > last (compared against immediates: a register per key would
    // crowd out the in-flight operands).
    const int key0 = j * wg::kKeys;
    if (key0 + wg::kKeys - 1 > group_min_pos) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int last = pos[h] - key0 - 2 * t4;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * nt + e > last) s[4 * nt + 2 * h + e] = -INFINITY;
      }
    }
    // Row maxima and sums over 4 independent chains each, not one chain of 32 dependent steps.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) mx4[2 * (nt & 1) + e] = fmaxf(mx4[2 * (nt & 1) + e], s[4 * nt + 2 * h + e]);
      float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[h] = fast_exp2(m_run[h] - m_use);
      m_run[h] = m_new;
      float sum4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pr = fast_exp2(fmaf(s[4 * nt + 2 * h + e], scale_log2, -m_use));
          s[4 * nt + 2 * h + e] = pr;
          sum4[2 * (nt & 1) + e] += pr;
        }
      l_run[h] = l_run[h] * alpha[h] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
    }
    // Pins the results before the next wgmma wait: the compiler would otherwise sink this
    // arithmetic past it, and the softmax would no longer overlap the products.
    wgmma_fence_operand(s);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      wgmma_fence_operand(alpha[h]);
      wgmma_fence_operand(l_run[h]);
    }
  };
  // Once P V of the previous tile has finished: O's rescale, and the packing of P (before S of the
  // next tile overwrites s).
  auto rescale_o = [&](const float (&alpha)[2]) {
    wgmma_fence_operand(o);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * dt + 2 * h] *= alpha[h];
        o[4 * dt + 2 * h + 1] *= alpha[h];
      }
  };
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      pk[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
      pk[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
      pk[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
      pk[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  // ptxas schedules inside basic blocks and moves a wgmma wait up to the first instruction it
  // finds room for; a branch it cannot remove (paged_prefill_attention refuses a negative count)
  // ends a block. (An exit, not a trap: with a trap on the path ptxas keeps these warpgroups to the
  // launch's 168 registers, ignoring setmaxnreg, and serializes the wgmmas.)
  auto schedule_boundary = [&] {
    if (p.num_seqs < 0) asm volatile("exit;");
  };
  // Waits for the use-th filling of a ring slot. K and V come by TMA (the async proxy, as wgmma reads);
  // Q by cp.async, through the generic proxy, hence the proxy fence after Q's wait below.
  auto wait_full = [&](uint32_t bar, int use) { mbarrier_wait(bar, (use / wg::kStages) & 1); };
  // A slot is free once both CTAs' products have read it (the partner's boxes land here too): one
  // arrival per warp on each CTA's barrier.
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane < 2) mbarrier_arrive_cluster(bar, lane);
  };

  // Software pipeline over KV tiles: while the tensor cores run S of tile j + 1 and O += P V of
  // tile j, the warpgroup computes the softmax of tile j + 1; only O's rescale and P's packing wait
  // for the products. Each slot is released as soon as the products that read it have finished.
  float alpha[2];
  mbarrier_wait(q_full, 0);
  wait_full(k_full(0), 0);
  fence_proxy_async_shared();
  issue_s(0);
  wgmma_wait<0>();
  release(k_empty(0));
  softmax(0, alpha);
  for (int j = 0; j + 1 < n_tiles; ++j) {
    const int k_slot = (j + 1) % wg::kStages, v_slot = j % wg::kStages;
    pack_p();
    rescale_o(alpha);
    wait_full(k_full(k_slot), j + 1);
    wait_full(v_full(v_slot), j);
    issue_s(k_slot);
    issue_pv(v_slot);
    wgmma_wait<1>();  // S of tile j + 1 (P V of tile j may still run)
    release(k_empty(k_slot));
    softmax(j + 1, alpha);
    schedule_boundary();  // else the wait below moves above the softmax, which then waits for P V
    wgmma_wait<0>();
    release(v_empty(v_slot));
  }
  pack_p();
  rescale_o(alpha);
  wait_full(v_full((n_tiles - 1) % wg::kStages), n_tiles - 1);
  {
    // V rows at or past kv_end hold what their page or an earlier tile left (maybe NaN); their
    // probabilities are 0, but 0 x NaN is NaN. The multiplying threads zero them, then meet on a
    // named barrier before either warpgroup's products read them. K rows there need nothing: the
    // causal mask replaces their scores.
    const uint32_t v_last = s_v + ((n_tiles - 1) % wg::kStages) * wg::kTileBytes;
    const int first_row = kv_end - (n_tiles - 1) * wg::kKeys;
    for (int i = first_row * 16 + mtid; i < wg::kKeys * 16; i += 32 * wg::kMathWarps) {
      const int row = i >> 4, chunk = i & 15;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(v_last + wg::offset(row, chunk)), "r"(0) : "memory");
    }
    fence_proxy_async_shared();
    asm volatile("bar.sync 1, %0;\n" ::"n"(32 * wg::kMathWarps) : "memory");
  }
  issue_pv((n_tiles - 1) % wg::kStages);
  wgmma_wait<0>();
  wgmma_fence_operand(o);
  cluster_sync();  // this CTA's last arrivals on the partner's barriers are in before either exits

  if (!group_active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int row = row0 + g + 8 * h;
    const int tl = row / group;
    if (tl >= t_valid) continue;
    __nv_bfloat16* dst =
        out + (static_cast<int64_t>(tok_begin + t0 + tl) * num_q_heads + kv_head * group + row - tl * group) * D + 2 * t4;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * dt) =
          __floats2bfloat162_rn(o[4 * dt + 2 * h] * inv, o[4 * dt + 2 * h + 1] * inv);
  }
#else
  __trap();  // launched only where sm_90a code was built (prefill_wgmma_available)
#endif
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

bool valid_params(const PagedPrefillParams& p, const __nv_bfloat16* out) {
  const int64_t q_width = static_cast<int64_t>(p.num_kv_heads) * p.group * p.head_dim;
  // Grid: y = sequence, z = KV head (each at most 65535); (seq, head) list indices fit in int.
  return p.num_kv_heads > 0 && p.num_kv_heads <= 65535 && p.num_seqs <= 65535 &&
         static_cast<int64_t>(p.num_seqs) * p.num_kv_heads < INT32_MAX && p.group >= 1 &&
         p.group <= kMaxGroup && (p.head_dim == 64 || p.head_dim == 128) && p.page_size >= 8 &&
         p.page_size <= 64 && p.page_size % 8 == 0 && std::isfinite(p.scale) && p.scale > 0.0f &&
         p.variant >= -1 && p.variant <= 2 && (p.variant != 2 || p.head_dim == 128) &&
         (p.q_row_stride == 0 || (p.q_row_stride >= q_width && p.q_row_stride % 8 == 0)) &&
         p.q && p.kv_pool && p.page_ids && p.list_offsets && p.token_offsets && p.first_pos && out &&
         aligned16(p.q) && aligned16(p.kv_pool) && aligned16(out);
}

template <int D, int kWarps, int kRowFrags>
cudaError_t launch(const PagedPrefillParams& p, __nv_bfloat16* out, cudaStream_t stream) {
  using C = Config<D, kWarps, kRowFrags>;
  const cudaError_t smem_status = per_device<cudaError_t>([] {
    return cudaFuncSetAttribute(paged_prefill_kernel<D, kWarps, kRowFrags>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  });
  if (smem_status != cudaSuccess) return smem_status;
  const int64_t q_row_stride =
      p.q_row_stride > 0 ? p.q_row_stride : static_cast<int64_t>(p.num_kv_heads) * p.group * D;
  // ceil(2^32 / page_size): key / page_size == umulhi(key, magic) for keys below 2^32 / 64 =
  // 2^26 positions.
  const uint32_t page_magic =
      static_cast<uint32_t>(((uint64_t{1} << 32) + p.page_size - 1) / p.page_size);
  const int tile_tokens = kRows / p.group;
  const dim3 grid((p.max_new_tokens + tile_tokens - 1) / tile_tokens, p.num_seqs, p.num_kv_heads);
  paged_prefill_kernel<D, kWarps, kRowFrags>
      <<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, q_row_stride, page_magic, out);
  return cudaGetLastError();
}

// cuTensorMapEncodeTiled, or null where the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn = driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn;
}

cudaError_t launch_wgmma(const PagedPrefillParams& p, __nv_bfloat16* out, cudaStream_t stream) {
  const cudaError_t smem_status = per_device<cudaError_t>([] {
    return cudaFuncSetAttribute(paged_prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                wg::kSmemBytes);
  });
  if (smem_status != cudaSuccess) return smem_status;
  // The pool as rows of head_dim keys or values: boxes of 64 dims (the 128-byte swizzle's width)
  // and the largest power-of-two row count that divides the page size (a box never crosses a
  // page). The row count's bound is only what TMA checks coordinates against.
  int box_rows = 8;
  while (box_rows < 64 && p.page_size % (2 * box_rows) == 0) box_rows *= 2;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return cudaErrorNotSupported;
  CUtensorMap kv_map{};
  const cuuint64_t dims[2] = {128, static_cast<cuuint64_t>(INT32_MAX)};
  const cuuint64_t strides[1] = {256};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  if (encode(&kv_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.kv_pool), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int64_t q_row_stride = p.q_row_stride > 0 ? p.q_row_stride : static_cast<int64_t>(p.num_kv_heads) * p.group * 128;
  const uint32_t page_magic = static_cast<uint32_t>(((uint64_t{1} << 32) + p.page_size - 1) / p.page_size);
  const int tile_tokens = wg::kRows / p.group;
  const int query_tiles = (p.max_new_tokens + tile_tokens - 1) / tile_tokens;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3((query_tiles + 1) & ~1, p.num_seqs, p.num_kv_heads);  // whole clusters of 2
  config.blockDim = dim3(wg::kThreads);
  config.dynamicSmemBytes = wg::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, paged_prefill_wgmma_kernel, p, q_row_stride, page_magic, out, kv_map, box_rows);
}

}  // namespace

bool prefill_wgmma_available() {
#ifdef SPIN_CUDA_SM90A
  return per_device<bool>([] {
    int device = 0, major = 0, minor = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess && major == 9 &&
           minor == 0 && tensor_map_encoder() != nullptr;
  });
#else
  return false;
#endif
}

cudaError_t paged_prefill_attention(const PagedPrefillParams& p, __nv_bfloat16* out,
                                    cudaStream_t stream) {
  if (p.num_seqs < 0 || p.max_new_tokens < 0) return cudaErrorInvalidValue;
  if (p.num_seqs == 0 || p.max_new_tokens == 0) return cudaSuccess;
  if (!valid_params(p, out)) return cudaErrorInvalidValue;
  if (p.variant == 2 || (p.variant == -1 && p.head_dim == 128 && prefill_wgmma_available()))
    return prefill_wgmma_available() ? launch_wgmma(p, out, stream) : cudaErrorNotSupported;
  const bool eight_warps = p.variant == 1;
  if (p.head_dim == 64)
    return eight_warps ? launch<64, 8, 1>(p, out, stream) : launch<64, 4, 2>(p, out, stream);
  return eight_warps ? launch<128, 8, 1>(p, out, stream) : launch<128, 4, 2>(p, out, stream);
}

}  // namespace spin::cuda
