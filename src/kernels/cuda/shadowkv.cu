#include "kernels/cuda/shadowkv.h"

#include <mma.h>

#include <algorithm>
#include <climits>

#include "kernels/cuda/block_softmax.cuh"
#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/sparse_select.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

// Index: one warp per page; lane l owns head_dim / 32 consecutive dimensions. The mean is summed
// in fp32, then each token's cosine to it is three warp all-reduces.
//
// Score: blocks of (kThreads candidates, item), so even one sequence fills the GPU. Pass 1 takes
// q . landmark on the tensor cores as Quest's score does (sparse_select.cu): 16 candidates'
// landmark rows against the group's queries per mma, each thread loading 16 contiguous bytes of a
// row per 32 columns as its A fragment and the query in the same column order. bf16 products are
// exact in the fp32 sums, so only the summation order differs from one thread per candidate doing
// D * G FMAs, which was instruction-bound at batch 8. It writes each head's logit to scratch and the
// block's (max, sum of exp) per head; pass 2, a thread per candidate, merges the item's blocks into
// the softmax normalisers and writes the largest probability over the group.
//
// Rebuild: blocks of (item, kRebuildPages pages); each holds its KV head's basis rows in shared
// memory and 64 rows of A at a time (bf16, the rank padded with zeros to whole k-steps), multiplies
// them on tensor cores (wmma 8x32x16, fp32 sums) into shared memory, then turns each pair by RoPE
// and writes the bf16 keys into the fetched page.
namespace spin::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
static_assert(kThreads == 256, "shadowkv_score_scratch counts blocks of 256 candidates");
constexpr unsigned kFull = 0xffffffffu;
constexpr int kRebuildPages = 16;  // pages per rebuild block (each loads its KV head's basis once)

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
  return v;
}

// The summary entry of logical page `page` of KV head h, through a request's chunk directory.
__device__ __forceinline__ int64_t entry_of(const int32_t* dir, int num_kv_heads, int h, int page) {
  return summary_entry(dir[page / kSummaryChunkPages], num_kv_heads, h, page);
}

// RoPE pair j of head_dim D: its two dimensions.
__device__ __forceinline__ void rope_pair(int j, int D, bool neox, int& a, int& b) {
  a = neox ? j : 2 * j;
  b = neox ? j + D / 2 : 2 * j + 1;
}

// ---------------------------------------------------------------------------------------------
// Index

template <int D>
__global__ void __launch_bounds__(kThreads) shadowkv_index_kernel(ShadowKvIndexParams p) {
  enter_dependent_grid();
  constexpr int V = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= p.num_pages) return;  // whole warp
  const int32_t src = p.src_pages[i];
  const int32_t dst = p.dst_entries[i];
  if (src < 0 || dst < 0) return;  // whole warp
  const __nv_bfloat16* keys = p.kv_pool + static_cast<int64_t>(src) * 2 * p.page_size * D + lane * V;
  float mean[V];
#pragma unroll
  for (int e = 0; e < V; ++e) mean[e] = 0.0f;
  for (int t = 0; t < p.page_size; ++t)
#pragma unroll
    for (int e = 0; e < V; ++e) mean[e] += __bfloat162float(keys[t * D + e]);
#pragma unroll
  for (int e = 0; e < V; ++e) mean[e] /= static_cast<float>(p.page_size);
  __nv_bfloat16* entry = p.summaries + static_cast<int64_t>(dst) * 2 * D;
#pragma unroll
  for (int e = 0; e < V; ++e) entry[lane * V + e] = __float2bfloat16(mean[e]);
  if (lane == 0) entry[D] = __float2bfloat16(0.0f);
  if (p.min_cos == nullptr || p.min_cos_at[i] < 0) return;  // whole warp
  float bb = 0.0f;
