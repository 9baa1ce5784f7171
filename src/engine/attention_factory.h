#pragma once
// Where the engine gets each request's SequenceAttention. The engine asks a factory, so another
// attention (paged, sparse) plugs in without touching the scheduler. The factory also says how
// much KV a request holds in the units its stores admit by, so the scheduler admits and preempts
// without knowing which store a request lives in.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/attention.h"

namespace spin {

// Per-request attention settings (the server's "spin" extension object).
struct AttentionSettings {
  std::string algorithm = "dense";
  int64_t budget = 0;           // tokens selected per KV head at decode; 0 = the algorithm's default
  double budget_fraction = 0.0; // > 0: the budget is this fraction (0, 1] of the context instead
  std::optional<int64_t> sink_tokens;         // default: the store's always-resident sinks
  std::optional<int64_t> window_tokens;       // default: the store's always-resident window
  std::optional<int64_t> first_dense_layers;  // default: the algorithm's
};

// KV a request holds, in the units each store admits by. Components add and compare one by one.
struct KvDemand {
  int64_t blocks = 0;        // contiguous store: blocks of the engine's KV-token budget
  int64_t device_pages = 0;  // paged store: device-tier pages (page_size tokens of one layer x KV head)
  int64_t host_pages = 0;    // paged store: host-tier pages
  int64_t slots = 0;         // paged store: request slots (a swapped-out request keeps its own)
  // Paged store whose first dense layers of sparse requests have a device pool of their own (the
  // GPU's): pages of that pool, counted apart because either pool can run out first.
  int64_t dense_layer_pages = 0;
  KvDemand& operator+=(const KvDemand& o);
  KvDemand& operator-=(const KvDemand& o);
  bool fits_within(const KvDemand& capacity) const;  // every component <= capacity's
  // The components in device memory (device_pages, dense_layer_pages): what a swap gives back.
  KvDemand on_device() const { return {.device_pages = device_pages, .dense_layer_pages = dense_layer_pages}; }
  bool operator==(const KvDemand&) const = default;
};
KvDemand max_of(const KvDemand& a, const KvDemand& b);

struct KvCacheCounts {
  uint64_t hits = 0;    // selected pages already on the device
  uint64_t misses = 0;  // selected pages fetched from the host tier
};

// What a paged store holds right now (from the KV manager's pools and counters).
struct KvStoreUsage {
  int64_t device_pages_used = 0;
  int64_t device_pages_capacity = 0;
  int64_t host_pages_used = 0;
  int64_t host_pages_capacity = 0;
  int64_t page_bytes = 0;
  int64_t logical_segments_used = 0;
  int64_t resident_segments_used = 0;
  int64_t requests = 0;  // request slots taken
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t retrieve_bytes = 0;  // host -> device
  uint64_t offload_bytes = 0;   // device -> host (offload and write-through)
  uint64_t evictions = 0;
  uint64_t metadata_device_bytes = 0;
  uint64_t metadata_host_bytes = 0;
};

class AttentionFactory {
 public:
  virtual ~AttentionFactory() = default;
  // Algorithms create() accepts.
  virtual std::vector<std::string> algorithms() const = 0;
  // Throws spin::Error naming the problem when create() would refuse these settings; called by
  // Engine::add_request so a bad request fails its caller, never the engine thread.
  virtual void validate(const AttentionSettings& settings) const;
  // KV for one sequence of at most max_tokens tokens. Throws spin::Error for an unknown algorithm.
  virtual std::unique_ptr<SequenceKv> create(const AttentionSettings& settings,
                                                    int64_t max_tokens) = 0;
  // The KV a request holds after storing `tokens` tokens (max_tokens: its capacity); `decoding`:
  // its prefill has ended. Default: blocks of block_tokens tokens.
  virtual KvDemand demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens,
                          bool decoding, int64_t block_tokens) const;
  // The store ran out during a step that ran requests with these settings: their algorithm kept
  // more pages than demand() allowed for, so from now on it is admitted by its whole context.
  virtual void store_exhausted(const AttentionSettings&) {}
  // Paged-store capacity (the blocks component is the engine's own budget and ignored).
  virtual KvDemand capacity() const { return {}; }
  // True when a one-token call on a non-empty sequence ends its prefill (paged sparse stores):
  // the engine then never splits a prefill so that a single token comes before the last chunk.
  virtual bool single_token_is_decode(const AttentionSettings&) const { return false; }
  // The paged store's pools and counters, if the factory has one.
  virtual std::optional<KvStoreUsage> usage() const { return std::nullopt; }

  // Elastic KV buffer: device pages a decoding request keeps for reuse beyond the working set
  // that demand() counts, sized by the scheduler per request between 0 and max_buffer_pages, in
  // pages per buffered stream (one (layer, KV head) whose selection is retrieved). A buffer of b
  // pages holds up to buffer_streams * b device pages. Defaults: no buffer.
  virtual int64_t buffer_streams(const AttentionSettings&) const { return 0; }
  virtual int64_t max_buffer_pages(const AttentionSettings&, int64_t /*max_tokens*/) const { return 0; }
  // Resizes the buffer of a sequence create() made; shrinking frees the pages at once. The engine
  // sets every new sequence's buffer (0 included) before its first step, so a store's own default
  // (the GPU's: the whole buffer) only holds where no engine sizes it (benchmarks).
  virtual void set_buffer_pages(SequenceKv&, int64_t /*pages*/) {}
  // Device-tier hits and misses of one sequence's retrieves so far (paged stores).
  virtual std::optional<KvCacheCounts> cache_counts(const SequenceKv&) const { return std::nullopt; }

  // Preemption by swap: a sequence whose whole KV is in the host tier (a paged sequence past its
  // prefill, written through) gives back its device pages (swap_out) and later gets its
  // always-resident pages back (swap_in) and goes on without recompute. While swapped out it
  // holds demand(..., decoding = true) without the device pages.
  virtual bool can_swap(const SequenceKv&) const { return false; }
  virtual void swap_out(SequenceKv&);
  virtual void swap_in(SequenceKv&);
};

// Dense attention over a contiguous buffer per sequence (model/contiguous_attention.h).
std::unique_ptr<AttentionFactory> make_contiguous_attention_factory(const AttentionShape& shape);

// KV bytes one token takes in fp32 K and V over all layers and KV heads.
int64_t kv_bytes_per_token(const AttentionShape& shape);

}  // namespace spin
