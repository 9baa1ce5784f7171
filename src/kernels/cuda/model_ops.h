#pragma once
// The elementwise and row-wise kernels of the bf16 forward pass. Activations are bf16, math is
// fp32. Every function checks its shapes (cudaErrorInvalidValue) and returns the launch status.
//
// Layout of the fused projection output `qkv` (one row per token, row_stride >= q_width +
// 2 * kv_width elements): q heads [0, q_width), k heads [q_width, q_width + kv_width), v heads
// after them; q_width = n_heads * head_dim, kv_width = n_kv_heads * head_dim.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

// out[t] = table[ids[t]] for t < n_tokens; rows of `width` elements. Ids were checked on the host.
cudaError_t embedding_bf16(const int32_t* ids, int64_t n_tokens, const __nv_bfloat16* table,
                           int64_t width, __nv_bfloat16* out, cudaStream_t stream);

// The first `rows` tokens' q heads packed as [rows][q_width] (what decode attention reads).
struct QueryCopy {
  __nv_bfloat16* out = nullptr;
  int64_t rows = 0;
};

struct QkRopeParams {
  __nv_bfloat16* qkv = nullptr;        // [n_tokens][row_stride], updated in place (q and k parts)
  int64_t row_stride = 0;
  __nv_bfloat16* k_pre_rope = nullptr; // optional [n_tokens][kv_width]: k after the norm, before RoPE
  const int32_t* positions = nullptr;  // [n_tokens]
  int64_t n_tokens = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;                    // even, <= 256
  const __nv_bfloat16* q_norm = nullptr;  // optional [head_dim] (Qwen3 per-head RMSNorm of q)
  const __nv_bfloat16* k_norm = nullptr;  // optional [head_dim]
  float norm_eps = 1e-6f;
  const float* inv_freq = nullptr;     // [head_dim / 2] (RopeTable::inv_freq: Llama-3 / YaRN scaled)
  float mscale = 1.0f;                 // multiplies cos and sin (YaRN)
  bool neox = true;                    // rotate halves (true) or adjacent pairs (false), as cpu::rope
  // Optional: the same launch stores each token's k (after RoPE) and v into its KV page as
  // store_kv_pages_bf16 does (page page_of[t * n_kv_heads + h], slot slot_of[t]), and packs the
  // first q_copy.rows tokens' q heads (after RoPE) into q_copy.out. One launch instead of two saves
  // a kernel boundary per layer, which a batch-1 decode step pays for on every layer.
  __nv_bfloat16* kv_pool = nullptr;
  const int32_t* page_of = nullptr;
  const int32_t* slot_of = nullptr;
  int page_size = 0;
  QueryCopy q_copy = {};
};
// Per head: optional RMSNorm, then RoPE at positions[t] with angle = position * inv_freq[i];
// q and k are rewritten in place, and with kv_pool also stored to their pages.
cudaError_t qk_norm_rope_bf16(const QkRopeParams& p, cudaStream_t stream);

// Writes the k and v heads of each token into its KV page (layout: paged_attention.h):
// token t, KV head h goes to page page_of[t * n_kv_heads + h], slot slot_of[t]. With `q` (rows
// <= n_tokens), the same launch also packs those tokens' q heads into q.out.
cudaError_t store_kv_pages_bf16(const __nv_bfloat16* qkv, int64_t row_stride, int64_t q_width,
                                const int32_t* page_of, const int32_t* slot_of, int64_t n_tokens,
                                int n_kv_heads, int head_dim, int page_size,
                                __nv_bfloat16* kv_pool, cudaStream_t stream, QueryCopy q = {});

// out[t][i] = silu(gate_up[t][i]) * gate_up[t][ffn + i]: the fused gate|up projection in, the
// down projection's input out.
cudaError_t silu_mul_bf16(const __nv_bfloat16* gate_up, int64_t n_tokens, int64_t ffn,
                          __nv_bfloat16* out, cudaStream_t stream);

// Gathers rows: out[i] = in[rows[i]] (width elements), e.g. the last token of each sequence.
cudaError_t gather_rows_bf16(const __nv_bfloat16* in, const int32_t* rows, int64_t n_rows,
                             int64_t width, __nv_bfloat16* out, cudaStream_t stream);

// fp32 -> bf16 (round to nearest even) and back, for weights and tests.
cudaError_t convert_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, cudaStream_t stream);
cudaError_t convert_bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n, cudaStream_t stream);

}  // namespace spin::cuda
