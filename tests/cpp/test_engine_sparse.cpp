// The engine serving sparse attention through the paged two-tier store
// (engine/paged_attention_factory.h) on the tiny dummy model. References: the plain
// single-sequence greedy loop over dense contiguous attention (engine_fixture.h), and the store's
// idle state read before any request ran.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "base/error.h"
#include "engine/engine.h"
#include "engine/paged_attention_factory.h"
#include "engine_fixture.h"
#include "sparse/algorithm.h"

namespace spin {
namespace {

using namespace engine_test;

constexpr int64_t kMaxModelLen = 160;

// tiny-llama has 2 layers: Quest's default of 2 dense layers would leave nothing sparse.
AttentionSettings quest(int64_t budget) {
  AttentionSettings s;
  s.algorithm = "quest";
  s.budget = budget;
  s.first_dense_layers = 0;
  return s;
}

PagedStoreConfig store(int64_t device_pages, int64_t host_pages, int64_t max_batch, double buffer_factor = 1.0) {
  PagedStoreConfig c;
  c.page_size = 16;
  c.device_pages = device_pages;
  c.host_pages = host_pages;
  c.max_batch = max_batch;
  c.max_context = kMaxModelLen;
  c.buffer_factor = buffer_factor;
  return c;
}

EngineConfig engine_config(int64_t max_num_seqs) {
  EngineConfig c;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = 48;  // prefill chunks of several requests share steps with decode
  c.max_model_len = kMaxModelLen;
  return c;
}

// bound_holds: the algorithm stays within the admission bound, so the scheduler's reservation
// bounds what the store really holds at every step.
void run_to_end(Engine& engine, bool bound_holds = true) {
  for (int steps = 0; engine.has_work(); ++steps) {
    ASSERT_LT(steps, 20000) << "no progress";
    engine.step();
    const EngineMetrics m = engine.metrics();
    ASSERT_TRUE(m.kv_store.has_value());
    if (bound_holds) {
      EXPECT_LE(m.kv_store->device_pages_used, m.kv_device_pages_reserved);
    }
    EXPECT_LE(m.kv_store->host_pages_used, m.kv_host_pages_reserved);
    EXPECT_LE(m.kv_device_pages_reserved, m.kv_store->device_pages_capacity);
  }
}

// One greedy request of max_tokens per prompt, run to the end: each ends by length with the
// tokens of plain greedy decoding (for attention that is exact whatever the scheduler did).
void expect_greedy_outputs(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int64_t max_tokens,
                           const AttentionSettings& attention, bool bound_holds = true) {
  Collector c;
  std::vector<uint64_t> ids;
  for (const auto& prompt : prompts) ids.push_back(engine.add_request(prompt, greedy(max_tokens, attention), c.callback()));
  run_to_end(engine, bound_holds);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(c.finish[ids[i]], "length") << "request " << i;
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], max_tokens)) << "request " << i;
  }
}

// Pools, segments and reservations are back where they were before any request.
void expect_idle(const Engine& engine, const KvStoreUsage& idle) {
  const EngineMetrics m = engine.metrics();
  ASSERT_TRUE(m.kv_store.has_value());
  EXPECT_EQ(m.kv_store->device_pages_used, idle.device_pages_used);
  EXPECT_EQ(m.kv_store->host_pages_used, idle.host_pages_used);
  EXPECT_EQ(m.kv_store->logical_segments_used, idle.logical_segments_used);
  EXPECT_EQ(m.kv_store->resident_segments_used, idle.resident_segments_used);
  EXPECT_EQ(m.kv_store->requests, idle.requests);
  EXPECT_EQ(m.kv_store->metadata_device_bytes, idle.metadata_device_bytes);
  EXPECT_EQ(m.kv_store->metadata_host_bytes, idle.metadata_host_bytes);
  EXPECT_EQ(m.kv_device_pages_reserved, 0);
  EXPECT_EQ(m.kv_host_pages_reserved, 0);
  EXPECT_EQ(m.kv_tokens_used, 0);
  EXPECT_EQ(m.requests_running, 0);
  EXPECT_EQ(m.requests_waiting, 0);
}

