// Quest, Seer, ShadowKV and RetroInfer on the GPU through the Engine (engine/cuda/cuda_paged_attention.*): dense prefill
// with the KV written through to the host tier, then per decode step and sparse layer the Index,
// Select and Retrieve kernels and attention over sinks + selected + window pages.
//
// References: the same model and store running `dense`. With a budget that covers the whole context,
// Quest or Seer selects every candidate page (ShadowKV too, and at full rank its rebuilt keys are
// the stored ones up to rounding; RetroInfer too, and leaves no cluster to estimate), so its outputs must equal dense's up to bf16 noise (the same
// tolerance as batching: log-probabilities within 0.15) — and every selected page reached the
// device through the host tier and the cache, so the write-through, the retrieve's gather and the
// page lists are all checked. With a small budget the outputs must not depend on the batch (each
// request alone vs together), the cache must both miss and hit, and a rerun must be bit-identical.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_model_test.h"
#include "gpu_test.h"

#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "base/error.h"
#include "engine/cuda/cuda_paged_attention.h"
#include "model/cuda/cuda_model.h"

namespace spin {
namespace {

using namespace gpu_test;

constexpr int64_t kPage = 16;
constexpr int64_t kContext = 512;

// Qwen3-like with 4 layers: Quest keeps the first 2 dense, the other 2 run sparse.
ModelConfig four_layer_config() {
  ModelConfig c = small_config(true);
  c.n_layers = 4;
  return c;
}

// ShadowKV keeps 2 outlier chunks per (layer, KV head) here: its published 48 would be every page
// of these contexts.
std::unique_ptr<CudaPagedAttentionFactory> sparse_factory(const ModelConfig& c, const ForwardModel& model,
                                                          int64_t host_pages, uint32_t shadowkv_rank = 0,
                                                          std::shared_ptr<const sparse::SeerGate> seer_gate = nullptr) {
  CudaPagedKvConfig kv = paged_kv_config(kPage, 2 * pages_for(c, kPage, 8 * kContext), 8, kContext);
  kv.host_pages = host_pages;
  kv.rope = make_rope_table(c.rope, c.head_dim);
  kv.shadowkv_rank = shadowkv_rank;
  kv.shadowkv_outliers = 2;
  kv.seer_gate = std::move(seer_gate);
  return std::make_unique<CudaPagedAttentionFactory>(model.attention_shape(), kv);
}

// Seer gate weights of the model's shape, drawn with a seed from `rng`.
std::shared_ptr<const sparse::SeerGate> random_seer_gate(const ModelConfig& c, std::mt19937& rng) {
  return sparse::random_seer_gate(
      {.n_layers = c.n_layers, .n_heads = c.n_heads, .n_kv_heads = c.n_kv_heads, .head_dim = c.head_dim}, rng());
}

AttentionSettings sparse(const char* algorithm, int64_t budget, double fraction) {
  AttentionSettings s;
  s.algorithm = algorithm;
  s.budget = budget;
  s.budget_fraction = fraction;
  return s;
}

AttentionSettings quest(int64_t budget, double fraction = 0.0) { return sparse("quest", budget, fraction); }
AttentionSettings seer(int64_t budget, double fraction = 0.0) { return sparse("seer", budget, fraction); }
AttentionSettings shadowkv(int64_t budget, double fraction = 0.0) { return sparse("shadowkv", budget, fraction); }
AttentionSettings retroinfer(int64_t budget, double fraction = 0.0) { return sparse("retroinfer", budget, fraction); }

AttentionSettings dense_offload() {
  AttentionSettings s;
  s.algorithm = "dense-offload";
  return s;
}

class CudaSparseTest : public GpuTest {
 protected:
  // Seer's trained gate of the stores the helpers below make; null: the training-free gate.
  std::shared_ptr<const sparse::SeerGate> seer_gate;

