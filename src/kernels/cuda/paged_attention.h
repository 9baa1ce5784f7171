#pragma once
// Paged decode attention on the GPU: one new query token per request against a list of KV pages
// per (request, KV head). The same kernel serves dense decode (the list holds every page) and
// sparse decode (the list holds the selected pages).
//
// Page layout (matches src/kv/layout.h): physical page p of the pool starts at
//   kv_pool + p * 2 * page_size * head_dim   (bf16 elements)
// and holds K as [page_size][head_dim] followed by V as [page_size][head_dim], for ONE
// (layer, KV head).
//
// Work item i = seq * num_kv_heads + kv_head. Its pages are page_ids[list_offsets[i] ..
// list_offsets[i+1]) in attention order, covering num_tokens[i] tokens: every page is full except
// possibly the last, which holds num_tokens[i] - (pages - 1) * page_size tokens. The caller
// guarantees ceil(num_tokens[i] / page_size) == list length, num_tokens[i] <= max_tokens, and
// page ids inside the pool (a kernel cannot report errors; the host checks what it can).
// A negative id ~p names page p of host_pool instead: pinned host memory mapped into the device's
// address space, read straight over the link (dense-offload attends to its host-tier pages so).
// An item with 0 tokens writes zeros (and a log-sum-exp of -INFINITY, see lse below).
//
// GQA: query head qh = kv_head * group + j (j < group) attends to kv_head; each KV tile is loaded
// once for the whole group. Scores and accumulation are fp32 (tensor-core bf16 products, fp32
// sums); probabilities enter the P·V product rounded to bf16, as in flash attention.
//
// Split-K: each item's token range is cut into splits, one thread block each: of
// tokens_per_split tokens when the caller sets it, else the launch sizes the grid by its split
// policy at max_tokens and each item takes as many of those splits as the policy gives its own
// length (paged_decode_item_splits). With more than one
// split, partial results (max, sum, unnormalised output) go to the workspace and a merge kernel
// combines them (launched as a programmatic dependent on sm_90). Measured on the H200 against
// cuDNN: docs/results/gpu-kernels.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

struct PagedDecodeParams {
  const __nv_bfloat16* q = nullptr;        // [num_seqs][num_kv_heads * group][head_dim]
  const __nv_bfloat16* kv_pool = nullptr;  // physical pages, layout above
  const __nv_bfloat16* host_pool = nullptr;  // pages named by negative ids (same layout); may be null
  const int32_t* page_ids = nullptr;       // concatenated page lists
  const int32_t* list_offsets = nullptr;   // [num_seqs * num_kv_heads + 1]
  const int32_t* num_tokens = nullptr;     // [num_seqs * num_kv_heads]
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;       // query heads per KV head, 1..8
  int head_dim = 128;  // 64 or 128
  int page_size = 16;  // multiple of 8 in [8, 64]
  int max_tokens = 0;  // upper bound of num_tokens[i]; sizes the split grid
  float scale = 0.0f;  // softmax scale (usually 1/sqrt(head_dim))
  int tokens_per_split = 0;  // 0: splits chosen to fill the GPU; else a multiple of 64
  // How K/V tiles reach shared memory: -1 the default (2); 0 cp.async 16 B per thread in
  // fragment order; 1 the same with a 256-byte L2 prefetch hint; 2 cp.async with each warp
  // instruction covering 512 contiguous bytes, swizzled, no hint. For benchmarks and tuning;
  // every path computes the same result.
  int load_path = -1;
  // Pages fetched while they are attended (the sparse path's Retrieve misses, page_cache.h): at a
  // negative id in list position j of item i, fill_pages[list_offsets[i] + j] >= 0 names the page
  // of fill_pool (usually kv_pool) that the host page's rows are also written to; a negative entry
  // writes nothing, and entries at non-negative ids are not read. The rows written are those the
  // item attends, so a list covering whole pages fills whole pages. Null: nothing is written.
  // Only load path 2 (the default) fills.
  const int32_t* fill_pages = nullptr;
  __nv_bfloat16* fill_pool = nullptr;
  // Optional [num_seqs][num_kv_heads * group] fp32 output, indexed like `out`'s rows (row
  // r = seq * num_kv_heads * group + kv_head * group + j): the natural-log log-sum-exp of that
  // query head's scaled logits, ln(sum_t exp(scale * q . k_t)); -INFINITY for an item with 0
  // tokens. out * exp(lse) is the unnormalised sum over this call's tokens, so a caller can merge
  // further softmax terms (other tokens, a sink) into the normalised output afterwards without
  // rerunning the kernel. Null: not written (no extra work).
  float* lse = nullptr;
};

// Splits per item the launch will use (1 means no merge pass and no workspace).
int paged_decode_splits(const PagedDecodeParams& p);

// Splits an item of n_tok tokens (<= max_tokens) runs on, at most paged_decode_splits(p): with
// tokens_per_split 0, the launch's policy applied to the item's own length.
int paged_decode_item_splits(const PagedDecodeParams& p, int n_tok);

// Workspace bytes the launch needs (0 when one split suffices).
size_t paged_decode_workspace_bytes(const PagedDecodeParams& p);

// out: [num_seqs][num_kv_heads * group][head_dim]. Returns cudaErrorInvalidValue on unsupported
// shapes or a too-small workspace, else the launch status.
cudaError_t paged_decode_attention(const PagedDecodeParams& p, __nv_bfloat16* out, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);
cudaError_t paged_decode_attention(const PagedDecodeParams& p, float* out, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace spin::cuda