#pragma unroll
  for (int e = 0; e < V; ++e) bb += mean[e] * mean[e];
  bb = warp_sum(bb);
  float worst = INFINITY;
  for (int t = 0; t < p.page_size; ++t) {
    float ab = 0.0f, aa = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float k = __bfloat162float(keys[t * D + e]);
      ab += k * mean[e];
      aa += k * k;
    }
    ab = warp_sum(ab);
    aa = warp_sum(aa);
    worst = fminf(worst, aa > 0.0f && bb > 0.0f ? ab / sqrtf(aa * bb) : 1.0f);
  }
  if (lane == 0) p.min_cos[p.min_cos_at[i]] = -worst;
}

__global__ void shadowkv_outlier_kernel(ShadowKvOutlierParams p) {
  enter_dependent_grid();
  const int item = blockIdx.x;
  const int seq = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int32_t* pages = p.pages + p.offsets[item];
  const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
  for (int k = threadIdx.x; k < p.counts[item]; k += blockDim.x) {
    const int64_t entry = entry_of(dir, p.num_kv_heads, h, pages[k]);
    p.summaries[entry * 2 * p.head_dim + p.head_dim] = __float2bfloat16(1.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// Score

// Within the 128 registers this allows, ptxas schedules all of a warp's row loads before its first
// mma; left free, it interleaved them and the warp waited on memory once per slice.
constexpr int kLogitsBlocksPerSm = 2;

// Pass 1, block (chunk, item): the logits of candidates [first + chunk * kThreads, ...) and the
// chunk's (max, sum of exp) per head. Warp w takes the chunk's candidates 32 w .. 32 w + 31 as
// two MMA tiles of 16.
template <int D, int G>
__global__ void __launch_bounds__(kThreads, kLogitsBlocksPerSm) shadowkv_logits_kernel(ShadowKvScoreParams p) {
  enter_dependent_grid();
  constexpr int kSlices = D / 32;  // 32-column slices of the landmark
  __shared__ float warp_max[kWarps][G], warp_total[kWarps][G];
  const int item = blockIdx.y;
  const int seq = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int first = p.first_candidate[seq];
  const int end = p.end_candidate[seq];
  const int chunk_first = first + static_cast<int>(blockIdx.x) * kThreads;
  if (end <= chunk_first) return;  // whole block
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4;   // MMA group: rows r and r + 8 of a tile, query head r
  const int t4 = lane % 4;  // columns t4 * 8 .. + 8 of each slice; heads 2 t4 and 2 t4 + 1 of the sums
  const int page0 = chunk_first + warp * 32;
  // x[t][i]: the logit of tile t's row r + 8 (i / 2) for head 2 t4 + i % 2, -inf where none.
  float x[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) x[t][i] = -INFINITY;
  if (page0 < end) {  // whole warp
    // B operand: head r's query in the column order of the rows below (zero past the group).
    uint4 qf[kSlices];
    const __nv_bfloat16* q = p.q + (static_cast<int64_t>(item) * G + r) * D + t4 * 8;
#pragma unroll
    for (int c = 0; c < kSlices; ++c)
      qf[c] = r < G ? __ldg(reinterpret_cast<const uint4*>(q + c * 32)) : make_uint4(0, 0, 0, 0);
    // A operand: 16 bytes of each slice of the thread's four rows. A chunk starts at any page, so
    // a tile may straddle summary chunks: each row finds its own entry. Rows past the end read
    // the last candidate's (whose chunk exists) and are masked below.
    const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
    uint4 a[2][2][kSlices];
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int page = min(page0 + 16 * t + 8 * half + r, end - 1);
        const uint4* row =
            reinterpret_cast<const uint4*>(p.summaries + entry_of(dir, p.num_kv_heads, h, page) * 2 * D) + t4;
#pragma unroll
        for (int c = 0; c < kSlices; ++c) a[t][half][c] = __ldcs(row + c * 4);
      }
    float* logits = p.logits + static_cast<int64_t>(item) * G * p.max_candidates + (page0 - first);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int c = 0; c < kSlices; ++c)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t frag[4] = {component(a[t][0][c], 2 * k), component(a[t][1][c], 2 * k),
                                    component(a[t][0][c], 2 * k + 1), component(a[t][1][c], 2 * k + 1)};
          mma_bf16(s, frag, component(qf[c], 2 * k), component(qf[c], 2 * k + 1));
        }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * t + 8 * (i / 2) + r, g = 2 * t4 + i % 2;
        if (g < G && page0 + row < end) {
          x[t][i] = s[i] * p.scale;
          logits[static_cast<int64_t>(g) * p.max_candidates + row] = x[t][i];
        }
      }
    }
  }
  // The warp's (max, sum of exp) of heads 2 t4 and 2 t4 + 1 over the lanes of the same t4, then
  // the block's over the warps.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float m = fmaxf(fmaxf(x[0][i], x[0][i + 2]), fmaxf(x[1][i], x[1][i + 2]));
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, offset));
    float e = m == -INFINITY ? 0.0f
                             : __expf(x[0][i] - m) + __expf(x[0][i + 2] - m) + __expf(x[1][i] - m) +
                                   __expf(x[1][i + 2] - m);
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) e += __shfl_xor_sync(kFull, e, offset);
    const int g = 2 * t4 + i;
    if (r == 0 && g < G) warp_max[warp][g] = m, warp_total[warp][g] = e;
  }
  block_partials_from_warps<G, kWarps>(warp_max, warp_total,
                                       p.logits + shadowkv_score_partials_at(p.num_seqs * p.num_kv_heads, G, p.max_candidates) +
                                           (static_cast<int64_t>(item) * gridDim.x + blockIdx.x) * G * 2);
}

