#include "kernels/cuda/model_ops.h"

#include <algorithm>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/launch.cuh"

namespace spin::cuda {

namespace {

using bf16 = __nv_bfloat16;

// Grid-stride loops cover any remainder, so the grid is capped well below the launch limit.
unsigned grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 20));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// ---- row copies: embedding lookup and row gather are the same operation -------------------

constexpr int kCopyThreads = 128;

// Unit is the widest word (16, 4 or 2 bytes) that every row start is aligned to.
template <typename Unit>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(const Unit* __restrict__ src, const int32_t* __restrict__ rows, int64_t n_rows,
                     int64_t units_per_row, Unit* __restrict__ out) {
  enter_dependent_grid();
  for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
    const Unit* from = src + static_cast<int64_t>(rows[r]) * units_per_row;
    Unit* to = out + r * units_per_row;
    for (int64_t i = threadIdx.x; i < units_per_row; i += kCopyThreads) to[i] = from[i];
  }
}

cudaError_t copy_rows(const bf16* src, const int32_t* rows, int64_t n_rows, int64_t width,
                      bf16* out, cudaStream_t stream) {
  if (n_rows < 0 || width <= 0) return cudaErrorInvalidValue;
  if (n_rows == 0) return cudaSuccess;
  if (!src || !rows || !out) return cudaErrorInvalidValue;
  const int64_t row_bytes = width * 2;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n_rows, int64_t{1} << 20));
  if (row_bytes % 16 == 0 && aligned(src, 16) && aligned(out, 16)) {
    launch(copy_rows_kernel<uint4>, blocks, kCopyThreads, 0, stream, reinterpret_cast<const uint4*>(src), rows,
           n_rows, row_bytes / 16, reinterpret_cast<uint4*>(out));
  } else if (row_bytes % 4 == 0 && aligned(src, 4) && aligned(out, 4)) {
    launch(copy_rows_kernel<uint32_t>, blocks, kCopyThreads, 0, stream, reinterpret_cast<const uint32_t*>(src),
           rows, n_rows, row_bytes / 4, reinterpret_cast<uint32_t*>(out));
  } else {
    launch(copy_rows_kernel<uint16_t>, blocks, kCopyThreads, 0, stream, reinterpret_cast<const uint16_t*>(src),
           rows, n_rows, width, reinterpret_cast<uint16_t*>(out));
  }
  return cudaGetLastError();
}

// ---- q/k RMSNorm + RoPE ------------------------------------------------------------------------