TEST(EngineSparse, QuestAtFullBudgetEqualsDenseWhileBatched) {
  std::mt19937 rng(5);
  const AttentionShape shape = tiny().model.attention_shape();
  Engine engine(tiny().model, nullptr, engine_config(8),
                make_paged_attention_factory(shape, store(4000, 4000, 8)));
  const KvStoreUsage idle = *engine.metrics().kv_store;
  Collector c;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> lengths;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(random_prompt(rng, 20 + 13 * i));  // 20..111 tokens: 1..6 complete pages
    lengths.push_back(18 + i % 4);                       // decode fills pages (Index at decode)
    // A budget of the whole context: every candidate page is selected.
    const AttentionSettings attention = i % 4 == 3 ? AttentionSettings{} : quest(kMaxModelLen);
    ids.push_back(engine.add_request(prompts[i], greedy(lengths[i], attention), c.callback()));
  }
  run_to_end(engine);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], lengths[i])) << "request " << i;
    EXPECT_EQ(c.finish[ids[i]], "length");
  }
  const EngineMetrics m = engine.metrics();
  // Quest requests were offloaded and read pages through Retrieve.
  EXPECT_GT(m.kv_store->offload_bytes, 0u);
  EXPECT_GT(m.kv_store->hits + m.kv_store->misses, 0u);
  EXPECT_EQ(m.kv_store->retrieve_bytes, m.kv_store->misses * static_cast<uint64_t>(m.kv_store->page_bytes));
  expect_idle(engine, idle);
}

TEST(EngineSparse, SmallBudgetUnderPressurePreemptsAndReturnsEveryPage) {
  std::mt19937 rng(9);
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  // Device tier: room for about two full prefills of the longest request (prefill is dense on the
  // device); sparse decode then keeps only a working set, so more requests run at once.
  const int64_t device_pages = streams * 2 * (kMaxModelLen / 16);
  Engine engine(tiny().model, nullptr, engine_config(12),
                make_paged_attention_factory(shape, store(device_pages, 20 * streams * (kMaxModelLen / 16), 12, 0.0)));
  const KvStoreUsage idle = *engine.metrics().kv_store;
  Collector c;
  std::vector<uint64_t> ids;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back(random_prompt(rng, 40 + 9 * i));
    ids.push_back(engine.add_request(prompts.back(), greedy(16, quest(32)), c.callback()));
  }
  // Abort two: one before it ran, one mid-run.
  engine.abort(ids[11]);
  for (int s = 0; s < 6; ++s) engine.step();
  engine.abort(ids[0]);
  run_to_end(engine);
  EXPECT_TRUE(engine.alive());
  EXPECT_EQ(c.finish[ids[11]], "abort");
  EXPECT_EQ(c.finish[ids[0]], "abort");
  for (int i = 1; i < 11; ++i) {
    EXPECT_EQ(c.finish[ids[i]], "length") << "request " << i;
    EXPECT_EQ(c.ids[ids[i]].size(), 16u) << "request " << i;
  }
  const EngineMetrics m = engine.metrics();
  // A budget of 2 pages and no buffer left most of each context on the host: pages were fetched,
  // and evicted when the selection moved.
  EXPECT_GT(m.kv_store->misses, 0u);
  EXPECT_GT(m.kv_store->evictions, 0u);
  EXPECT_GT(m.preemptions_total(), 0u);
  EXPECT_EQ(m.kv_store->retrieve_bytes, m.kv_store->misses * static_cast<uint64_t>(m.kv_store->page_bytes));
  expect_idle(engine, idle);
}

// Selects every candidate page and reports all of them as unbudgeted (as outliers are): exact
// attention, but a decode working set of the whole context, far above the budget bound.
class AllPagesUnbudgeted final : public sparse::SparseAlgorithm {
 public:
  sparse::AlgorithmTraits traits() const override { return {.placement = sparse::Placement::Offload}; }
  void select(const sparse::SelectQuery& query, kv::LayerSelection& out, sparse::StepBudget&) override {
    sparse::select_all(query, out);
    selected_ = query.end_candidate - query.first_candidate;
  }
  uint32_t unbudgeted_pages(uint32_t) const override { return selected_; }

 private:
  uint32_t selected_ = 0;
};

const sparse::AlgorithmRegistrar kAllPagesRegistration(
    "test-all-pages-unbudgeted", [](const sparse::AlgorithmContext&) { return std::make_unique<AllPagesUnbudgeted>(); });