// Pass 2, block (chunk, item): the softmax normalisers from every chunk's partials, then each
// candidate's largest probability over the group (+inf for an outlier chunk).
template <int D, int G>
__global__ void __launch_bounds__(kThreads) shadowkv_probs_kernel(ShadowKvScoreParams p) {
  enter_dependent_grid();
  __shared__ float norm_max[G], norm_scale[G];
  const int item = blockIdx.y;
  const int seq = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int first = p.first_candidate[seq];
  const int end = p.end_candidate[seq];
  const int page = first + static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (end <= first + static_cast<int>(blockIdx.x) * kThreads) return;  // whole block
  if (threadIdx.x < G) {
    const float* partial = p.logits + shadowkv_score_partials_at(p.num_seqs * p.num_kv_heads, G, p.max_candidates) +
                           static_cast<int64_t>(item) * gridDim.x * G * 2 + threadIdx.x * 2;
    merge_softmax_partials(partial, (end - first + kThreads - 1) / kThreads, G * 2, norm_max[threadIdx.x],
                           norm_scale[threadIdx.x]);
  }
  __syncthreads();
  if (page >= end) return;
  const int32_t* dir = p.summary_dir + p.dir_offsets[seq];
  const __nv_bfloat16* entry = p.summaries + entry_of(dir, p.num_kv_heads, h, page) * 2 * D;
  const float* logits = p.logits + static_cast<int64_t>(item) * G * p.max_candidates + (page - first);
  float best = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g)
    best = fmaxf(best, __expf(logits[static_cast<int64_t>(g) * p.max_candidates] - norm_max[g]) * norm_scale[g]);
  p.scores[static_cast<int64_t>(item) * p.max_candidates + (page - first)] =
      __bfloat162float(entry[D]) != 0.0f ? INFINITY : best;
}

template <int D, int G>
void launch_score_passes(const ShadowKvScoreParams& p, dim3 grid, cudaStream_t stream) {
  launch(shadowkv_logits_kernel<D, G>, grid, kThreads, 0, stream, p);
  launch(shadowkv_probs_kernel<D, G>, grid, kThreads, 0, stream, p);
}

