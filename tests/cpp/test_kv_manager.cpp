// KvManager checked step by step against a plain model (maps + a sort-based bucketed LRU that is
// exact LRU whenever the candidates span <= buckets steps), plus exhaustion and accounting tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <set>

#include "kv/kv_manager.h"

#if defined(__SANITIZE_ADDRESS__)
#define SPIN_KV_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPIN_KV_SANITIZED 1
#endif
#endif
#ifndef SPIN_KV_SANITIZED
#define SPIN_KV_SANITIZED 0
#endif

namespace spin::kv {
namespace {

// Deterministic K/V value of (request uid, layer, head, token, dim, k-or-v).
float kv_value(uint32_t uid, uint32_t layer, uint32_t head, uint32_t token, uint32_t d, int v) {
  uint32_t x = uid * 0x9E3779B1u ^ layer * 0x85EBCA77u ^ head * 0xC2B2AE3Du ^ token * 0x27D4EB2Fu ^
               d * 0x165667B1u ^ static_cast<uint32_t>(v) * 0xD3A2646Cu;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return static_cast<float>(x % 20001) / 1000.0f - 10.0f;
}

struct ModelRequest {
  RequestId id = 0;
  uint32_t uid = 0;
  uint32_t tokens = 0;
  bool offloaded = false;
  uint32_t buffer = 0;
  bool stepped = false;
  uint64_t last_step = 0;
  uint32_t local = 0;
  std::vector<std::map<uint32_t, uint32_t>> resident;  // per stream: logical -> stamp
  KvCounters counters;
};

class Model {
 public:
  Model(const KvConfig& config) : c_(config) {}
  uint32_t pages(uint32_t tokens) const { return (tokens + c_.layout.page_size - 1) / c_.layout.page_size; }
  bool pinned(uint32_t logical, uint32_t num_pages) const {
    return logical < c_.sink_pages || logical + 1 + c_.window_pages >= num_pages;
  }
  // Reference victim order: sort by (bucket, logical page).
  std::vector<uint32_t> victims(const std::map<uint32_t, uint32_t>& resident,
                                const std::set<uint32_t>& protect, uint32_t num_pages,
                                uint32_t now, uint32_t keep) const {
    std::vector<std::pair<uint32_t, uint32_t>> cands;  // (stamp, logical)
    for (auto [logical, stamp] : resident)
      if (!pinned(logical, num_pages) && stamp != now && !protect.count(logical))
        cands.push_back({stamp, logical});
    if (cands.size() <= keep) return {};
    uint32_t oldest = now;
    for (auto& cnd : cands) oldest = std::min(oldest, cnd.first);
    const uint32_t span = now - oldest;
    const uint32_t width = std::max<uint32_t>(1, (span + c_.lru_buckets - 1) / c_.lru_buckets);
    std::sort(cands.begin(), cands.end(), [&](auto a, auto b) {
      const uint32_t ba = (a.first - oldest) / width, bb = (b.first - oldest) / width;
      return ba != bb ? ba < bb : a.second < b.second;
    });
    std::vector<uint32_t> out;
    for (size_t i = 0; i + keep < cands.size(); ++i) out.push_back(cands[i].second);
    return out;
  }