TEST(EngineSparse, AlgorithmAboveItsBoundRecomputesInsteadOfFailing) {
  std::mt19937 rng(21);
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  const int64_t device_pages = streams * 2 * (kMaxModelLen / 16);
  Engine engine(tiny().model, nullptr, engine_config(8),
                make_paged_attention_factory(shape, store(device_pages, 20 * device_pages, 8, 0.0)));
  const KvStoreUsage idle = *engine.metrics().kv_store;
  AttentionSettings attention;
  attention.algorithm = "test-all-pages-unbudgeted";
  attention.budget = 16;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(random_prompt(rng, 60 + 7 * i));
  // Attention over every page is exact: recomputed or not, each output is the dense one.
  expect_greedy_outputs(engine, prompts, 20, attention, false);
  EXPECT_TRUE(engine.alive());
  EXPECT_GT(engine.metrics().preemptions_total(), 0u);
  expect_idle(engine, idle);
}

// Every registered algorithm under a device tier far smaller than its requests' contexts: the
// scheduler admits by demand(), so what the store holds must never exceed what was reserved, and
// the store must never run out inside a step (ShadowKV's outlier chunks and RetroInfer's pending
// decode pages are selected outside the budget and must be counted).
TEST(EngineSparse, DemandBoundsTheDeviceWorkingSetOfEveryAlgorithm) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  constexpr int64_t kContext = 384;
  constexpr int kRequests = 6;
  for (const std::string& name : sparse::AlgorithmRegistry::global().names()) {
    if (name.rfind("test-", 0) == 0) continue;  // this file's deliberately unbounded algorithm
    SCOPED_TRACE(name);
    PagedStoreConfig paged = store(streams * 2 * (kContext / 16), streams * 20 * (kContext / 16), kRequests, 0.0);
    paged.max_context = kContext;
    EngineConfig config = engine_config(kRequests);
    config.max_model_len = kContext;
    Engine engine(tiny().model, nullptr, config, make_paged_attention_factory(shape, paged));
    AttentionSettings attention;
    attention.algorithm = name;
    attention.budget = 32;
    attention.first_dense_layers = 0;
    std::mt19937 rng(31);
    Collector c;
    std::vector<uint64_t> ids;
    for (int i = 0; i < kRequests; ++i) {
      ids.push_back(engine.add_request(random_prompt(rng, 150 + 30 * i), greedy(80, attention), c.callback()));
    }
    run_to_end(engine);
    EXPECT_EQ(engine.metrics().kv_store_exhausted_total, 0u);
    for (uint64_t id : ids) {
      EXPECT_EQ(c.finish[id], "length") << "request " << id;
      EXPECT_EQ(c.ids[id].size(), 80u) << "request " << id;
    }
  }
}

// Elastic buffers. Quest with a 32-token budget selects 3 pages (its minimum) and keeps a working
// set of 8 pages per stream (sink, 2 window pages, the page being written, one sliding out, 3
// selected), and a buffer of at most 5x the budget and the pages the working set leaves out.
// Whole prompts are prefilled in one chunk, so each admission reserves its prefill at once and no
// request is preempted (a recomputed sparse request would not reproduce its decode KV exactly).
struct ElasticRun {
  std::vector<std::vector<int32_t>> outputs;  // per prompt
  std::vector<RequestOutput> finals;
};

constexpr int64_t kElasticContext = 320;

ElasticRun run_quest_requests(const std::vector<std::vector<int32_t>>& prompts, int64_t device_pages, bool elastic) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  const auto n = static_cast<int64_t>(prompts.size());
  PagedStoreConfig paged = store(device_pages, streams * 40 * (kElasticContext / 16), n, 5.0);
  paged.max_context = kElasticContext;
  EngineConfig config = engine_config(n);
  config.max_model_len = kElasticContext;
  config.max_num_batched_tokens = 512;
  config.elastic_kv_buffers = elastic;
  Engine engine(tiny().model, nullptr, config, make_paged_attention_factory(shape, paged));
  Collector c;
  std::vector<uint64_t> ids;
  for (const auto& prompt : prompts) ids.push_back(engine.add_request(prompt, greedy(100, quest(32)), c.callback()));
  run_to_end(engine);
  EXPECT_EQ(engine.metrics().preemptions_total(), 0u);
  ElasticRun run;
  for (uint64_t id : ids) {
    EXPECT_EQ(c.finish[id], "length") << "request " << id;
    run.outputs.push_back(c.ids[id]);
    run.finals.push_back(c.last[id]);
  }
  return run;
}

