// PagedSparseAttention on the two-tier store: exactness against ContiguousAttention (random
// q/k/v and the tiny Transformer), placement of each baseline, budgets, settings errors, and an
// algorithm defined in this file to show that adding one needs only its class + one registration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "base/error.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/transformer.h"
#include "sparse/paged_sparse_attention.h"
#include "sparse_exactness.h"

namespace {

using spin::AttentionShape;
using spin::sparse::PagedSparseAttention;
using spin::sparse::SparseSettings;

constexpr uint32_t kPage = 16;

// A test-only algorithm: the newest candidate pages win. Its whole definition is here plus the
// one registration line below.
class NewestPagesAlgorithm final : public spin::sparse::SparseAlgorithm {
 public:
  spin::sparse::AlgorithmTraits traits() const override { return {}; }
  void score_pages(const spin::sparse::SelectQuery& query, uint32_t,
                   std::span<float> scores) const override {
    for (uint32_t p = query.first_candidate; p < query.end_candidate; ++p)
      scores[p - query.first_candidate] = static_cast<float>(p);
  }
};
const spin::sparse::AlgorithmRegistrar kNewestRegistration(
    "test-newest", [](const spin::sparse::AlgorithmContext&) {
      return std::make_unique<NewestPagesAlgorithm>();
    });

// A KV store with room for `requests` sequences of max_context tokens, dense on the device.
struct Store : spin_test::PagedStore {
  Store(const AttentionShape& shape, uint32_t max_context, uint32_t requests = 1)
      : PagedStore(shape, max_context, kPage, requests) {}
};

const AttentionShape kShape{3, 8, 2, 16, 0.25f};  // GQA groups of 4

double max_error_vs_dense(const SparseSettings& settings) {
  return spin_test::max_error_vs_dense(kShape, settings, kPage);
}

TEST(SparsePipeline, FullBudgetEqualsDenseOnRandomInputs) {
  for (const char* name : {"dense", "dense-offload", "quest", "test-newest"}) {
    SparseSettings s{.algorithm = name, .budget_fraction = 1.0};
    EXPECT_LE(max_error_vs_dense(s), 1e-6) << name;
    s.first_dense_layers = 0;  // every layer through Select
    EXPECT_LE(max_error_vs_dense(s), 1e-6) << name << " without dense layers";
  }
}

// Prompts shorter than a page (no prompt Index; the first decode steps have no candidate beyond
// the sink) and small budgets: every registered algorithm decodes, exactly at full budget.
TEST(SparsePipeline, EveryAlgorithmDecodesAfterAPromptShorterThanAPage) {
  for (const std::string& name : spin::sparse::AlgorithmRegistry::global().names()) {
    for (double fraction : {1.0, 0.25}) {
      Store store(kShape, 256);
      auto paged = store.attention(kShape, {.algorithm = name, .budget_fraction = fraction});
      spin::ContiguousAttention dense(kShape, 256);
      std::mt19937 rng(11);
      std::normal_distribution<float> n01(0.0f, 1.0f);
      double error = 0.0;
      ASSERT_NO_THROW(error = spin_test::max_decode_error(*paged, dense, kShape, 5, 40, rng, n01,
                                                          [&](int64_t, float* row) {
                                                            for (int64_t i = 0; i < kShape.n_kv_heads * kShape.head_dim;
                                                                 ++i)
                                                              row[i] = n01(rng);
                                                          }))
          << name << " at " << fraction;
      if (fraction == 1.0) {
        EXPECT_LE(error, 1e-5) << name;
      }
    }
  }
}

TEST(SparsePipeline, FullBudgetEqualsDenseThroughTheTransformer) {
  for (const char* name : {"dense", "dense-offload", "quest", "test-newest"}) {
    for (uint32_t first_dense : {0u, 2u}) {
      const SparseSettings s{.algorithm = name, .budget_fraction = 1.0, .first_dense_layers = first_dense};
      EXPECT_LE(spin_test::max_logit_error_through_transformer(s, kPage), 1e-6)
          << name << " first dense " << first_dense;
    }
  }
}

// Feeds a prefill of `prompt` tokens and `steps` decode steps of random q/k/v.
void drive(PagedSparseAttention& a, const AttentionShape& s, int64_t prompt, int steps,
           const std::function<void(int64_t pos)>& after_step = {}) {
  spin::ContiguousAttention dense(s, prompt + steps);
  spin_test::RopedFeed feed(s.head_dim);
  feed.step(a, dense, s, 0, prompt);
  for (int i = 0; i < steps; ++i) {
    feed.step(a, dense, s, prompt + i, 1);
    if (after_step) after_step(prompt + i);
  }
}

TEST(SparsePipeline, DenseKeepsEverythingOnTheDevice) {
  Store store(kShape, 256);
  auto a = store.attention(kShape, {.algorithm = "dense"});
  drive(*a, kShape, 100, 20);
  EXPECT_FALSE(store.kv->offloaded(a->request()));
  EXPECT_EQ(store.kv->counters(a->request()).h2d_pages, 0u);
  EXPECT_EQ(store.kv->counters(a->request()).d2h_pages, 0u);
  EXPECT_EQ(store.kv->device_pool().num_used(), store.config.layout.pages_for_tokens(120) * 6u);
}

TEST(SparsePipeline, DenseOffloadFetchesEveryNonResidentPageEachStep) {
  Store store(kShape, 256);
  auto a = store.attention(kShape, {.algorithm = "dense-offload"});
  const auto request = a->request();
  const uint32_t streams = store.config.layout.streams();
  uint64_t h2d_before = 0;
  drive(*a, kShape, 100, 20, [&](int64_t pos) {
    // Every page but the always-resident ones (1 sink, 2 window, the current) crosses over,
    // except, on a page's first token, the page that just left the window: it was resident.
    const uint32_t pages = static_cast<uint32_t>(pos / kPage + 1);
    const uint32_t pinned = std::min(pages, 1u + std::min(pages - 1, 3u));
    const uint32_t just_left_window = pos % kPage == 0 && pages > 4 ? 1 : 0;
    const uint64_t h2d = store.kv->counters(request).h2d_pages;
    EXPECT_EQ(h2d - h2d_before, uint64_t{pages - pinned - just_left_window} * streams)
        << "position " << pos;
    h2d_before = h2d;
    // After the step only always-resident pages stay on the device.
    for (uint32_t l = 0; l < kShape.n_layers; ++l)
      EXPECT_EQ(store.kv->resident_pages(request, l, 0).size(), pinned);
  });
  EXPECT_TRUE(store.kv->offloaded(request));
}

TEST(SparsePipeline, SmallBudgetIsRespectedAndReportedApart) {
  const uint32_t prompt = 512;
  Store store(kShape, 640);
  auto a = store.attention(kShape, {.algorithm = "quest", .budget_fraction = 1.0 / 8});
  const uint32_t sparse_layers = kShape.n_layers - 2;  // Quest: first 2 layers dense
  drive(*a, kShape, prompt, 24, [&](int64_t pos) {
    const auto& b = a->last_step();
    const uint32_t tokens = static_cast<uint32_t>(pos + 1);
    const uint32_t current = pos / kPage;
    EXPECT_EQ(b.context_tokens, tokens);
    EXPECT_EQ(b.budget_tokens, tokens / 8 / kPage * kPage);  // ≥ 3 pages at this length
    EXPECT_EQ(b.sparse_heads, sparse_layers * 2u);
    EXPECT_EQ(b.max_selected_per_head, b.budget_tokens);
    EXPECT_EQ(b.selected_tokens, uint64_t{b.budget_tokens} * b.sparse_heads);
    // 1 sink page; window: 2 complete pages before the current one, and the current one's tokens.
    EXPECT_EQ(b.sink_tokens, uint64_t{kPage} * b.sparse_heads);
    EXPECT_EQ(b.window_tokens, uint64_t{2 * kPage + (tokens - current * kPage)} * b.sparse_heads);
    EXPECT_EQ(b.dense_layer_tokens, uint64_t{tokens} * 2 * 2);
    // The device keeps the working set: sinks, window, current and this step's selection.
    const uint32_t working = 1 + 3 + b.budget_tokens / kPage;
    EXPECT_LE(store.kv->resident_pages(a->request(), 2, 0).size(), working);
  });
  EXPECT_TRUE(store.kv->offloaded(a->request()));
}

// The test algorithm at a small budget attends exactly sink + newest candidates + window:
// checked against attention computed directly over those positions.
TEST(SparsePipeline, SmallBudgetAttendsExactlyTheSelectedPages) {
  const AttentionShape s{1, 4, 2, 16, 0.25f};
  const int64_t prompt = 200;
  Store store(s, 256);
  auto a = store.attention(s, {.algorithm = "test-newest", .budget_tokens = 2 * kPage});
  spin::ContiguousAttention unused(s, 256);
  spin_test::RopedFeed feed(s.head_dim);
  std::vector<float> all_k, all_v;  // [pos][kv_head][d]
  auto record = [&](int64_t n) {
    all_k.insert(all_k.end(), feed.k.begin(), feed.k.begin() + n * 32);
    all_v.insert(all_v.end(), feed.v.begin(), feed.v.begin() + n * 32);
  };
  feed.step(*a, unused, s, 0, prompt);
  record(prompt);
  for (int64_t pos = prompt; pos < prompt + 10; ++pos) {
    feed.step(*a, unused, s, pos, 1);
    record(1);
    // Attended pages: sink 0, the two newest candidates, window (2 pages) and the current page.
    const int64_t current = pos / kPage;
    std::set<int64_t> pages{0, current - 4, current - 3, current - 2, current - 1, current};
    for (int64_t h = 0; h < 4; ++h) {
      const int64_t g = h / 2;
      std::vector<double> scores, out(16, 0.0);
      std::vector<int64_t> positions;
      for (int64_t p : pages)
        for (int64_t t = p * kPage; t < std::min((p + 1) * kPage, pos + 1); ++t) positions.push_back(t);
      double max_score = -1e300;
      for (int64_t t : positions) {
        double dot = 0.0;
        for (int d = 0; d < 16; ++d) dot += double{feed.q[h * 16 + d]} * all_k[(t * 2 + g) * 16 + d];
        scores.push_back(dot * 0.25);
        max_score = std::max(max_score, scores.back());
      }
      double sum = 0.0;
      for (double& x : scores) sum += (x = std::exp(x - max_score));
      for (size_t i = 0; i < positions.size(); ++i)
        for (int d = 0; d < 16; ++d) out[d] += scores[i] / sum * all_v[(positions[i] * 2 + g) * 16 + d];
      for (int d = 0; d < 16; ++d)
        EXPECT_NEAR(feed.out_a[h * 16 + d], out[d], 1e-5) << "position " << pos << " head " << h;
    }
  }
}

TEST(SparsePipeline, RegistryListsAlgorithmsAndRejectsUnknownOrDuplicateNames) {
  auto& registry = spin::sparse::AlgorithmRegistry::global();
  for (const char* name : {"dense", "dense-offload", "quest", "test-newest"})
    EXPECT_TRUE(registry.contains(name)) << name;
  Store store(kShape, 64);
  try {
    store.attention(kShape, {.algorithm = "nope"});
    FAIL() << "unknown algorithm accepted";
  } catch (const spin::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown sparse algorithm 'nope'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("dense-offload"), std::string::npos);
  }
  EXPECT_THROW(registry.add("quest", [](const spin::sparse::AlgorithmContext&) {
                 return std::make_unique<NewestPagesAlgorithm>();
               }),
               spin::Error);
  EXPECT_EQ(store.kv->num_active_requests(), 0u);
}

