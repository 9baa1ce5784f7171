// Bucketed LRU against exact LRU, Belady against LRU and against brute force, the replay against a
// plain one, trace file I/O.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <map>
#include <set>
#include <tuple>

#include "base/error.h"
#include "kv/bucketed_lru.h"
#include "kv/replacement_oracle.h"
#include "kv/selection_trace.h"

namespace spin::kv {
namespace {

std::vector<uint32_t> sorted(std::vector<uint32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(KvBucketedLru, EqualsExactLruWhenEveryBucketIsOneStep) {
  std::mt19937 rng(5);
  BucketedLruPicker picker(64);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t now = 64 + rng() % 1000;
    const uint32_t span = 1 + rng() % 64;  // stamps in [now - span, now)
    std::vector<LruCandidate> c;
    const uint32_t n = 1 + rng() % 60;
    for (uint32_t i = 0; i < n; ++i) c.push_back({static_cast<uint32_t>(now - 1 - rng() % span), static_cast<uint32_t>(i * 7 + rng() % 7), i});  // distinct pages
    const uint32_t count = rng() % (n + 1);
    std::vector<uint32_t> bucketed, exact;
    picker.pick(c, now, count, bucketed);
    pick_exact_lru(c, count, exact);
    ASSERT_EQ(sorted(bucketed), sorted(exact));
  }
}

TEST(KvBucketedLru, SharedBucketsOnlyReorderInsideABucket) {
  std::mt19937 rng(6);
  const uint32_t buckets = 8;
  BucketedLruPicker picker(buckets);
  int differing = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t now = 500 + rng() % 1000;
    const uint32_t span = 9 + rng() % 400;  // wider than the bucket count
    std::vector<LruCandidate> c;
    const uint32_t n = 2 + rng() % 60;
    for (uint32_t i = 0; i < n; ++i) c.push_back({static_cast<uint32_t>(now - 1 - rng() % span), static_cast<uint32_t>(i * 3 + rng() % 3), i});
    const uint32_t count = rng() % (n + 1);
    std::vector<uint32_t> bucketed, exact;
    picker.pick(c, now, count, bucketed);
    pick_exact_lru(c, count, exact);
    ASSERT_EQ(bucketed.size(), count);
    // Independent bucket of each candidate, from the documented rule.
    uint32_t oldest = now;
    for (auto& x : c) oldest = std::min(oldest, x.stamp);
    const uint32_t width = std::max<uint32_t>(1, (now - oldest + buckets - 1) / buckets);
    auto bucket = [&](uint32_t slot) { return (c[slot].stamp - oldest) / width; };
    std::set<uint32_t> victims(bucketed.begin(), bucketed.end());
    uint32_t max_victim = 0, min_kept = UINT32_MAX;
    for (uint32_t i = 0; i < n; ++i)
      (victims.count(i) ? max_victim = std::max(max_victim, bucket(i))
                        : min_kept = std::min(min_kept, bucket(i)));
    if (!victims.empty() && victims.size() < n) {
      ASSERT_LE(max_victim, min_kept);
    }
    // Wherever the two policies disagree, the pages involved share the boundary bucket.
    for (uint32_t slot : exact)
      if (!victims.count(slot)) {
        ++differing;
        ASSERT_EQ(bucket(slot), max_victim);
      }
  }
  EXPECT_GT(differing, 0) << "the test never exercised a shared bucket";
}

// Locality-shaped synthetic trace: each head reads a slowly drifting hot region plus a few
// random pages, like a sparse-attention selection over a growing context.
SelectionTrace locality_trace(uint32_t seed, uint32_t requests, uint32_t steps) {
  std::mt19937 rng(seed);
  SelectionTrace t;
  for (uint32_t step = 0; step < steps; ++step)
    for (uint32_t r = 0; r < requests; ++r)
      for (uint32_t h = 0; h < 2; ++h) {
        std::set<uint32_t> pages;
        const uint32_t context = 200 + step;
        const uint32_t hot = (step / 7 + 31 * h + 17 * r) % context;
        while (pages.size() < 12) {
          const uint32_t pick = rng() % 10 < 8 ? (hot + rng() % 24) % context : rng() % context;
          pages.insert(pick);
        }
        std::vector<uint32_t> v(pages.begin(), pages.end());
        t.add(step, r, 0, h, v);
      }
  return t;
}

TEST(KvReplacementOracle, BucketedHitRateWithinOnePercentOfExactLru) {
  const SelectionTrace t = locality_trace(11, 4, 600);
  for (uint32_t buffer : {12u, 36u, 60u}) {
    const auto exact = replay_trace(t, ReplacementPolicy::ExactLru, buffer);
    const auto bucketed = replay_trace(t, ReplacementPolicy::BucketedLru, buffer, 64);
    const auto coarse = replay_trace(t, ReplacementPolicy::BucketedLru, buffer, 4);
    const auto belady = replay_trace(t, ReplacementPolicy::Belady, buffer);
    std::printf("buffer %u: hit rate exact LRU %.4f, bucketed(64) %.4f, bucketed(4) %.4f, Belady %.4f\n",
                buffer, exact.hit_rate(), bucketed.hit_rate(), coarse.hit_rate(), belady.hit_rate());
    EXPECT_EQ(exact.hits + exact.misses, bucketed.hits + bucketed.misses);
    EXPECT_NEAR(bucketed.hit_rate(), exact.hit_rate(), 0.01);
    EXPECT_LE(belady.misses, exact.misses);
  }
}

// The replay written plainly: each step rebuilds the candidate list from the whole cache and asks
// the picker (or sorts by next use). replay_trace keeps its caches ordered instead; both must
// count the same hits and misses.
ReplayResult plain_replay(const SelectionTrace& trace, ReplacementPolicy policy, uint32_t buffer, uint32_t buckets,
                          uint32_t warm_steps) {
  struct Page {
    uint32_t stamp;
    uint64_t next_use;
  };
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<size_t>> streams;
  std::map<uint32_t, std::pair<uint64_t, uint32_t>> last_step;  // request -> (step, local step)
  std::vector<uint32_t> local(trace.records.size());
  for (size_t i = 0; i < trace.records.size(); ++i) {
    const TraceRecord& r = trace.records[i];
    auto [it, fresh] = last_step.try_emplace(r.request, r.step, 1);
    if (!fresh && it->second.first != r.step) it->second = {r.step, it->second.second + 1};
    local[i] = it->second.second;
    streams[{r.request, r.layer, r.head}].push_back(i);
  }
  BucketedLruPicker picker(buckets);
  ReplayResult out;
  for (const auto& [key, records] : streams) {
    std::map<uint32_t, Page> cache;
    for (size_t k = 0; k < records.size(); ++k) {
      const auto pages = trace.pages_of(trace.records[records[k]]);
      const std::set<uint32_t> needed(pages.begin(), pages.end());
      const uint32_t now = local[records[k]];
      if (now > warm_steps)
        for (uint32_t p : needed) (cache.count(p) ? out.hits : out.misses) += 1;
      std::vector<LruCandidate> candidates;
      std::vector<std::pair<uint64_t, uint32_t>> by_next_use;
      for (const auto& [page, info] : cache) {
        if (needed.count(page)) continue;
        candidates.push_back({info.stamp, page, page});
        by_next_use.push_back({info.next_use, page});
      }
      if (candidates.size() > buffer) {
        const auto count = static_cast<uint32_t>(candidates.size() - buffer);
        std::vector<uint32_t> victims;
        if (policy == ReplacementPolicy::ExactLru) {
          pick_exact_lru(candidates, count, victims);
        } else if (policy == ReplacementPolicy::BucketedLru) {
          picker.pick(candidates, now, count, victims);
        } else {
          std::sort(by_next_use.begin(), by_next_use.end(), [](const auto& a, const auto& b) {
            return a.first != b.first ? a.first > b.first : a.second < b.second;
          });
          for (uint32_t i = 0; i < count; ++i) victims.push_back(by_next_use[i].second);
        }
        for (uint32_t v : victims) cache.erase(v);
      }
      for (uint32_t p : needed) {
        uint64_t next = UINT64_MAX;  // the stream's next record that names p
        for (size_t later = k + 1; later < records.size() && next == UINT64_MAX; ++later) {
          const auto pl = trace.pages_of(trace.records[records[later]]);
          if (std::find(pl.begin(), pl.end(), p) != pl.end()) next = later;
        }
        cache[p] = {now, next};
      }
    }
  }
  return out;
}

TEST(KvReplacementOracle, OrderedCachesCountAsThePlainReplay) {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 40; ++trial) {
    // Random traces: a few requests and heads, selections with locality and repeats in a record.
    SelectionTrace t;
    const uint32_t requests = 1 + rng() % 3, heads = 1 + rng() % 3, steps = 20 + rng() % 60;
    const uint32_t universe = 20 + rng() % 200, select = 1 + rng() % 12;
    for (uint32_t step = 0; step < steps; ++step)
      for (uint32_t r = 0; r < requests; ++r)
        for (uint32_t h = 0; h < heads; ++h) {
          std::vector<uint32_t> pages(select);
          const uint32_t centre = (step * 3 + h * 17) % universe;
          for (auto& p : pages) p = rng() % 4 == 0 ? rng() % universe : (centre + rng() % 16) % universe;
          t.add(step, r, rng() % 2, h, pages);
        }
    for (const auto policy : {ReplacementPolicy::ExactLru, ReplacementPolicy::BucketedLru, ReplacementPolicy::Belady}) {
      const uint32_t buffer = rng() % 40, buckets = 1 + rng() % 64, warm = rng() % 10;
      const ReplayResult fast = replay_trace(t, policy, buffer, buckets, warm);
      const ReplayResult plain = plain_replay(t, policy, buffer, buckets, warm);
      ASSERT_EQ(fast.hits, plain.hits) << "trial " << trial << " policy " << static_cast<int>(policy);
      ASSERT_EQ(fast.misses, plain.misses) << "trial " << trial << " policy " << static_cast<int>(policy);
    }
  }
}