constexpr int kRopeThreads = 256;
constexpr int kRopeWarps = kRopeThreads / 32;  // heads per block
constexpr int kMaxHeadDim = 256;
constexpr int kPairsPerLane = kMaxHeadDim / 2 / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// A block per (token, group of kRopeWarps heads): the token's cos/sin table is computed in shared
// memory (angle and trigonometry in double, as cpu::rope, so large positions keep their
// precision), then each warp takes one head (q heads, then k heads, then, when it stores pages,
// v heads, which it only copies). At batch 1 the heads spread over several SMs instead of queueing
// on one block's warps. Lane l owns pairs l, l + 32, ...; a warp's loads of one pair member are
// 32 consecutive (neox) or every-other (interleaved) bf16, so they coalesce.
__global__ void __launch_bounds__(kRopeThreads) qk_norm_rope_kernel(QkRopeParams p) {
  enter_dependent_grid();
  __shared__ float cos_table[kMaxHeadDim / 2];
  __shared__ float sin_table[kMaxHeadDim / 2];
  const int half = p.head_dim / 2;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int qk_heads = p.n_heads + p.n_kv_heads;
  const int heads = qk_heads + (p.kv_pool ? p.n_kv_heads : 0);
  const int64_t kv_width = static_cast<int64_t>(p.n_kv_heads) * p.head_dim;
  const int64_t page_elems = static_cast<int64_t>(p.page_size) * p.head_dim;  // one K or V half
  for (int64_t t = blockIdx.x; t < p.n_tokens; t += gridDim.x) {
    const double pos = static_cast<double>(p.positions[t]);
    for (int i = threadIdx.x; i < half; i += kRopeThreads) {
      double s, c;
      sincos(pos * static_cast<double>(p.inv_freq[i]), &s, &c);
      cos_table[i] = static_cast<float>(c) * p.mscale;
      sin_table[i] = static_cast<float>(s) * p.mscale;
    }
    __syncthreads();
    for (int h = blockIdx.y * kRopeWarps + warp; h < heads; h += gridDim.y * kRopeWarps) {
      const bool is_v = h >= qk_heads;
      const bool is_k = !is_v && h >= p.n_heads;
      // Heads run q, k, v as in the row, so h also indexes the row's heads.
      bf16* x = p.qkv + t * p.row_stride + static_cast<int64_t>(h) * p.head_dim;
      bf16* page_row = nullptr;  // this token's slot of its K or V page half
      if (p.kv_pool && (is_k || is_v)) {
        const int kv_head = h - (is_v ? qk_heads : p.n_heads);
        const int64_t page = p.page_of[t * p.n_kv_heads + kv_head];
        page_row = p.kv_pool + (page * 2 + (is_v ? 1 : 0)) * page_elems +
                   static_cast<int64_t>(p.slot_of[t]) * p.head_dim;
      }
      if (is_v) {
        for (int i = lane; i < p.head_dim; i += 32) page_row[i] = x[i];
        continue;
      }
      bf16* q_row = !is_k && t < p.q_copy.rows
                        ? p.q_copy.out + t * static_cast<int64_t>(p.n_heads) * p.head_dim +
                              static_cast<int64_t>(h) * p.head_dim
                        : nullptr;
      const bf16* norm = is_k ? p.k_norm : p.q_norm;
      float x0[kPairsPerLane], x1[kPairsPerLane];
      float sum_sq = 0.0f;
#pragma unroll
      for (int j = 0; j < kPairsPerLane; ++j) {
        const int i = lane + 32 * j;
        x0[j] = x1[j] = 0.0f;
        if (i < half) {
          x0[j] = __bfloat162float(x[p.neox ? i : 2 * i]);
          x1[j] = __bfloat162float(x[p.neox ? i + half : 2 * i + 1]);
          sum_sq += x0[j] * x0[j] + x1[j] * x1[j];
        }
      }
      if (norm) {
        const float scale =
            1.0f / sqrtf(warp_sum(sum_sq) / static_cast<float>(p.head_dim) + p.norm_eps);
#pragma unroll
        for (int j = 0; j < kPairsPerLane; ++j) {
          const int i = lane + 32 * j;
          if (i < half) {
            x0[j] = x0[j] * scale * __bfloat162float(norm[p.neox ? i : 2 * i]);
            x1[j] = x1[j] * scale * __bfloat162float(norm[p.neox ? i + half : 2 * i + 1]);
          }
        }
      }
      bf16* pre = (is_k && p.k_pre_rope)
                      ? p.k_pre_rope + t * kv_width +
                            static_cast<int64_t>(h - p.n_heads) * p.head_dim
                      : nullptr;
#pragma unroll
      for (int j = 0; j < kPairsPerLane; ++j) {
        const int i = lane + 32 * j;
        if (i < half) {
          const int a = p.neox ? i : 2 * i;
          const int b = p.neox ? i + half : 2 * i + 1;
          if (pre) {
            pre[a] = __float2bfloat16(x0[j]);
            pre[b] = __float2bfloat16(x1[j]);
          }
          const float c = cos_table[i];
          const float s = sin_table[i];
          const bf16 ra = __float2bfloat16(x0[j] * c - x1[j] * s);
          const bf16 rb = __float2bfloat16(x0[j] * s + x1[j] * c);
          x[a] = ra;
          x[b] = rb;
          bf16* copy = page_row ? page_row : q_row;
          if (copy) {
            copy[a] = ra;
            copy[b] = rb;
          }
        }
      }
    }
    __syncthreads();  // the next token rewrites the tables
  }
}

// ---- KV page stores ----------------------------------------------------------------------------

constexpr int kStoreThreads = 256;