double hit_rate(const RequestOutput& out) {
  return static_cast<double>(out.kv_hits) / static_cast<double>(out.kv_hits + out.kv_misses);
}

TEST(EngineSparse, ElasticBufferRaisesTheHitRateAloneAndKeepsOutputs) {
  const int64_t streams = tiny().model.attention_shape().n_layers * tiny().model.attention_shape().n_kv_heads;
  std::mt19937 rng(41);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(random_prompt(rng, 200));
  // Crowded: 8 requests' working sets (32 pages each) and little more, so the buffers stay small.
  const ElasticRun crowded = run_quest_requests(prompts, streams * 70, true);
  // Alone: room for the buffer to grow to its largest. Fixed: the largest buffer from the start.
  for (size_t i = 0; i < prompts.size(); ++i) {
    const ElasticRun alone = run_quest_requests({prompts[i]}, streams * 40, true);
    const ElasticRun fixed = run_quest_requests({prompts[i]}, streams * 40, false);
    // Greedy outputs do not depend on what stays resident.
    EXPECT_EQ(crowded.outputs[i], fixed.outputs[0]) << "request " << i;
    EXPECT_EQ(alone.outputs[0], fixed.outputs[0]) << "request " << i;
    EXPECT_EQ(alone.finals[0].kv_hits + alone.finals[0].kv_misses,
              crowded.finals[i].kv_hits + crowded.finals[i].kv_misses) << "the same pages are retrieved";
    if (i == 0) {
      const double rate_alone = hit_rate(alone.finals[0]), rate_crowded = hit_rate(crowded.finals[0]);
      EXPECT_GT(rate_alone, rate_crowded + 0.05) << "alone " << rate_alone << ", crowded " << rate_crowded;
      EXPECT_GE(hit_rate(fixed.finals[0]) + 1e-9, rate_alone);
    }
  }
}

TEST(EngineSparse, AdmissionShrinksARunningRequestsBuffer) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  PagedStoreConfig paged = store(100, streams * 40 * (kElasticContext / 16), 2, 5.0);
  paged.max_context = kElasticContext;
  EngineConfig config = engine_config(2);
  config.max_model_len = kElasticContext;
  config.max_num_batched_tokens = 512;  // a whole prompt in one chunk: admission takes its prefill at once
  Engine engine(tiny().model, nullptr, config, make_paged_attention_factory(shape, paged));
  std::mt19937 rng(43);
  const std::vector<int32_t> first = random_prompt(rng, 200), second = random_prompt(rng, 150);
  Collector c;
  const uint64_t a = engine.add_request(first, greedy(60, quest(32)), c.callback());
  engine.step();  // prefill: 13 pages per stream on the device
  // The first decode step offloads: 8 working-set pages per stream stay, and the buffer grows to
  // its largest, the 17 pages of 260 tokens less the working set.
  engine.step();
  EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.kv_buffer_pages_reserved, streams * 9);
  EXPECT_EQ(m.kv_device_pages_reserved, streams * (8 + 9));
  // The second prefill needs 10 pages per stream; 100 - 68 = 32 are free, so 8 more come out of
  // the buffer (down to 7 pages per stream), and nothing is preempted.
  const uint64_t b = engine.add_request(second, greedy(20, quest(32)), c.callback());
  const StepReport admitted = engine.step();
  ASSERT_EQ(admitted.chunks.size(), 2u);
  EXPECT_EQ(admitted.chunks[0].request_id, a);
  EXPECT_EQ(admitted.chunks[1].request_id, b);
  EXPECT_EQ(admitted.chunks[1].n_tokens, 150);
  EXPECT_EQ(admitted.preempted, 0);
  m = engine.metrics();
  EXPECT_EQ(m.kv_buffer_pages_reserved, streams * 7);
  EXPECT_LE(m.kv_store->device_pages_used, m.kv_device_pages_reserved);
  run_to_end(engine);
  EXPECT_EQ(engine.metrics().preemptions_total(), 0u);

  // The outputs are those of the same requests without elasticity, each alone.
  for (const auto& [prompt, tokens, id] : {std::tuple{first, 60, a}, std::tuple{second, 20, b}}) {
    EngineConfig fixed_config = config;
    fixed_config.elastic_kv_buffers = false;
    PagedStoreConfig big = paged;
    big.device_pages = streams * 40;
    Engine fixed(tiny().model, nullptr, fixed_config, make_paged_attention_factory(shape, big));
    Collector alone;
    const uint64_t only = fixed.add_request(prompt, greedy(tokens, quest(32)), alone.callback());
    run_to_end(fixed);
    EXPECT_EQ(c.ids[id], alone.ids[only]) << "request " << id;
  }
}