 private:
  KvConfig c_;
};

// Everything observable about the manager, to prove a failed call changed nothing.
struct Snapshot {
  std::vector<uint32_t> counts;
  std::vector<uint64_t> values;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const KvManager& m, const std::vector<RequestId>& ids) {
  Snapshot s;
  s.counts = {m.device_pool().num_free(), m.host_pool().num_free(),
              m.logical_segment_pool().num_free(), m.resident_segment_pool().num_free(),
              m.num_active_requests()};
  const KvCounters& g = m.global_counters();
  s.values = {g.hits, g.misses, g.h2d_pages, g.h2d_bytes, g.d2h_pages, g.d2h_bytes, g.evictions};
  const KvLayout& L = m.config().layout;
  for (RequestId id : ids) {
    s.counts.push_back(m.num_tokens(id));
    s.counts.push_back(m.offloaded(id));
    s.counts.push_back(m.buffer_pages(id));
    const KvCounters& c = m.counters(id);
    s.values.insert(s.values.end(), {c.hits, c.misses, c.h2d_pages, c.evictions, c.d2h_bytes});
    for (uint32_t l = 0; l < L.num_layers; ++l)
      for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
        auto r = m.resident_pages(id, l, h);
        s.counts.insert(s.counts.end(), r.begin(), r.end());
        for (uint32_t p = 0; p < m.num_pages(id); ++p) {
          const PageLocation loc = m.lookup(id, l, h, p);
          s.counts.push_back(loc.device);
          s.counts.push_back(loc.host);
        }
      }
  }
  return s;
}

class PropertyRun {
 public:
  PropertyRun(KvConfig config, uint32_t seed)
      : config_(config),
        memory_(config.layout, config.device_pages, config.host_pages),
        manager_(config, memory_),
        model_(config),
        rng_(seed) {
    start_ = {manager_.device_pool().num_free(), manager_.host_pool().num_free(),
              manager_.logical_segment_pool().num_free(),
              manager_.resident_segment_pool().num_free()};
  }

  uint32_t rand(uint32_t n) { return std::uniform_int_distribution<uint32_t>(0, n - 1)(rng_); }

  void run(int operations) {
    for (int op = 0; op < operations; ++op) {
      const uint32_t kind = rand(100);
      if (requests_.empty() || (kind < 8 && requests_.size() < config_.max_batch + 1)) {
        create();
      } else {
        ModelRequest& r = requests_[rand(static_cast<uint32_t>(requests_.size()))];
        if (kind < 30) {
          append(r);
        } else if (kind < 36) {
          finish_prefill(r);
        } else if (kind < 85) {
          retrieve(r);
        } else if (kind < 93) {
          resize(r);
        } else {
          release(r);
        }
      }
      if (rand(10) == 0) ++step_;
      verify();
    }
    while (!requests_.empty()) release(requests_.back());
    verify();
    EXPECT_EQ(manager_.device_pool().num_free(), start_[0]);
    EXPECT_EQ(manager_.host_pool().num_free(), start_[1]);
    EXPECT_EQ(manager_.logical_segment_pool().num_free(), start_[2]);
    EXPECT_EQ(manager_.resident_segment_pool().num_free(), start_[3]);
    EXPECT_EQ(manager_.num_active_requests(), 0u);
    EXPECT_EQ(manager_.global_counters(), global_);
  }

  uint64_t exhaustions = 0, evictions_seen = 0, hits_seen = 0;

 private:
  std::vector<RequestId> ids() const {
    std::vector<RequestId> out;
    for (auto& r : requests_) out.push_back(r.id);
    return out;
  }

  // Runs an operation that may throw PoolExhausted; on throw the manager must be unchanged.
  template <typename F>
  bool attempt(F&& f) {
    const Snapshot before = snapshot(manager_, ids());
    try {
      f();
      return true;
    } catch (const PoolExhausted&) {
      ++exhaustions;
      EXPECT_TRUE(snapshot(manager_, ids()) == before) << "state changed by a failed call";
      return false;
    }
  }

  void create() {
    if (requests_.size() == config_.max_batch) {
      EXPECT_THROW(manager_.create_request(), PoolExhausted);
      return;
    }
    ModelRequest r;
    r.id = manager_.create_request();
    r.uid = next_uid_++;
    r.resident.resize(config_.layout.streams());
    requests_.push_back(r);
  }