// Work item (token, kv head, K or V, unit): consecutive threads copy consecutive units of one
// head row, so both the read of the qkv row and the write of the page slot are contiguous. Items
// from `total` on copy q units of the first q rows into q_out. Index is 32-bit when the work fits
// (its divisions are much cheaper than 64-bit ones).
template <typename Unit, typename Index>
__global__ void __launch_bounds__(kStoreThreads)
    store_kv_pages_kernel(const Unit* __restrict__ qkv, int64_t row_units, Index q_units,
                          const int32_t* __restrict__ page_of, const int32_t* __restrict__ slot_of,
                          Index total, Index n_kv_heads, Index head_units, int page_size,
                          Unit* __restrict__ pool, Unit* __restrict__ q_out, Index q_total) {
  enter_dependent_grid();
  for (int64_t i = global_thread(); i < static_cast<int64_t>(total) + q_total; i += grid_threads()) {
    if (i >= static_cast<int64_t>(total)) {
      const Index j = static_cast<Index>(i - static_cast<int64_t>(total));
      const Index t = j / q_units;
      q_out[j] = qkv[static_cast<int64_t>(t) * row_units + (j - t * q_units)];
      continue;
    }
    const Index idx = static_cast<Index>(i);
    const Index unit = idx % head_units;
    Index rest = idx / head_units;
    const Index is_v = rest % 2;
    rest /= 2;
    const Index head = rest % n_kv_heads;
    const int64_t t = rest / n_kv_heads;
    const Unit* from = qkv + t * row_units + q_units +
                       static_cast<int64_t>(is_v * n_kv_heads + head) * head_units;
    const int64_t page = page_of[t * n_kv_heads + head];
    Unit* to = pool + (page * 2 + is_v) * page_size * static_cast<int64_t>(head_units) +
               static_cast<int64_t>(slot_of[t]) * head_units;
    to[unit] = from[unit];
  }
}

template <typename Unit>
void launch_store_kv(const Unit* qkv, int64_t row_units, int64_t q_units, const int32_t* page_of,
                     const int32_t* slot_of, int64_t n_tokens, int n_kv_heads, int64_t head_units,
                     int page_size, Unit* pool, Unit* q_out, int64_t q_rows, cudaStream_t stream) {
  const int64_t total = n_tokens * n_kv_heads * 2 * head_units;
  const int64_t q_total = q_out ? q_rows * q_units : 0;
  const unsigned blocks = grid_for(total + q_total, kStoreThreads);
  if (total + q_total <= UINT32_MAX) {
    launch(store_kv_pages_kernel<Unit, uint32_t>, blocks, kStoreThreads, 0, stream, qkv, row_units,
           static_cast<uint32_t>(q_units), page_of, slot_of, static_cast<uint32_t>(total),
           static_cast<uint32_t>(n_kv_heads), static_cast<uint32_t>(head_units), page_size, pool, q_out,
           static_cast<uint32_t>(q_total));
  } else {
    launch(store_kv_pages_kernel<Unit, int64_t>, blocks, kStoreThreads, 0, stream, qkv, row_units, q_units,
           page_of, slot_of, total, int64_t{n_kv_heads}, head_units, page_size, pool, q_out, q_total);
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------

constexpr int kElementwiseThreads = 256;

__device__ __forceinline__ float silu_times(float g, float u) {
  return g / (1.0f + expf(-g)) * u;  // cpu::silu_mul's expression
}

template <typename Index>
__global__ void __launch_bounds__(kElementwiseThreads)
    silu_mul_vec_kernel(const Bf16x8* __restrict__ gate_up, Index total, Index ffn_units,
                        Bf16x8* __restrict__ out) {
  enter_dependent_grid();
  for (int64_t i = global_thread(); i < static_cast<int64_t>(total); i += grid_threads()) {
    const Index idx = static_cast<Index>(i);
    const Index t = idx / ffn_units;
    const Index unit = idx - t * ffn_units;
    const int64_t in = static_cast<int64_t>(t) * 2 * ffn_units + unit;
    const Bf16x8 g = gate_up[in];
    const Bf16x8 u = gate_up[in + ffn_units];
    Bf16x8 r;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 gf = __bfloat1622float2(g.pair[k]);
      const float2 uf = __bfloat1622float2(u.pair[k]);
      r.pair[k] = __floats2bfloat162_rn(silu_times(gf.x, uf.x), silu_times(gf.y, uf.y));
    }
    out[i] = r;
  }
}

__global__ void __launch_bounds__(kElementwiseThreads)
    silu_mul_kernel(const bf16* __restrict__ gate_up, int64_t n_tokens, int64_t ffn,
                    bf16* __restrict__ out) {
  enter_dependent_grid();
  const int64_t total = n_tokens * ffn;
  for (int64_t idx = global_thread(); idx < total; idx += grid_threads()) {
    const int64_t t = idx / ffn;
    const int64_t i = idx - t * ffn;
    const float g = __bfloat162float(gate_up[t * 2 * ffn + i]);
    const float u = __bfloat162float(gate_up[t * 2 * ffn + ffn + i]);
    out[idx] = __float2bfloat16(silu_times(g, u));
  }
}

// ---- conversions -------------------------------------------------------------------------------

// Threads first take 8-element units (16-byte bf16 side) when both pointers allow it, then the
// tail (or everything, unaligned) one element at a time.
__global__ void __launch_bounds__(kElementwiseThreads)
    f32_to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, int64_t n,
                       int64_t units) {
  enter_dependent_grid();
  for (int64_t idx = global_thread(); idx < units; idx += grid_threads()) {
    const float4 a = reinterpret_cast<const float4*>(in)[2 * idx];
    const float4 b = reinterpret_cast<const float4*>(in)[2 * idx + 1];
    Bf16x8 r;
    r.pair[0] = __floats2bfloat162_rn(a.x, a.y);
    r.pair[1] = __floats2bfloat162_rn(a.z, a.w);
    r.pair[2] = __floats2bfloat162_rn(b.x, b.y);
    r.pair[3] = __floats2bfloat162_rn(b.z, b.w);
    reinterpret_cast<Bf16x8*>(out)[idx] = r;
  }
  for (int64_t i = units * 8 + global_thread(); i < n; i += grid_threads())
    out[i] = __float2bfloat16(in[i]);
}