  // Runs the prompts with dense and then with `attention` on fresh stores of one model; each
  // request must get dense's tokens (log-probabilities within 0.15), and the pools must be back
  // to empty afterwards. `usage`: the second store's counters.
  void expect_dense_tokens(CudaModel& model, const ModelConfig& c, const std::vector<std::vector<int32_t>>& prompts,
                           const std::vector<int64_t>& max_tokens, const AttentionSettings& attention,
                           KvStoreUsage& usage, uint32_t shadowkv_rank = 0) {
    const int64_t host = pages_for(c, kPage, 8 * kContext);
    const auto dense = run_engine(model, sparse_factory(c, model, host), prompts, max_tokens);
    const auto runs = run_engine(model, sparse_factory(c, model, host, shadowkv_rank, seer_gate), prompts, max_tokens, nullptr,
                                 std::vector<AttentionSettings>(prompts.size(), attention), &usage);
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(static_cast<int64_t>(runs[i].tokens.size()), max_tokens[i]) << "request " << i;
      EXPECT_EQ(runs[i].tokens, dense[i].tokens) << "request " << i;
      EXPECT_LE(max_logprob_difference(runs[i], dense[i]), 0.15) << "request " << i;
    }
    EXPECT_EQ(usage.host_pages_used, 0) << "finished requests must give back their host-tier pages";
    EXPECT_EQ(usage.device_pages_used, 0) << "finished requests must give back their device pages";
  }

  // With a budget of the whole context (prompts of 150, 263, 40 and 300 tokens), `attention` gives
  // dense's tokens; the first decode step of each request fetched every candidate page of both
  // sparse layers from the host tier, later steps found them in the cache.
  void expect_full_budget_gives_dense(const AttentionSettings& attention, uint64_t weight_seed, KvStoreUsage& usage,
                                      uint32_t shadowkv_rank = 0) {
    const ModelConfig c = four_layer_config();
    const ModelWeights w = wide_margin_weights(c, weight_seed);
    CudaModel model(w, CudaModelOptions{});
    const auto prompts = random_prompts(rng, c.vocab_size, {150, 263, 40, 300});
    ASSERT_NO_FATAL_FAILURE(expect_dense_tokens(model, c, prompts, {40, 36, 30, 44}, attention, usage, shadowkv_rank));
    EXPECT_GT(usage.misses, 0u);
    EXPECT_GT(usage.hits, usage.misses);
  }

  // The model options of the tests that compare a request's run in steps of other sizes (alone
  // against batched, a tight pool's preemptions against a roomy pool): every product on cuBLASLt.
  // gemv.h's kernel (a step of at most gemv_rows rows) sums in another order, so a request's rows
  // could round differently in a small step than in a larger one, and a small budget's page choice
  // can flip on that. With one product path, what is left to differ is what these tests are about:
  // whether one request's pages, caches and selections are touched by the others.
  static CudaModelOptions one_product_path() {
    CudaModelOptions options;
    options.gemv_rows = 0;
    return options;
  }

  // Each request with `settings` gets the same tokens alone as batched with the others, a rerun is
  // bit-identical, the outputs move away from dense's, and the cache both misses and hits.
  void expect_batch_invariant(CudaModel& model, const ModelConfig& c, const std::vector<std::vector<int32_t>>& prompts,
                              const std::vector<int64_t>& max_tokens, const std::vector<AttentionSettings>& settings) {
    const int64_t host = pages_for(c, kPage, 8 * kContext);
    const auto dense = run_engine(model, sparse_factory(c, model, host), prompts, max_tokens);
    const auto together = run_engine(model, sparse_factory(c, model, host, 0, seer_gate), prompts, max_tokens, nullptr, settings);
    const auto again = run_engine(model, sparse_factory(c, model, host, 0, seer_gate), prompts, max_tokens, nullptr, settings);
    double largest_gap = 0.0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto alone = run_engine(model, sparse_factory(c, model, host, 0, seer_gate), {prompts[i]}, {max_tokens[i]}, nullptr,
                                    {settings[i]})[0];
      ASSERT_EQ(static_cast<int64_t>(together[i].tokens.size()), max_tokens[i]) << "request " << i;
      EXPECT_EQ(together[i].tokens, alone.tokens) << "request " << i << " (" << settings[i].algorithm << ")";
      EXPECT_LE(max_logprob_difference(together[i], alone), 0.15) << "request " << i << ": batching changed it";
      EXPECT_EQ(max_logprob_difference(together[i], again[i]), 0.0) << "request " << i << ": a rerun differs";
      if (settings[i].algorithm != "dense") {
        largest_gap = std::max(largest_gap, max_logprob_difference(together[i], dense[i]));
      }
    }
    // A few of ~20 pages attended in the sparse layers: the distributions move away from dense's.
    EXPECT_GT(largest_gap, 1e-3) << "a small budget gave dense's log-probabilities: is Select a no-op?";

