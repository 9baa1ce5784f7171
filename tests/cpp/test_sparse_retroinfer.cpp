// RetroInfer: exact at full budget; at a small budget the decode output equals a brute-force
// reimplementation (k-means, cluster scores, exact zone of best pages, estimation zone) in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#include "sparse_exactness.h"

namespace {

using spin::AttentionShape;
using spin::sparse::SparseSettings;

TEST(SparseRetroInfer, FullBudgetEqualsDense) {
  const AttentionShape shape{3, 8, 2, 16, 0.25f};
  SparseSettings s{.algorithm = "retroinfer", .budget_fraction = 1.0,
                   .retroinfer_recluster_tokens = 32};  // decode pages get clustered too
  EXPECT_LE(spin_test::max_error_vs_dense(shape, s, 16), 1e-6);
  EXPECT_LE(spin_test::max_logit_error_through_transformer(s, 16), 1e-6);
}

// Brute force, one layer: returns the expected output of the decode step at position `prompt`.
struct Reference {
  uint32_t hd, group, ps, n_kv;
  std::vector<double> kmeans_centroid_ranking_output(
      const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& q,
      uint32_t prompt, uint32_t first, uint32_t end, uint32_t budget_pages, double fraction,
      uint32_t cluster_tokens, std::vector<std::set<uint32_t>>& selected) const {
    const uint32_t tokens = prompt + 1, n = prompt / ps * ps;  // complete prompt pages
    std::vector<double> out(size_t{group} * n_kv * hd);
    selected.assign(n_kv, {});
    for (uint32_t g = 0; g < n_kv; ++g) {
      auto key = [&](uint32_t t, uint32_t d) { return double{k[(size_t{t} * n_kv + g) * hd + d]}; };
      auto val = [&](uint32_t t, uint32_t d) { return double{v[(size_t{t} * n_kv + g) * hd + d]}; };
      // k-means on mean-centred keys, inner-product assignment, 10 iterations.
      const uint32_t kc = std::max(1u, n / cluster_tokens);
      std::vector<double> mean(hd, 0.0), c(size_t{kc} * hd);
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < hd; ++d) mean[d] += key(t, d) / n;
      for (uint32_t j = 0; j < kc; ++j)
        for (uint32_t d = 0; d < hd; ++d) c[j * hd + d] = key(j * n / kc, d) - mean[d];
      std::vector<uint32_t> assign(n);
      for (int iter = 0; iter < 10; ++iter) {
        for (uint32_t t = 0; t < n; ++t) {
          double best = -1e300;
          for (uint32_t j = 0; j < kc; ++j) {
            double dot = 0.0;
            for (uint32_t d = 0; d < hd; ++d) dot += (key(t, d) - mean[d]) * c[j * hd + d];
            if (dot > best) best = dot, assign[t] = j;
          }
        }
        for (uint32_t j = 0; j < kc; ++j) {
          std::vector<double> sum(hd, 0.0);
          uint32_t count = 0;
          for (uint32_t t = 0; t < n; ++t) {
            if (assign[t] != j) continue;
            ++count;
            for (uint32_t d = 0; d < hd; ++d) sum[d] += key(t, d) - mean[d];
          }
          if (count > 0)
            for (uint32_t d = 0; d < hd; ++d) c[j * hd + d] = sum[d] / count;
        }
      }
      // Non-empty clusters, in k-means order; centroid = mean raw key.
      std::vector<std::vector<uint32_t>> members;
      std::vector<int> id(kc, -1);
      for (uint32_t j = 0; j < kc; ++j) {
        if (std::count(assign.begin(), assign.end(), j) > 0) id[j] = static_cast<int>(members.size()), members.emplace_back();
      }
      for (uint32_t t = 0; t < n; ++t) members[id[assign[t]]].push_back(t);
      const auto m = static_cast<uint32_t>(members.size());
      std::vector<std::vector<double>> centroid(m, std::vector<double>(hd, 0.0));
      for (uint32_t j = 0; j < m; ++j)
        for (uint32_t t : members[j])
          for (uint32_t d = 0; d < hd; ++d) centroid[j][d] += key(t, d) / members[j].size();
      // Ranking: softmax over centroids per query head, summed over the group.
      std::vector<double> score(m, 0.0);
      for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
        std::vector<double> logit(m);
        double z = 0.0;
        for (uint32_t j = 0; j < m; ++j) {
          double dot = 0.0;
          for (uint32_t d = 0; d < hd; ++d) dot += q[h * hd + d] * centroid[j][d];
          logit[j] = dot / std::sqrt(static_cast<double>(hd));
          z += std::exp(logit[j]);
        }
        for (uint32_t j = 0; j < m; ++j) score[j] += std::exp(logit[j]) / z;
      }
      // Exact zone: the budget's candidate pages of most estimated attention (a token: its
      // cluster's score over its size).
      std::vector<int> cluster_of(n);
      for (uint32_t j = 0; j < m; ++j)
        for (uint32_t t : members[j]) cluster_of[t] = static_cast<int>(j);
      std::vector<std::pair<double, uint32_t>> by_page;  // (-score, page)
      for (uint32_t p = first; p < end; ++p) {
        double mass = 0.0;
        for (uint32_t t = p * ps; t < (p + 1) * ps; ++t) mass += score[cluster_of[t]] / members[cluster_of[t]].size();
        by_page.emplace_back(-mass, p);
      }
      std::sort(by_page.begin(), by_page.end());
      std::set<uint32_t>& pages = selected[g];
      for (uint32_t i = 0; i < std::min<size_t>(budget_pages, by_page.size()); ++i) pages.insert(by_page[i].second);
      auto attended = [&](uint32_t t) { return t / ps < first || t / ps >= end || pages.count(t / ps); };
      // Estimation zone: the best ceil(fraction * m) clusters that have a token left out.
      std::vector<std::pair<double, uint32_t>> left;  // (-score, cluster)
      for (uint32_t j = 0; j < m; ++j) {
        if (std::any_of(members[j].begin(), members[j].end(), [&](uint32_t t) { return !attended(t); }))
          left.emplace_back(-score[j], j);
      }
      std::sort(left.begin(), left.end());
      std::vector<uint32_t> left_out;
      for (const auto& [neg, j] : left) left_out.push_back(j);
      const auto n_est = static_cast<uint32_t>(std::ceil(fraction * m));
      for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
        std::vector<std::pair<double, std::vector<double>>> terms;  // (weight, weighted value)
        auto dotq = [&](const std::vector<double>& x) {
          double dot = 0.0;
          for (uint32_t d = 0; d < hd; ++d) dot += q[h * hd + d] * x[d];
          return dot / std::sqrt(static_cast<double>(hd));
        };
        for (uint32_t t = 0; t < tokens; ++t) {
          if (!attended(t)) continue;
          std::vector<double> kt(hd), vt(hd);
          for (uint32_t d = 0; d < hd; ++d) kt[d] = key(t, d), vt[d] = val(t, d);
          terms.emplace_back(std::exp(dotq(kt)), vt);
        }
        for (uint32_t i = 0; i < std::min<size_t>(left_out.size(), n_est); ++i) {
          std::vector<double> vs(hd, 0.0);
          uint32_t size = 0;
          for (uint32_t t : members[left_out[i]]) {
            if (attended(t)) continue;
            ++size;
            for (uint32_t d = 0; d < hd; ++d) vs[d] += val(t, d);
          }
          if (size == 0) continue;
          const double w = std::exp(dotq(centroid[left_out[i]]));
          for (double& x : vs) x /= size;
          terms.emplace_back(w * size, vs);
        }
        double z = 0.0;
        for (const auto& [w, x] : terms) z += w;
        for (const auto& [w, x] : terms)
          for (uint32_t d = 0; d < hd; ++d) out[h * hd + d] += w / z * x[d];
      }
    }
    return out;
  }
};

