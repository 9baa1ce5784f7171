// GPU sampling (kernels/cuda/sampling.h) against the definitions, recomputed here in plain C++:
// greedy equals the CPU argmax (engine/sampler.h); padding logits past `vocab` (set larger than
// every real logit) are never drawn; no draw falls outside the exactly filtered set; the empirical
// distribution of >= 131072 draws is within total variation 0.02 of the filtered distribution
// (sampling noise alone is about 0.4 * sqrt(kept / draws) <= 0.009 here); draws depend on
// (seed, step, params, logits) only, not on the batch; different steps draw differently.
// Fresh random logits each run (seed printed); the output is poisoned (-1) before each launch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "engine/sampler.h"
#include "kernels/cuda/sampling.h"

namespace spin {
namespace {

using cuda::SamplingRow;

constexpr float kPadding = 1000.0f;  // logits past vocab: would win every draw if read
constexpr double kMaxTotalVariation = 0.02;

// The filtered distribution from the definitions: tokens ordered by (logit desc, index asc);
// top-k keeps the first k; p = exp((logit - max) * (1 / temperature)) in fp32 as the CPU Sampler
// computes it; min-p drops p < min_p; top-p keeps the shortest prefix whose mass reaches
// top_p * total; the rest is renormalised.
std::vector<double> filtered_distribution(std::span<const float> logits, const SamplingRow& s) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[a] > logits[b]; });
  if (s.top_k > 0 && s.top_k < vocab) order.resize(s.top_k);
  const float top = logits[order[0]];
  const float inv_t = 1.0f / s.temperature;
  std::vector<std::pair<int, float>> kept;
  for (int i : order) {
    const float p = std::exp((logits[i] - top) * inv_t);
    if (s.min_p > 0.0f && p < s.min_p) continue;
    kept.emplace_back(i, p);
  }
  double total = 0.0;
  for (const auto& [i, p] : kept) total += p;
  if (s.top_p < 1.0f) {
    double mass = 0.0;
    size_t n = 0;
    while (n < kept.size() && mass < s.top_p * total) mass += kept[n++].second;
    kept.resize(n);
    total = mass;
  }
  std::vector<double> dist(vocab, 0.0);
  for (const auto& [i, p] : kept) dist[i] = p / total;
  return dist;
}

