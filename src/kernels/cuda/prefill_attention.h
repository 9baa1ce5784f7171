#pragma once
// Causal attention for prefill chunks over paged KV on the GPU: every new token of a sequence
// attends to all of that sequence's positions up to and including its own, reading earlier
// chunks' K/V from the same pages (the chunk's own K/V were stored into the pages first, by
// store_kv_pages_bf16). Flash-style: bf16 tensor-core products, fp32 online softmax, no score
// matrix in memory. Page layout and page lists as in paged_attention.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

struct PagedPrefillParams {
  const __nv_bfloat16* q = nullptr;        // [total_tokens][num_kv_heads * group][head_dim]
  int64_t q_row_stride = 0;                // elements between tokens' q rows (>= heads * head_dim,
                                           // a multiple of 8); 0 means heads * head_dim
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* page_ids = nullptr;       // concatenated page lists, per (seq, kv head)
  const int32_t* list_offsets = nullptr;   // [num_seqs * num_kv_heads + 1]
  const int32_t* token_offsets = nullptr;  // [num_seqs + 1]: seq s owns q rows [token_offsets[s], token_offsets[s+1])
  const int32_t* first_pos = nullptr;      // [num_seqs]: position of the sequence's first new token
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;        // 1..8
  int head_dim = 128;   // 64 or 128
  int page_size = 16;   // multiple of 8 in [8, 64]
  int max_new_tokens = 0;  // max over sequences of new tokens (sizes the grid)
  float scale = 0.0f;      // softmax scale, > 0 (usually 1/sqrt(head_dim))
  // Work split of a 128-row query tile: -1 the default (2 where it runs, else 0); 0: 4 warps of
  // 32 rows (2 blocks per SM, Q re-read from shared memory every KV tile); 1: 8 warps of 16 rows
  // (1 block per SM, Q in registers); 2: two warpgroups of 64 rows on Hopper's wgmma, fed by a
  // third that copies (TMA, clusters of 2 blocks sharing K/V; head_dim 128 only;
  // cudaErrorNotSupported where prefill_wgmma_available() is false). For benchmarks and tuning; all
  // compute the same result.
  int variant = -1;
};

// out: [total_tokens][num_kv_heads * group][head_dim] bf16. A sequence's page list must cover
// positions [0, first_pos + new tokens), and its new tokens must not exceed max_new_tokens (the
// kernel cannot check either). q, kv_pool and out must be 16-byte aligned. Returns
// cudaErrorInvalidValue on unsupported shapes or null pointers, else the launch status; a batch
// with no tokens launches nothing.
// Whether variant 2 runs here: spin was built with sm_90a code, the current GPU is sm_90 and the
// driver encodes TMA tensor maps.
bool prefill_wgmma_available();

cudaError_t paged_prefill_attention(const PagedPrefillParams& p, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace spin::cuda