    KvStoreUsage u;
    run_engine(model, sparse_factory(c, model, host, 0, seer_gate), {prompts[0]}, {64}, nullptr, {settings[0]}, &u);
    EXPECT_GT(u.misses, 0u);
    EXPECT_GT(u.hits, 0u) << "consecutive steps never reused a cached page";
  }

  // One request at a time on one store and model: the first decodes alone (its steps are captured
  // as CUDA graphs), then the second, of the same length, alone, with the same batch size and
  // context bucket. Each must get the tokens it gets alone: a graph of the first's steps must not
  // be replayed for the second's if they run different kernels or grids.
  void expect_graphs_keyed_apart(const std::vector<AttentionSettings>& settings, int prompt_tokens,
                                 uint64_t weight_seed) {
    const ModelConfig c = four_layer_config();
    const ModelWeights w = wide_margin_weights(c, weight_seed);
    CudaModel model(w, CudaModelOptions{});
    const auto prompts = random_prompts(rng, c.vocab_size, {prompt_tokens, prompt_tokens});
    const int64_t host = pages_for(c, kPage, 8 * kContext);
    // The references first, each alone on its own store, after a run that leaves the model's
    // buffers at their size for these steps.
    run_engine(model, sparse_factory(c, model, host), prompts, {40, 40}, nullptr, settings);
    std::vector<EngineRun> alone;
    for (size_t i = 0; i < 2; ++i) {
      alone.push_back(run_engine(model, sparse_factory(c, model, host), {prompts[i]}, {40}, nullptr, {settings[i]})[0]);
    }
    EngineConfig config;  // run_engine's, one request at a time: each is scheduled as when alone
    config.max_num_seqs = 1;
    config.max_num_batched_tokens = 48;
    config.max_model_len = kContext;
    Engine engine(model, nullptr, config, sparse_factory(c, model, host));
    std::vector<EngineRun> runs(2);
    for (size_t i = 0; i < 2; ++i) {
      RequestParams params;  // as run_engine's
      params.max_tokens = 40;
      params.sampling.temperature = 0.0f;
      params.ignore_eos = true;
      params.top_logprobs = 5;
      params.attention = settings[i];
      engine.add_request(prompts[i], params, [&runs, i](const RequestOutput& o) {
        runs[i].tokens.insert(runs[i].tokens.end(), o.token_ids.begin(), o.token_ids.end());
        runs[i].logprobs.insert(runs[i].logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      });
    }
    const int64_t replays = model.forward_stats()->graph_replays;
    while (engine.has_work()) engine.step();
    EXPECT_GT(model.forward_stats()->graph_replays, replays);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(runs[i].tokens, alone[i].tokens) << "request " << i;
      EXPECT_LE(max_logprob_difference(runs[i], alone[i]), 0.15) << "request " << i;
    }
  }

