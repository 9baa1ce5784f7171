// The CPU attention kernels (attend_group for one position, attend_causal for a chunk) against a
// plain double-precision causal attention written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/paged_attention.h"

namespace spin::cpu {
namespace {

// Keys and values of every KV head, [position][kv_head][head_dim] as the model produces them,
// and per head a contiguous copy in the [position][head_dim] layout the kernels read.
struct CausalCase {
  CausalShape shape;
  int64_t pos0 = 0;
  int64_t n_tokens = 0;
  std::vector<float> q, k, v;                      // q: [n_tokens][n_heads][head_dim]
  std::vector<std::vector<float>> head_k, head_v;  // per KV head: [pos0 + n_tokens][head_dim]

  CausalCase(int64_t group, int64_t n_kv, int64_t head_dim, int64_t pos0_, int64_t n, float magnitude,
             uint32_t seed)
      : shape{group * n_kv, n_kv, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim))},
        pos0(pos0_),
        n_tokens(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, magnitude);
    const int64_t keys = pos0 + n;
    q.resize(n * shape.n_heads * head_dim);
    for (float& x : q) x = normal(rng);
    head_k.resize(n_kv);
    head_v.resize(n_kv);
    for (int64_t g = 0; g < n_kv; ++g) {
      head_k[g].resize(keys * head_dim);
      head_v[g].resize(keys * head_dim);
      for (int64_t t = 0; t < keys; ++t) {
        // Keys grow with the position, so a row's maximum score rises from key tile to key tile
        // and the online softmax must rescale what it summed before.
        const float growth = 1.0f + static_cast<float>(t) / 128.0f;
        for (int64_t d = 0; d < head_dim; ++d) {
          head_k[g][t * head_dim + d] = growth * normal(rng);
          head_v[g][t * head_dim + d] = normal(rng);
        }
      }
    }
  }

  std::vector<KvHeadRows> heads() const {
    std::vector<KvHeadRows> rows;
    for (size_t g = 0; g < head_k.size(); ++g)
      rows.push_back({head_k[g].data(), head_v[g].data(), pos0 + n_tokens});
    return rows;
  }

  // Output of query head h at chunk token i in double: softmax over keys 0 .. pos0 + i.
  std::vector<double> reference(int64_t i, int64_t h) const {
    const int64_t hd = shape.head_dim;
    const int64_t g = h / (shape.n_heads / shape.n_kv_heads);
    const float* qh = &q[(i * shape.n_heads + h) * hd];
    const int64_t keys = pos0 + i + 1;
    std::vector<double> p(keys);
    double mx = -INFINITY;
    for (int64_t t = 0; t < keys; ++t) {
      double dot = 0.0;
      for (int64_t d = 0; d < hd; ++d) dot += double{qh[d]} * head_k[g][t * hd + d];
      p[t] = dot * shape.scale;
      mx = std::max(mx, p[t]);
    }
    double sum = 0.0;
    for (double& x : p) sum += (x = std::exp(x - mx));
    std::vector<double> out(hd, 0.0);
    for (int64_t t = 0; t < keys; ++t) {
      for (int64_t d = 0; d < hd; ++d) out[d] += p[t] / sum * head_v[g][t * hd + d];
    }
    return out;
  }

  // The largest relative (L2) error of any (token, head) output row.
  double worst_row_error(const std::vector<float>& out) const {
    const int64_t hd = shape.head_dim;
    double worst = 0.0;
    for (int64_t i = 0; i < n_tokens; ++i) {
      for (int64_t h = 0; h < shape.n_heads; ++h) {
        const std::vector<double> ref = reference(i, h);
        const float* got = &out[(i * shape.n_heads + h) * hd];
        double num = 0.0, den = 0.0;
        for (int64_t d = 0; d < hd; ++d) {
          num += (got[d] - ref[d]) * (got[d] - ref[d]);
          den += ref[d] * ref[d];
        }
        worst = std::max(worst, std::sqrt(num / den));
      }
    }
    return worst;
  }

  std::vector<float> run_causal() const {
    std::vector<float> out(q.size(), NAN);
    const std::vector<KvHeadRows> rows = heads();
    attend_causal(q.data(), n_tokens, pos0, rows, shape, out.data());
    return out;
  }
};

