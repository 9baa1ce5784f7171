#pragma once
// KvManager: the policy half of the two-tier paged KV store. It owns the page pools, the
// two-level page tables and the per-request device budgets, and decides residency; page bytes
// live behind PageMemory so the CUDA backend runs this same code. See docs/kv.md.
//
// Per request × layer × KV head ("stream") there are two tables, both two-level (a statically
// sized directory per stream whose entries index fixed-size segments taken from a shared pool):
//  - the logical table (host tier, capacity-heavy): logical page -> physical page, which is a
//    device page until prefill is offloaded and a host page after, plus the page's slot in the
//    resident table;
//  - the resident table (device tier, latency-critical): one slot per device-resident page after
//    offload: logical page, device page, LRU stamp. It grows with the working set only.
#include <cstdint>
#include <span>
#include <vector>

#include "kv/bucketed_lru.h"
#include "kv/layout.h"
#include "kv/page_memory.h"
#include "kv/page_pool.h"

namespace spin::kv {

inline constexpr uint32_t kSegmentEntries = 64;

struct KvConfig {
  KvLayout layout;
  uint32_t device_pages = 0;
  uint32_t host_pages = 0;
  uint32_t max_batch = 1;          // request slots
  uint32_t max_context = 0;        // tokens per request
  uint32_t max_resident_pages = 0; // device-resident pages per stream after offload (0: max_context)
  uint32_t sink_pages = 1;         // first pages, always resident
  uint32_t window_pages = 2;       // complete pages before the page being written, always resident
  uint32_t lru_buckets = 64;
  bool tier_split = true;          // logical tables in host memory; false: on the device too
  uint32_t logical_segments = 0;   // shared segment pool sizes (0: enough for the page pools)
  uint32_t resident_segments = 0;
};

struct KvCounters {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t h2d_pages = 0;
  uint64_t h2d_bytes = 0;
  uint64_t d2h_pages = 0;
  uint64_t d2h_bytes = 0;  // offload pages plus write-through tokens
  uint64_t evictions = 0;
  KvCounters& operator+=(const KvCounters& o);
  bool operator==(const KvCounters&) const = default;
};

// Where one logical page lives; kNoPage where it has no copy.
struct PageLocation {
  PageId device = kNoPage;
  PageId host = kNoPage;
};

// Logical pages each KV head of one layer needs this step, in CSR form: head h owns
// pages[offsets[h] .. offsets[h+1]).
struct LayerSelection {
  std::vector<uint32_t> offsets{0};
  std::vector<uint32_t> pages;
  void add_head(std::span<const uint32_t> head_pages);
  std::span<const uint32_t> head(uint32_t h) const;
  uint32_t num_heads() const { return static_cast<uint32_t>(offsets.size() - 1); }
  void clear();
};

struct MetadataBytes {
  uint64_t device_directories = 0;  // static: resident-table directories + per-stream counts
  uint64_t device_segments = 0;     // resident-table segments in use
  uint64_t host_directories = 0;    // static: logical-table directories + request records
  uint64_t host_segments = 0;       // logical-table segments in use
  uint64_t device() const { return device_directories + device_segments; }
  uint64_t host() const { return host_directories + host_segments; }
};

// A flat layout: every table sized max_batch × max_context/page_size × layers × KV heads.
struct FlatMetadataBytes {
  uint64_t device_page_table = 0;  // device page + LRU stamp per logical page
  uint64_t host_page_table = 0;    // host page per logical page
  uint64_t total() const { return device_page_table + host_page_table; }
};

using RequestId = uint32_t;

class KvManager {
 public:
  KvManager(const KvConfig& config, PageMemory& memory);

  // Lifecycle. create_request throws PoolExhausted when every request slot is taken.
  RequestId create_request();
  // Allocates pages for `count` more tokens in every (layer, head); throws PoolExhausted with
  // nothing changed when a pool lacks pages or segments.
  void reserve_tokens(RequestId request, uint32_t count);
  // Writes K/V of tokens [first_token, first_token + count) of one layer; k and v are
  // [count][kv_heads][head_dim]. After offload tokens go to the device page and its host copy.
  void write_tokens(RequestId request, uint32_t layer, uint32_t first_token, uint32_t count,
                    const void* k, const void* v);
  // Prefill done: copy every page to the host tier; the device keeps only always-resident pages.
  void finish_prefill(RequestId request);
  // Buffer pages per stream kept for reuse beyond this step's selection; shrinking evicts.
  void set_buffer_pages(RequestId request, uint32_t pages);
  // Makes the selected pages of one layer device-resident: residency check, bucketed-LRU
  // eviction, host->device copy of misses, table update. `step` is the engine step (non-
  // decreasing per request). device_pages receives the device page of each selected page.
  void retrieve(RequestId request, uint32_t layer, uint64_t step, const LayerSelection& selection,
                std::vector<PageId>& device_pages);
  // Evicts every device-resident page of one layer that is not always resident, whatever its
  // stamp: streaming baselines (dense-offload) keep nothing of a layer between steps.
  void drop_layer(RequestId request, uint32_t layer);
  // Finish, abort and preemption: every page and segment of the request goes back.
  void release(RequestId request);
  // Preemption by swap of an offloaded request: every device page goes back; the host tier keeps
  // its whole KV (written through). Until resume, only release and queries may touch it.
  void suspend(RequestId request);
  // Copies the always-resident pages back from the host tier (counted as misses); throws
  // PoolExhausted with nothing changed when the device or segment pool lacks room.
  void resume(RequestId request);
  bool suspended(RequestId request) const;