class GpuSampling : public SeededGpuTest<std::mt19937_64> {
 protected:
  // Rows of `stride` floats: `vocab` normal logits, then padding.
  std::vector<float> random_rows(int64_t rows, int64_t vocab, int64_t stride, float stddev) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> v(rows * stride, kPadding);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < vocab; ++i) v[r * stride + i] = dist(rng_);
    return v;
  }

  // Samples `rows` rows (device logits) and returns the tokens.
  void sample(const DeviceArray<float>& logits, int64_t rows, int64_t vocab, int64_t stride,
              const std::vector<SamplingRow>& params, std::vector<int32_t>* tokens) {
    DeviceArray<SamplingRow> d_params(params);
    DeviceArray<int32_t> d_out(rows);  // poisoned: -1
    ASSERT_EQ(d_params.status(), cudaSuccess);
    ASSERT_EQ(d_out.status(), cudaSuccess);
    const size_t ws_bytes = cuda::sampling_workspace_bytes(rows, vocab);
    void* ws = nullptr;
    if (ws_bytes) CUDA_OK(cudaMalloc(&ws, ws_bytes));
    CUDA_OK(cuda::sample_tokens(logits.get(), rows, vocab, stride, d_params.get(), d_out.get(), ws,
                                ws_bytes, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(ws);
    *tokens = d_out.download();
  }

  // Draws `launches` x `rows` tokens from one row of logits (replicated), steps all distinct,
  // and checks them against the filtered distribution.
  void check_distribution(const std::vector<float>& row, int64_t vocab, int64_t stride,
                          SamplingRow s, int64_t rows, int launches, bool compare_groups) {
    SCOPED_TRACE(testing::Message() << "vocab " << vocab << " T " << s.temperature << " top_k "
                                    << s.top_k << " top_p " << s.top_p << " min_p " << s.min_p);
    const std::vector<double> expect =
        filtered_distribution(std::span<const float>(row.data(), vocab), s);
    std::vector<float> batch(rows * stride);
    for (int64_t r = 0; r < rows; ++r) std::copy_n(row.begin(), stride, batch.begin() + r * stride);
    DeviceArray<float> d_logits(batch);
    ASSERT_EQ(d_logits.status(), cudaSuccess);
    std::vector<int64_t> counts(vocab, 0);
    int64_t outside = 0;
    s.seed = rng_();
    for (int l = 0; l < launches; ++l) {
      std::vector<SamplingRow> params(rows, s);
      for (int64_t r = 0; r < rows; ++r) params[r].step = static_cast<uint64_t>(l * rows + r);
      std::vector<int32_t> tokens;
      sample(d_logits, rows, vocab, stride, params, &tokens);
      if (HasFatalFailure()) return;
      for (int32_t t : tokens) {
        if (t < 0 || t >= vocab || expect[t] == 0.0) {
          ++outside;
        } else {
          ++counts[t];
        }
      }
    }
    const double n = static_cast<double>(rows) * launches;
    EXPECT_EQ(outside, 0) << "draws outside the kept set (or past vocab)";
    if (!compare_groups) {
      double tv = 0.0;
      for (int64_t i = 0; i < vocab; ++i) tv += std::abs(counts[i] / n - expect[i]);
      EXPECT_LT(tv / 2, kMaxTotalVariation);
      return;
    }
    // Large kept sets: compare the mass of 16 consecutive groups of the kept tokens in index order.
    const int64_t kept = std::count_if(expect.begin(), expect.end(), [](double p) { return p > 0; });
    std::vector<double> got_group(16, 0.0), expect_group(16, 0.0);
    int64_t seen = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (expect[i] == 0.0) continue;
      const int64_t g = seen++ * 16 / kept;
      got_group[g] += counts[i] / n;
      expect_group[g] += expect[i];
    }
    double tv = 0.0;
    for (int g = 0; g < 16; ++g) tv += std::abs(got_group[g] - expect_group[g]);
    EXPECT_LT(tv / 2, kMaxTotalVariation);
  }
};

SamplingRow params(float temperature, int top_k, float top_p, float min_p) {
  SamplingRow s;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.min_p = min_p;
  return s;
}

TEST_F(GpuSampling, GreedyEqualsCpuArgmax) {
  for (const int64_t vocab : {1, 64, 1000, 151936}) {
    const int64_t rows = 37, stride = vocab + 5;
    std::vector<float> logits = random_rows(rows, vocab, stride, 3.0f);
    // Every other row is rounded to integers: the maximum is tied at several indices.
    for (int64_t r = 1; r < rows; r += 2)
      for (int64_t i = 0; i < vocab; ++i) logits[r * stride + i] = std::round(logits[r * stride + i]);
    std::vector<SamplingRow> prm(rows);
    for (int64_t r = 0; r < rows; ++r) {
      prm[r] = r % 3 == 2 ? params(0.8f, 1, 0.9f, 0.0f) : params(0.0f, 0, 1.0f, 0.0f);  // top_k 1 is greedy too
      prm[r].seed = r;
    }
    DeviceArray<float> d_logits(logits);
    ASSERT_EQ(d_logits.status(), cudaSuccess);
    std::vector<int32_t> tokens;
    sample(d_logits, rows, vocab, stride, prm, &tokens);
    if (HasFatalFailure()) return;
    int ties = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::span<const float> row(&logits[r * stride], vocab);
      EXPECT_EQ(tokens[r], argmax(row)) << "vocab " << vocab << " row " << r;
      ties += std::count(row.begin(), row.end(), row[argmax(row)]) > 1;
    }
    if (vocab >= 1000) {
      EXPECT_GT(ties, 0) << "the tied rows have tied maxima";
    }
  }
}