__global__ void __launch_bounds__(kElementwiseThreads)
    bf16_to_f32_kernel(const bf16* __restrict__ in, float* __restrict__ out, int64_t n,
                       int64_t units) {
  enter_dependent_grid();
  for (int64_t idx = global_thread(); idx < units; idx += grid_threads()) {
    const Bf16x8 v = reinterpret_cast<const Bf16x8*>(in)[idx];
    const float2 f0 = __bfloat1622float2(v.pair[0]);
    const float2 f1 = __bfloat1622float2(v.pair[1]);
    const float2 f2 = __bfloat1622float2(v.pair[2]);
    const float2 f3 = __bfloat1622float2(v.pair[3]);
    reinterpret_cast<float4*>(out)[2 * idx] = make_float4(f0.x, f0.y, f1.x, f1.y);
    reinterpret_cast<float4*>(out)[2 * idx + 1] = make_float4(f2.x, f2.y, f3.x, f3.y);
  }
  for (int64_t i = units * 8 + global_thread(); i < n; i += grid_threads())
    out[i] = __bfloat162float(in[i]);
}

}  // namespace

cudaError_t embedding_bf16(const int32_t* ids, int64_t n_tokens, const __nv_bfloat16* table,
                           int64_t width, __nv_bfloat16* out, cudaStream_t stream) {
  return copy_rows(table, ids, n_tokens, width, out, stream);
}

cudaError_t gather_rows_bf16(const __nv_bfloat16* in, const int32_t* rows, int64_t n_rows,
                             int64_t width, __nv_bfloat16* out, cudaStream_t stream) {
  return copy_rows(in, rows, n_rows, width, out, stream);
}

