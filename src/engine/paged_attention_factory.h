#pragma once
// The serving factory for sparse attention: one paged two-tier KV store (kv::KvManager on
// HostPageMemory) shared by every request, and per request a sparse::PagedSparseAttention running
// the algorithm the request names (any in the sparse registry). `dense` keeps the exact
// contiguous attention of make_contiguous_attention_factory, so a server whose requests do not
// ask for sparse attention behaves exactly as before.
#include <cstdint>
#include <memory>

#include "engine/attention_factory.h"
#include "sparse/settings.h"

namespace spin {

// A request's attention settings as the sparse pipeline takes them (spin::Error on values out of
// range).
sparse::SparseSettings to_sparse_settings(const AttentionSettings& settings);

struct PagedStoreConfig {
  uint32_t page_size = 16;       // tokens per page (8..64)
  int64_t device_pages = 0;      // device-tier pages (one page: page_size tokens of a layer x KV head)
  int64_t host_pages = 0;        // host-tier pages
  int64_t max_batch = 1;         // requests in the store at once (the engine's max_num_seqs)
  int64_t max_context = 0;       // tokens per request (the engine's max_model_len)
  // The largest elastic buffer per (layer, KV head), as a multiple of the selection budget: pages
  // kept for reuse that the scheduler grants while device pages are free (SPEC: up to 5x).
  double buffer_factor = 5.0;
  // Seer's trained gate for every Seer request (shaped for this store's attention); null: the
  // training-free gate.
  std::shared_ptr<const sparse::SeerGate> seer_gate;
};

std::unique_ptr<AttentionFactory> make_paged_attention_factory(const AttentionShape& shape,
                                                               const PagedStoreConfig& config);

}  // namespace spin