TEST_F(GpuSampling, SmallVocabMatchesFilteredDistribution) {
  const int64_t vocab = 64, stride = 80;
  const std::vector<float> row = random_rows(1, vocab, stride, 2.0f);
  const std::vector<SamplingRow> settings = {
      params(1.0f, 0, 1.0f, 0.0f),   params(0.6f, 8, 1.0f, 0.0f),   params(1.5f, 0, 0.7f, 0.0f),
      params(1.0f, 0, 1.0f, 0.05f),  params(0.8f, 20, 0.85f, 0.02f), params(2.0f, 63, 0.95f, 0.0f),
      params(0.3f, 0, 0.999f, 0.0f),
  };
  for (const SamplingRow& s : settings) check_distribution(row, vocab, stride, s, 16384, 8, false);
}

TEST_F(GpuSampling, TiesAreCutInIndexOrder) {
  // Logits from a few values: top-k and top-p cuts fall inside groups of equal logits, where
  // the lowest indices stay (the CPU's stable order).
  const int64_t vocab = 64, stride = 64;
  std::vector<float> row(vocab);
  const float levels[] = {-1.0f, 0.0f, 0.5f, 1.0f, 2.0f};
  std::uniform_int_distribution<int> pick(0, 4);
  for (float& x : row) x = levels[pick(rng_)];
  for (int k : {3, 10, 25}) check_distribution(row, vocab, stride, params(1.0f, k, 1.0f, 0.0f), 16384, 8, false);
  for (float p : {0.13f, 0.41f, 0.77f}) check_distribution(row, vocab, stride, params(0.7f, 0, p, 0.0f), 16384, 8, false);
  check_distribution(row, vocab, stride, params(1.0f, 12, 0.6f, 0.0f), 16384, 8, false);
}

TEST_F(GpuSampling, LargeVocabMatchesFilteredDistribution) {
  // Qwen-sized rows: 151936 tokens padded to 152064.
  const int64_t vocab = 151936, stride = 152064;
  const std::vector<float> peaked = random_rows(1, vocab, stride, 3.0f);
  check_distribution(peaked, vocab, stride, params(0.8f, 40, 0.95f, 0.0f), 1024, 128, false);
  check_distribution(peaked, vocab, stride, params(1.2f, 0, 1.0f, 0.1f), 1024, 64, true);
  const std::vector<float> flat = random_rows(1, vocab, stride, 0.5f);
  check_distribution(flat, vocab, stride, params(1.0f, 0, 0.9f, 0.0f), 1024, 64, true);
  check_distribution(flat, vocab, stride, params(1.0f, 50000, 0.5f, 0.0f), 1024, 64, true);
}

TEST_F(GpuSampling, DrawDependsOnRowOnly) {
  const int64_t vocab = 5000, stride = 5003, rows = 64;
  std::vector<float> logits = random_rows(rows, vocab, stride, 1.0f);
  std::vector<SamplingRow> prm(rows);
  for (int64_t r = 0; r < rows; ++r) {
    prm[r] = params(0.5f + 0.02f * r, static_cast<int>(r % 4) * 30, r % 3 ? 0.9f : 1.0f, 0.01f * (r % 2));
    prm[r].seed = rng_();
    prm[r].step = r;
  }
  DeviceArray<float> d_logits(logits);
  ASSERT_EQ(d_logits.status(), cudaSuccess);
  std::vector<int32_t> first;
  sample(d_logits, rows, vocab, stride, prm, &first);
  if (HasFatalFailure()) return;

  // Reverse the batch: every row must draw the same token at its new position.
  std::vector<float> reversed(logits.size());
  std::vector<SamplingRow> rprm(rows);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(&logits[r * stride], stride, &reversed[(rows - 1 - r) * stride]);
    rprm[rows - 1 - r] = prm[r];
  }
  DeviceArray<float> d_reversed(reversed);
  ASSERT_EQ(d_reversed.status(), cudaSuccess);
  std::vector<int32_t> second;
  sample(d_reversed, rows, vocab, stride, rprm, &second);
  if (HasFatalFailure()) return;
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(second[rows - 1 - r], first[r]) << "row " << r;

  // Alone in a batch of one, again the same.
  for (int64_t r : {0, 17, 63}) {
    DeviceArray<float> d_one(
        std::vector<float>(logits.begin() + r * stride, logits.begin() + (r + 1) * stride));
    ASSERT_EQ(d_one.status(), cudaSuccess);
    std::vector<int32_t> one;
    sample(d_one, 1, vocab, stride, {prm[r]}, &one);
    if (HasFatalFailure()) return;
    EXPECT_EQ(one[0], first[r]) << "row " << r << " alone";
  }
}