  // Eight prompts on a roomy store (16 contexts of device pages), then on a tight one (2), both
  // with a host tier of 8 contexts, RoPE and `configure`'s changes, through run_engine's engine
  // config; `each_step` (if set) checks the tight run after every step. Each request must get the
  // roomy store's tokens and the tight store's pools must end empty. `tight`: that run's metrics.
  void expect_tight_pool_gives_roomy_tokens(
      uint64_t weight_seed, const AttentionSettings& attention, const std::function<void(CudaPagedKvConfig&)>& configure,
      const std::function<void(const Engine&, const CudaPagedAttentionFactory&)>& each_step, EngineMetrics& tight) {
    const ModelConfig c = four_layer_config();
    const ModelWeights w = wide_margin_weights(c, weight_seed);
    CudaModel model(w, one_product_path());
    const auto prompts = random_prompts(rng, c.vocab_size, {120, 136, 152, 168, 184, 200, 216, 232});
    const std::vector<int64_t> max_tokens(prompts.size(), 64);
    const std::vector<AttentionSettings> settings(prompts.size(), attention);
    const auto factory = [&](int64_t device_tokens) {
      CudaPagedKvConfig kv = paged_kv_config(kPage, pages_for(c, kPage, device_tokens), 8, kContext);
      kv.host_pages = pages_for(c, kPage, 8 * kContext);
      kv.rope = make_rope_table(c.rope, c.head_dim);
      configure(kv);
      return std::make_unique<CudaPagedAttentionFactory>(model.attention_shape(), kv);
    };
    const auto roomy = run_engine(model, factory(16 * kContext), prompts, max_tokens, nullptr, settings);

    EngineConfig config;  // run_engine's
    config.max_num_seqs = 8;
    config.max_num_batched_tokens = 48;
    config.max_model_len = kContext;
    auto small = factory(2 * kContext);
    const CudaPagedAttentionFactory* store = small.get();
    Engine engine(model, nullptr, config, std::move(small));
    std::vector<EngineRun> runs;
    add_greedy_requests(engine, prompts, max_tokens, settings, runs);
    while (engine.has_work()) {
      engine.step();
      if (each_step) {
        ASSERT_NO_FATAL_FAILURE(each_step(engine, *store));
      }
    }
    tight = engine.metrics();
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(static_cast<int64_t>(runs[i].tokens.size()), max_tokens[i]) << "request " << i;
      EXPECT_EQ(runs[i].tokens, roomy[i].tokens) << "request " << i;
      EXPECT_LE(max_logprob_difference(runs[i], roomy[i]), 0.15) << "request " << i;
    }
    const KvStoreUsage idle = store->usage().value();
    EXPECT_EQ(idle.device_pages_used, 0);
    EXPECT_EQ(idle.host_pages_used, 0);
  }

  std::mt19937 rng{777};
};

TEST_F(CudaSparseTest, QuestSelectingEveryPageEqualsDense) {
  KvStoreUsage usage;
  expect_full_budget_gives_dense(quest(0, 1.0), 31, usage);
}

TEST_F(CudaSparseTest, SeerSelectingEveryPageEqualsDense) {
  KvStoreUsage usage;
  expect_full_budget_gives_dense(seer(0, 1.0), 37, usage);
}

TEST_F(CudaSparseTest, ShadowKvAtFullRankSelectingEveryPageEqualsDense) {
  const ModelConfig c = four_layer_config();
  const auto full_rank = static_cast<uint32_t>(c.n_kv_heads * c.head_dim);
  KvStoreUsage usage;
  ASSERT_NO_FATAL_FAILURE(expect_full_budget_gives_dense(shadowkv(0, 1.0), 41, usage, full_rank));
  // The prompt pages' misses fetched their values only (the keys were rebuilt from the factors).
  EXPECT_LT(usage.retrieve_bytes, usage.misses * static_cast<uint64_t>(usage.page_bytes));
}

TEST_F(CudaSparseTest, RetroInferSelectingEveryPageEqualsDense) {
  KvStoreUsage usage;
  expect_full_budget_gives_dense(retroinfer(0, 1.0), 43, usage);
}

