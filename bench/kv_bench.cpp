// Microbenchmarks of the KV manager's CPU-side work: table lookup, one layer's retrieve of a
// typical selection, and bucketed-LRU eviction over a 5x buffer. See docs/results/kv-microbench.md.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "kv/bucketed_lru.h"
#include "kv/kv_manager.h"

namespace spin::kv {
namespace {

constexpr uint32_t kHeads = 8;
constexpr uint32_t kPageSize = 16;
constexpr uint32_t kSelectedPages = 2048 / kPageSize;  // 2048 tokens per KV head
constexpr uint32_t kBufferPages = 5 * kSelectedPages;

// One layer of 8 KV heads, head_dim 64 (SmolLM2-like), fp32 pages, prefill already offloaded.
struct Fixture {
  explicit Fixture(uint32_t context_tokens, uint32_t layers = 1, uint32_t heads = kHeads) {
    config.layout = {.num_layers = layers, .num_kv_heads = heads, .head_dim = 64, .page_size = kPageSize};
    const uint32_t streams = layers * heads;
    const uint32_t pages = context_tokens / kPageSize;
    config.max_batch = 1;
    config.max_context = context_tokens + 64;
    config.device_pages = streams * (kSelectedPages + kBufferPages + 16);
    config.host_pages = streams * (pages + 8);
    config.max_resident_pages = std::min(kSelectedPages + kBufferPages + 16, config.max_context / kPageSize);
    config.device_pages = std::max(config.device_pages, streams * (pages + 8));  // dense prefill
    memory = std::make_unique<HostPageMemory>(config.layout, config.device_pages, config.host_pages);
    manager = std::make_unique<KvManager>(config, *memory);
    request = manager->create_request();
    manager->reserve_tokens(request, context_tokens);
    manager->finish_prefill(request);
    manager->set_buffer_pages(request, kBufferPages);
    num_pages = pages;
  }
  // Drifting hot set: each step keeps ~90% of the previous selection.
  void next_selection(std::mt19937& rng) {
    if (current.empty()) {
      current.resize(config.layout.num_kv_heads);
      for (auto& head : current)
        for (uint32_t i = 0; i < kSelectedPages; ++i) head.push_back(i * (num_pages / kSelectedPages));
    }
    selection.clear();
    for (auto& head : current) {
      for (uint32_t& p : head)
        if (rng() % 10 == 0) p = rng() % num_pages;
      std::sort(head.begin(), head.end());
      head.erase(std::unique(head.begin(), head.end()), head.end());
      while (head.size() < kSelectedPages) {
        const uint32_t p = rng() % num_pages;
        if (!std::binary_search(head.begin(), head.end(), p)) head.insert(std::lower_bound(head.begin(), head.end(), p), p);
      }
      selection.add_head(head);
    }
  }
  KvConfig config;
  std::unique_ptr<HostPageMemory> memory;
  std::unique_ptr<KvManager> manager;
  RequestId request = 0;
  uint32_t num_pages = 0;
  std::vector<std::vector<uint32_t>> current;
  LayerSelection selection;
};

void BM_TableLookup(benchmark::State& state) {
  Fixture f(8192);
  std::mt19937 rng(1);
  std::vector<uint32_t> logical(4096);
  for (auto& p : logical) p = rng() % f.num_pages;
  size_t i = 0;
  for (auto _ : state) {
    const PageLocation loc = f.manager->lookup(f.request, 0, i % kHeads, logical[i % logical.size()]);
    benchmark::DoNotOptimize(loc);
    ++i;
  }
}
BENCHMARK(BM_TableLookup);

// One layer's retrieve: 8 heads x 128 selected pages, buffer 5x, ~10% new pages per step.
void BM_RetrieveLayer(benchmark::State& state) {
  Fixture f(static_cast<uint32_t>(state.range(0)));
  std::mt19937 rng(2);
  std::vector<PageId> out;
  uint64_t step = 0;
  for (int warm = 0; warm < 50; ++warm) {
    f.next_selection(rng);
    f.manager->retrieve(f.request, 0, ++step, f.selection, out);
  }
  const KvCounters start = f.manager->counters(f.request);
  for (auto _ : state) {
    state.PauseTiming();
    f.next_selection(rng);
    state.ResumeTiming();
    f.manager->retrieve(f.request, 0, ++step, f.selection, out);
    benchmark::DoNotOptimize(out.data());
  }
  const KvCounters& c = f.manager->counters(f.request);
  const double n = static_cast<double>(state.iterations());
  state.counters["misses/step"] = (c.misses - start.misses) / n;
  state.counters["evictions/step"] = (c.evictions - start.evictions) / n;
  state.counters["MB_h2d/step"] = (c.h2d_bytes - start.h2d_bytes) / n / 1e6;
}
BENCHMARK(BM_RetrieveLayer)->Arg(8192)->Arg(32768)->Unit(benchmark::kMicrosecond);

// The manager's whole per-decode-step work for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64)
// at 8K context: write-through of the new token's K/V and a retrieve of 2048 tokens per KV head
// in every layer. The selection drifts once per step and is reused by all layers.
void BM_DecodeStepSmolLM2(benchmark::State& state) {
  const uint32_t layers = 30, heads = 3, context = static_cast<uint32_t>(state.range(0));
  Fixture f(context, layers, heads);
  std::mt19937 rng(4);
  std::vector<PageId> out;
  std::vector<float> k(heads * 64, 0.5f), v(heads * 64, -0.5f);
  uint64_t step = 0;
  for (auto _ : state) {
    state.PauseTiming();
    f.next_selection(rng);
    state.ResumeTiming();
    ++step;
    for (uint32_t layer = 0; layer < layers; ++layer) {
      f.manager->write_tokens(f.request, layer, context - 1, 1, k.data(), v.data());
      f.manager->retrieve(f.request, layer, step, f.selection, out);
    }
    benchmark::DoNotOptimize(out.data());
  }
  const KvCounters& c = f.manager->counters(f.request);
  state.counters["misses/step"] = static_cast<double>(c.misses) / state.iterations();
}
BENCHMARK(BM_DecodeStepSmolLM2)->Arg(8192)->Arg(16384)->Unit(benchmark::kMicrosecond);

// Eviction choice alone: 64 buckets, candidates = a 5x buffer plus the previous selection,
// stamps spread over 200 steps, evicting one selection's worth of pages.
void BM_BucketedEviction(benchmark::State& state) {
  const uint32_t buckets = static_cast<uint32_t>(state.range(0));
  BucketedLruPicker picker(buckets);
  std::mt19937 rng(3);
  std::vector<LruCandidate> candidates;
  for (uint32_t i = 0; i < kBufferPages + kSelectedPages; ++i)
    candidates.push_back({1000 + static_cast<uint32_t>(rng() % 200), i, i});
  std::vector<uint32_t> victims;
  for (auto _ : state) {
    victims.clear();
    picker.pick(candidates, 1200, kSelectedPages, victims);
    benchmark::DoNotOptimize(victims.data());
  }
}
BENCHMARK(BM_BucketedEviction)->Arg(64);

void BM_ExactLruEviction(benchmark::State& state) {
  std::mt19937 rng(3);
  std::vector<LruCandidate> candidates;
  for (uint32_t i = 0; i < kBufferPages + kSelectedPages; ++i)
    candidates.push_back({1000 + static_cast<uint32_t>(rng() % 200), i, i});
  std::vector<uint32_t> victims;
  for (auto _ : state) {
    victims.clear();
    pick_exact_lru(candidates, kSelectedPages, victims);
    benchmark::DoNotOptimize(victims.data());
  }
}
BENCHMARK(BM_ExactLruEviction);

}  // namespace
}  // namespace spin::kv

BENCHMARK_MAIN();