void expect_causal_matches(int64_t group, int64_t n_kv, int64_t head_dim, int64_t pos0, int64_t n,
                           float magnitude = 1.0f, uint32_t seed = 1) {
  const CausalCase c(group, n_kv, head_dim, pos0, n, magnitude, seed);
  const std::vector<float> out = c.run_causal();
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LE(c.worst_row_error(out), 1e-5)
      << "group " << group << " KV heads " << n_kv << " head_dim " << head_dim << " pos0 " << pos0
      << " tokens " << n;
}

TEST(CpuAttention, WholePromptFromPositionZero) {
  expect_causal_matches(1, 2, 64, 0, 300);   // crosses the 256-key tile, tiles of 75 tokens
  expect_causal_matches(3, 3, 64, 0, 257);   // one key past a key tile
  expect_causal_matches(4, 1, 64, 0, 600);   // full tiles of 128 query rows, 3 key tiles
  expect_causal_matches(4, 2, 128, 0, 37);   // chunk shorter than a tile
}

TEST(CpuAttention, ChunkAfterEarlierPositions) {
  // The chunk starts just before, at and after a key-tile edge: some rows see no key of the
  // last key tile, others see part of it.
  expect_causal_matches(4, 2, 128, 250, 70);
  expect_causal_matches(3, 1, 64, 256, 33);
  expect_causal_matches(1, 3, 128, 257, 64);
  expect_causal_matches(3, 2, 64, 700, 129);
}

TEST(CpuAttention, SinglePositionAsInDecode) {
  expect_causal_matches(3, 3, 64, 0, 1);
  expect_causal_matches(4, 2, 128, 511, 1);
  expect_causal_matches(1, 1, 64, 256, 1);
}

TEST(CpuAttention, StableUnderLargeScores) {
  // Scores up to about 50 and rising with the key position: a row's maximum changes across key
  // tiles and most exponentials are far below e^0. (Much larger scores carry fp32 rounding
  // errors of their own above 1e-5 relative, in attend_group as well.)
  expect_causal_matches(3, 2, 64, 0, 300, 2.0f, 2);
  expect_causal_matches(4, 1, 128, 200, 100, 1.7f, 3);
}

TEST(CpuAttention, AgreesWithAttendGroupPerPosition) {
  const CausalCase c(3, 2, 64, 100, 50, 1.0f, 4);
  const std::vector<float> out = c.run_causal();
  const int64_t hd = c.shape.head_dim, group = 3;
  std::vector<float> single(group * hd), scores(c.pos0 + c.n_tokens);
  double worst = 0.0;
  for (int64_t i = 0; i < c.n_tokens; ++i) {
    for (int64_t g = 0; g < c.shape.n_kv_heads; ++g) {
      scores.resize(group * (c.pos0 + i + 1));
      attend_group(&c.q[(i * c.shape.n_heads + g * group) * hd], group, c.head_k[g].data(),
                   c.head_v[g].data(), c.pos0 + i + 1, hd, hd, c.shape.scale, single.data(),
                   scores.data());
      const float* blocked = &out[(i * c.shape.n_heads + g * group) * hd];
      double num = 0.0, den = 0.0;
      for (int64_t e = 0; e < group * hd; ++e) {
        num += (double{blocked[e]} - single[e]) * (double{blocked[e]} - single[e]);
        den += double{single[e]} * single[e];
      }
      worst = std::max(worst, std::sqrt(num / den));
    }
  }
  EXPECT_LE(worst, 1e-5);
}

