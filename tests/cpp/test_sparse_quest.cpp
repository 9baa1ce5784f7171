// Quest's Index and Select against a plain brute-force reimplementation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "base/error.h"
#include "sparse/algorithm.h"

namespace {

using spin::sparse::AlgorithmContext;
using spin::sparse::AlgorithmRegistry;
using spin::sparse::SelectQuery;

constexpr uint32_t kPage = 16;

struct QuestCase {
  uint32_t n_layers = 3, n_heads = 8, n_kv = 2, head_dim = 16, pages = 40;
  spin::AttentionShape shape() const {
    return {n_layers, n_heads, n_kv, head_dim, 1.0f / std::sqrt(float(head_dim))};
  }
  spin::kv::KvLayout layout() const { return {n_layers, n_kv, head_dim, kPage}; }
};

// keys[layer][kv_head][token][d]
using Keys = std::vector<float>;

float key(const Keys& k, const QuestCase& c, uint32_t l, uint32_t g, uint32_t t, uint32_t d) {
  return k[((size_t{l} * c.n_kv + g) * c.pages * kPage + t) * c.head_dim + d];
}

// Σ_d max(q_d·max_d, q_d·min_d) over the page's keys, recomputed from the raw keys.
double brute_bound(const Keys& k, const QuestCase& c, uint32_t l, uint32_t g, uint32_t page,
                   const float* q) {
  double bound = 0.0;
  for (uint32_t d = 0; d < c.head_dim; ++d) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (uint32_t t = page * kPage; t < (page + 1) * kPage; ++t) {
      lo = std::min(lo, key(k, c, l, g, t, d));
      hi = std::max(hi, key(k, c, l, g, t, d));
    }
    bound += std::max(double{q[d]} * hi, double{q[d]} * lo);
  }
  return bound;
}

double brute_max_dot(const Keys& k, const QuestCase& c, uint32_t l, uint32_t g, uint32_t page,
                     const float* q) {
  double best = -std::numeric_limits<double>::infinity();
  for (uint32_t t = page * kPage; t < (page + 1) * kPage; ++t) {
    double dot = 0.0;
    for (uint32_t d = 0; d < c.head_dim; ++d) dot += double{q[d]} * key(k, c, l, g, t, d);
    best = std::max(best, dot);
  }
  return best;
}

struct IndexedQuest {
  QuestCase c;
  Keys keys;
  std::unique_ptr<spin::sparse::SparseAlgorithm> quest;
  spin::sparse::SparseSettings settings{.algorithm = "quest"};

  explicit IndexedQuest(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    keys.resize(size_t{c.n_layers} * c.n_kv * c.pages * kPage * c.head_dim);
    for (float& x : keys) x = normal(rng);
    quest = AlgorithmRegistry::global().create("quest",
                                               AlgorithmContext{c.shape(), c.layout(), &settings});
    // Index in two batches per layer, as prefill then decode would.
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      for (auto [first, end] : {std::pair{0u, 25u}, std::pair{25u, c.pages}}) {
        quest->index({l, first, end, [&, l](uint32_t g, uint32_t p) {
                        return &keys[((size_t{l} * c.n_kv + g) * c.pages * kPage + p * kPage) *
                                     c.head_dim];
                      }});
      }
    }
  }
};

TEST(SparseQuest, BoundMatchesBruteForceAndBoundsEveryHeadOfTheGroup) {
  IndexedQuest iq(11);
  const QuestCase& c = iq.c;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(c.n_heads * c.head_dim);
  const uint32_t group = c.n_heads / c.n_kv;
  for (int trial = 0; trial < 5; ++trial) {
    for (float& x : q) x = normal(rng);
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      SelectQuery query{.layer = l, .q = q.data(), .num_kv_heads = c.n_kv, .group = group,
                        .context_tokens = c.pages * kPage, .first_candidate = 1,
                        .end_candidate = c.pages, .budget_pages = 8};
      std::vector<float> scores(c.pages - 1);
      for (uint32_t g = 0; g < c.n_kv; ++g) {
        iq.quest->score_pages(query, g, scores);
        for (uint32_t p = 1; p < c.pages; ++p) {
          double expected = -std::numeric_limits<double>::infinity();
          for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
            const float* qh = &q[h * c.head_dim];
            const double bound = brute_bound(iq.keys, c, l, g, p, qh);
            // The bound really bounds: no key of the page beats it for any head of the group.
            EXPECT_GE(bound, brute_max_dot(iq.keys, c, l, g, p, qh) - 1e-9);
            expected = std::max(expected, bound);
          }
          EXPECT_NEAR(scores[p - 1], expected, 1e-5 * std::max(1.0, std::abs(expected)))
              << "layer " << l << " head " << g << " page " << p;
        }
      }
    }
  }
}

