#include "kv/bucketed_lru.h"

#include <algorithm>

#include "base/error.h"

namespace spin::kv {

BucketedLruPicker::BucketedLruPicker(uint32_t buckets) : buckets_(buckets), histogram_(buckets) {
  SPIN_CHECK(buckets >= 1 && buckets <= 65536, "LRU bucket count must be 1..65536, got {}",
             buckets);
}

void BucketedLruPicker::pick(std::span<const LruCandidate> candidates, uint32_t now,
                             uint32_t count, std::vector<uint32_t>& victims) {
  if (count == 0) return;
  SPIN_CHECK(count <= candidates.size(), "cannot evict {} of {} candidates", count,
             candidates.size());
  uint32_t oldest = now;
  for (const LruCandidate& c : candidates) oldest = std::min(oldest, c.stamp);
  const uint32_t span = now - oldest;
  const uint32_t width = std::max<uint32_t>(1, (span + buckets_ - 1) / buckets_);

  std::fill(histogram_.begin(), histogram_.end(), 0);
  for (const LruCandidate& c : candidates) ++histogram_[(c.stamp - oldest) / width];
  // Find the boundary bucket: all older buckets go whole, the boundary one only in part.
  uint32_t boundary = 0;
  uint32_t taken = 0;
  while (taken + histogram_[boundary] < count) taken += histogram_[boundary++];
  boundary_.clear();
  for (const LruCandidate& c : candidates) {
    const uint32_t bucket = (c.stamp - oldest) / width;
    if (bucket < boundary) {
      victims.push_back(c.slot);
    } else if (bucket == boundary) {
      boundary_.push_back(c);
    }
  }
  const uint32_t rest = count - taken;  // 1..size of the boundary bucket
  auto by_logical = [](const LruCandidate& a, const LruCandidate& b) {
    return a.logical < b.logical;
  };
  std::nth_element(boundary_.begin(), boundary_.begin() + (rest - 1), boundary_.end(), by_logical);
  for (uint32_t i = 0; i < rest; ++i) victims.push_back(boundary_[i].slot);
}

void pick_exact_lru(std::span<const LruCandidate> candidates, uint32_t count,
                    std::vector<uint32_t>& victims) {
  std::vector<LruCandidate> sorted(candidates.begin(), candidates.end());
  std::sort(sorted.begin(), sorted.end(), [](const LruCandidate& a, const LruCandidate& b) {
    return a.stamp != b.stamp ? a.stamp < b.stamp : a.logical < b.logical;
  });
  for (uint32_t i = 0; i < count; ++i) victims.push_back(sorted[i].slot);
}

}  // namespace spin::kv