// Exhaustive search over which buffer pages to keep after each step: the true optimum.
uint64_t brute_force_min_misses(const std::vector<std::vector<uint32_t>>& steps, uint32_t buffer) {
  uint64_t best = UINT64_MAX;
  std::function<void(size_t, std::set<uint32_t>, uint64_t)> go = [&](size_t k, std::set<uint32_t> cache,
                                                                       uint64_t misses) {
    if (misses >= best) return;
    if (k == steps.size()) {
      best = misses;
      return;
    }
    std::set<uint32_t> needed(steps[k].begin(), steps[k].end());
    for (uint32_t p : needed) misses += !cache.count(p);
    std::vector<uint32_t> others;
    for (uint32_t p : cache)
      if (!needed.count(p)) others.push_back(p);
    const uint32_t keep = std::min<uint32_t>(buffer, static_cast<uint32_t>(others.size()));
    // Every subset of `others` of size `keep` (more never hurts, so exactly keep).
    std::vector<bool> mask(others.size(), false);
    std::fill(mask.begin(), mask.begin() + keep, true);
    do {
      std::set<uint32_t> next = needed;
      for (size_t i = 0; i < others.size(); ++i)
        if (mask[i]) next.insert(others[i]);
      go(k + 1, next, misses);
    } while (std::prev_permutation(mask.begin(), mask.end()));
  };
  go(0, {}, 0);
  return best;
}

