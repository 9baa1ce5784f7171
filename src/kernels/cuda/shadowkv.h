#pragma once
// ShadowKV on the GPU: Index (chunk landmarks, outlier chunks), Select's scores, and the key
// rebuild from the low-rank factors of the prompt's pre-RoPE keys. Reference: the CPU algorithm
// in src/sparse/shadowkv.cpp. A chunk is one page; the top-k over the scores is select_top_pages
// (sparse_select.h), and the factorisation itself (cuBLAS, cuSOLVER) is engine/cuda/shadowkv_factors.
//
// Pages are those of paged_attention.h. Summaries use Quest's chunks, directory and entry size
// (sparse_select.h): a ShadowKV entry holds the chunk's landmark (the mean of its stored keys,
// RoPE applied) as head_dim bf16, then one bf16 flag: 1 for an outlier chunk, which Select always
// takes (its score is +inf), else 0.
//
// Factors live in device page groups of the store's pool. In one layer's slice a group's
// num_kv_heads pages are contiguous: group_elems = num_kv_heads * 2 * page_size * head_dim bf16.
//  - A, the prompt tokens' coefficients (bf16 rows of `rank`): the page_size rows of logical page
//    p sit in group factor_groups[p / pages_per_factor_group] at element
//    (p % pages_per_factor_group) * page_size * rank of its layer slice.
//  - B, the basis (bf16 rows of `rank`; row h * head_dim + d is dimension d of KV head h): row d
//    of KV head h sits in page basis_groups[d / rows_per_page] * num_kv_heads + h, at element
//    (d % rows_per_page) * rank of the page.
// The rebuild multiplies them on tensor cores (bf16 in, fp32 sums), as ShadowKV's own kernels do.
// The pool holds k_t = mscale * R(t) k_pre_t; the factors are those of R(-t) k_t, so a rebuilt key
// is turned by R(t) alone and carries mscale as the stored one does.
//
// RoPE (the model's, cpu::rope): pair i of head_dim / 2 is (i, i + head_dim / 2) when neox, else
// (2i, 2i + 1); at position t it turns by t * inv_freq[i] (the angle in double).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

// Logical pages of A rows per factor group, and rows of B per page.
constexpr int shadowkv_pages_per_factor_group(int num_kv_heads, int head_dim, int rank) {
  return 2 * num_kv_heads * head_dim / rank;
}
constexpr int shadowkv_basis_rows_per_page(int page_size, int head_dim, int rank) {
  return 2 * page_size * head_dim / rank;
}
// Groups a sequence's basis takes.
constexpr int shadowkv_basis_groups(int page_size, int head_dim, int rank) {
  const int rows = shadowkv_basis_rows_per_page(page_size, head_dim, rank);
  return (head_dim + rows - 1) / rows;
}

// Index: for i < num_pages with src_pages[i] >= 0, writes the landmark of page src_pages[i] of
// kv_pool to entry dst_entries[i] with flag 0. With min_cos set, also the negated smallest cosine
// similarity of the page's keys to the (fp32) mean at min_cos[min_cos_at[i]] (none where
// min_cos_at[i] < 0): select_top_pages over those values picks the outlier chunks, the lowest
// cosines, ties to the lower page, as the CPU's partial sort does. A zero key or mean counts as
// cosine 1.
struct ShadowKvIndexParams {
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* src_pages = nullptr;
  const int32_t* dst_entries = nullptr;
  int num_pages = 0;
  int head_dim = 128;  // 64 or 128
  int page_size = 8;   // 8..64, multiple of 8
  __nv_bfloat16* summaries = nullptr;
  float* min_cos = nullptr;
  const int32_t* min_cos_at = nullptr;
};
cudaError_t shadowkv_index_pages(const ShadowKvIndexParams& p, cudaStream_t stream);

// Sets the outlier flag of the pages[offsets[i] .. offsets[i] + counts[i]) (logical pages) of
// item i = seq * num_kv_heads + h, whose entries the summary directory of seq gives.
struct ShadowKvOutlierParams {
  const int32_t* pages = nullptr;
  const int32_t* offsets = nullptr;  // [num_seqs * num_kv_heads]
  const int32_t* counts = nullptr;   // [num_seqs * num_kv_heads]
  const int32_t* summary_dir = nullptr;
  const int32_t* dir_offsets = nullptr;  // [num_seqs]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  __nv_bfloat16* summaries = nullptr;
};
cudaError_t shadowkv_mark_outliers(const ShadowKvOutlierParams& p, cudaStream_t stream);

