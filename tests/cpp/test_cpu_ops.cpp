// CPU kernels against naive double-precision loops written here, on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"
#include "model/contiguous_attention.h"
#include "model/rope.h"

namespace spin {
namespace {

std::vector<float> random_vector(std::mt19937& rng, size_t n, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double rel_error(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

struct CpuOps : ::testing::Test {
  std::mt19937 rng{std::random_device{}()};
};

TEST_F(CpuOps, RmsNormMatchesNaive) {
  const int64_t rows = 5, n = 576;
  auto x = random_vector(rng, rows * n, 3.0f);
  auto w = random_vector(rng, n);
  std::vector<float> y(rows * n);
  cpu::rmsnorm(x.data(), w.data(), y.data(), rows, n, 1e-5f);
  std::vector<double> ref(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) ref[r * n + i] = x[r * n + i] * inv * w[i];
  }
  EXPECT_LE(rel_error(y, ref), 1e-6);
}

TEST_F(CpuOps, MatmulMatchesNaiveForGemvAndGemm) {
  for (int64_t m : {1, 7}) {
    const int64_t n = 33, k = 130;
    auto x = random_vector(rng, m * k);
    auto w = random_vector(rng, n * k);
    std::vector<float> y(m * n, NAN);
    cpu::matmul_nt(x.data(), w.data(), y.data(), m, n, k);
    std::vector<double> ref(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < k; ++d) ref[i * n + j] += double(x[i * k + d]) * w[j * k + d];
    EXPECT_LE(rel_error(y, ref), 1e-6) << "m=" << m;
  }
}

TEST_F(CpuOps, SiluMulMatchesFormula) {
  auto g = random_vector(rng, 1000, 4.0f);
  auto u = random_vector(rng, 1000);
  std::vector<double> ref(1000);
  for (int i = 0; i < 1000; ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  cpu::silu_mul(g.data(), u.data(), 1000);
  EXPECT_LE(rel_error(g, ref), 1e-6);
}

TEST_F(CpuOps, RopeRotatesNeoxAndAdjacentPairs) {
  const int64_t heads = 3, d = 16, pos = 37;
  const RopeTable table = make_rope_table(RopeConfig{}, d);
  for (bool neox : {true, false}) {
    auto x = random_vector(rng, heads * d);
    auto y = x;
    cpu::rope(y.data(), heads, d, pos, table.inv_freq.data(), 1.0f, neox);
    std::vector<double> ref(heads * d);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double theta = pos * std::pow(10000.0, -2.0 * i / d);
        const int64_t a = h * d + (neox ? i : 2 * i), b = h * d + (neox ? i + d / 2 : 2 * i + 1);
        ref[a] = x[a] * std::cos(theta) - x[b] * std::sin(theta);
        ref[b] = x[a] * std::sin(theta) + x[b] * std::cos(theta);
      }
    }
    EXPECT_LE(rel_error(y, ref), 1e-6) << "neox=" << neox;
  }
}

TEST(RopeTable, Llama3ScalingKeepsHighAndDividesLowFrequencies) {
  RopeConfig rope;
  rope.theta = 500000.0f;
  rope.scaling = RopeScaling::Llama3;
  rope.factor = 8.0f;
  rope.low_freq_factor = 1.0f;
  rope.high_freq_factor = 4.0f;
  rope.original_max_position = 8192;
  const RopeTable scaled = make_rope_table(rope, 128);
  rope.scaling = RopeScaling::None;
  const RopeTable plain = make_rope_table(rope, 128);
  for (size_t i = 0; i < plain.inv_freq.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / plain.inv_freq[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(scaled.inv_freq[i], plain.inv_freq[i]);
    }
    if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(scaled.inv_freq[i], plain.inv_freq[i] / 8.0f);
    }
    EXPECT_LE(scaled.inv_freq[i], plain.inv_freq[i] * (1 + 1e-6));
  }
}

TEST(RopeTable, YarnMscaleFollowsFactor) {
  RopeConfig rope;
  rope.scaling = RopeScaling::Yarn;
  rope.factor = 4.0f;
  rope.original_max_position = 32768;
  EXPECT_NEAR(make_rope_table(rope, 128).mscale, 0.1 * std::log(4.0) + 1.0, 1e-6);
  rope.yarn_attn_factor = 1.25f;
  EXPECT_NEAR(make_rope_table(rope, 128).mscale, 1.25 * (0.1 * std::log(4.0) + 1.0), 1e-6);
}

// Causal GQA attention over a contiguous cache, chunked writes, against a naive loop.
TEST_F(CpuOps, ContiguousAttentionMatchesNaiveCausalGqa) {
  const AttentionShape shape{2, 6, 2, 8, 1.0f / std::sqrt(8.0f)};
  const int64_t T = 11;
  const int64_t qw = shape.n_heads * shape.head_dim, kw = shape.n_kv_heads * shape.head_dim;
  auto q = random_vector(rng, T * qw), k = random_vector(rng, T * kw), v = random_vector(rng, T * kw);
  // Chunked prefill (4, 4, 3 tokens; every layer per chunk, as the model runs) and one shot.
  ContiguousAttention chunked(shape, 16), one_shot(shape, 16);
  std::vector<float> out(T * qw, NAN), out1(T * qw, NAN);
  for (int64_t p = 0; p < T; p += 4) {
    const int64_t n = std::min<int64_t>(4, T - p);
    for (int64_t layer = 0; layer < shape.n_layers; ++layer)
      chunked.forward(layer, p, n, {.q = &q[p * qw], .k = &k[p * kw], .v = &v[p * kw]}, &out[p * qw]);
  }
  for (int64_t layer = 0; layer < shape.n_layers; ++layer)
    one_shot.forward(layer, 0, T, {.q = q.data(), .k = k.data(), .v = v.data()}, out1.data());
  EXPECT_EQ(chunked.length(), T);
  std::vector<double> ref(T * qw, 0.0);
  const int64_t group = shape.n_heads / shape.n_kv_heads, d = shape.head_dim;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t g = h / group;
      std::vector<double> s(t + 1);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j <= t; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += double(q[t * qw + h * d + e]) * k[j * kw + g * d + e];
        s[j] = dot * shape.scale;
        mx = std::max(mx, s[j]);
      }
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j <= t; ++j)
        for (int64_t e = 0; e < d; ++e) ref[t * qw + h * d + e] += s[j] / sum * v[j * kw + g * d + e];
    }
  }
  EXPECT_LE(rel_error(out, ref), 1e-5);
  EXPECT_LE(rel_error(out1, ref), 1e-5);
}