TEST_F(CudaSparseTest, RetroInferReclusteringDecodePagesKeepsDenseTokensAtFullBudget) {
  // 1100 decode tokens: the pages they fill are clustered as a new segment once 1024 tokens of
  // them wait (read from the host tier); with the whole context as budget every page is still
  // attended, so the tokens stay dense's through and after it.
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 44);
  CudaModel model(w, CudaModelOptions{});
  const auto prompts = random_prompts(rng, c.vocab_size, {200, 120});
  const std::vector<int64_t> max_tokens{1100, 1090};
  constexpr int64_t kLong = 2048;
  const auto run = [&](const AttentionSettings& attention, KvStoreUsage* usage) {
    CudaPagedKvConfig kv = paged_kv_config(kPage, 2 * pages_for(c, kPage, 4 * kLong), 8, kLong);
    kv.host_pages = pages_for(c, kPage, 4 * kLong);
    kv.rope = make_rope_table(c.rope, c.head_dim);
    return run_engine(model, std::make_unique<CudaPagedAttentionFactory>(model.attention_shape(), kv), prompts,
                      max_tokens, nullptr, {attention, attention}, usage, kLong);
  };
  const auto dense = run(AttentionSettings{}, nullptr);
  KvStoreUsage usage;
  const auto runs = run(retroinfer(0, 1.0), &usage);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(static_cast<int64_t>(runs[i].tokens.size()), max_tokens[i]) << "request " << i;
    EXPECT_EQ(runs[i].tokens, dense[i].tokens) << "request " << i;
    EXPECT_LE(max_logprob_difference(runs[i], dense[i]), 0.15) << "request " << i;
  }
  EXPECT_EQ(usage.device_pages_used, 0) << "finished requests must give back their device pages";
  EXPECT_EQ(usage.host_pages_used, 0);
}

TEST_F(CudaSparseTest, RetroInferSmallBudgetIsBatchInvariantAndUsesTheCache) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 45);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  expect_batch_invariant(model, c, prompts, {48, 40, 56}, std::vector<AttentionSettings>(prompts.size(), retroinfer(48)));
}

TEST_F(CudaSparseTest, ShadowKvSmallBudgetIsBatchInvariantAndUsesTheCache) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 42);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  expect_batch_invariant(model, c, prompts, {48, 40, 56}, std::vector<AttentionSettings>(prompts.size(), shadowkv(48)));
}

TEST_F(CudaSparseTest, QuestSmallBudgetIsBatchInvariantAndUsesTheCache) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 32);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  expect_batch_invariant(model, c, prompts, {48, 40, 56}, std::vector<AttentionSettings>(prompts.size(), quest(48)));
}

TEST_F(CudaSparseTest, SeerSmallBudgetIsBatchInvariantAndUsesTheCache) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 38);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  expect_batch_invariant(model, c, prompts, {48, 40, 56}, std::vector<AttentionSettings>(prompts.size(), seer(64)));
}

// Seer's trained gate (random weights): a full budget gives dense's tokens, a small one is batch
// invariant, misses and hits the cache, and gives other tokens than the training-free gate.
TEST_F(CudaSparseTest, SeerTrainedGateEqualsDenseAtFullBudgetAndIsBatchInvariant) {
  const ModelConfig c = four_layer_config();
  seer_gate = random_seer_gate(c, rng);
  KvStoreUsage usage;
  expect_full_budget_gives_dense(seer(0, 1.0), 40, usage);
  const ModelWeights w = wide_margin_weights(c, 38);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  expect_batch_invariant(model, c, prompts, {48, 40, 56}, std::vector<AttentionSettings>(prompts.size(), seer(64)));
  const int64_t host = pages_for(c, kPage, 8 * kContext);
  const std::vector<AttentionSettings> settings(prompts.size(), seer(64));
  const auto trained = run_engine(model, sparse_factory(c, model, host, 0, seer_gate), prompts, {48, 40, 56}, nullptr,
                                  settings);
  const auto training_free = run_engine(model, sparse_factory(c, model, host), prompts, {48, 40, 56}, nullptr, settings);
  double largest_gap = 0.0;
  for (size_t i = 0; i < prompts.size(); ++i)
    largest_gap = std::max(largest_gap, max_logprob_difference(trained[i], training_free[i]));
  EXPECT_GT(largest_gap, 1e-3) << "the trained gate selected what the training-free one does: is it used?";
}

// Prompts shorter than a page (no prompt Index; the first steps have no candidate beyond the
// sink): every host-tier algorithm gives dense's tokens at a full budget.
TEST_F(CudaSparseTest, PromptsShorterThanAPageGiveDenseTokens) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 42);
  CudaModel model(w, CudaModelOptions{});
  const auto prompts = random_prompts(rng, c.vocab_size, {5, 12, 3});
  for (const AttentionSettings& attention :
       {quest(0, 1.0), seer(0, 1.0), shadowkv(0, 1.0), retroinfer(0, 1.0), dense_offload()}) {
    SCOPED_TRACE(attention.algorithm);
    KvStoreUsage usage;
    expect_dense_tokens(model, c, prompts, {40, 30, 36}, attention, usage);
  }
}

