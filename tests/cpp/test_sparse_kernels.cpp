// The page-list attention kernel (online softmax) against the contiguous one.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/paged_attention.h"

namespace {

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

// Splits n_keys contiguous rows into pages of the given sizes (last may be partial) and checks
// the paged result against attend_group over the same rows.
void check_split(int64_t group, int64_t head_dim, const std::vector<int64_t>& page_tokens,
                 float magnitude, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, magnitude);
  int64_t n_keys = 0;
  for (int64_t t : page_tokens) n_keys += t;
  std::vector<float> q(group * head_dim), k(n_keys * head_dim), v(n_keys * head_dim);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  std::vector<float> expected(group * head_dim), scores(group * n_keys);
  spin::cpu::attend_group(q.data(), group, k.data(), v.data(), n_keys, head_dim, head_dim, scale,
                          expected.data(), scores.data());

  // Copy each page to its own buffer so nothing relies on the rows being adjacent.
  std::vector<std::vector<float>> page_k, page_v;
  std::vector<spin::cpu::KvPageView> views;
  int64_t row = 0, max_tokens = 0;
  for (int64_t t : page_tokens) {
    page_k.emplace_back(k.begin() + row * head_dim, k.begin() + (row + t) * head_dim);
    page_v.emplace_back(v.begin() + row * head_dim, v.begin() + (row + t) * head_dim);
    row += t;
    max_tokens = std::max(max_tokens, t);
  }
  for (size_t i = 0; i < page_tokens.size(); ++i)
    views.push_back({page_k[i].data(), page_v[i].data(), page_tokens[i]});
  std::vector<float> got(group * head_dim);
  std::vector<float> scratch(spin::cpu::paged_attention_scratch(group, max_tokens));
  spin::cpu::attend_group_pages(q.data(), group, views, head_dim, scale, got.data(),
                                scratch.data());
  EXPECT_LE(rel_error(got, expected), 1e-6) << "group " << group << " magnitude " << magnitude;
}

TEST(SparsePagedKernel, MatchesContiguousAttention) {
  check_split(1, 16, {16}, 1.0f, 1);
  check_split(4, 16, {16, 16, 16, 5}, 1.0f, 2);
  check_split(2, 64, {8, 8, 8, 8, 8, 8, 1}, 1.0f, 3);
  check_split(8, 32, {64, 64, 64, 33}, 1.0f, 4);
  check_split(3, 16, {16, 0, 16, 7}, 1.0f, 5);  // an empty page is skipped
}

TEST(SparsePagedKernel, StableUnderLargeScores) {
  // Scores of hundreds: the running maximum rises page after page and must rescale the sums.
  check_split(4, 16, {16, 16, 16, 16, 16, 9}, 6.0f, 6);
  check_split(2, 32, {8, 8, 8, 8, 3}, 8.0f, 7);
}

}  // namespace
