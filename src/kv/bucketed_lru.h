#pragma once
// Bucketed LRU victim selection, shared by the KV manager and the trace simulators.
//
// Every resident page carries `stamp`, the request-local step at which it was last read. At
// eviction the candidates' stamps are mapped to `buckets` buckets covering [oldest, now):
//   width  = max(1, ceil((now - oldest) / buckets))
//   bucket = (stamp - oldest) / width
// One pass builds the bucket histogram; victims are taken from the oldest bucket upward. In the
// last (partially taken) bucket pages go in ascending logical-page order. When the candidates
// span at most `buckets` steps, width is 1, every bucket is one step, and the choice equals exact
// LRU ordered by (stamp, logical page). Longer spans widen the buckets, so the scheme only
// reorders pages whose stamps share a bucket; stamps never wrap (32-bit request-local steps).
#include <cstdint>
#include <span>
#include <vector>

namespace spin::kv {

struct LruCandidate {
  uint32_t stamp;    // last step the page was read; < now
  uint32_t logical;  // logical page, the tie-break inside a bucket
  uint32_t slot;     // caller's handle, returned in the victim list
};

class BucketedLruPicker {
 public:
  explicit BucketedLruPicker(uint32_t buckets);
  uint32_t buckets() const { return buckets_; }
  // Appends the slots of `count` victims (count <= candidates.size()) to `victims`.
  void pick(std::span<const LruCandidate> candidates, uint32_t now, uint32_t count,
            std::vector<uint32_t>& victims);

 private:
  uint32_t buckets_;
  std::vector<uint32_t> histogram_;
  std::vector<LruCandidate> boundary_;
};

// Reference order for tests and simulators: exact LRU by (stamp, logical page).
void pick_exact_lru(std::span<const LruCandidate> candidates, uint32_t count,
                    std::vector<uint32_t>& victims);

}  // namespace spin::kv