TEST(SparsePipeline, BadSettingsGiveClearErrors) {
  Store store(kShape, 64);
  auto expect_error = [&](const SparseSettings& s, const std::string& text) {
    try {
      store.attention(kShape, s);
      ADD_FAILURE() << "accepted settings that should fail with: " << text;
    } catch (const spin::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error({.algorithm = "quest", .budget_tokens = 0}, "token budget must be > 0");
  expect_error({.algorithm = "quest", .budget_fraction = 1.5}, "budget fraction 1.5");
  expect_error({.algorithm = "quest", .budget_fraction = -0.1}, "budget fraction");
  expect_error({.algorithm = "quest", .page_size = 32}, "page size 32");
  expect_error({.algorithm = "quest", .sink_tokens = 10}, "sink tokens (10 tokens)");
  expect_error({.algorithm = "quest", .window_tokens = 17}, "window tokens");
  expect_error({.algorithm = "quest", .first_dense_layers = 4}, "4 first dense layers");
  const AttentionShape other{3, 8, 4, 16, 0.25f};
  EXPECT_THROW(store.attention(other, {}), spin::Error);
  EXPECT_EQ(store.kv->num_active_requests(), 0u);
}

TEST(SparsePipeline, RejectsMisorderedCalls) {
  Store store(kShape, 64);
  auto a = store.attention(kShape, {.algorithm = "quest"});
  std::vector<float> q(8 * 16 * 4), k(2 * 16 * 4), v(2 * 16 * 4), out(8 * 16 * 4);
  const spin::AttentionTokens tokens{.q = q.data(), .k = k.data(), .v = v.data()};
  EXPECT_THROW(a->forward(0, 3, 1, tokens, out.data()), spin::Error);
  EXPECT_THROW(a->forward(1, 0, 1, tokens, out.data()), spin::Error);
  for (int64_t l = 0; l < 3; ++l) a->forward(l, 0, 4, tokens, out.data());
  a->finish_prefill();
  EXPECT_THROW(a->forward(0, 4, 2, tokens, out.data()), spin::Error);
  EXPECT_THROW(a->forward(0, 4, 61, tokens, out.data()), spin::Error);
}

}  // namespace
