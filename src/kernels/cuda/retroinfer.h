#pragma once
// RetroInfer on the GPU: Index (k-means over segments of keys, and the cluster summaries), Select's
// scores (clusters, then pages) and the estimation zone, and the estimation terms merged into the
// decode attention's output. Reference: the CPU algorithm in src/sparse/retroinfer.cpp. The top-k
// of pages and of estimation clusters is select_top_pages (sparse_select.h).
//
// Pages are those of paged_attention.h. Summaries live in device page groups of the store's pool,
// in records, one per logical page of a (layer, KV head): the record of logical page p sits in
// group dir[p / records_per_page] (the page of its KV head in the layer's slice) at byte
// (p % records_per_page) * record_bytes. A record holds, for its page's page_size tokens and its
// `slots` cluster slots (cluster slot c belongs to the record of page c / slots):
//   int32 cluster[page_size]   the cluster slot of each token
//   int32 member[page_size]    token positions in cluster order: the members of the clusters of a
//                              segment [f, e) are entries f * page_size .. e * page_size (entry i
//                              in the record of page i / page_size), each cluster's ascending
//   int32 start[slots], size[slots]  a cluster's first member entry and its member count (0: empty)
//   float value_sum[slots][head_dim]
//   bf16 centroid[slots][head_dim]   the mean of its members' stored keys (RoPE applied)
// A segment of logical pages [f, e) owns cluster slots [f * slots, e * slots): its k-means cluster
// j is slot f * slots + j, and slots past its k clusters are empty.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

inline constexpr int kRetroInferMaxSegmentTokens = 8192;

constexpr int retroinfer_slots_per_page(int page_size, int cluster_tokens) {
  return (page_size + cluster_tokens - 1) / cluster_tokens;
}
constexpr int64_t retroinfer_values_at(int page_size, int slots) {
  return (int64_t{8} * page_size + int64_t{8} * slots + 15) / 16 * 16;
}
constexpr int64_t retroinfer_record_bytes(int page_size, int head_dim, int slots) {
  return (retroinfer_values_at(page_size, slots) + int64_t{6} * slots * head_dim + 15) / 16 * 16;
}
// Records in one (layer, KV head) page of a group: 2 * page_size * head_dim bf16. 0: none fits.
constexpr int retroinfer_records_per_page(int page_size, int head_dim, int slots) {
  return static_cast<int>(int64_t{4} * page_size * head_dim / retroinfer_record_bytes(page_size, head_dim, slots));
}

// Where a layer's records are.
struct RetroInferRecords {
  __nv_bfloat16* kv_pool = nullptr;  // the layer's slice of the pool
  int num_kv_heads = 0;
  int head_dim = 128;  // 64 or 128
  int page_size = 16;  // 8..64, multiple of 8
  int slots = 1;       // retroinfer_slots_per_page (at least that of the cluster size)
  int records_per_page = 1;
};

// Index: job j clusters the keys of one segment, logical pages [first_page[j], first_page[j] +
// pages) of KV head head[j] of a sequence whose summary groups are dir[dir_offsets[j] ..): k-means
// as sparse/retroinfer.cpp (keys mean-centred over the segment, inner-product assignment with ties
// to the lower cluster, `iterations` rounds, k = max(1, n / cluster_tokens) clusters seeded with
// the centred keys of tokens j * n / k, an empty cluster keeps its centroid), then writes the
// segment's records. The segment's pages are page_ids[page_offsets[j] ..+ pages] (pages =
// page_offsets[j + 1] - page_offsets[j], n = pages * page_size <= kRetroInferMaxSegmentTokens): a
// negative id ~p names page p of host_pool (the host tier, mapped); every job has a page. The
// assignment multiplies bf16-rounded centred keys and centroids (tensor cores, fp32 sums); the
// centroids are fp32 means. Keys and values are read once,
// into the scratch, before any record is written, so records may take the groups of the pages read.
struct RetroInferClusterParams {
  RetroInferRecords records;
  const __nv_bfloat16* host_pool = nullptr;  // the layer's slice of the host tier; may be null
  const int32_t* page_ids = nullptr;
  const int32_t* page_offsets = nullptr;  // [num_jobs + 1]
  const int32_t* first_page = nullptr;    // [num_jobs]
  const int32_t* head = nullptr;          // [num_jobs]
  const int32_t* dir = nullptr;
  const int32_t* dir_offsets = nullptr;   // [num_jobs]
  int num_jobs = 0;
  int total_pages = 0;  // page_offsets[num_jobs]
  int cluster_tokens = 16;
  int iterations = 10;
  void* scratch = nullptr;  // retroinfer_cluster_scratch_bytes
};
size_t retroinfer_cluster_scratch_bytes(int64_t total_pages, int64_t num_jobs, int page_size, int head_dim, int slots);
cudaError_t retroinfer_cluster(const RetroInferClusterParams& p, cudaStream_t stream);