  void append(ModelRequest& r) {
    const uint32_t count = r.offloaded ? 1 + rand(2) : 1 + rand(40);
    if (r.tokens + count > config_.max_context) return;
    const uint32_t old_pages = model_.pages(r.tokens);
    if (!attempt([&] { manager_.reserve_tokens(r.id, count); })) return;
    const uint32_t new_pages = model_.pages(r.tokens + count);
    if (r.offloaded) {
      for (auto& res : r.resident) {
        for (auto& [logical, stamp] : res)
          if (model_.pinned(logical, old_pages) && !model_.pinned(logical, new_pages)) stamp = r.local;
        for (uint32_t p = old_pages; p < new_pages; ++p) res[p] = r.local;
      }
    }
    const KvLayout& L = config_.layout;
    std::vector<float> k(count * L.num_kv_heads * L.head_dim), v(k.size());
    for (uint32_t layer = 0; layer < L.num_layers; ++layer) {
      for (uint32_t t = 0; t < count; ++t)
        for (uint32_t h = 0; h < L.num_kv_heads; ++h)
          for (uint32_t d = 0; d < L.head_dim; ++d) {
            const size_t i = (size_t{t} * L.num_kv_heads + h) * L.head_dim + d;
            k[i] = kv_value(r.uid, layer, h, r.tokens + t, d, 0);
            v[i] = kv_value(r.uid, layer, h, r.tokens + t, d, 1);
          }
      manager_.write_tokens(r.id, layer, r.tokens, count, k.data(), v.data());
    }
    if (r.offloaded) {
      const uint64_t bytes = uint64_t{count} * 2 * L.token_bytes() * L.streams();
      r.counters.d2h_bytes += bytes;
      global_.d2h_bytes += bytes;
    }
    r.tokens += count;
  }

  void finish_prefill(ModelRequest& r) {
    if (r.offloaded || r.tokens == 0) return;
    if (!attempt([&] { manager_.finish_prefill(r.id); })) return;
    r.offloaded = true;
    const uint32_t n = model_.pages(r.tokens);
    for (auto& res : r.resident)
      for (uint32_t p = 0; p < n; ++p)
        if (model_.pinned(p, n)) res[p] = r.local;
    const uint64_t pages = uint64_t{n} * config_.layout.streams();
    r.counters.d2h_pages += pages;
    r.counters.d2h_bytes += pages * config_.layout.page_bytes();
    global_.d2h_pages += pages;
    global_.d2h_bytes += pages * config_.layout.page_bytes();
  }

  void retrieve(ModelRequest& r) {
    const uint32_t n = model_.pages(r.tokens);
    if (n == 0) return;
    const uint32_t layer = rand(config_.layout.num_layers);
    LayerSelection sel;
    std::vector<std::set<uint32_t>> chosen(config_.layout.num_kv_heads);
    for (auto& set : chosen) {
      const uint32_t want = rand(std::min<uint32_t>(n, 7) + 1);
      // Mostly from a sliding "hot" region so the buffer gets hits.
      while (set.size() < want) set.insert(rand(3) ? std::min<uint32_t>(n - 1, static_cast<uint32_t>(step_ % n) + rand(6)) : rand(n));
      std::vector<uint32_t> pages(set.begin(), set.end());
      std::shuffle(pages.begin(), pages.end(), rng_);
      sel.add_head(pages);
    }
    std::vector<PageId> out;
    const uint64_t step = std::max(step_, r.last_step);
    if (!attempt([&] { manager_.retrieve(r.id, layer, step, sel, out); })) return;
    const bool new_step = !r.stepped || step > r.last_step;
    const uint32_t now = new_step ? r.local + 1 : r.local;
    r.stepped = true;
    r.last_step = step;
    r.local = now;
    KvCounters d;
    for (uint32_t h = 0; h < config_.layout.num_kv_heads; ++h) {
      if (!r.offloaded) {
        d.hits += chosen[h].size();
        continue;
      }
      auto& res = r.resident[layer * config_.layout.num_kv_heads + h];
      for (uint32_t p : chosen[h]) {
        if (res.count(p)) {
          ++d.hits;
          res[p] = now;
        }
      }
      for (uint32_t p : model_.victims(res, chosen[h], n, now, r.buffer)) {
        res.erase(p);
        ++d.evictions;
      }
      for (uint32_t p : chosen[h]) {
        if (!res.count(p)) {
          ++d.misses;
          res[p] = now;
        }
      }
    }
    d.h2d_pages = d.misses;
    d.h2d_bytes = d.misses * config_.layout.page_bytes();
    r.counters += d;
    global_ += d;
    evictions_seen += d.evictions;
    hits_seen += d.hits;
    // Returned pages are where lookup says, and hold the selected page's data.
    for (uint32_t h = 0; h < config_.layout.num_kv_heads; ++h) {
      const auto head = sel.head(h);
      for (size_t i = 0; i < head.size(); ++i)
        ASSERT_EQ(out[sel.offsets[h] + i], manager_.lookup(r.id, layer, h, head[i]).device);
    }
  }

