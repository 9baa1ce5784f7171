#pragma once
// Seer's gates on the GPU: Index and the block scores of Select, for a decode step with no host
// round trip. Reference: the CPU algorithm in src/sparse/seer.cpp (the training-free gate, and the
// trained one of sparse/seer_gate.h); the top-k over the scores is select_top_pages
// (sparse_select.h).
//
// Summaries use Quest's chunks, directory and entry size (sparse_select.h): entry e starts at
// summaries + e * 2 * head_dim bf16, and a Seer entry holds head_dim fp32 there instead of a
// min/max pair. A page's keys enter as the stored keys turned back to position 0: R(-t) k_t, where
// the pool holds k_t = mscale * R(t) k_pre_t, i.e. mscale times the pre-RoPE keys the CPU sums.
// The training-free gate's entry of page p0 + j of block b (p0 = b * block_pages) holds:
//  * j < block_pages - 1: the sum of those keys over pages p0 .. p0 + j (the block so far);
//  * j = block_pages - 1: the block key, ready to score: the mean over the block's tokens turned
//    to the block's centre b * T + T / 2 (T = block_pages * page_size), without mscale.
// So a complete block costs Score one entry; only a block cut by the candidates' end turns a
// partial sum itself. Either way the score carries mscale once, as the CPU's does.
//
// RoPE (the model's, cpu::rope): pair i of head_dim / 2 is (i, i + head_dim / 2) when neox, else
// (2i, 2i + 1); at position t it turns by t * inv_freq[i] (the angle in double).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

// Index (both gates): run r folds list entries [run_offsets[r], run_offsets[r + 1]): consecutive
// pages, in page order, of one block and KV head (whose summary entries are consecutive), page
// src_pages[i] of kv_pool holding the tokens at positions logical_pages[i] * page_size + t and
// entry dst_entries[i] being its summary; run_offsets null: each entry is a run. A run that starts
// mid-block continues from the entry before its first (written by an earlier run); a run whose
// first entry has src_pages < 0 is skipped (a decode row that completes no page). Requires
// kSummaryChunkPages % block_pages == 0 (a block's entries share a chunk).
struct SeerIndexParams {
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* src_pages = nullptr;
  const int32_t* dst_entries = nullptr;  // entry of each page (sparse_select.h's summary_entry)
  const int32_t* logical_pages = nullptr;
  const int32_t* run_offsets = nullptr;  // [num_runs + 1], or null
  int num_runs = 0;                      // = list entries when run_offsets is null
  int head_dim = 128;                    // 64 or 128
  int page_size = 16;                    // 8..64, multiple of 8
  int block_pages = 4;
  const float* inv_freq = nullptr;  // [head_dim / 2], device memory
  bool neox = true;
  __nv_bfloat16* summaries = nullptr;  // this layer's slice of the summary pool
};
cudaError_t seer_index_pages(const SeerIndexParams& p, cudaStream_t stream);

// Score: item i = seq * num_kv_heads + h. Block b holds logical pages [b * block_pages,
// (b + 1) * block_pages). For each block b that meets the candidates [first, end) of the seq,
// the block key is the mean pre-RoPE key of its pages below `end` (those below `first` too)
// turned to the block's centre position b * T + T / 2 (T = block_pages * page_size), from the
// entries seer_index_pages wrote, and the block score is the largest dot product of it with the
// group's query heads h * group .. h * group + group - 1; the block of current_page[seq] (the
// page being decoded) scores +inf. Every candidate page p gets its block's score at
// scores[i * max_candidates + (p - first)], so select_top_pages (ties: the lower page) takes whole
// blocks in score order, as the CPU's Select. Entries past the item's candidates are not written.
// Requires end - first <= max_candidates and kSummaryChunkPages % block_pages == 0.
struct SeerScoreParams {
  const __nv_bfloat16* q = nullptr;          // [num_seqs][num_kv_heads * group][head_dim]
  const __nv_bfloat16* summaries = nullptr;  // this layer's slice of the summary pool
  const int32_t* summary_dir = nullptr;      // chunk ids, see sparse_select.h
  const int32_t* dir_offsets = nullptr;      // [num_seqs]
  const int32_t* first_candidate = nullptr;  // [num_seqs]
  const int32_t* end_candidate = nullptr;    // [num_seqs]
  const int32_t* current_page = nullptr;     // [num_seqs]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;  // 1..8
  int head_dim = 128;
  int page_size = 16;
  int block_pages = 4;
  const float* inv_freq = nullptr;
  bool neox = true;
  int max_candidates = 0;
  float* scores = nullptr;  // [num_seqs * num_kv_heads][max_candidates]
  // The trained gate: item i's gate query (seer_gate_queries), and the block key is the one
  // seer_trained_index_pages wrote to the entry of the block's first page; q, page_size and the
  // RoPE fields are unused then.
  const float* gate_queries = nullptr;  // [num_seqs * num_kv_heads][head_dim]; null: training-free
  // Blocks a warp scores: 1, or 4 with their loads in flight together; 0 picks 4 once the blocks
  // outnumber the warps the GPU holds. Tests pin it to check both.
  int tile_blocks = 0;
};
cudaError_t seer_score_pages(const SeerScoreParams& p, cudaStream_t stream);

// The trained gate's Index: a block's compressed key, made when its last page is folded in; runs
// as in SeerIndexParams, and block_pages >= 3. The block's first three entries (those of its pages
// p0, p0 + 1, p0 + 2) hold, until then, the running elementwise max, min and sum over its folded
// pages of the keys turned back to position 0 (max, min and sum carry the factor mscale > 0
// through). The last page's fold writes to the entry of p0 the key RoPE(p0 * page_size) applied
// to concat(max, min, sum / (block_pages * page_size)) · k_gate[h] (without mscale, which the key
// carries once already), as the CPU's trained gate.
struct SeerTrainedIndexParams : SeerIndexParams {
  int num_kv_heads = 0;                   // the KV head of an entry is (entry / kSummaryChunkPages) % num_kv_heads
  const __nv_bfloat16* k_gate = nullptr;  // this layer's [num_kv_heads][3 * head_dim][head_dim]
};
cudaError_t seer_trained_index_pages(const SeerTrainedIndexParams& p, cudaStream_t stream);

// The trained gate's query of item i = seq * num_kv_heads + h: the group's query heads
// h * group .. h * group + group - 1, concatenated, times q_gate[h] (fp32 sums).
struct SeerGateQueryParams {
  const __nv_bfloat16* q = nullptr;       // [num_items][group * head_dim]
  const __nv_bfloat16* q_gate = nullptr;  // this layer's [num_kv_heads][group * head_dim][head_dim]
  int num_items = 0;
  int num_kv_heads = 0;
  int group = 1;  // 1..8
  int head_dim = 128;
  float* out = nullptr;  // [num_items][head_dim]
};
cudaError_t seer_gate_queries(const SeerGateQueryParams& p, cudaStream_t stream);

}  // namespace spin::cuda