// The cache grows as tokens arrive (256, 512, 1024 rows): chunks that cross each growth step
// must see exactly what one-shot attention sees.
TEST_F(CpuOps, ContiguousAttentionGrowsWithoutChangingResults) {
  const AttentionShape shape{2, 4, 2, 8, 1.0f / std::sqrt(8.0f)};
  const int64_t T = 700, qw = 4 * 8, kw = 2 * 8;
  auto q = random_vector(rng, T * qw), k = random_vector(rng, T * kw), v = random_vector(rng, T * kw);
  ContiguousAttention grown(shape, 4096), one_shot(shape, T);
  std::vector<float> out(T * qw, NAN), ref(T * qw, NAN);
  for (int64_t p = 0; p < T; p += 90) {
    const int64_t n = std::min<int64_t>(90, T - p);
    for (int64_t layer = 0; layer < 2; ++layer)
      grown.forward(layer, p, n, {&q[p * qw], &k[p * kw], &v[p * kw]}, &out[p * qw]);
  }
  for (int64_t layer = 0; layer < 2; ++layer)
    one_shot.forward(layer, 0, T, {q.data(), k.data(), v.data()}, ref.data());
  std::vector<double> ref64(ref.begin(), ref.end());
  EXPECT_LE(rel_error(out, ref64), 1e-6);
}

}  // namespace
}  // namespace spin
