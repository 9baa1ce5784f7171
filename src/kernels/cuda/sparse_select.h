#pragma once
// Sparse Index and Select on the GPU, for a decode step with no host round trip: Quest's page
// summaries (Index), their scores against the step's queries, and the per-(request, KV head)
// top-k that turns scores into the list of pages to attend (Select). Reference: the CPU algorithm
// in src/sparse/quest.cpp and the default select in src/sparse/algorithm.cpp.
//
// Pages are those of paged_attention.h (page p of a layer's pool slice starts at
// kv_pool + p * 2 * page_size * head_dim and holds K then V rows, bf16, of one (layer, KV head)).
//
// Summaries live in chunks of kSummaryChunkPages logical pages. Within one layer's slice of the
// summary pool, the summary of logical page p of KV head h of a request whose chunk for p is c
// (c = summary_dir[dir_offsets[seq] + p / kSummaryChunkPages]) is entry
//   (c * num_kv_heads + h) * kSummaryChunkPages + p % kSummaryChunkPages
// and entry e holds 2 * head_dim bf16 at summaries + e * 2 * head_dim: the elementwise minimum of
// the page's keys, then the maximum (exact in bf16: min and max only pick values).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

inline constexpr int kSummaryChunkPages = 64;

// The entry of logical page `page` of KV head `head` whose summary chunk is `chunk` (above).
__host__ __device__ constexpr int64_t summary_entry(int64_t chunk, int num_kv_heads, int head, int64_t page) {
  return (chunk * num_kv_heads + head) * kSummaryChunkPages + page % kSummaryChunkPages;
}

// Quest Index: for i < num_pages with src_pages[i] >= 0, writes the min/max summary of page
// src_pages[i] of kv_pool to entry dst_entries[i] of summaries. Entries with src_pages[i] < 0 are
// skipped (a decode step passes one entry per (row, KV head), -1 where no page completed).
struct QuestIndexParams {
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* src_pages = nullptr;
  const int32_t* dst_entries = nullptr;
  int num_pages = 0;
  int head_dim = 128;  // 64 or 128
  int page_size = 16;  // 8..64, multiple of 8
  __nv_bfloat16* summaries = nullptr;
};
cudaError_t quest_index_pages(const QuestIndexParams& p, cudaStream_t stream);

// Quest Select, scoring: item i = seq * num_kv_heads + h scores the candidate logical pages
// [first_candidate[seq], end_candidate[seq]) of its KV head: the upper bound of q.k over the page,
// sum_d max(q_d * max_d, q_d * min_d), maximised over the group's query heads
// h * group .. h * group + group - 1 (fp32 accumulation). The score of page p goes to
// scores[i * max_candidates + (p - first_candidate[seq])]; entries past the item's candidates are
// not written. Requires end - first <= max_candidates.
struct QuestScoreParams {
  const __nv_bfloat16* q = nullptr;  // [num_seqs][num_kv_heads * group][head_dim]
  const __nv_bfloat16* summaries = nullptr;  // this layer's slice of the summary pool
  const int32_t* summary_dir = nullptr;      // chunk ids, see above
  const int32_t* dir_offsets = nullptr;      // [num_seqs]
  const int32_t* first_candidate = nullptr;  // [num_seqs]
  const int32_t* end_candidate = nullptr;    // [num_seqs]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;  // 1..8
  int head_dim = 128;
  int max_candidates = 0;
  float* scores = nullptr;  // [num_seqs * num_kv_heads][max_candidates]
};
cudaError_t quest_score_pages(const QuestScoreParams& p, cudaStream_t stream);

// Select: for item i = seq * num_kv_heads + h, the counts[i] candidates with the highest scores
// among scores[i * max_candidates + j], j < end_candidate[seq] - first_candidate[seq] (ties: the
// lower page; NaN ranks below every number), written as logical pages (first_candidate[seq] + j)
// in ascending page order to out_pages[out_offsets[i] ..]. Requires counts[i] <= the item's
// candidates. Page selections stay within kMaxSelectedPages (the cache's bound); the kernel itself
// takes any count (RetroInfer's estimation zone selects clusters past it).
inline constexpr int kMaxSelectedPages = 2048;
struct SelectTopParams {
  const float* scores = nullptr;
  int max_candidates = 0;
  const int32_t* first_candidate = nullptr;  // [num_seqs]
  const int32_t* end_candidate = nullptr;    // [num_seqs]
  const int32_t* counts = nullptr;           // [num_seqs * num_kv_heads]
  const int32_t* out_offsets = nullptr;      // [num_seqs * num_kv_heads]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int32_t* out_pages = nullptr;
};
cudaError_t select_top_pages(const SelectTopParams& p, cudaStream_t stream);

}  // namespace spin::cuda