TEST(KvReplacementOracle, BeladyIsOptimalOnSmallTracesAndNeverWorseThanLru) {
  std::mt19937 rng(12);
  const int trials = 300;
  for (int trial = 0; trial < trials; ++trial) {
    const uint32_t universe = 3 + rng() % 6;
    const uint32_t buffer = rng() % 4;
    SelectionTrace t;
    std::vector<std::vector<uint32_t>> steps;
    for (uint32_t s = 0; s < 8; ++s) {
      std::set<uint32_t> pages;
      const uint32_t n = 1 + rng() % 3;
      while (pages.size() < n) pages.insert(rng() % universe);
      steps.emplace_back(pages.begin(), pages.end());
      t.add(s, 0, 0, 0, steps.back());
    }
    const auto belady = replay_trace(t, ReplacementPolicy::Belady, buffer);
    ASSERT_EQ(belady.misses, brute_force_min_misses(steps, buffer)) << "trial " << trial;
    ASSERT_LE(belady.misses, replay_trace(t, ReplacementPolicy::ExactLru, buffer).misses);
    ASSERT_LE(belady.misses, replay_trace(t, ReplacementPolicy::BucketedLru, buffer, 2).misses);
  }
}

TEST(KvReplacementOracle, BeladyBeatsLruOnCyclicScans) {
  // A cyclic scan over more pages than the cache holds: LRU misses every time, MIN does not.
  SelectionTrace t;
  const uint32_t cycle = 10, buffer = 5;
  for (uint32_t step = 0; step < 200; ++step) {
    const uint32_t page = step % cycle;
    t.add(step, 0, 0, 0, std::vector<uint32_t>{page});
  }
  const auto lru = replay_trace(t, ReplacementPolicy::ExactLru, buffer);
  const auto belady = replay_trace(t, ReplacementPolicy::Belady, buffer);
  EXPECT_EQ(lru.hits, 0u);
  EXPECT_GT(belady.hits, 80u);
  EXPECT_LE(belady.misses, lru.misses);
  // Random traces: Belady never loses.
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    SelectionTrace r;
    for (uint32_t step = 0; step < 100; ++step)
      for (uint32_t h = 0; h < 2; ++h) {
        std::set<uint32_t> pages;
        while (pages.size() < 4) pages.insert(rng() % 40);
        r.add(step, trial % 3, 0, h, std::vector<uint32_t>(pages.begin(), pages.end()));
      }
    for (uint32_t b : {0u, 4u, 16u})
      ASSERT_LE(replay_trace(r, ReplacementPolicy::Belady, b).misses,
                replay_trace(r, ReplacementPolicy::ExactLru, b).misses);
  }
}