TEST_F(GpuSampling, StepsAndSeedsChangeTheDraw) {
  const int64_t vocab = 64, rows = 200;
  const std::vector<float> row = random_rows(1, vocab, vocab, 0.3f);
  std::vector<float> batch(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) std::copy(row.begin(), row.end(), batch.begin() + r * vocab);
  DeviceArray<float> d_logits(batch);
  ASSERT_EQ(d_logits.status(), cudaSuccess);
  const uint64_t seed = rng_();
  for (bool vary_step : {true, false}) {
    std::vector<SamplingRow> prm(rows, params(1.0f, 0, 1.0f, 0.0f));
    for (int64_t r = 0; r < rows; ++r) {
      prm[r].seed = vary_step ? seed : seed + static_cast<uint64_t>(r);
      prm[r].step = vary_step ? static_cast<uint64_t>(r) : 7;
    }
    std::vector<int32_t> tokens;
    sample(d_logits, rows, vocab, vocab, prm, &tokens);
    if (HasFatalFailure()) return;
    // 200 draws from a near-uniform 64-token distribution hit ~60 distinct tokens.
    EXPECT_GE(std::set<int32_t>(tokens.begin(), tokens.end()).size(), 30u)
        << (vary_step ? "steps" : "seeds");
  }
}

TEST_F(GpuSampling, RejectsBadShapes) {
  EXPECT_EQ(cuda::sample_tokens(nullptr, 1, 0, 10, nullptr, nullptr, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::sample_tokens(nullptr, 1, 10, 9, nullptr, nullptr, nullptr, 0, nullptr),
            cudaErrorInvalidValue);  // row_stride < vocab
  EXPECT_EQ(cuda::sample_tokens(nullptr, 0, 10, 10, nullptr, nullptr, nullptr, 0, nullptr),
            cudaSuccess);  // no rows, no launch
}

// Kernel time for one row and for a decode batch at Qwen3's vocabulary (reported, not asserted).
TEST_F(GpuSampling, TimingReport) {
  const int64_t vocab = 151936, stride = 152064, rows = 256;
  const std::vector<float> logits = random_rows(rows, vocab, stride, 3.0f);
  DeviceArray<float> d_logits(logits);
  DeviceArray<int32_t> d_out(rows);
  ASSERT_EQ(d_logits.status(), cudaSuccess);
  const std::vector<std::pair<const char*, SamplingRow>> settings = {
      {"greedy", params(0.0f, 0, 1.0f, 0.0f)},
      {"T=1", params(1.0f, 0, 1.0f, 0.0f)},
      {"T=0.7 top_k=40 top_p=0.95", params(0.7f, 40, 0.95f, 0.0f)},
      {"T=1 top_p=0.9 min_p=0.05", params(1.0f, 0, 0.9f, 0.05f)},
  };
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (const auto& [name, s] : settings) {
    for (const int64_t n : {int64_t{1}, rows}) {
      DeviceArray<SamplingRow> d_params(std::vector<SamplingRow>(n, s));
      ASSERT_EQ(d_params.status(), cudaSuccess);
      CUDA_OK(cuda::sample_tokens(d_logits.get(), n, vocab, stride, d_params.get(), d_out.get(),
                                  nullptr, 0, nullptr));
      cudaEventRecord(start);
      for (int i = 0; i < 10; ++i)
        cuda::sample_tokens(d_logits.get(), n, vocab, stride, d_params.get(), d_out.get(), nullptr,
                            0, nullptr);
      cudaEventRecord(stop);
      CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      std::printf("sample_tokens vocab %d rows %3d %-28s %8.1f us\n", static_cast<int>(vocab),
                  static_cast<int>(n), name, ms * 100.0);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace spin
