#pragma once
// Shared by the per-algorithm tests: a paged store of a chosen page size, random q/k/v whose
// keys are real RoPE rotations of random pre-RoPE keys, and the exactness check against
// ContiguousAttention (random inputs, and the tiny-llama Transformer with greedy decode).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/rope.h"
#include "model/transformer.h"
#include "sparse/paged_sparse_attention.h"

namespace spin_test {

inline double rel_error(const float* a, const float* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

// Room for `requests` sequences of max_context tokens in each tier.
struct PagedStore {
  spin::kv::KvConfig config;
  std::unique_ptr<spin::kv::HostPageMemory> memory;
  std::unique_ptr<spin::kv::KvManager> kv;
  PagedStore(const spin::AttentionShape& shape, uint32_t max_context, uint32_t page_size, uint32_t requests = 1) {
    config.layout = {static_cast<uint32_t>(shape.n_layers), static_cast<uint32_t>(shape.n_kv_heads),
                     static_cast<uint32_t>(shape.head_dim), page_size};
    const uint32_t pages = config.layout.pages_for_tokens(max_context) * config.layout.streams() * requests;
    config.device_pages = pages;
    config.host_pages = pages;
    config.max_batch = requests;
    config.max_context = max_context;
    memory = std::make_unique<spin::kv::HostPageMemory>(config.layout, pages, pages);
    kv = std::make_unique<spin::kv::KvManager>(config, *memory);
  }
  std::unique_ptr<spin::sparse::PagedSparseAttention> attention(
      const spin::AttentionShape& shape, const spin::sparse::SparseSettings& settings) {
    return std::make_unique<spin::sparse::PagedSparseAttention>(*kv, *memory, shape, settings);
  }
};

// Random q and pre-RoPE keys; k = RoPE(pre-RoPE keys) at each token's position.
struct RopedFeed {
  spin::RopeTable rope;
  std::mt19937 rng{7};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::vector<float> q, k, k_pre, v, out_a, out_b;
  explicit RopedFeed(int64_t head_dim) : rope(spin::make_rope_table(spin::RopeConfig{}, head_dim)) {}
  // Feeds tokens [pos0, pos0 + n) of every layer to both; returns the largest relative error.
  double step(spin::SequenceAttention& a, spin::SequenceAttention& b,
              const spin::AttentionShape& s, int64_t pos0, int64_t n) {
    const int64_t qw = s.n_heads * s.head_dim, kw = s.n_kv_heads * s.head_dim;
    double worst = 0.0;
    for (int64_t l = 0; l < s.n_layers; ++l) {
      q.resize(n * qw);
      k_pre.resize(n * kw);
      v.resize(n * kw);
      for (float& x : q) x = 1.5f * normal(rng);
      for (float& x : k_pre) x = 1.5f * normal(rng);
      for (float& x : v) x = normal(rng);
      k = k_pre;
      for (int64_t t = 0; t < n; ++t) {
        spin::cpu::rope(&k[t * kw], s.n_kv_heads, s.head_dim, pos0 + t, rope.inv_freq.data(),
                        rope.mscale, rope.neox);
      }
      out_a.assign(n * qw, 0.0f);
      out_b.assign(n * qw, 0.0f);
      const spin::AttentionTokens tokens{
          .q = q.data(), .k = k.data(), .v = v.data(), .k_pre_rope = k_pre.data(), .rope = &rope};
      a.forward(l, pos0, n, tokens, out_a.data());
      b.forward(l, pos0, n, tokens, out_b.data());
      for (float x : out_a) EXPECT_TRUE(std::isfinite(x));
      worst = std::max(worst, rel_error(out_a.data(), out_b.data(), out_a.size()));
    }
    return worst;
  }
};

// A prompt of `prompt` tokens in one chunk, then `steps` single-token steps, every layer fed to
// both `a` and `b`: q and v drawn from `normal(rng)`, each token's pre-RoPE key row (zeroed first)
// filled by `pre_rope_key(position, row)`, k = its RoPE. The largest relative error of a decode
// step's output.
template <typename KeyRow>
double max_decode_error(spin::SequenceAttention& a, spin::SequenceAttention& b, const spin::AttentionShape& s,
                        int64_t prompt, int64_t steps, std::mt19937& rng, std::normal_distribution<float>& normal,
                        KeyRow pre_rope_key) {
  const int64_t kw = s.n_kv_heads * s.head_dim, qw = s.n_heads * s.head_dim;
  const spin::RopeTable rope = spin::make_rope_table(spin::RopeConfig{}, s.head_dim);
  double worst = 0.0;
  for (int64_t pos = 0, n = prompt; pos < prompt + steps; pos += n, n = 1) {
    std::vector<float> q(n * qw), k_pre(n * kw, 0.0f), v(n * kw), out_a(n * qw), out_b(n * qw);
    for (float& x : q) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (int64_t t = 0; t < n; ++t) pre_rope_key(pos + t, &k_pre[t * kw]);
    std::vector<float> k = k_pre;
    for (int64_t t = 0; t < n; ++t)
      spin::cpu::rope(&k[t * kw], s.n_kv_heads, s.head_dim, pos + t, rope.inv_freq.data(), rope.mscale, rope.neox);
    for (int64_t l = 0; l < s.n_layers; ++l) {
      const spin::AttentionTokens tokens{q.data(), k.data(), v.data(), k_pre.data(), &rope};
      a.forward(l, pos, n, tokens, out_a.data());
      b.forward(l, pos, n, tokens, out_b.data());
      if (n == 1) worst = std::max(worst, rel_error(out_a.data(), out_b.data(), out_a.size()));
    }
  }
  return worst;
}

// Chunked prefill of 150 tokens, then 40 decode steps; the largest relative error of any output.
inline double max_error_vs_dense(const spin::AttentionShape& shape,
                                 const spin::sparse::SparseSettings& settings, uint32_t page_size) {
  PagedStore store(shape, 256, page_size);
  auto paged = store.attention(shape, settings);
  spin::ContiguousAttention dense(shape, 256);
  RopedFeed feed(shape.head_dim);
  double worst = 0.0;
  int64_t pos = 0;
  for (int64_t chunk : {64, 64, 22}) {
    worst = std::max(worst, feed.step(*paged, dense, shape, pos, chunk));
    pos += chunk;
  }
  for (int i = 0; i < 40; ++i, ++pos) worst = std::max(worst, feed.step(*paged, dense, shape, pos, 1));
  EXPECT_EQ(paged->length(), pos);
  return worst;
}

// The tiny-llama Transformer: prompt of 100 tokens + 16 greedy steps; the largest relative error
// of a logit row against ContiguousAttention.
inline double max_logit_error_through_transformer(const spin::sparse::SparseSettings& settings,
                                                  uint32_t page_size) {
  const spin::ModelWeights weights =
      spin::make_dummy_weights(spin::preset_config("tiny-llama"), 1234);
  spin::Transformer model(weights);
  const spin::AttentionShape shape = model.attention_shape();
  const auto vocab = static_cast<int32_t>(weights.config.vocab_size);
  std::vector<int32_t> prompt(100);
  std::mt19937 rng(5);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  auto run = [&](spin::SequenceAttention& attention, std::vector<std::vector<float>>& rows) {
    std::vector<float> logits;
    spin::SequenceChunk chunk{prompt, 0, &attention};
    model.forward(std::span(&chunk, 1), false, logits);
    rows.push_back(logits);
    auto pos = static_cast<int64_t>(prompt.size());
    for (int i = 0; i < 16; ++i, ++pos) {
      const auto next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      spin::SequenceChunk step{std::span(&next, 1), pos, &attention};
      model.forward(std::span(&step, 1), false, logits);
      rows.push_back(logits);
    }
  };
  std::vector<std::vector<float>> expected, got;
  spin::ContiguousAttention dense(shape, 256);
  run(dense, expected);
  PagedStore store(shape, 256, page_size);
  auto paged = store.attention(shape, settings);
  run(*paged, got);
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, rel_error(got[i].data(), expected[i].data(), got[i].size()));
  return worst;
}

}  // namespace spin_test