// Score: item i = seq * num_kv_heads + h. For each query head of the group, the softmax over the
// candidates [first_candidate[seq], end_candidate[seq]) of q . landmark * scale; a candidate's
// score is the largest of its probabilities over the group, +inf for an outlier chunk, written to
// scores[i * max_candidates + (p - first)]. logits is scratch of shadowkv_score_scratch floats.
// Entries past the item's candidates are not written.
struct ShadowKvScoreParams {
  const __nv_bfloat16* q = nullptr;          // [num_seqs][num_kv_heads * group][head_dim]
  const __nv_bfloat16* summaries = nullptr;  // this layer's slice of the summary pool
  const int32_t* summary_dir = nullptr;
  const int32_t* dir_offsets = nullptr;      // [num_seqs]
  const int32_t* first_candidate = nullptr;  // [num_seqs]
  const int32_t* end_candidate = nullptr;    // [num_seqs]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;  // 1..8
  int head_dim = 128;
  float scale = 1.0f;
  int max_candidates = 0;
  float* logits = nullptr;
  float* scores = nullptr;  // [num_seqs * num_kv_heads][max_candidates]
};
cudaError_t shadowkv_score_pages(const ShadowKvScoreParams& p, cudaStream_t stream);
// Score scratch: the logits ([item][head][max_candidates]), then per (item, block of 256
// candidates, head) a (max, sum) pair.
constexpr int64_t shadowkv_score_partials_at(int64_t items, int group, int max_candidates) {
  return items * group * max_candidates;
}
constexpr int64_t shadowkv_score_scratch(int64_t items, int group, int max_candidates) {
  return shadowkv_score_partials_at(items, group, max_candidates) + items * ((max_candidates + 255) / 256) * group * 2;
}

// The pre-RoPE keys of a prompt, for its factorisation: row t (t < num_pages * page_size) of
// `keys` (fp32, row-major with num_kv_heads * head_dim columns, head h at columns h * head_dim ..)
// is token first_page * page_size + t turned back by its position, read from page
// pages[(t / page_size) * num_kv_heads + h] of kv_pool.
struct ShadowKvUnrotateParams {
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* pages = nullptr;
  int first_page = 0;
  int num_pages = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  int page_size = 8;
  const float* inv_freq = nullptr;  // [head_dim / 2], device memory
  bool neox = true;
  float* keys = nullptr;
};
cudaError_t shadowkv_unrotate_keys(const ShadowKvUnrotateParams& p, cudaStream_t stream);

// Stores one layer's factorisation of a prompt in its groups (layout above), rounded to bf16: A's
// rows for tokens t < num_pages * page_size from coeffs (fp32 row-major [t][rank]), and B from
// basis (fp32 column-major [num_kv_heads * head_dim][ld_basis]: B's row i is basis[i + j *
// ld_basis], j < rank).
struct ShadowKvStoreParams {
  __nv_bfloat16* kv_pool = nullptr;  // the layer's slice
  const int32_t* factor_groups = nullptr;  // A's groups, from logical page 0
  const int32_t* basis_groups = nullptr;
  int num_pages = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  int page_size = 8;
  int rank = 0;
  const float* coeffs = nullptr;
  const float* basis = nullptr;
  int ld_basis = 0;
};
cudaError_t shadowkv_store_factors(const ShadowKvStoreParams& p, cudaStream_t stream);

// Rebuild: item i = seq * num_kv_heads + h rebuilds the keys of pages[offsets[i] .. + counts[i]):
// page j holds logical page logical[offsets[i] + j]'s values (Retrieve fetched them) and gets its
// page_size keys: row t = R(pos) (A row pos . B rows of head h), pos = logical * page_size + t,
// rounded to bf16. Sequence seq's basis groups are factor_dir[factor_offsets[seq] ..
// + basis_groups) and its A groups follow them. A null `counts` (a sequence of no ShadowKV row)
// is not allowed; counts[i] = 0 rebuilds nothing.
struct ShadowKvRebuildParams {
  __nv_bfloat16* kv_pool = nullptr;  // the layer's slice: factors in, rebuilt keys out
  const int32_t* pages = nullptr;
  const int32_t* logical = nullptr;
  const int32_t* offsets = nullptr;  // [num_seqs * num_kv_heads]
  const int32_t* counts = nullptr;   // [num_seqs * num_kv_heads]
  const int32_t* factor_dir = nullptr;
  const int32_t* factor_offsets = nullptr;  // [num_seqs]
  int basis_groups = 0;
  // Bound on counts[i]: the grid covers that many pages per item. A captured graph replays the
  // grid, so it must come from what keys the graph (not from this step's selection).
  int max_count = 0;
  int num_seqs = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  int page_size = 8;
  int rank = 0;
  const float* inv_freq = nullptr;
  bool neox = true;
};
// Largest rank shadowkv_rebuild_keys takes for this head_dim and page_size within shared_bytes of
// shared memory per block (the device's opt-in limit); the rank must also be a multiple of 8.
int shadowkv_max_rank(int head_dim, int page_size, size_t shared_bytes);
cudaError_t shadowkv_rebuild_keys(const ShadowKvRebuildParams& p, cudaStream_t stream);

}  // namespace spin::cuda