template <int D>
cudaError_t launch_score(const ShadowKvScoreParams& p, dim3 grid, cudaStream_t stream) {
  with_group(p.group, [&](auto g) { launch_score_passes<D, decltype(g)::value>(p, grid, stream); });
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Factorisation helpers

template <int D>
__global__ void __launch_bounds__(kThreads) shadowkv_unrotate_kernel(ShadowKvUnrotateParams p) {
  enter_dependent_grid();
  constexpr int kPairs = D / 64;  // pairs per lane
  const int lane = threadIdx.x % 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (page, head)
  if (i >= static_cast<int64_t>(p.num_pages) * p.num_kv_heads) return;  // whole warp
  const int64_t page = i / p.num_kv_heads;
  const int h = static_cast<int>(i % p.num_kv_heads);
  const __nv_bfloat16* keys = p.kv_pool + static_cast<int64_t>(p.pages[i]) * 2 * p.page_size * D;
  const int64_t width = static_cast<int64_t>(p.num_kv_heads) * D;
  for (int t = 0; t < p.page_size; ++t) {
    const int64_t row = page * p.page_size + t;
    const int64_t pos = (p.first_page + page) * p.page_size + t;
    float* out = p.keys + row * width + static_cast<int64_t>(h) * D;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      int a, b;
      rope_pair(lane + 32 * j, D, p.neox, a, b);
      double sn, cs;
      sincos(static_cast<double>(pos) * static_cast<double>(p.inv_freq[lane + 32 * j]), &sn, &cs);
      const auto c = static_cast<float>(cs), s = static_cast<float>(sn);
      const float k0 = __bfloat162float(keys[t * D + a]), k1 = __bfloat162float(keys[t * D + b]);
      out[a] = k0 * c + k1 * s;  // x = R(-angle) k
      out[b] = k1 * c - k0 * s;
    }
  }
}