cudaError_t qk_norm_rope_bf16(const QkRopeParams& p, cudaStream_t stream) {
  if (p.n_tokens < 0 || p.n_heads <= 0 || p.n_kv_heads <= 0 || p.head_dim <= 0 ||
      p.head_dim % 2 != 0 || p.head_dim > kMaxHeadDim ||
      p.row_stride < static_cast<int64_t>(p.n_heads + 2 * p.n_kv_heads) * p.head_dim)
    return cudaErrorInvalidValue;
  if (p.n_tokens == 0) return cudaSuccess;
  if (!p.qkv || !p.positions || !p.inv_freq) return cudaErrorInvalidValue;
  if (p.kv_pool && (!p.page_of || !p.slot_of || p.page_size <= 0)) return cudaErrorInvalidValue;
  if (p.q_copy.rows < 0 || p.q_copy.rows > p.n_tokens || (p.q_copy.rows > 0 && !p.q_copy.out))
    return cudaErrorInvalidValue;
  const int heads = p.n_heads + p.n_kv_heads + (p.kv_pool ? p.n_kv_heads : 0);
  const dim3 blocks(static_cast<unsigned>(std::min<int64_t>(p.n_tokens, int64_t{1} << 20)),
                    static_cast<unsigned>(std::min(65535, (heads + kRopeWarps - 1) / kRopeWarps)));
  launch(qk_norm_rope_kernel, blocks, kRopeThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t store_kv_pages_bf16(const __nv_bfloat16* qkv, int64_t row_stride, int64_t q_width,
                                const int32_t* page_of, const int32_t* slot_of, int64_t n_tokens,
                                int n_kv_heads, int head_dim, int page_size,
                                __nv_bfloat16* kv_pool, cudaStream_t stream, QueryCopy q) {
  if (n_tokens < 0 || n_kv_heads <= 0 || head_dim <= 0 || page_size <= 0 || q_width < 0 ||
      row_stride < q_width + 2 * static_cast<int64_t>(n_kv_heads) * head_dim || q.rows < 0 ||
      q.rows > n_tokens || (q.rows > 0 && (!q.out || q_width == 0)))
    return cudaErrorInvalidValue;
  if (n_tokens == 0) return cudaSuccess;
  if (!qkv || !page_of || !slot_of || !kv_pool) return cudaErrorInvalidValue;
  const int64_t q_rows = q.out ? q.rows : 0;
  if (head_dim % 8 == 0 && row_stride % 8 == 0 && q_width % 8 == 0 && aligned(qkv, 16) &&
      aligned(kv_pool, 16) && (!q.out || aligned(q.out, 16))) {
    launch_store_kv(reinterpret_cast<const uint4*>(qkv), row_stride / 8, q_width / 8, page_of,
                    slot_of, n_tokens, n_kv_heads, head_dim / 8, page_size,
                    reinterpret_cast<uint4*>(kv_pool), reinterpret_cast<uint4*>(q.out), q_rows, stream);
  } else {
    launch_store_kv(reinterpret_cast<const uint16_t*>(qkv), row_stride, q_width, page_of, slot_of,
                    n_tokens, n_kv_heads, head_dim, page_size,
                    reinterpret_cast<uint16_t*>(kv_pool), reinterpret_cast<uint16_t*>(q.out), q_rows, stream);
  }
  return cudaGetLastError();
}

cudaError_t silu_mul_bf16(const __nv_bfloat16* gate_up, int64_t n_tokens, int64_t ffn,
                          __nv_bfloat16* out, cudaStream_t stream) {
  if (n_tokens < 0 || ffn <= 0) return cudaErrorInvalidValue;
  if (n_tokens == 0) return cudaSuccess;
  if (!gate_up || !out) return cudaErrorInvalidValue;
  if (ffn % 8 == 0 && aligned(gate_up, 16) && aligned(out, 16)) {
    const int64_t units = ffn / 8;
    const int64_t total = n_tokens * units;
    const unsigned blocks = grid_for(total, kElementwiseThreads);
    const auto* in = reinterpret_cast<const Bf16x8*>(gate_up);
    auto* to = reinterpret_cast<Bf16x8*>(out);
    if (total <= UINT32_MAX) {
      launch(silu_mul_vec_kernel<uint32_t>, blocks, kElementwiseThreads, 0, stream, in,
             static_cast<uint32_t>(total), static_cast<uint32_t>(units), to);
    } else {
      launch(silu_mul_vec_kernel<int64_t>, blocks, kElementwiseThreads, 0, stream, in, total, units, to);
    }
  } else {
    launch(silu_mul_kernel, grid_for(n_tokens * ffn, kElementwiseThreads), kElementwiseThreads, 0, stream, gate_up,
           n_tokens, ffn, out);
  }
  return cudaGetLastError();
}

cudaError_t convert_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n,
                                cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!in || !out) return cudaErrorInvalidValue;
  const int64_t units = (aligned(in, 16) && aligned(out, 16)) ? n / 8 : 0;
  launch(f32_to_bf16_kernel, grid_for(std::max<int64_t>(units, n - units * 8), kElementwiseThreads), kElementwiseThreads,
         0, stream, in, out, n, units);
  return cudaGetLastError();
}

cudaError_t convert_bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n,
                                cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!in || !out) return cudaErrorInvalidValue;
  const int64_t units = (aligned(in, 16) && aligned(out, 16)) ? n / 8 : 0;
  launch(bf16_to_f32_kernel, grid_for(std::max<int64_t>(units, n - units * 8), kElementwiseThreads), kElementwiseThreads,
         0, stream, in, out, n, units);
  return cudaGetLastError();
}

}  // namespace spin::cuda
