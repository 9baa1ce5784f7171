#include "kv/replacement_oracle.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kv/bucketed_lru.h"

namespace spin::kv {

namespace {

struct ResidentPage {
  uint32_t stamp;     // request-local step of the last use (LRU)
  uint64_t next_use;  // index in the stream of the next record naming the page (Belady)
};

constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// Request-local steps, numbered like KvManager does: each new step value of a request is +1.
std::vector<uint32_t> local_steps(const SelectionTrace& trace) {
  std::unordered_map<uint32_t, std::pair<uint64_t, uint32_t>> last;  // request -> (step, local)
  std::vector<uint32_t> local(trace.records.size());
  for (size_t i = 0; i < trace.records.size(); ++i) {
    const TraceRecord& r = trace.records[i];
    auto [it, inserted] = last.try_emplace(r.request, r.step, 1);
    if (!inserted && r.step != it->second.first) it->second = {r.step, it->second.second + 1};
    local[i] = it->second.second;
  }
  return local;
}

// The resident pages of one (request, layer, KV head) stream, kept in the order each policy
// evicts from, so that a step costs its own pages and victims, not a pass over the whole cache.
class StreamCache {
 public:
  explicit StreamCache(ReplacementPolicy policy) : policy_(policy) {}
  size_t size() const { return resident_.size(); }
  bool holds(uint32_t page) const { return resident_.count(page) > 0; }
  void erase(uint32_t page) {
    auto it = resident_.find(page);
    if (it == resident_.end()) return;
    if (policy_ == ReplacementPolicy::Belady) {
      by_next_use_.erase({it->second.next_use, page});
    } else {
      auto group = by_stamp_.find(it->second.stamp);
      group->second.erase(page);
      if (group->second.empty()) by_stamp_.erase(group);
    }
    resident_.erase(it);
  }
  void put(uint32_t page, ResidentPage info) {
    erase(page);
    resident_.emplace(page, info);
    if (policy_ == ReplacementPolicy::Belady) {
      by_next_use_.insert({info.next_use, page});
    } else {
      by_stamp_[info.stamp].insert(page);
    }
  }
  // The `count` victims the policy takes from the resident pages (all of them candidates).
  void pick(uint32_t count, uint32_t now, BucketedLruPicker& picker, std::vector<uint32_t>& victims) {
    victims.clear();
    if (policy_ == ReplacementPolicy::Belady) {
      for (auto it = by_next_use_.begin(); victims.size() < count; ++it) victims.push_back(it->second);
      return;
    }
    // The oldest stamps' pages, up to whole buckets past the count-th: the picker's choice
    // among them equals its choice among all (it keeps every candidate of the buckets it reads).
    candidates_.clear();
    const uint32_t oldest = by_stamp_.begin()->first;
    const uint32_t width = std::max<uint32_t>(1, (now - oldest + picker.buckets() - 1) / picker.buckets());
    const auto bucket_of = [&](uint32_t stamp) {
      return policy_ == ReplacementPolicy::ExactLru ? stamp : (stamp - oldest) / width;
    };
    std::optional<uint32_t> last_bucket;
    for (const auto& [stamp, pages] : by_stamp_) {
      if (last_bucket && bucket_of(stamp) != *last_bucket) break;
      for (const uint32_t page : pages) candidates_.push_back({stamp, page, page});
      if (!last_bucket && candidates_.size() >= count) last_bucket = bucket_of(stamp);
    }
    if (policy_ == ReplacementPolicy::ExactLru) {
      pick_exact_lru(candidates_, count, victims);
    } else {
      picker.pick(candidates_, now, count, victims);
    }
  }

 private:
  // Belady's victims first: farthest next use, ties by logical page.
  struct FarthestFirst {
    bool operator()(const std::pair<uint64_t, uint32_t>& a, const std::pair<uint64_t, uint32_t>& b) const {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    }
  };
  ReplacementPolicy policy_;
  std::unordered_map<uint32_t, ResidentPage> resident_;
  std::map<uint32_t, std::set<uint32_t>> by_stamp_;  // LRU: pages by last use, each set by logical page
  std::set<std::pair<uint64_t, uint32_t>, FarthestFirst> by_next_use_;
  std::vector<LruCandidate> candidates_;
};

}  // namespace

ReplayResult replay_trace(const SelectionTrace& trace, ReplacementPolicy policy,
                          uint32_t buffer_pages, uint32_t lru_buckets, uint32_t warm_steps) {
  const std::vector<uint32_t> local = local_steps(trace);
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<uint32_t>> streams;
  for (uint32_t i = 0; i < trace.records.size(); ++i) {
    const TraceRecord& r = trace.records[i];
    streams[{r.request, r.layer, r.head}].push_back(i);
  }
  BucketedLruPicker picker(lru_buckets);
  ReplayResult result;
  std::vector<uint32_t> needed, victims;
  for (const auto& [key, records] : streams) {
    // Next use of each (record, page), filled backwards.
    std::vector<std::vector<uint64_t>> next_use(records.size());
    std::unordered_map<uint32_t, uint64_t> upcoming;
    for (size_t k = records.size(); k-- > 0;) {
      const auto pages = trace.pages_of(trace.records[records[k]]);
      next_use[k].resize(pages.size());
      for (size_t j = 0; j < pages.size(); ++j) {
        auto it = upcoming.find(pages[j]);
        next_use[k][j] = it == upcoming.end() ? kNever : it->second;
      }
      for (uint32_t p : pages) upcoming[p] = k;
    }
    StreamCache cache(policy);
    for (size_t k = 0; k < records.size(); ++k) {
      const auto pages = trace.pages_of(trace.records[records[k]]);
      const uint32_t now = local[records[k]];
      needed.assign(pages.begin(), pages.end());
      std::sort(needed.begin(), needed.end());
      needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
      if (now > warm_steps) {  // local steps count from 1
        for (uint32_t p : needed) (cache.holds(p) ? result.hits : result.misses) += 1;
      }
      // Evict among the pages this step does not need: the needed ones leave the cache until
      // they come back below with this step's stamp and next use.
      for (uint32_t p : needed) cache.erase(p);
      if (cache.size() > buffer_pages) {
        cache.pick(static_cast<uint32_t>(cache.size() - buffer_pages), now, picker, victims);
        for (uint32_t page : victims) cache.erase(page);
      }
      for (size_t j = 0; j < pages.size(); ++j) cache.put(pages[j], {now, next_use[k][j]});
    }
  }
  return result;
}

}  // namespace spin::kv