__global__ void shadowkv_store_kernel(ShadowKvStoreParams p) {
  enter_dependent_grid();
  const int D = p.head_dim, r = p.rank;
  const int64_t page_elems = 2LL * p.page_size * D;
  const int64_t group_elems = p.num_kv_heads * page_elems;
  const int ppg = shadowkv_pages_per_factor_group(p.num_kv_heads, D, r);
  const int64_t a_elems = static_cast<int64_t>(p.num_pages) * p.page_size * r;
  const int64_t b_elems = static_cast<int64_t>(p.num_kv_heads) * D * r;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < a_elems + b_elems;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (idx < a_elems) {
      const int64_t t = idx / r;
      const int j = static_cast<int>(idx % r);
      const int64_t page = t / p.page_size;
      const int64_t group = p.factor_groups[page / ppg];
      p.kv_pool[group * group_elems + ((page % ppg) * p.page_size + t % p.page_size) * r + j] =
          __float2bfloat16(p.coeffs[idx]);
    } else {
      const int64_t k = idx - a_elems;
      const int64_t i = k / r;
      const int j = static_cast<int>(k % r);
      const int h = static_cast<int>(i / D), d = static_cast<int>(i % D);
      const int rows = shadowkv_basis_rows_per_page(p.page_size, D, r);
      const int64_t page = static_cast<int64_t>(p.basis_groups[d / rows]) * p.num_kv_heads + h;
      p.kv_pool[page * page_elems + (d % rows) * r + j] = __float2bfloat16(p.basis[i + static_cast<int64_t>(j) * p.ld_basis]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rebuild

// Rows (tokens) of A a rebuild block multiplies at once: whole pages, at least one.
constexpr int kRebuildRows = 64;
__host__ __device__ constexpr int rebuild_pages_at_once(int page_size) {
  return page_size >= kRebuildRows ? 1 : kRebuildRows / page_size;
}
// Shared-memory rows of the rank: padded to whole k-steps of 16 with zeros, plus 8 against bank
// conflicts (a multiple of 8 elements, as wmma wants).
__host__ __device__ constexpr int padded_rank(int rank) { return (rank + 15) / 16 * 16; }
__host__ __device__ constexpr int rank_stride(int rank) { return padded_rank(rank) + 8; }

template <int D>
__global__ void __launch_bounds__(kThreads) shadowkv_rebuild_kernel(ShadowKvRebuildParams p) {
  enter_dependent_grid();
  using namespace nvcuda;
  extern __shared__ uint4 shared16[];
  const int item = blockIdx.x;
  const int seq = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int count = p.counts[item];
  const int begin = static_cast<int>(blockIdx.y) * kRebuildPages;
  if (begin >= count) return;  // whole block
  const int r = p.rank, rp = padded_rank(r), ld = rank_stride(r);
  const int at_once = rebuild_pages_at_once(p.page_size);
  const int rows_at_once = at_once * p.page_size;
  auto* basis = reinterpret_cast<__nv_bfloat16*>(shared16);  // [D][ld]: B, col-major rank x D
  __nv_bfloat16* coeffs = basis + D * ld;                     // [rows_at_once][ld]: A rows
  auto* out = reinterpret_cast<float*>(coeffs + rows_at_once * ld);  // [rows_at_once][D]
  const int64_t page_elems = 2LL * p.page_size * D;
  const int64_t group_elems = p.num_kv_heads * page_elems;
  const int32_t* dir = p.factor_dir + p.factor_offsets[seq];
  const int rows = shadowkv_basis_rows_per_page(p.page_size, D, r);
  const int vecs = r / 8;  // 16-byte vectors per row
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int k = threadIdx.x; k < D * vecs; k += kThreads) {
    const int d = k / vecs, v = k % vecs;
    const int64_t page = static_cast<int64_t>(dir[d / rows]) * p.num_kv_heads + h;
    reinterpret_cast<uint4*>(basis + d * ld)[v] =
        reinterpret_cast<const uint4*>(p.kv_pool + page * page_elems + (d % rows) * r)[v];
  }
  for (int k = threadIdx.x; k < D * (rp - r); k += kThreads) basis[(k / (rp - r)) * ld + r + k % (rp - r)] = zero;
  for (int k = threadIdx.x; k < rows_at_once * (rp - r); k += kThreads)
    coeffs[(k / (rp - r)) * ld + r + k % (rp - r)] = zero;
  const int ppg = shadowkv_pages_per_factor_group(p.num_kv_heads, D, r);
  const int32_t* a_groups = dir + p.basis_groups;
  const int32_t* logical = p.logical + p.offsets[item];
  const int32_t* pages = p.pages + p.offsets[item];
  const int warp = threadIdx.x / 32;
  const int end = min(count, begin + kRebuildPages);
  for (int n0 = begin; n0 < end; n0 += at_once) {
    const int held = min(at_once, end - n0);
    const int held_rows = held * p.page_size;
    __syncthreads();  // the previous round's outputs are stored; the basis is written (first round)
    for (int k = threadIdx.x; k < held_rows * vecs; k += kThreads) {
      const int row = k / vecs, v = k % vecs;
      const int64_t l = logical[n0 + row / p.page_size];
      const __nv_bfloat16* a = p.kv_pool + static_cast<int64_t>(a_groups[l / ppg]) * group_elems +
                               ((l % ppg) * p.page_size + row % p.page_size) * r;
      reinterpret_cast<uint4*>(coeffs + row * ld)[v] = reinterpret_cast<const uint4*>(a)[v];
    }
    __syncthreads();
    // Tiles of 8 tokens x 32 dimensions, k-steps of 16.
    const int tiles_n = D / 32, tiles = held_rows / 8 * tiles_n;
    for (int tile = warp; tile < tiles; tile += kWarps) {
      const int m0 = tile / tiles_n * 8, n0d = tile % tiles_n * 32;
      wmma::fragment<wmma::accumulator, 8, 32, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int k0 = 0; k0 < rp; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 8, 32, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 8, 32, 16, __nv_bfloat16, wmma::col_major> b;
        wmma::load_matrix_sync(a, coeffs + m0 * ld + k0, ld);
        wmma::load_matrix_sync(b, basis + n0d * ld + k0, ld);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(out + m0 * D + n0d, acc, D, wmma::mem_row_major);
    }
    __syncthreads();
    // RoPE at each token's position, both members of a pair in one thread; bf16 into the page.
    for (int k = threadIdx.x; k < held_rows * (D / 2); k += kThreads) {
      const int row = k / (D / 2), pair = k % (D / 2);
      int da, db;
      rope_pair(pair, D, p.neox, da, db);
      const int token = row % p.page_size;
      const int64_t l = logical[n0 + row / p.page_size];
      double sn, cs;
      sincos(static_cast<double>(l * p.page_size + token) * static_cast<double>(p.inv_freq[pair]), &sn, &cs);
      const auto co = static_cast<float>(cs), si = static_cast<float>(sn);
      const float x0 = out[row * D + da], x1 = out[row * D + db];
      __nv_bfloat16* keys = p.kv_pool + static_cast<int64_t>(pages[n0 + row / p.page_size]) * page_elems;
      keys[token * D + da] = __float2bfloat16(x0 * co - x1 * si);
      keys[token * D + db] = __float2bfloat16(x0 * si + x1 * co);
    }
  }
}

size_t rebuild_shared_bytes(int head_dim, int page_size, int rank) {
  const int rows = rebuild_pages_at_once(page_size) * page_size;
  return static_cast<size_t>(head_dim + rows) * rank_stride(rank) * sizeof(__nv_bfloat16) +
         static_cast<size_t>(rows) * head_dim * sizeof(float);
}

bool valid_shape(int head_dim, int page_size) {
  return (head_dim == 64 || head_dim == 128) && page_size >= 8 && page_size <= 64 && page_size % 8 == 0;
}

}  // namespace

cudaError_t shadowkv_index_pages(const ShadowKvIndexParams& p, cudaStream_t stream) {
  if (p.num_pages < 0 || !valid_shape(p.head_dim, p.page_size)) return cudaErrorInvalidValue;
  if (p.num_pages == 0) return cudaSuccess;
  if (!p.kv_pool || !p.src_pages || !p.dst_entries || !p.summaries || (p.min_cos && !p.min_cos_at))
    return cudaErrorInvalidValue;
  const auto blocks = static_cast<unsigned>((p.num_pages + kWarps - 1) / kWarps);
  if (p.head_dim == 64)
    launch(shadowkv_index_kernel<64>, blocks, kThreads, 0, stream, p);
  else
    launch(shadowkv_index_kernel<128>, blocks, kThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t shadowkv_mark_outliers(const ShadowKvOutlierParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || items > INT_MAX || (p.head_dim != 64 && p.head_dim != 128))
    return cudaErrorInvalidValue;
  if (items == 0) return cudaSuccess;
  if (!p.pages || !p.offsets || !p.counts || !p.summary_dir || !p.dir_offsets || !p.summaries)
    return cudaErrorInvalidValue;
  launch(shadowkv_outlier_kernel, static_cast<unsigned>(items), 128, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t shadowkv_score_pages(const ShadowKvScoreParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (p.num_seqs < 0 || p.num_kv_heads < 0 || p.group < 1 || p.group > 8 || (p.head_dim != 64 && p.head_dim != 128) ||
      p.max_candidates < 0 || items > 65535)
    return cudaErrorInvalidValue;
  if (items == 0 || p.max_candidates == 0) return cudaSuccess;
  if (!p.q || !p.summaries || !p.summary_dir || !p.dir_offsets || !p.first_candidate || !p.end_candidate ||
      !p.logits || !p.scores || !aligned16(p.q) || !aligned16(p.summaries))
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.max_candidates + kThreads - 1) / kThreads), static_cast<unsigned>(items));
  return p.head_dim == 64 ? launch_score<64>(p, grid, stream) : launch_score<128>(p, grid, stream);
}

cudaError_t shadowkv_unrotate_keys(const ShadowKvUnrotateParams& p, cudaStream_t stream) {
  if (p.num_pages < 0 || p.first_page < 0 || p.num_kv_heads < 1 || !valid_shape(p.head_dim, p.page_size))
    return cudaErrorInvalidValue;
  if (p.num_pages == 0) return cudaSuccess;
  if (!p.kv_pool || !p.pages || !p.inv_freq || !p.keys) return cudaErrorInvalidValue;
  const int64_t warps = static_cast<int64_t>(p.num_pages) * p.num_kv_heads;
  const auto blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  if (p.head_dim == 64)
    launch(shadowkv_unrotate_kernel<64>, blocks, kThreads, 0, stream, p);
  else
    launch(shadowkv_unrotate_kernel<128>, blocks, kThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t shadowkv_store_factors(const ShadowKvStoreParams& p, cudaStream_t stream) {
  if (p.num_pages < 0 || p.num_kv_heads < 1 || !valid_shape(p.head_dim, p.page_size) || p.rank < 1 ||
      p.rank > p.page_size * p.head_dim || p.rank > 2 * p.num_kv_heads * p.head_dim ||
      p.ld_basis < p.num_kv_heads * p.head_dim)
    return cudaErrorInvalidValue;
  if (!p.kv_pool || (p.num_pages > 0 && (!p.factor_groups || !p.coeffs)) || !p.basis || !p.basis_groups)
    return cudaErrorInvalidValue;
  const int64_t elems = (static_cast<int64_t>(p.num_pages) * p.page_size + int64_t{p.num_kv_heads} * p.head_dim) * p.rank;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((elems + kThreads - 1) / kThreads, 4096));
  launch(shadowkv_store_kernel, blocks, kThreads, 0, stream, p);
  return cudaGetLastError();
}

int shadowkv_max_rank(int head_dim, int page_size, size_t shared_bytes) {
  // The largest multiple of 8 whose shared memory (rebuild_shared_bytes) fits; 0 if none does.
  int rank = 0;
  while (rebuild_shared_bytes(head_dim, page_size, rank + 8) <= shared_bytes) rank += 8;
  return rank;
}

cudaError_t shadowkv_rebuild_keys(const ShadowKvRebuildParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (p.num_seqs < 0 || p.num_kv_heads < 1 || items > INT_MAX || !valid_shape(p.head_dim, p.page_size) ||
      p.rank < 8 || p.rank % 8 != 0 ||
      p.rank > p.page_size * p.head_dim ||
      p.rank > 2 * p.num_kv_heads * p.head_dim || p.basis_groups < 1 || p.max_count < 0)
    return cudaErrorInvalidValue;
  if (items == 0 || p.max_count == 0) return cudaSuccess;
  if (!p.kv_pool || !p.pages || !p.logical || !p.offsets || !p.counts || !p.factor_dir || !p.factor_offsets ||
      !p.inv_freq)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>((p.max_count + kRebuildPages - 1) / kRebuildPages));
  // Fails (cudaErrorInvalidValue) past the device's shared memory per block: shadowkv_max_rank.
  const auto shared = static_cast<int>(rebuild_shared_bytes(p.head_dim, p.page_size, p.rank));
  cudaError_t e = cudaSuccess;
  if (p.head_dim == 64) {
    e = cudaFuncSetAttribute(shadowkv_rebuild_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (e == cudaSuccess) launch(shadowkv_rebuild_kernel<64>, grid, kThreads, shared, stream, p);
  } else {
    e = cudaFuncSetAttribute(shadowkv_rebuild_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (e == cudaSuccess) launch(shadowkv_rebuild_kernel<128>, grid, kThreads, shared, stream, p);
  }
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace spin::cuda