TEST(KvReplacementOracle, WarmStepsFillTheCacheWithoutBeingCounted) {
  // Two requests: steps 0-1 of each warm the cache; from then on only their steps count.
  SelectionTrace t;
  for (uint32_t request : {0u, 1u}) {
    t.add(10, request, 0, 0, std::vector<uint32_t>{1, 2});
    t.add(11, request, 0, 0, std::vector<uint32_t>{2, 3});
    t.add(12, request, 0, 0, std::vector<uint32_t>{1, 3});  // both hit: 1 stayed in the buffer
    t.add(13, request, 0, 0, std::vector<uint32_t>{4});     // a miss
  }
  for (ReplacementPolicy policy : {ReplacementPolicy::ExactLru, ReplacementPolicy::Belady}) {
    const ReplayResult all = replay_trace(t, policy, 1);
    EXPECT_EQ(all.misses, 2u * 4u);
    EXPECT_EQ(all.hits, 2u * 3u);
    const ReplayResult warm = replay_trace(t, policy, 1, 64, 2);
    EXPECT_EQ(warm.misses, 2u * 1u);
    EXPECT_EQ(warm.hits, 2u * 2u);
  }
}

TEST(KvSelectionTrace, RoundTripsAndRejectsDamagedFiles) {
  const SelectionTrace t = locality_trace(2, 2, 20);
  const auto dir = std::filesystem::temp_directory_path();
  const std::string path = (dir / "spin_kv_trace_test.bin").string();
  write_trace(t, path);
  const SelectionTrace back = read_trace(path);
  EXPECT_EQ(back.page_size, t.page_size);
  ASSERT_EQ(back.records.size(), t.records.size());
  EXPECT_EQ(back.pages, t.pages);
  for (size_t i = 0; i < t.records.size(); ++i) {
    EXPECT_EQ(back.records[i].step, t.records[i].step);
    EXPECT_EQ(back.records[i].request, t.records[i].request);
    EXPECT_EQ(back.records[i].head, t.records[i].head);
    EXPECT_EQ(back.records[i].first, t.records[i].first);
    EXPECT_EQ(back.records[i].count, t.records[i].count);
  }
  // Truncation and a bad magic are errors, not crashes.
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 3);
  EXPECT_THROW(read_trace(path), Error);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << "NOTATRACE-----------------------------------";
  }
  EXPECT_THROW(read_trace(path), Error);
  std::filesystem::remove(path);
  EXPECT_THROW(read_trace(path), Error);
}

}  // namespace
}  // namespace spin::kv