  void resize(ModelRequest& r) {
    r.buffer = rand(7);
    manager_.set_buffer_pages(r.id, r.buffer);
    if (!r.offloaded) return;
    const uint32_t n = model_.pages(r.tokens);
    KvCounters d;
    for (auto& res : r.resident)
      for (uint32_t p : model_.victims(res, {}, n, r.local, r.buffer)) {
        res.erase(p);
        ++d.evictions;
      }
    r.counters += d;
    global_ += d;
  }

  void release(ModelRequest& r) {
    EXPECT_EQ(manager_.counters(r.id), r.counters);
    manager_.release(r.id);
    std::swap(r, requests_.back());
    requests_.pop_back();
  }

  void check_data(const ModelRequest& r, uint32_t layer, uint32_t head, uint32_t logical, Tier tier,
                  PageId page) {
    const KvLayout& L = config_.layout;
    const uint32_t first = logical * L.page_size;
    const uint32_t count = std::min(L.page_size, r.tokens - first);
    std::vector<float> k(count * L.head_dim), v(k.size());
    memory_.read_tokens(tier, page, 0, count, k.data(), v.data());
    for (uint32_t t = 0; t < count; ++t)
      for (uint32_t d = 0; d < L.head_dim; ++d) {
        ASSERT_EQ(k[t * L.head_dim + d], kv_value(r.uid, layer, head, first + t, d, 0));
        ASSERT_EQ(v[t * L.head_dim + d], kv_value(r.uid, layer, head, first + t, d, 1));
      }
  }

  void verify() {
    const KvLayout& L = config_.layout;
    std::set<PageId> device_owned, host_owned;
    uint64_t expect_device = 0, expect_host = 0;
    for (const ModelRequest& r : requests_) {
      ASSERT_EQ(manager_.num_tokens(r.id), r.tokens);
      ASSERT_EQ(manager_.counters(r.id), r.counters);
      const uint32_t n = model_.pages(r.tokens);
      for (uint32_t l = 0; l < L.num_layers; ++l)
        for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
          const auto& res = r.resident[l * L.num_kv_heads + h];
          auto actual = manager_.resident_pages(r.id, l, h);
          std::sort(actual.begin(), actual.end());
          std::vector<uint32_t> expected;
          for (auto& [p, stamp] : res) expected.push_back(p);
          ASSERT_EQ(actual, expected) << "residency of request " << r.uid << " layer " << l
                                      << " head " << h;
          for (uint32_t p = 0; p < n; ++p) {
            const PageLocation loc = manager_.lookup(r.id, l, h, p);
            const bool on_device = !r.offloaded || res.count(p);
            ASSERT_EQ(loc.device != kNoPage, on_device);
            ASSERT_EQ(loc.host != kNoPage, r.offloaded);
            if (on_device) {
              ASSERT_TRUE(device_owned.insert(loc.device).second) << "device page owned twice";
              ++expect_device;
              if (rand(4) == 0) check_data(r, l, h, p, Tier::Device, loc.device);
            }
            if (r.offloaded) {
              ASSERT_TRUE(host_owned.insert(loc.host).second) << "host page owned twice";
              ++expect_host;
              if (rand(4) == 0) check_data(r, l, h, p, Tier::Host, loc.host);
            }
          }
        }
    }
    // No page lost: every used pool page is owned by exactly one table entry.
    ASSERT_EQ(manager_.device_pool().num_used(), expect_device);
    ASSERT_EQ(manager_.host_pool().num_used(), expect_host);
    ASSERT_EQ(manager_.global_counters(), global_);
  }

