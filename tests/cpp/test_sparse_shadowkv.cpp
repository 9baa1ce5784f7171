// ShadowKV: exact at full budget and full rank; a rank-r factorisation of keys that truly have
// rank r rebuilds them exactly (RoPE re-applied); Select against a brute-force reimplementation
// (landmarks, min-cosine outliers, per-head softmax max over the group, top-k).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <set>

#include "sparse_exactness.h"

namespace {

using spin::AttentionShape;
using spin::sparse::SparseSettings;

const AttentionShape kShape{3, 8, 2, 16, 0.25f};  // GQA groups of 4; 32 key dims per layer
constexpr uint32_t kChunk = 8;

TEST(SparseShadowKv, FullBudgetAndFullRankEqualsDense) {
  SparseSettings s{.algorithm = "shadowkv", .budget_fraction = 1.0, .shadowkv_rank = 32};
  EXPECT_LE(spin_test::max_error_vs_dense(kShape, s, kChunk), 1e-6);
  s.shadowkv_outliers = 0;  // every chunk rebuilt from the factors
  EXPECT_LE(spin_test::max_error_vs_dense(kShape, s, kChunk), 1e-6);
}

TEST(SparseShadowKv, FullBudgetThroughTheTransformer) {
  const spin::ModelConfig c = spin::preset_config("tiny-llama");
  const SparseSettings s{.algorithm = "shadowkv",
                         .budget_fraction = 1.0,
                         .shadowkv_rank = static_cast<uint32_t>(c.n_kv_heads * c.head_dim),
                         .shadowkv_outliers = 2};
  EXPECT_LE(spin_test::max_logit_error_through_transformer(s, kChunk), 1e-6);
}

// Pre-RoPE keys of true rank 4 (a shared 4-dim subspace across both KV heads): rank 4 rebuilds
// them exactly, rank 2 does not.
TEST(SparseShadowKv, LowRankKeysRebuildExactly) {
  const int64_t T = 200, kw = kShape.n_kv_heads * kShape.head_dim;
  auto run = [&](uint32_t rank) {
    spin_test::PagedStore store(kShape, 256, kChunk);
    auto paged = store.attention(kShape, {.algorithm = "shadowkv", .budget_fraction = 1.0,
                                          .shadowkv_rank = rank, .shadowkv_outliers = 0});
    spin::ContiguousAttention dense(kShape, 256);
    std::mt19937 local(9);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    std::vector<float> basis(4 * kw);
    for (float& x : basis) x = n01(local);
    return spin_test::max_decode_error(*paged, dense, kShape, T, 20, local, n01, [&](int64_t, float* row) {
      for (int j = 0; j < 4; ++j) {
        const float c = n01(local);
        for (int64_t i = 0; i < kw; ++i) row[i] += c * basis[j * kw + i];
      }
    });
  };
  EXPECT_LE(run(4), 2e-5);
  EXPECT_GT(run(2), 1e-3);
}

// A prompt shorter than a chunk has no prompt Index, so nothing is factorised (as on the GPU):
// pages filled during decode keep their exact keys, even at a rank that could not rebuild them.
// Without sinks the first chunk is a candidate (it would be rebuilt, were it factorised); with the
// default sink, steps before it is complete have no candidates, which is no error.
TEST(SparseShadowKv, PromptShorterThanAChunkFactorisesNothing) {
  for (const std::optional<uint32_t> sinks : {std::optional<uint32_t>{0}, std::optional<uint32_t>{}}) {
    spin_test::PagedStore store(kShape, 256, kChunk);
    auto paged = store.attention(kShape, {.algorithm = "shadowkv", .budget_fraction = 1.0, .sink_tokens = sinks,
                                          .shadowkv_rank = 2, .shadowkv_outliers = 0});
    spin::ContiguousAttention dense(kShape, 256);
    std::mt19937 local(10);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    const double error = spin_test::max_decode_error(*paged, dense, kShape, kChunk - 3, 40, local, n01,
                                                     [&](int64_t, float* row) {
                                                       for (int64_t i = 0; i < kShape.n_kv_heads * kShape.head_dim; ++i)
                                                         row[i] = n01(local);
                                                     });
    EXPECT_LE(error, 1e-5) << (sinks ? "no sinks" : "default sinks");
  }
}

// Select on hand-fed keys against a plain reimplementation.
TEST(SparseShadowKv, SelectMatchesBruteForce) {
  const uint32_t pages = 40, hd = kShape.head_dim, n_kv = 2, group = 4, outliers = 5;
  spin::kv::KvLayout layout{3, n_kv, hd, kChunk};
  SparseSettings settings{.algorithm = "shadowkv", .shadowkv_outliers = outliers};
  auto algo = spin::sparse::AlgorithmRegistry::global().create(
      "shadowkv", {kShape, layout, &settings});
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // keys[g][token][d], post-RoPE; the pre-RoPE keys are unrelated noise (Select ignores them).
  std::vector<float> keys(size_t{n_kv} * pages * kChunk * hd), pre(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = normal(rng) + (i / (kChunk * hd) % 7 == 0 ? 3.0f : 0.0f);
    pre[i] = normal(rng);
  }
  auto at = [&](std::vector<float>& x, uint32_t g, uint32_t p) {
    return x.data() + (size_t{g} * pages + p) * kChunk * hd;
  };
  for (uint32_t l = 0; l < 3; ++l) {
    spin::sparse::IndexInput in{.layer = l, .first_page = 0, .end_page = 30,
                                .page_keys = [&](uint32_t g, uint32_t p) { return at(keys, g, p); },
                                .page_keys_pre_rope = [&](uint32_t g, uint32_t p) { return at(pre, g, p); },
                                .prompt = true, .first_candidate = 1, .end_candidate = 26};
    algo->index(in);
    in.first_page = 30;
    in.end_page = pages;
    in.prompt = false;
    in.first_candidate = in.end_candidate = 0;
    algo->index(in);
  }
  std::vector<float> q(kShape.n_heads * hd);
  for (float& x : q) x = normal(rng);
  const uint32_t first = 1, end = 36, budget = 6;
  spin::sparse::SelectQuery query{.layer = 1, .q = q.data(), .num_kv_heads = n_kv, .group = group,
                                  .context_tokens = pages * kChunk, .first_candidate = first,
                                  .end_candidate = end, .budget_pages = budget};
  spin::kv::LayerSelection out;
  spin::sparse::StepBudget step;
  algo->select(query, out, step);
  ASSERT_EQ(out.num_heads(), n_kv);
  for (uint32_t g = 0; g < n_kv; ++g) {
    // Brute force: landmarks, min cosine per prompt chunk, outliers among the first decode step's
    // candidates (pages [1, 26)).
    std::vector<std::vector<double>> lm(pages, std::vector<double>(hd, 0.0));
    std::vector<std::pair<double, uint32_t>> min_cos;
    for (uint32_t p = 0; p < pages; ++p) {
      const float* k = at(keys, g, p);
      for (uint32_t t = 0; t < kChunk; ++t)
        for (uint32_t d = 0; d < hd; ++d) lm[p][d] += k[t * hd + d] / kChunk;
      double worst = 2.0;
      for (uint32_t t = 0; t < kChunk; ++t) {
        double ab = 0, aa = 0, bb = 0;
        for (uint32_t d = 0; d < hd; ++d) {
          ab += k[t * hd + d] * lm[p][d];
          aa += double{k[t * hd + d]} * k[t * hd + d];
          bb += lm[p][d] * lm[p][d];
        }
        worst = std::min(worst, ab / std::sqrt(aa * bb));
      }
      if (p >= 1 && p < 26) min_cos.emplace_back(worst, p);
    }
    std::sort(min_cos.begin(), min_cos.end());
    std::set<uint32_t> outlier_set;
    for (uint32_t i = 0; i < outliers; ++i) outlier_set.insert(min_cos[i].second);
    std::set<uint32_t> expected;
    std::vector<std::pair<double, uint32_t>> ranked;
    for (uint32_t p = first; p < end; ++p) {
      if (outlier_set.count(p)) {
        expected.insert(p);
        continue;
      }
      double best = 0.0;
      for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
        double num = 0.0, den = 0.0;
        auto logit = [&](uint32_t page) {
          double dot = 0.0;
          for (uint32_t d = 0; d < hd; ++d) dot += q[h * hd + d] * lm[page][d];
          return dot / std::sqrt(static_cast<double>(hd));
        };
        for (uint32_t r = first; r < end; ++r) den += std::exp(logit(r));
        num = std::exp(logit(p));
        best = std::max(best, num / den);
      }
      ranked.emplace_back(-best, p);
    }
    std::sort(ranked.begin(), ranked.end());
    for (uint32_t i = 0; i < budget; ++i) expected.insert(ranked[i].second);
    const auto head = out.head(g);
    EXPECT_EQ(std::set<uint32_t>(head.begin(), head.end()), expected) << "KV head " << g;
    EXPECT_EQ(algo->unbudgeted_pages(g), outliers);  // each outlier is a candidate
  }
}

TEST(SparseShadowKv, ReportsOutliersApartFromTheBudget) {
  spin_test::PagedStore store(kShape, 512, kChunk);
  auto a = store.attention(kShape, {.algorithm = "shadowkv", .budget_tokens = 32,
                                    .shadowkv_outliers = 3});
  spin::ContiguousAttention dense(kShape, 512);
  spin_test::RopedFeed feed(kShape.head_dim);
  feed.step(*a, dense, kShape, 0, 300);
  feed.step(*a, dense, kShape, 300, 1);
  const auto& b = a->last_step();
  EXPECT_EQ(b.sparse_heads, 6u);
  EXPECT_EQ(b.max_selected_per_head, 32u);
  EXPECT_EQ(b.selected_tokens, 32u * 6);
  // Every outlier chunk is a candidate: picked among the first decode step's candidates.
  EXPECT_EQ(b.outlier_tokens, 3u * kChunk * 6);
  EXPECT_EQ(b.window_tokens, (4u * kChunk + 5) * 6);  // 4 recent chunks + the current 5 tokens
}

}  // namespace