TEST_F(CudaSparseTest, QuestSeerAndDenseRequestsInOneBatchGetTheirTokensAlone) {
  // Each algorithm's Index and scores run only over its own rows of a mixed step.
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 39);
  CudaModel model(w, one_product_path());
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 260, 180, 410, 330, 290, 350});
  expect_batch_invariant(model, c, prompts, {48, 40, 44, 56, 36, 50, 42},
                         {seer(64), quest(48), AttentionSettings{}, seer(0, 0.25), dense_offload(), shadowkv(48),
                          retroinfer(48)});
}

TEST_F(CudaSparseTest, DenseRequestsBesideQuestOnesGetTheirDenseTokens) {
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 33);
  CudaModel model(w, CudaModelOptions{});
  const auto prompts = random_prompts(rng, c.vocab_size, {200, 120, 330, 64});
  const std::vector<int64_t> max_tokens{30, 30, 30, 30};
  const int64_t host = pages_for(c, kPage, 8 * kContext);
  const auto dense = run_engine(model, sparse_factory(c, model, host), prompts, max_tokens);
  std::vector<AttentionSettings> mixed(prompts.size());
  mixed[1] = quest(32);
  mixed[2] = quest(0, 0.25);
  const auto runs = run_engine(model, sparse_factory(c, model, host), prompts, max_tokens, nullptr, mixed);
  for (size_t i : {size_t{0}, size_t{3}}) {
    EXPECT_EQ(runs[i].tokens, dense[i].tokens) << "dense request " << i;
    EXPECT_LE(max_logprob_difference(runs[i], dense[i]), 0.15) << "dense request " << i;
  }
}

TEST_F(CudaSparseTest, DenseOffloadEqualsDenseWithItsKvInTheHostTier) {
  // dense-offload attends to every page like dense, reading those between sinks and window from
  // the host tier, so its tokens are dense's; while it decodes, the device holds only sinks,
  // window and the first dense layers.
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 35);
  CudaModel model(w, CudaModelOptions{});
  const auto prompts = random_prompts(rng, c.vocab_size, {310, 150, 263, 400});
  KvStoreUsage usage;
  ASSERT_NO_FATAL_FAILURE(expect_dense_tokens(model, c, prompts, {40, 36, 30, 44}, dense_offload(), usage));
  EXPECT_EQ(usage.misses, 0u) << "dense-offload reads the host tier in place: nothing is retrieved";

  // Mid-run: every request decoding, its device pages far fewer than its KV.
  const int64_t host = pages_for(c, kPage, 8 * kContext);
  EngineConfig config;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 512;
  config.max_model_len = kContext;
  auto factory = sparse_factory(c, model, host);
  const CudaPagedAttentionFactory* store = factory.get();
  Engine engine(model, nullptr, config, std::move(factory));
  RequestParams params;
  params.max_tokens = 64;
  params.ignore_eos = true;
  params.attention = dense_offload();
  int64_t prompt_pages = 0;
  for (const auto& prompt : prompts) {
    engine.add_request(prompt, params, [](const RequestOutput&) {});
    prompt_pages += pages_for(c, kPage, static_cast<int64_t>(prompt.size()));
  }
  for (int i = 0; i < 12; ++i) engine.step();
  ASSERT_EQ(engine.metrics().requests_running, 4);
  const KvStoreUsage mid = store->usage().value();
  EXPECT_GE(mid.host_pages_used, prompt_pages);
  // Dense would hold every page in every layer. dense-offload's first 2 layers of 4 keep every page
  // (half the KV), and its sinks and window groups span all 4 layers (a few pages per request).
  EXPECT_LT(mid.device_pages_used, prompt_pages * 4 / 5) << "the device kept pages dense-offload reads from the host";
  while (engine.has_work()) engine.step();
}

TEST_F(CudaSparseTest, GraphsOfDenseStepsAreNotReplayedForQuestSteps) {
  // Replaying the dense request's graph would skip Quest's write-through and pipeline.
  expect_graphs_keyed_apart({AttentionSettings{}, quest(48)}, 200, 36);
}