TEST(SparseRetroInfer, SmallBudgetMatchesBruteForce) {
  const AttentionShape shape{1, 4, 2, 16, 0.25f};
  const uint32_t hd = 16, ps = 16, prompt = 320, n_kv = 2;
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Keys around 12 well separated centres, so every assignment is clear-cut.
  std::vector<float> centres(12 * hd);
  for (float& x : centres) x = 3.0f * normal(rng);
  const uint32_t tokens = prompt + 1;
  std::vector<float> k(size_t{tokens} * n_kv * hd), v(k.size()), q(4 * hd);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t g = 0; g < n_kv; ++g) {
      const uint32_t c = static_cast<uint32_t>(rng() % 12);
      for (uint32_t d = 0; d < hd; ++d) {
        k[(size_t{t} * n_kv + g) * hd + d] = centres[c * hd + d] + 0.3f * normal(rng);
        v[(size_t{t} * n_kv + g) * hd + d] = normal(rng);
      }
    }
  }
  for (float& x : q) x = 0.5f * normal(rng);
  const SparseSettings s{.algorithm = "retroinfer", .budget_tokens = 64,
                         .retroinfer_estimate_fraction = 0.25};
  spin_test::PagedStore store(shape, 512, ps);
  auto a = store.attention(shape, s);
  std::vector<float> prefill_q(4 * prompt * hd, 0.0f), out(prefill_q.size());
  a->forward(0, 0, prompt, {.q = prefill_q.data(), .k = k.data(), .v = v.data()}, out.data());
  std::vector<float> step_q = q, got(4 * hd);
  a->forward(0, prompt, 1,
             {.q = step_q.data(), .k = k.data() + size_t{prompt} * n_kv * hd,
              .v = v.data() + size_t{prompt} * n_kv * hd},
             got.data());
  // Sinks: 4 tokens -> page 0; window: 64 tokens -> pages 16..19, and the current page 20.
  const Reference ref{hd, 2, ps, n_kv};
  std::vector<std::set<uint32_t>> selected;
  const std::vector<double> want =
      ref.kmeans_centroid_ranking_output(k, v, q, prompt, 1, 16, 4, 0.25, 16, selected);
  std::vector<float> want_f(want.begin(), want.end());
  EXPECT_LE(spin_test::rel_error(got.data(), want_f.data(), got.size()), 1e-5);
  const auto& b = a->last_step();
  EXPECT_GT(b.estimated_tokens, 0u);
  EXPECT_LE(b.max_selected_per_head, 64u);
  EXPECT_EQ(b.selected_tokens, (selected[0].size() + selected[1].size()) * ps);
  // And the estimation zone matters: the same step without it differs.
  spin_test::PagedStore store2(shape, 512, ps);
  SparseSettings no_estimate = s;
  no_estimate.retroinfer_estimate_fraction = 0.0;
  auto a2 = store2.attention(shape, no_estimate);
  a2->forward(0, 0, prompt, {.q = prefill_q.data(), .k = k.data(), .v = v.data()}, out.data());
  std::vector<float> got2(4 * hd);
  a2->forward(0, prompt, 1,
              {.q = step_q.data(), .k = k.data() + size_t{prompt} * n_kv * hd,
               .v = v.data() + size_t{prompt} * n_kv * hd},
              got2.data());
  EXPECT_GT(spin_test::rel_error(got2.data(), want_f.data(), got2.size()), 1e-3);
}