  // Queries.
  PageLocation lookup(RequestId request, uint32_t layer, uint32_t head, uint32_t logical) const;
  bool is_always_resident(RequestId request, uint32_t logical) const;
  uint32_t num_tokens(RequestId request) const;
  uint32_t num_pages(RequestId request) const;
  bool offloaded(RequestId request) const;
  uint32_t buffer_pages(RequestId request) const;
  // Device-resident logical pages of one stream after offload, in table order.
  std::vector<uint32_t> resident_pages(RequestId request, uint32_t layer, uint32_t head) const;
  const KvCounters& counters(RequestId request) const;
  const KvCounters& global_counters() const { return global_; }

  const KvConfig& config() const { return config_; }
  const PagePool& device_pool() const { return device_pool_; }
  const PagePool& host_pool() const { return host_pool_; }
  const IdPool& logical_segment_pool() const { return logical_segments_; }
  const IdPool& resident_segment_pool() const { return resident_segments_; }
  uint32_t num_active_requests() const;

  MetadataBytes metadata_bytes() const;
  // The same accounting for a configuration with the given segments in use, without building it.
  static MetadataBytes two_level_metadata_bytes(const KvConfig& config,
                                                uint64_t resident_segments_in_use,
                                                uint64_t logical_segments_in_use);
  static FlatMetadataBytes flat_metadata_bytes(const KvConfig& config);

 private:
  struct LogicalEntry {
    PageId page;             // device page before offload, host page after
    uint32_t resident_slot;  // slot in the resident table, or kNoPage
  };
  struct RequestState {
    bool active = false;
    bool offloaded = false;
    bool suspended = false;
    uint32_t tokens = 0;
    uint32_t buffer_pages = 0;
    uint64_t last_step = 0;
    bool stepped = false;
    uint32_t local_step = 0;  // stamps are request-local steps: 0 before the first retrieve
    KvCounters counters;
  };
  struct StreamState {
    uint32_t resident_count = 0;
  };
  struct HeadPlan {
    uint32_t misses = 0;
    uint32_t evictions = 0;
  };

  static KvConfig with_defaults(KvConfig config);
  uint32_t stream_index(RequestId request, uint32_t layer, uint32_t head) const;
  RequestState& state(RequestId request);
  const RequestState& state(RequestId request) const;
  bool pinned(uint32_t logical, uint32_t num_pages) const;
  uint32_t pinned_count(uint32_t num_pages) const;
  static uint32_t segments_for(uint32_t entries) {
    return (entries + kSegmentEntries - 1) / kSegmentEntries;
  }

  LogicalEntry& logical_entry(uint32_t stream, uint32_t logical);
  const LogicalEntry& logical_entry(uint32_t stream, uint32_t logical) const;
  uint32_t resident_index(uint32_t stream, uint32_t slot) const;  // index into resident arrays
  void push_resident(uint32_t stream, uint32_t logical, PageId device_page, uint32_t stamp);
  void remove_resident(uint32_t stream, uint32_t slot);
  // Evicts `count` unprotected pages of one stream (protected: always resident, stamp == now).
  void evict(uint32_t stream, uint32_t num_pages, uint32_t now, uint32_t count, KvCounters& c);
  uint32_t count_candidates(uint32_t stream, uint32_t num_pages, uint32_t now) const;

  KvConfig config_;
  PageMemory& memory_;
  PagePool device_pool_;
  PagePool host_pool_;
  IdPool request_slots_;
  IdPool logical_segments_;
  IdPool resident_segments_;
  uint32_t max_pages_;
  uint32_t logical_dir_entries_;
  uint32_t resident_dir_entries_;
  std::vector<RequestState> requests_;
  std::vector<StreamState> streams_;
  std::vector<uint32_t> logical_directory_;   // [stream][logical_dir_entries_] -> segment
  std::vector<uint32_t> resident_directory_;  // [stream][resident_dir_entries_] -> segment
  std::vector<LogicalEntry> logical_arena_;   // [segment][kSegmentEntries]
  std::vector<uint32_t> resident_logical_;    // resident arena, [segment][kSegmentEntries]
  std::vector<PageId> resident_device_page_;
  std::vector<uint32_t> resident_stamp_;
  KvCounters global_;
  BucketedLruPicker picker_;
  // Scratch reused across calls.
  std::vector<uint32_t> seen_;  // per logical page: mark of the last selection that named it
  uint32_t seen_mark_ = 0;
  std::vector<HeadPlan> plans_;
  std::vector<LruCandidate> candidates_;
  std::vector<uint32_t> victims_;
  std::vector<PageCopy> copies_;
};

}  // namespace spin::kv