TEST_F(CudaSparseTest, ShadowKvGraphsAreKeyedByTheirKeyRebuildsGrid) {
  // The first request selects 3 pages; the second every candidate (about 23), whose first step
  // misses them all. Replaying the first one's graph would launch a key rebuild too small for
  // them, leaving keys of fetched pages unwritten.
  expect_graphs_keyed_apart({shadowkv(16), shadowkv(0, 1.0)}, 460, 44);
}

TEST_F(CudaSparseTest, SwapPreemptionResumesWithTheTokensOfARoomyStore) {
  // A device pool of two contexts' pages and a host tier of eight: prefills keep preempting
  // decoding requests, which are swapped out (their KV stays in the host tier, the first dense
  // layers copied there) and resume without recompute. Their tokens must be a roomy store's.
  EngineMetrics tight;
  ASSERT_NO_FATAL_FAILURE(expect_tight_pool_gives_roomy_tokens(
      40, quest(0, 0.5),
      [](CudaPagedKvConfig& kv) { kv.buffer_factor = 0.0; },  // cache slots = the selection: few pages
      {}, tight));
  EXPECT_GT(tight.preemptions_swap, 0u) << "the small pool never swapped a request out";
}

TEST_F(CudaSparseTest, ShadowKvInATightPoolGetsTheTokensOfARoomyStore) {
  // A device pool of two contexts' pages: prefills fill it, and each request's first decode step
  // must fit its factors into the pages its prompt gives back (the transition reads the prompt
  // before it writes the factors). ShadowKV keeps its factors on the device only, so pressure
  // preempts by recompute. Tokens must be a roomy store's, no step may run out of pages, and after
  // every step the store may hold no more device pages than the engine reserved (elastic buffers
  // included: a new request's cache buffer starts at the engine's size, not the store's default).
  EngineMetrics tight;
  ASSERT_NO_FATAL_FAILURE(expect_tight_pool_gives_roomy_tokens(
      43, shadowkv(0, 0.5), [](CudaPagedKvConfig& kv) { kv.shadowkv_outliers = 2; },
      [](const Engine& engine, const CudaPagedAttentionFactory& store) {
        const EngineMetrics m = engine.metrics();
        ASSERT_LE(store.usage().value().device_pages_used, m.kv_device_pages_reserved + m.kv_dense_layer_pages_reserved);
      },
      tight));
  EXPECT_EQ(tight.kv_store_exhausted_total, 0u);
}

TEST_F(CudaSparseTest, ElasticCacheBuffersGrowWithoutChangingTokens) {
  // With elastic buffers (the engine's default) a decoding request starts with cache slots for its
  // selection only, and the engine grows its buffer while pages are free. The cache's size must
  // not change the tokens: they are those of fixed full buffers.
  const ModelConfig c = four_layer_config();
  const ModelWeights w = wide_margin_weights(c, 41);
  CudaModel model(w, CudaModelOptions{});
  const auto prompts = random_prompts(rng, c.vocab_size, {300, 220, 410});
  const std::vector<int64_t> max_tokens{48, 40, 56};
  const int64_t host = pages_for(c, kPage, 8 * kContext);
  for (const AttentionSettings& attention : {quest(48), seer(64), shadowkv(48)}) {
    std::vector<std::vector<EngineRun>> runs;
    int64_t largest_buffer = 0;
    for (const bool elastic : {false, true}) {
      EngineConfig config;  // run_engine's
      config.max_num_seqs = 8;
      config.max_num_batched_tokens = 48;
      config.max_model_len = kContext;
      config.elastic_kv_buffers = elastic;
      auto factory = sparse_factory(c, model, host);
      const CudaPagedAttentionFactory* store = factory.get();
      Engine engine(model, nullptr, config, std::move(factory));
      std::vector<EngineRun> out;
      add_greedy_requests(engine, prompts, max_tokens, std::vector<AttentionSettings>(prompts.size(), attention), out);
      while (engine.has_work()) {
        engine.step();
        if (elastic) largest_buffer = std::max<int64_t>(largest_buffer, engine.metrics().kv_buffer_pages_reserved);
      }
      EXPECT_EQ(store->usage().value().device_pages_used, 0) << attention.algorithm;
      runs.push_back(std::move(out));
    }
    EXPECT_GT(largest_buffer, 0) << attention.algorithm << ": the engine never grew a cache buffer";
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(static_cast<int64_t>(runs[1][i].tokens.size()), max_tokens[i]) << "request " << i;
      EXPECT_EQ(runs[1][i].tokens, runs[0][i].tokens) << attention.algorithm << " request " << i;
      EXPECT_LE(max_logprob_difference(runs[1][i], runs[0][i]), 0.15) << attention.algorithm << " request " << i;
    }
  }
}

