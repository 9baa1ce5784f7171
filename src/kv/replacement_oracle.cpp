#include "kv/replacement_oracle.h"

#include <algorithm>
#include <limits>
#include <map>
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
  std::vector<LruCandidate> candidates;
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
    std::unordered_map<uint32_t, ResidentPage> resident;
    for (size_t k = 0; k < records.size(); ++k) {
      const auto pages = trace.pages_of(trace.records[records[k]]);
      const uint32_t now = local[records[k]];
      needed.assign(pages.begin(), pages.end());
      std::sort(needed.begin(), needed.end());
      needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
      if (now > warm_steps) {  // local steps count from 1
        for (uint32_t p : needed) (resident.count(p) ? result.hits : result.misses) += 1;
      }
      // Evict among the pages this step does not need.
      candidates.clear();
      std::vector<std::pair<uint64_t, uint32_t>> by_next_use;
      for (const auto& [page, info] : resident) {
        if (std::binary_search(needed.begin(), needed.end(), page)) continue;
        candidates.push_back({info.stamp, page, page});
        by_next_use.push_back({info.next_use, page});
      }
      if (candidates.size() > buffer_pages) {
        const uint32_t count = static_cast<uint32_t>(candidates.size()) - buffer_pages;
        victims.clear();
        if (policy == ReplacementPolicy::ExactLru) {
          pick_exact_lru(candidates, count, victims);
        } else if (policy == ReplacementPolicy::BucketedLru) {
          picker.pick(candidates, now, count, victims);
        } else {
          // Farthest next use first; ties (e.g. never used again) by logical page.
          std::sort(by_next_use.begin(), by_next_use.end(), [](const auto& a, const auto& b) {
            return a.first != b.first ? a.first > b.first : a.second < b.second;
          });
          for (uint32_t i = 0; i < count; ++i) victims.push_back(by_next_use[i].second);
        }
        for (uint32_t page : victims) resident.erase(page);
      }
      for (size_t j = 0; j < pages.size(); ++j) resident[pages[j]] = {now, next_use[k][j]};
    }
  }
  return result;
}

}  // namespace spin::kv
