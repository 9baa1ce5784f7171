#pragma once
// Retrieve on the GPU: makes the pages a decode step selected resident in each request's cache
// slots on the device, with no host round trip. Per (request, KV head) of one layer ("item"):
// residency check against the slots' table, eviction by bucketed LRU among the slots this step
// does not need, a zero-copy gather of the misses straight from pinned host memory into the freed
// slots, and the table update. The policy is kv::BucketedLruPicker's (src/kv/bucketed_lru.h), the
// one the CPU KV manager uses.
//
// Pages are those of paged_attention.h, in two pools with the same layout: the device pool and
// the host tier (pinned, mapped: its device pointer). Page ids in a layer's slice are
// group * num_kv_heads + kv_head in both.
//
// Slots: request `seq` owns the device page groups cache_groups[cache_offsets[seq] ..
// cache_offsets[seq + 1]); slot j of item (seq, h) in layer `layer` is device page
// cache_groups[cache_offsets[seq] + j] * num_kv_heads + h. Each slot's state persists across
// steps in slot_page / slot_stamp at index (group * num_layers + layer) * num_kv_heads + h:
// the logical page it holds (-1: empty) and the step it was last needed (request-local steps,
// now[seq] this step; stamps < now[seq] for every slot before the call).
//
// For item i, the needed logical pages are needed[needed_offsets[i] .. needed_offsets[i] +
// needed_counts[i]), distinct and ascending; the host tier holds logical page p of `seq` in host
// group host_groups[host_offsets[seq] + p]. The call, per item:
//  1. hits: slots holding a needed page get stamp now;
//  2. free slots for the misses, in this order: empty slots by ascending slot index, then victims
//     among the non-needed occupied slots chosen as BucketedLruPicker::pick does (stamps mapped to
//     `buckets` buckets over [oldest, now), oldest bucket first, ascending logical page inside the
//     last bucket taken), in pick's order: the whole buckets' victims by ascending slot index (the
//     candidate order), then the last bucket's by ascending logical page (pick's nth_element
//     leaves their order open; this fixes it);
//  3. the k-th miss (in needed order) goes to the k-th free slot: its page is copied from the host
//     tier, the slot gets the page and stamp now;
//  4. out_pages[out_offsets[i] + j] = device page id holding needed page j.
// Counters per seq (atomic adds): [seq * 3 + 0] hits, [+1] misses, [+2] evictions (victims of
// step 2 that held a page).
// Keys rebuilt on the device (ShadowKV): with rebuild_end set, a miss of a logical page below
// rebuild_end[seq] copies only the page's values (its keys come from rebuild_keys later); the
// item's such misses go, in needed order, to rebuild_pages / rebuild_logical[needed_offsets[i] ..]
// (device page, logical page), their number to rebuild_counts[i] and is added to
// value_only[seq]. Requires needed_counts[i] <= the request's slots <= kMaxCacheSlots;
// an item that breaks this writes -1 to its out_pages and sets *error = 1 instead of touching its
// slots. Launch errors: cudaErrorInvalidValue for bad parameters (null pointers, pools not
// 16-byte aligned, page bytes not a multiple of 16, buckets outside 1..kMaxLruBuckets).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

inline constexpr int kMaxCacheSlots = 4096;  // slots per request (one thread block holds them all)
inline constexpr int kMaxLruBuckets = 4096;

struct PageCacheParams {
  int num_seqs = 0;
  int num_kv_heads = 0;
  int num_layers = 0;
  int layer = 0;
  int head_dim = 128;
  int page_size = 16;
  int buckets = 64;
  const int32_t* needed = nullptr;
  const int32_t* needed_offsets = nullptr;  // [num_seqs * num_kv_heads]
  const int32_t* needed_counts = nullptr;   // [num_seqs * num_kv_heads]
  const int32_t* cache_groups = nullptr;
  const int32_t* cache_offsets = nullptr;   // [num_seqs + 1]
  const int32_t* host_groups = nullptr;
  const int32_t* host_offsets = nullptr;    // [num_seqs]
  const uint32_t* now = nullptr;            // [num_seqs]
  int32_t* slot_page = nullptr;
  uint32_t* slot_stamp = nullptr;
  const __nv_bfloat16* host_pool = nullptr;  // this layer's slice of the host tier (device pointer)
  __nv_bfloat16* device_pool = nullptr;      // this layer's slice of the device pool
  int32_t* out_pages = nullptr;
  const int32_t* out_offsets = nullptr;      // [num_seqs * num_kv_heads]
  unsigned long long* counters = nullptr;    // [num_seqs * 3]
  int* error = nullptr;
  const int32_t* rebuild_end = nullptr;      // [num_seqs], or null: every miss copies whole pages
  int32_t* rebuild_pages = nullptr;
  int32_t* rebuild_logical = nullptr;
  int32_t* rebuild_counts = nullptr;         // [num_seqs * num_kv_heads]
  unsigned long long* value_only = nullptr;  // [num_seqs]
  // Blocks that fetch one item's misses (1, 2, 4 or 8; in retrieve_cached_pages more than 1 needs
  // sm_90's clusters), or 0: the launch's choice, enough blocks at small batches that the host
  // link, not the SMs, bounds the fetch.
  int blocks_per_item = 0;
  // Retrieve in two launches (plan_cached_pages, then fetch_planned_pages): item i's copy list,
  // host page then device page of each miss in fetch order (the values-only misses first), at
  // copy_src / copy_dst[needed_offsets[i] ..], and its counts at copy_counts[2i] (misses) and
  // [2i + 1] (values-only misses among them).
  int32_t* copy_src = nullptr;
  int32_t* copy_dst = nullptr;
  int32_t* copy_counts = nullptr;  // [2 * num_seqs * num_kv_heads]
  // plan_cached_pages only: the misses are fetched by the decode attention (see below); indexed
  // like out_pages.
  int32_t* fill_pages = nullptr;
};
cudaError_t retrieve_cached_pages(const PageCacheParams& p, cudaStream_t stream);

// The same Retrieve in two launches, which together leave what retrieve_cached_pages leaves:
// plan_cached_pages does steps 1, 2 and 4, the table update and the rebuild lists, and writes the
// copy lists; fetch_planned_pages copies the listed pages. Work that needs the plan but not the
// pages' bytes (ShadowKV's key rebuild) can then run beside the fetch, on another stream.
// With fill_pages set, plan_cached_pages leaves the fetch to the decode attention instead
// (paged_attention.h's fill_pages): a miss's out_pages entry is ~(its host page), with its device
// page at the same index of fill_pages (-1 at hits and at refused items); no copy list is written,
// and rebuild_end must be null. retrieve_cached_pages and fetch_planned_pages refuse fill_pages.
cudaError_t plan_cached_pages(const PageCacheParams& p, cudaStream_t stream);
cudaError_t fetch_planned_pages(const PageCacheParams& p, cudaStream_t stream);

}  // namespace spin::cuda