  KvConfig config_;
  HostPageMemory memory_;
  KvManager manager_;
  Model model_;
  std::mt19937 rng_;
  std::vector<ModelRequest> requests_;
  std::vector<uint32_t> start_;
  uint32_t next_uid_ = 1;
  uint64_t step_ = 0;
  KvCounters global_;
};

KvConfig small_config(uint32_t buckets) {
  KvConfig c;
  c.layout = {.num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .page_size = 8};
  c.device_pages = 150;
  c.host_pages = 260;
  c.max_batch = 5;
  c.max_context = 200;
  c.max_resident_pages = 20;
  c.sink_pages = 1;
  c.window_pages = 1;
  c.lru_buckets = buckets;
  return c;
}

TEST(KvManagerProperty, MatchesModelOverRandomOperations) {
  const int operations = SPIN_KV_SANITIZED ? 3000 : 20000;
  for (uint32_t buckets : {64u, 4u}) {
    for (uint32_t seed : {1u, 2u}) {
      PropertyRun run(small_config(buckets), seed * 7919 + buckets);
      run.run(operations);
      // The random mix must actually exercise eviction, hits and pool exhaustion.
      EXPECT_GT(run.evictions_seen, 100u);
      EXPECT_GT(run.hits_seen, 1000u);
      EXPECT_GT(run.exhaustions, 0u);
      std::printf("buckets %u seed %u: %lu evictions, %lu hits, %lu exhaustions\n", buckets, seed,
                  (unsigned long)run.evictions_seen, (unsigned long)run.hits_seen,
                  (unsigned long)run.exhaustions);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(KvManagerExhaustion, FullPoolThrowsTypedErrorAndChangesNothing) {
  KvConfig c = small_config(64);
  c.device_pages = 40;  // 4 streams: 10 pages each
  HostPageMemory memory(c.layout, c.device_pages, c.host_pages);
  KvManager m(c, memory);
  const RequestId a = m.create_request();
  m.reserve_tokens(a, 8 * 9);  // 9 pages per stream = 36 device pages
  const Snapshot before = snapshot(m, {a});
  try {
    m.reserve_tokens(a, 8 * 2);  // needs 8 more pages, 4 free
    FAIL() << "expected PoolExhausted";
  } catch (const PoolExhausted& e) {
    EXPECT_EQ(e.requested(), 8u);
    EXPECT_EQ(e.available(), 4u);
  }
  EXPECT_TRUE(snapshot(m, {a}) == before);
  // Retrieve that needs more device pages than free + evictable fails the same way.
  m.finish_prefill(a);  // keeps sink + window + current = 3 pages per stream
  m.set_buffer_pages(a, 0);
  const RequestId b = m.create_request();
  m.reserve_tokens(b, 8 * 6);  // 24 device pages; 12 + 24 = 36 used, 4 free
  LayerSelection sel;
  const std::vector<uint32_t> three{2, 3, 4}, none;
  sel.add_head(three);
  sel.add_head(three);  // 6 misses on layer 0, 4 free, nothing evictable
  std::vector<PageId> out;
  const Snapshot before_retrieve = snapshot(m, {a, b});
  EXPECT_THROW(m.retrieve(a, 0, 1, sel, out), PoolExhausted);
  EXPECT_TRUE(snapshot(m, {a, b}) == before_retrieve);
  m.release(b);
  m.retrieve(a, 0, 1, sel, out);  // now it fits
  EXPECT_EQ(m.counters(a).misses, 6u);
  m.release(a);
  EXPECT_EQ(m.device_pool().num_used(), 0u);
  EXPECT_EQ(m.host_pool().num_used(), 0u);
}

}  // namespace
}  // namespace spin::kv