// Select, item i = seq * num_kv_heads + h, over the cluster slots [0, clustered_pages[seq] * slots)
// and the candidate pages [first_candidate[seq], end_candidate[seq]); sequence seq's summary groups
// are dir[dir_offsets[seq] ..). max_clusters bounds the slots (and strides the per-item arrays).
struct RetroInferSelectParams {
  RetroInferRecords records;
  const __nv_bfloat16* q = nullptr;  // [num_seqs][num_kv_heads * group][head_dim]
  const int32_t* dir = nullptr;
  const int32_t* dir_offsets = nullptr;      // [num_seqs]
  const int32_t* clustered_pages = nullptr;  // [num_seqs]
  const int32_t* first_candidate = nullptr;  // [num_seqs]
  const int32_t* end_candidate = nullptr;    // [num_seqs]
  int num_seqs = 0;
  int group = 1;  // 1..8
  float scale = 1.0f;
  int max_clusters = 0;
  int max_candidates = 0;
  // Scores: per cluster the softmax of q . centroid * scale over the non-empty slots, summed over
  // the group (0 for an empty slot), to totals[i * max_clusters + c]; logits is scratch of
  // retroinfer_score_scratch floats. Then per candidate page the attention its tokens are
  // estimated to take, the sum over its tokens (in order, fp32) of their cluster's total over the
  // cluster's size (+inf for a page at or past clustered_pages), to page_scores[i * max_candidates
  // + (p - first)]. Requires clustered_pages * slots <= max_clusters and end - first <=
  // max_candidates.
  float* logits = nullptr;
  float* totals = nullptr;
  float* page_scores = nullptr;
  // Estimation zone (after select_top_pages wrote the item's `selected_counts[i]` candidate pages,
  // ascending, at selected[selected_offsets[i]]): a cluster is a zone candidate when a token of it sits on a
  // clustered candidate page not selected; zone_scores[i * max_clusters + c] gets its total (NaN
  // for the others) and zone_counts[i] = min(ceil(estimate_fraction * non-empty slots), zone
  // candidates), for select_top_pages over [0, clustered_pages * slots). zone_flags (items *
  // max_clusters bytes) and zone_tallies (items * 2) are scratch that retroinfer_score clears.
  const int32_t* selected = nullptr;
  const int32_t* selected_offsets = nullptr;  // [items]
  const int32_t* selected_counts = nullptr;   // [items]
  double estimate_fraction = 0.0;
  uint8_t* zone_flags = nullptr;
  int32_t* zone_tallies = nullptr;
  float* zone_scores = nullptr;
  int32_t* zone_counts = nullptr;  // [items]
};
constexpr int64_t retroinfer_score_scratch(int64_t items, int group, int max_clusters) {
  return items * group * max_clusters + items * ((max_clusters + 255) / 256) * group * 2;
}
cudaError_t retroinfer_score(const RetroInferSelectParams& p, cudaStream_t stream);
cudaError_t retroinfer_zone(const RetroInferSelectParams& p, cudaStream_t stream);

// Estimation, after the decode attention wrote `out` and its log-sum-exp `lse` (paged_attention.h;
// -inf, attention over no token, leaves the estimate alone):
// item i adds, for each zone cluster zone[zone_offsets[i] ..+ zone_counts[i]], its members on no
// attended page as one softmax term per query head (weight m * exp(q . centroid * scale), value the
// sum of their values: the cluster's value sum less its attended members' values, read from the
// attended pages), and writes the merged output over `out`. Attended: pages before first_candidate
// (sinks), from end_candidate on (window) and the item's selected pages. The item's attention list
// (decode_pages[decode_offsets[i] ..)) is sinks, then its selected pages in order, then the window.
struct RetroInferEstimateParams {
  RetroInferRecords records;
  const __nv_bfloat16* q = nullptr;
  const int32_t* dir = nullptr;
  const int32_t* dir_offsets = nullptr;
  const int32_t* first_candidate = nullptr;
  const int32_t* end_candidate = nullptr;
  const int32_t* selected = nullptr;
  const int32_t* selected_offsets = nullptr;
  const int32_t* selected_counts = nullptr;
  const int32_t* zone = nullptr;
  const int32_t* zone_offsets = nullptr;  // [items]
  const int32_t* zone_counts = nullptr;   // [items]
  const int32_t* decode_pages = nullptr;
  const int32_t* decode_offsets = nullptr;
  // Indexed like decode_pages, or null: where the attention fetched a page from the host tier (a
  // negative entry), the device page it filled, which the attended members' values are read from.
  const int32_t* fill_pages = nullptr;
  int num_seqs = 0;
  int group = 1;
  float scale = 1.0f;
  const float* lse = nullptr;
  __nv_bfloat16* out = nullptr;  // [num_seqs][num_kv_heads * group][head_dim]
  // The zone is shared out over `splits` blocks per item (retroinfer_estimate_splits), whose
  // softmax partials (retroinfer_estimate_scratch floats) a second pass merges into `out`.
  int splits = 1;
  float* partials = nullptr;
  // Candidate pages (end_candidate - first_candidate) the selected pages' rank table of each block
  // covers (0..2^20, of which at most 32K take a table; an item with more is searched in its list
  // instead): at least the step's most.
  int max_candidates = 0;
};
constexpr int retroinfer_estimate_splits(int max_clusters) {
  const int splits = (max_clusters + 255) / 256;
  return splits < 1 ? 1 : splits > 32 ? 32 : splits;
}
constexpr int64_t retroinfer_estimate_scratch(int64_t items, int group, int head_dim, int splits) {
  return items * splits * group * (head_dim + 2);
}
cudaError_t retroinfer_estimate(const RetroInferEstimateParams& p, cudaStream_t stream);

}  // namespace spin::cuda