// An engine over a paged store of `device_pages` and `host_pages` for requests of up to
// `context` tokens.
std::unique_ptr<Engine> paged_engine(int64_t max_num_seqs, int64_t context, int64_t device_pages, int64_t host_pages) {
  PagedStoreConfig paged = store(device_pages, host_pages, max_num_seqs);
  paged.max_context = context;
  EngineConfig config = engine_config(max_num_seqs);
  config.max_model_len = context;
  return std::make_unique<Engine>(tiny().model, nullptr, config,
                                  make_paged_attention_factory(tiny().model.attention_shape(), paged));
}

TEST(EngineSparse, SwapPreemptionResumesWithoutRecompute) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  constexpr int64_t kContext = 384, kTokens = 128;
  // A budget of half the context: working sets grow as requests decode, and prefill
  // chunks grow too, so the small device tier keeps preempting decoding requests. The host tier
  // has room for every request, so each of those is swapped out and resumes from its host KV.
  AttentionSettings attention = quest(0);
  attention.budget_fraction = 0.5;
  std::mt19937 rng(51);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(random_prompt(rng, 120 + 16 * i));
  const std::unique_ptr<Engine> engine =
      paged_engine(8, kContext, streams * 2 * (kContext / 16), streams * 8 * (kContext / 16));
  const KvStoreUsage idle = *engine->metrics().kv_store;
  Collector c;
  std::vector<uint64_t> ids;
  for (const auto& prompt : prompts) {
    ids.push_back(engine->add_request(prompt, greedy(kTokens, attention), c.callback()));
  }
  run_to_end(*engine);
  const EngineMetrics m = engine->metrics();
  // Decoding victims are swapped out; one that has not decoded yet has no host KV and is
  // recomputed: its prompt prefilled again, then the tokens it sampled fed back one per step.
  EXPECT_GT(m.preemptions_swap, 0u);
  EXPECT_GT(m.preemptions_recompute, 0u);
  // A sparse request that prefilled the tokens it had decoded sparsely (a recompute done as one
  // prefill), or that resumed from KV other than its own, would change its output. The
  // reference: each request alone, never preempted.
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::unique_ptr<Engine> alone = paged_engine(1, kContext, 4000, 4000);
    Collector reference;
    const uint64_t only = alone->add_request(prompts[i], greedy(kTokens, attention), reference.callback());
    run_to_end(*alone);
    EXPECT_EQ(alone->metrics().preemptions_total(), 0u);
    EXPECT_EQ(c.finish[ids[i]], "length") << "request " << i;
    EXPECT_EQ(c.ids[ids[i]], reference.ids[only]) << "request " << i;
  }
  EXPECT_EQ(m.kv_store->retrieve_bytes, m.kv_store->misses * static_cast<uint64_t>(m.kv_store->page_bytes));
  expect_idle(*engine, idle);
}

TEST(EngineSparse, ChunkingOfThePromptDoesNotChangeOutputs) {
  // Quest at a small budget: its prefill is dense and its decode steps sparse, so a prompt whose
  // last token ran alone (as a decode step) would give other outputs. Prompts of 49 and 97 tokens
  // against chunks of 48 leave exactly one token; the reference: one chunk for each prompt.
  std::mt19937 rng(57);
  const std::vector<std::vector<int32_t>> prompts{random_prompt(rng, 49), random_prompt(rng, 97),
                                                  random_prompt(rng, 96)};
  const AttentionSettings attention = quest(32);
  auto outputs = [&](int64_t chunk) {
    EngineConfig config = engine_config(4);
    config.max_num_batched_tokens = chunk;
    const AttentionShape shape = tiny().model.attention_shape();
    Engine engine(tiny().model, nullptr, config, make_paged_attention_factory(shape, store(4000, 4000, 4)));
    Collector c;
    std::vector<uint64_t> ids;
    for (const auto& prompt : prompts) ids.push_back(engine.add_request(prompt, greedy(24, attention), c.callback()));
    run_to_end(engine);
    std::vector<std::vector<int32_t>> out;
    for (uint64_t id : ids) out.push_back(c.ids[id]);
    return out;
  };
  const auto whole = outputs(4096);
  for (int64_t chunk : {48, 3, 4}) {
    const auto chunked = outputs(chunk);
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(chunked[i].size(), 24u);
      EXPECT_EQ(chunked[i], whole[i]) << "prompt " << i << ", chunks of " << chunk;
    }
  }
}