TEST(CpuAttention, AttendGroupMatchesReference) {
  const CausalCase c(4, 1, 128, 300, 1, 2.0f, 5);
  std::vector<float> out(4 * 128), scores(4 * 301);
  attend_group(c.q.data(), 4, c.head_k[0].data(), c.head_v[0].data(), 301, 128, 128, c.shape.scale,
               out.data(), scores.data());
  EXPECT_LE(c.worst_row_error(out), 1e-5);
}

// A query row's result depends on its own keys only: splitting the prompt into chunks (which
// moves rows between tiles and changes the last key tile) gives the same bits.
TEST(CpuAttention, ChunkingDoesNotChangeResults) {
  for (const auto& [group, head_dim] : {std::pair<int64_t, int64_t>{3, 64}, {4, 128}}) {
    const CausalCase c(group, 2, head_dim, 0, 160, 1.0f, 8);
    const std::vector<float> one_shot = c.run_causal();
    const std::vector<KvHeadRows> rows = c.heads();
    const int64_t width = c.shape.n_heads * head_dim;
    for (int64_t chunk : {7, 64, 150}) {
      std::vector<float> chunked(c.q.size(), NAN);
      for (int64_t p = 0; p < c.n_tokens; p += chunk) {
        attend_causal(&c.q[p * width], std::min(chunk, c.n_tokens - p), p, rows, c.shape,
                      &chunked[p * width]);
      }
      EXPECT_EQ(chunked, one_shot) << "group " << group << " chunks of " << chunk;
    }
  }
}

// The paged decode kernel promises attend_group's result bit for bit, however the keys are split
// into pages (sizes that leave the partial sums' lanes unaligned, an empty page).
TEST(CpuAttention, PagedDecodeEqualsAttendGroupExactly) {
  const CausalCase c(3, 1, 64, 200, 1, 1.5f, 7);
  const int64_t n_keys = 201, hd = 64, group = 3;
  std::vector<float> expected(group * hd), scores(group * n_keys);
  attend_group(c.q.data(), group, c.head_k[0].data(), c.head_v[0].data(), n_keys, hd, hd,
               c.shape.scale, expected.data(), scores.data());
  EXPECT_LE(c.worst_row_error(expected), 1e-5);
  for (const std::vector<int64_t>& sizes :
       {std::vector<int64_t>{201}, {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 9},
        {8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1},
        {5, 0, 7, 64, 3, 100, 22}}) {
    // Each page in its own buffer, so nothing relies on the rows being adjacent.
    std::vector<std::vector<float>> page_k, page_v;
    std::vector<KvPageView> views;
    int64_t row = 0, largest = 0;
    for (int64_t n : sizes) {
      page_k.emplace_back(c.head_k[0].begin() + row * hd, c.head_k[0].begin() + (row + n) * hd);
      page_v.emplace_back(c.head_v[0].begin() + row * hd, c.head_v[0].begin() + (row + n) * hd);
      row += n;
      largest = std::max(largest, n);
    }
    ASSERT_EQ(row, n_keys);
    for (size_t i = 0; i < sizes.size(); ++i)
      views.push_back({page_k[i].data(), page_v[i].data(), sizes[i]});
    std::vector<float> got(group * hd), scratch(paged_attention_scratch(group, largest));
    attend_group_pages(c.q.data(), group, views, hd, c.shape.scale, got.data(), scratch.data());
    EXPECT_EQ(got, expected) << sizes.size() << " pages";
  }
}

TEST(CpuAttention, RejectsTooFewKeyRows) {
  const CausalCase c(2, 2, 64, 10, 5, 1.0f, 6);
  std::vector<KvHeadRows> rows = c.heads();
  rows[1].n_tokens = 14;  // position 14 needs 15 rows
  std::vector<float> out(c.q.size());
  EXPECT_THROW(attend_causal(c.q.data(), c.n_tokens, c.pos0, rows, c.shape, out.data()), Error);
  rows.pop_back();
  EXPECT_THROW(attend_causal(c.q.data(), c.n_tokens, c.pos0, rows, c.shape, out.data()), Error);
}

}  // namespace
}  // namespace spin::cpu