// Decodes one layer from a prompt of `prompt` tokens to token `end` with 16-token pages, one sink
// page, a one-page window and re-clustering every 2 pages; `waiting(pos)`: the pages not yet
// clustered among the candidates [1, pos / 16 - 1) at the step of token pos, which are attended
// outside the budget.
void expect_waiting_pages(uint32_t prompt, uint32_t end, const std::function<uint64_t(uint32_t)>& waiting) {
  const AttentionShape shape{1, 4, 2, 16, 0.25f};
  const uint32_t hd = 16, n_kv = 2, ps = 16;
  SparseSettings s{.algorithm = "retroinfer", .budget_tokens = 32, .sink_tokens = 16, .window_tokens = 16,
                   .retroinfer_recluster_tokens = 32};
  spin_test::PagedStore store(shape, 512, ps);
  auto a = store.attention(shape, s);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill = [&](std::vector<float>& x) {
    for (float& v : x) v = normal(rng);
  };
  std::vector<float> q(4 * prompt * hd), k(prompt * n_kv * hd), v(k.size()), out(q.size());
  fill(q), fill(k), fill(v);
  a->forward(0, 0, prompt, {.q = q.data(), .k = k.data(), .v = v.data()}, out.data());
  std::vector<float> q1(4 * hd), k1(n_kv * hd), v1(k1.size()), out1(q1.size());
  for (uint32_t pos = prompt; pos < end; ++pos) {
    fill(q1), fill(k1), fill(v1);
    a->forward(0, pos, 1, {.q = q1.data(), .k = k1.data(), .v = v1.data()}, out1.data());
    EXPECT_EQ(a->last_step().outlier_tokens, waiting(pos) * ps * n_kv) << "prompt " << prompt << ", token " << pos;
  }
}

TEST(SparseRetroInfer, WaitingDecodePagesAreClusteredAtThePageAfterASegmentOfThem) {
  // The prompt's 5 pages are clustered at once; decode pages 5 and 6 wait, and only when page 7
  // completes (token 127) do they make a segment and get clustered, page 7 waiting in turn (its
  // keys of every layer exist only after the step, when the CUDA store clusters); pages 7 and 8
  // at token 159. Waiting candidates: page 5 from token 112, page 7 from token 144.
  expect_waiting_pages(80, 170, [](uint32_t pos) { return (pos >= 112 && pos < 127) || (pos >= 144 && pos < 159); });
  // A prompt with no complete page has no prompt Index: its pages wait like decode pages (pages 0
  // and 1 are clustered at token 47, 2 and 3 at 79, 4 and 5 at 111), as the CUDA store does.
  expect_waiting_pages(10, 120, [](uint32_t pos) { return (pos >= 64 && pos < 79) || (pos >= 96 && pos < 111); });
}

}  // namespace