TEST(SparseQuest, SelectsBruteForceTopPagesByTheBound) {
  IndexedQuest iq(21);
  const QuestCase& c = iq.c;
  std::mt19937 rng(22);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(c.n_heads * c.head_dim);
  const uint32_t group = c.n_heads / c.n_kv;
  for (uint32_t budget : {1u, 3u, 7u, 20u}) {
    for (float& x : q) x = normal(rng);
    const uint32_t first = 2, end = c.pages - 3;
    SelectQuery query{.layer = 2, .q = q.data(), .num_kv_heads = c.n_kv, .group = group,
                      .context_tokens = c.pages * kPage, .first_candidate = first,
                      .end_candidate = end, .budget_pages = budget};
    spin::kv::LayerSelection out;
    spin::sparse::StepBudget step;
    iq.quest->select(query, out, step);
    ASSERT_EQ(out.num_heads(), c.n_kv);
    for (uint32_t g = 0; g < c.n_kv; ++g) {
      std::vector<std::pair<double, uint32_t>> ranked;
      for (uint32_t p = first; p < end; ++p) {
        double best = -std::numeric_limits<double>::infinity();
        for (uint32_t h = g * group; h < (g + 1) * group; ++h)
          best = std::max(best, brute_bound(iq.keys, c, 2, g, p, &q[h * c.head_dim]));
        ranked.push_back({-best, p});
      }
      std::sort(ranked.begin(), ranked.end());
      std::set<uint32_t> expected;
      for (uint32_t i = 0; i < budget; ++i) expected.insert(ranked[i].second);
      const auto head = out.head(g);
      EXPECT_EQ(std::set<uint32_t>(head.begin(), head.end()), expected) << "budget " << budget;
      EXPECT_EQ(head.size(), budget);
    }
  }
}

TEST(SparseQuest, PublishedDefaults) {
  IndexedQuest iq(31);
  const auto traits = iq.quest->traits();
  EXPECT_EQ(traits.first_dense_layers, 2u);
  EXPECT_EQ(traits.min_selected_pages, 3u);
  EXPECT_EQ(traits.placement, spin::sparse::Placement::Offload);
  // Min and max key of every page of every stream: 2 × head_dim floats.
  EXPECT_EQ(iq.quest->summary_bytes(),
            uint64_t{iq.c.n_layers} * iq.c.n_kv * iq.c.pages * 2 * iq.c.head_dim * sizeof(float));
}

TEST(SparseQuest, RejectsOutOfOrderIndexAndUnindexedPages) {
  IndexedQuest iq(41);
  const QuestCase& c = iq.c;
  auto keys = [&](uint32_t, uint32_t) { return iq.keys.data(); };
  EXPECT_THROW(iq.quest->index({0, c.pages + 1, c.pages + 2, keys}), spin::Error);
  std::vector<float> q(c.n_heads * c.head_dim, 1.0f), scores(c.pages + 1);
  SelectQuery query{.layer = 0, .q = q.data(), .num_kv_heads = c.n_kv, .group = 4,
                    .context_tokens = (c.pages + 2) * kPage, .first_candidate = 0,
                    .end_candidate = c.pages + 1, .budget_pages = 3};
  EXPECT_THROW(iq.quest->score_pages(query, 0, scores), spin::Error);
}

}  // namespace