TEST(EngineSparse, RecomputeWhenTheHostTierIsFull) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  // Room on the device for everything, on the host for two requests' KV: a third request that
  // ends its prefill cannot offload, and a preemption frees host pages only by recompute. Quest
  // at a budget of the whole context is exact, so recomputed or not each output is the dense one.
  std::mt19937 rng(53);
  Engine engine(tiny().model, nullptr, engine_config(4),
                make_paged_attention_factory(shape, store(4000, streams * 22, 4)));
  const KvStoreUsage idle = *engine.metrics().kv_store;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(rng, 100));
  expect_greedy_outputs(engine, prompts, 40, quest(kMaxModelLen));
  const EngineMetrics m = engine.metrics();
  EXPECT_GT(m.preemptions_recompute, 0u);
  EXPECT_EQ(m.preemptions_swap, 0u);
  expect_idle(engine, idle);
}

TEST(EngineSparse, SwappedOutRequestsGiveUpHostPagesWhenBothTiersAreShort) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  // Both tiers small: device pressure swaps decoding requests out, and their host pages then run
  // short for the others, so swapped-out requests are dropped to recompute. Exact attention
  // (Quest over the whole context) makes every output the dense one whatever happened.
  std::mt19937 rng(57);
  Engine engine(tiny().model, nullptr, engine_config(6),
                make_paged_attention_factory(shape, store(streams * 20, streams * 24, 6)));
  const KvStoreUsage idle = *engine.metrics().kv_store;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_prompt(rng, 90 + 6 * i));
  expect_greedy_outputs(engine, prompts, 40, quest(kMaxModelLen));
  const EngineMetrics m = engine.metrics();
  EXPECT_GT(m.preemptions_swap, 0u);
  EXPECT_GT(m.preemptions_recompute, 0u);
  expect_idle(engine, idle);
}

TEST(EngineSparse, RequestsThatCannotWorkAreRefusedUpFront) {
  const AttentionShape shape = tiny().model.attention_shape();
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  // The device tier holds 4 pages per stream: a 64-token prefill at most.
  Engine engine(tiny().model, nullptr, engine_config(4),
                make_paged_attention_factory(shape, store(4 * streams, 100 * streams, 4)));
  std::mt19937 rng(3);
  Collector c;
  AttentionSettings unknown = quest(64);
  unknown.algorithm = "no-such-algorithm";
  try {
    engine.add_request(random_prompt(rng, 10), greedy(4, unknown), c.callback());
    FAIL() << "unknown algorithm accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("quest"), std::string::npos) << e.what();
  }
  AttentionSettings bad_sinks = quest(64);
  bad_sinks.sink_tokens = 5;  // not a multiple of the page size
  EXPECT_THROW(engine.add_request(random_prompt(rng, 10), greedy(4, bad_sinks), c.callback()), InvalidRequest);
  try {
    engine.add_request(random_prompt(rng, 60), greedy(10, quest(64)), c.callback());
    FAIL() << "a request larger than the device tier was accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("device pages"), std::string::npos) << e.what();
  }
  // One that fits runs.
  const uint64_t id = engine.add_request(random_prompt(rng, 40), greedy(8, quest(32)), c.callback());
  run_to_end(engine);
  EXPECT_EQ(c.finish[id], "length");
  EXPECT_EQ(c.ids[id].size(), 8u);
  // Steps of 2 tokens cannot end a 3-token prompt without a lone last token.
  EngineConfig tiny_steps = engine_config(4);
  tiny_steps.max_num_batched_tokens = 2;
  Engine small(tiny().model, nullptr, tiny_steps, make_paged_attention_factory(shape, store(4000, 4000, 4)));
  try {
    small.add_request(random_prompt(rng, 3), greedy(4, quest(32)), c.callback());
    FAIL() << "a sparse request with 2-token steps was accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("--max-num-batched-tokens >= 3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spin
