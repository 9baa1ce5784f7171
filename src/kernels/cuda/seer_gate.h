#pragma once
// Seer's training-free gate on the GPU: Index (per-page key sums) and the block scores of Select,
// for a decode step with no host round trip. Reference: the CPU algorithm in src/sparse/seer.cpp
// (its gate without a file); the top-k over the scores is select_top_pages (sparse_select.h).
//
// Summaries use Quest's chunks, directory and entry size (sparse_select.h): entry e starts at
// summaries + e * 2 * head_dim bf16, and a Seer entry holds head_dim fp32 there instead of a
// min/max pair. It is the sum over the page's tokens of the stored key rotated back to position 0:
// sum_t R(-t) k_t, where the pool holds k_t = mscale * R(t) k_pre_t. That is mscale times the sum
// of the pre-RoPE keys the CPU sums; the score rotates it forward once, without mscale, so the
// score carries mscale once, as the CPU's does.
//
// RoPE (the model's, cpu::rope): pair i of head_dim / 2 is (i, i + head_dim / 2) when neox, else
// (2i, 2i + 1); at position t it turns by t * inv_freq[i] (the angle in double).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

// Index: for i < num_pages with src_pages[i] >= 0, writes the rotated-back key sum of page
// src_pages[i] of kv_pool, whose tokens sit at positions logical_pages[i] * page_size + t, to
// entry dst_entries[i]. Entries with src_pages[i] < 0 are skipped.
struct SeerIndexParams {
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* src_pages = nullptr;
  const int32_t* dst_entries = nullptr;
  const int32_t* logical_pages = nullptr;
  int num_pages = 0;
  int head_dim = 128;  // 64 or 128
  int page_size = 16;  // 8..64, multiple of 8
  const float* inv_freq = nullptr;  // [head_dim / 2], device memory
  bool neox = true;
  __nv_bfloat16* summaries = nullptr;
};
cudaError_t seer_index_pages(const SeerIndexParams& p, cudaStream_t stream);

// Score: item i = seq * num_kv_heads + h. Block b holds logical pages [b * block_pages,
// (b + 1) * block_pages). For each block b that meets the candidates [first, end) of the seq,
// the block key is the mean pre-RoPE key of its pages below `end` (those below `first` too)
// turned to the block's centre position b * T + T / 2 (T = block_pages * page_size), and the
// block score is the largest dot product of it with the group's query heads h * group ..
// h * group + group - 1; the block of current_page[seq] (the page being decoded) scores +inf.
// Every candidate page p gets its block's score at scores[i * max_candidates + (p - first)], so
// select_top_pages (ties: the lower page) takes whole blocks in score order, as the CPU's Select.
// Entries past the item's candidates are not written. Requires end - first <= max_candidates.
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
};
cudaError_t seer_score_pages(const SeerScoreParams& p, cudaStream_t stream);

}  // namespace spin::cuda