TEST_F(CudaSparseTest, UnsupportedSparseSettingsAreClearErrors) {
  const ModelConfig c = four_layer_config();
  CudaModel model(bf16_weights(c, 34), CudaModelOptions{});
  auto no_host = sparse_factory(c, model, 0);
  EXPECT_EQ(no_host->algorithms(), std::vector<std::string>{"dense"});
  EXPECT_THROW(no_host->validate(quest(64)), Error);
  EXPECT_THROW(no_host->validate(dense_offload()), Error);
  auto factory = sparse_factory(c, model, pages_for(c, kPage, 4 * kContext));
  EXPECT_NO_THROW(factory->validate(quest(64)));
  EXPECT_NO_THROW(factory->validate(dense_offload()));
  EXPECT_NO_THROW(factory->validate(seer(64)));
  EXPECT_EQ(factory->algorithms(),
            (std::vector<std::string>{"dense", "dense-offload", "quest", "seer", "shadowkv", "retroinfer"}));
  for (AttentionSettings other_dense_layers : {quest(64), seer(64)}) {
    other_dense_layers.first_dense_layers = 0;
    EXPECT_THROW(factory->validate(other_dense_layers), Error);
  }
  // Seer turns stored keys back by the model's RoPE, and its 64-token blocks need whole pages.
  CudaPagedKvConfig no_rope = paged_kv_config(kPage, 2 * pages_for(c, kPage, 8 * kContext), 8, kContext);
  no_rope.host_pages = pages_for(c, kPage, 4 * kContext);
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), no_rope).validate(seer(64)), Error);
  CudaPagedKvConfig page_24 = no_rope;
  page_24.page_size = 24;
  page_24.rope = make_rope_table(c.rope, c.head_dim);
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), page_24).validate(seer(64)), Error);
  // The trained gate keeps a block's running pools in three of its pages' summaries.
  CudaPagedKvConfig trained_page_32 = page_24;
  trained_page_32.page_size = 32;
  EXPECT_NO_THROW(CudaPagedAttentionFactory(model.attention_shape(), trained_page_32).validate(seer(64)));
  trained_page_32.seer_gate = random_seer_gate(c, rng);
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), trained_page_32).validate(seer(64)), Error);
  // A gate of another model's shape.
  CudaPagedKvConfig other_gate = trained_page_32;
  other_gate.page_size = kPage;
  ModelConfig deeper = c;
  deeper.n_layers += 1;
  other_gate.seer_gate = random_seer_gate(deeper, rng);
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), other_gate), Error);
  // ShadowKV also turns stored keys back; its rank must fit the model and the rebuild kernel.
  EXPECT_NO_THROW(factory->validate(shadowkv(64)));
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), no_rope).validate(shadowkv(64)), Error);
  CudaPagedKvConfig too_wide = page_24;
  too_wide.page_size = kPage;
  too_wide.shadowkv_rank = static_cast<uint32_t>(c.n_kv_heads * c.head_dim + 1);
  EXPECT_THROW(CudaPagedAttentionFactory(model.attention_shape(), too_wide).validate(shadowkv(64)), Error);
  EXPECT_NO_THROW(factory->validate(retroinfer(64)));
  AttentionSettings unknown;
  unknown.algorithm = "no-such-algorithm";
  EXPECT_THROW(factory->validate(unknown), Error);
  EXPECT_THROW(factory->create(quest(0, 1.5), 256), Error);
}

}  // namespace
}  // namespace spin
