#pragma once
// Replays a selection trace through a cache per (request, layer, KV head) with the same device
// budget as the KV manager: at each step the cache must hold the selected pages, and at most
// `buffer_pages` other pages stay for reuse. Belady (MIN: evict the page whose next use is
// farthest) gives the fewest misses any policy can reach, which the ideal envelope uses; exact
// and bucketed LRU are the comparisons. Pages selected twice in one record count once.
#include <cstdint>

#include "kv/selection_trace.h"

namespace spin::kv {

enum class ReplacementPolicy { ExactLru, BucketedLru, Belady };

struct ReplayResult {
  uint64_t hits = 0;
  uint64_t misses = 0;
  double hit_rate() const {
    return hits + misses == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(hits + misses);
  }
};

// The first `warm_steps` steps of each request fill its caches and are not counted.
ReplayResult replay_trace(const SelectionTrace& trace, ReplacementPolicy policy,
                          uint32_t buffer_pages, uint32_t lru_buckets = 64, uint32_t warm_steps = 0);

}  // namespace spin::kv
