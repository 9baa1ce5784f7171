// Tensor parallelism on the CPU (model/tensor_parallel.h, engine/tensor_parallel_factory.h).
// References: the unsplit weights and plain loops over them (sharding and partial sums), a
// double-precision sum (the in-process all-reduce), and the one-rank CPU Transformer over dense
// contiguous attention or the paged store (the model over 2 and 3 ranks, alone and in the Engine).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine/engine.h"
#include "engine/generator.h"
#include "engine/paged_attention_factory.h"
#include "engine/tensor_parallel_factory.h"
#include "kernels/cpu/ops.h"
#include "model/communicator.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/tensor_parallel.h"
#include "model/transformer.h"

namespace spin {
namespace {

// 6 KV heads (12 query heads) and an intermediate size of 96: 1, 2, 3 and 6 ranks divide both.
ModelConfig tp_config(bool qwen3) {
  ModelConfig c = preset_config(qwen3 ? "tiny-qwen3" : "tiny-llama");
  c.vocab_size = 256;
  c.hidden_size = 48;
  c.n_heads = 12;
  c.n_kv_heads = 6;
  c.head_dim = 8;
  c.intermediate_size = 96;
  c.n_layers = 2;
  return c;
}

struct TpModels {
  ModelWeights llama = make_dummy_weights(tp_config(false), 5);
  ModelWeights qwen3 = make_dummy_weights(tp_config(true), 6);
};

TpModels& models() {
  static TpModels m;
  return m;
}

const ModelWeights& weights_of(bool qwen3) { return qwen3 ? models().qwen3 : models().llama; }

// ||a - b|| / ||b|| in double precision.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

std::vector<float> random_vector(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// y[m, n] = x[m, k] · w[n, k]^T by plain loops in double.
std::vector<double> matmul_ref(const std::vector<float>& x, const Matrix& w, int64_t m) {
  std::vector<double> y(static_cast<size_t>(m * w.rows), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < w.rows; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) s += static_cast<double>(x[i * w.cols + k]) * w.data[j * w.cols + k];
      y[i * w.rows + j] = s;
    }
  }
  return y;
}

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

int32_t argmax(const float* x, int64_t n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}

// ---------------------------------------------------------------------------------------------
// Sharding

TEST(TensorParallelShard, ShardsReassembleToTheOriginals) {
  for (bool qwen3 : {false, true}) {
    const ModelWeights& full = weights_of(qwen3);
    const ModelConfig& c = full.config;
    for (int world : {1, 2, 3, 6}) {
      SCOPED_TRACE(testing::Message() << (qwen3 ? "qwen3" : "llama") << " world " << world);
      std::vector<ModelWeights> shards;
      for (int r = 0; r < world; ++r) shards.push_back(shard_weights(full, r, world));
      for (const ModelWeights& s : shards) {
        EXPECT_EQ(s.config.n_heads, c.n_heads / world);
        EXPECT_EQ(s.config.n_kv_heads, c.n_kv_heads / world);
        EXPECT_EQ(s.config.intermediate_size, c.intermediate_size / world);
        EXPECT_EQ(s.config.hidden_size, c.hidden_size);
        EXPECT_NO_THROW(s.validate_shapes());
        EXPECT_EQ(s.tok_embd.data, full.tok_embd.data);
        EXPECT_EQ(s.lm_head.data, full.lm_head.data);
        EXPECT_EQ(s.out_norm, full.out_norm);
      }
      for (int64_t l = 0; l < c.n_layers; ++l) {
        const LayerWeights& F = full.layers[l];
        // Row-split matrices: the shards' rows one after another; column-split: side by side.
        std::vector<float> wq, wk, wv, gate, up;
        for (const ModelWeights& s : shards) {
          const LayerWeights& L = s.layers[l];
          wq.insert(wq.end(), L.wq.data.begin(), L.wq.data.end());
          wk.insert(wk.end(), L.wk.data.begin(), L.wk.data.end());
          wv.insert(wv.end(), L.wv.data.begin(), L.wv.data.end());
          gate.insert(gate.end(), L.w_gate.data.begin(), L.w_gate.data.end());
          up.insert(up.end(), L.w_up.data.begin(), L.w_up.data.end());
          EXPECT_EQ(L.attn_norm, F.attn_norm);
          EXPECT_EQ(L.ffn_norm, F.ffn_norm);
          EXPECT_EQ(L.q_norm, F.q_norm);
          EXPECT_EQ(L.k_norm, F.k_norm);
        }
        EXPECT_EQ(wq, F.wq.data);
        EXPECT_EQ(wk, F.wk.data);
        EXPECT_EQ(wv, F.wv.data);
        EXPECT_EQ(gate, F.w_gate.data);
        EXPECT_EQ(up, F.w_up.data);
        std::vector<float> wo, down;
        for (int64_t row = 0; row < c.hidden_size; ++row) {
          for (const ModelWeights& s : shards) {
            const Matrix& o = s.layers[l].wo;
            const Matrix& d = s.layers[l].w_down;
            wo.insert(wo.end(), o.data.begin() + row * o.cols, o.data.begin() + (row + 1) * o.cols);
            down.insert(down.end(), d.data.begin() + row * d.cols, d.data.begin() + (row + 1) * d.cols);
          }
        }
        EXPECT_EQ(wo, F.wo.data);
        EXPECT_EQ(down, F.w_down.data);
      }
      if (qwen3) {
        EXPECT_FALSE(shards[0].layers[0].q_norm.empty());
      }
    }
  }
}

// Rank r's query heads use exactly rank r's KV heads (GQA groups never straddle ranks): its wk
// rows are the KV heads that the full model's query heads of this rank map to.
TEST(TensorParallelShard, QueryHeadsKeepTheirKvHeads) {
  const ModelWeights& full = weights_of(false);
  const ModelConfig& c = full.config;
  const int64_t group = c.n_heads / c.n_kv_heads;
  for (int world : {2, 3}) {
    for (int r = 0; r < world; ++r) {
      const ModelWeights s = shard_weights(full, r, world);
      for (int64_t h = 0; h < s.config.n_heads; ++h) {
        const int64_t global_q = r * s.config.n_heads + h;
        const int64_t global_kv = global_q / group;
        const int64_t local_kv = h / group;
        const float* expect = &full.layers[0].wk.data[global_kv * c.head_dim * c.hidden_size];
        const float* got = &s.layers[0].wk.data[local_kv * c.head_dim * c.hidden_size];
        EXPECT_TRUE(std::equal(got, got + c.head_dim * c.hidden_size, expect))
            << "world " << world << " rank " << r << " head " << h;
      }
    }
  }
}

TEST(TensorParallelShard, ClearErrorsForSizesTheRanksCannotSplit) {
  const ModelWeights& full = weights_of(false);
  auto message = [&](int world) {
    try {
      check_tensor_parallel(full.config, world);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(4).find("4 does not divide the model's 6 KV heads"), std::string::npos) << message(4);
  EXPECT_NE(message(5).find("5 does not divide the model's 6 KV heads"), std::string::npos) << message(5);
  EXPECT_NE(message(0).find("must be >= 1, got 0"), std::string::npos) << message(0);
  EXPECT_NE(message(-2).find("got -2"), std::string::npos) << message(-2);
  EXPECT_EQ(message(3), "");
  // KV heads divide but the intermediate size does not.
  ModelConfig odd = full.config;
  odd.intermediate_size = 100;
  EXPECT_THROW(check_tensor_parallel(odd, 3), Error);
  try {
    check_tensor_parallel(odd, 3);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate size 100"), std::string::npos) << e.what();
  }
  EXPECT_THROW(shard_weights(full, 2, 2), Error);
  EXPECT_THROW(shard_weights(full, -1, 2), Error);
  EXPECT_THROW(make_cpu_tensor_parallel_model(full, 4), Error);
  EXPECT_THROW(make_tensor_parallel(full, 4), Error);
}

// Row-parallel O projection: each rank multiplies its heads' slice of the attention output by
// its columns of o_proj; the partial results summed over the ranks are the unsplit product.
TEST(TensorParallelShard, PartialOProjectionsSumToTheUnsplitLayer) {
  const ModelWeights& full = weights_of(true);
  const ModelConfig& c = full.config;
  const int64_t n = 5, q_width = c.n_heads * c.head_dim;
  std::mt19937 rng(3);
  const std::vector<float> attn = random_vector(rng, static_cast<size_t>(n * q_width));
  const std::vector<float> expect = to_float(matmul_ref(attn, full.layers[1].wo, n));
  for (int world : {2, 3, 6}) {
    std::vector<float> sum(static_cast<size_t>(n * c.hidden_size), 0.0f);
    for (int r = 0; r < world; ++r) {
      const ModelWeights s = shard_weights(full, r, world);
      const int64_t w = s.config.n_heads * c.head_dim;
      std::vector<float> part_in(static_cast<size_t>(n * w));
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(&attn[t * q_width + r * w], w, &part_in[t * w]);
      }
      std::vector<float> part(sum.size());
      cpu::matmul_nt(part_in.data(), s.layers[1].wo.data.data(), part.data(), n, c.hidden_size, w);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_LE(rel_err(sum, expect), 1e-5) << "world " << world;
  }
}

// The MLP with gate/up split by rows and down by columns: per-rank outputs summed equal the
// unsplit SwiGLU MLP computed by plain loops.
TEST(TensorParallelShard, PartialMlpOutputsSumToTheUnsplitLayer) {
  const ModelWeights& full = weights_of(false);
  const ModelConfig& c = full.config;
  const LayerWeights& F = full.layers[0];
  const int64_t n = 4, ffn = c.intermediate_size;
  std::mt19937 rng(4);
  const std::vector<float> h = random_vector(rng, static_cast<size_t>(n * c.hidden_size));
  const std::vector<double> g = matmul_ref(h, F.w_gate, n), u = matmul_ref(h, F.w_up, n);
  std::vector<float> act(static_cast<size_t>(n * ffn));
  for (size_t i = 0; i < act.size(); ++i) act[i] = static_cast<float>(g[i] / (1.0 + std::exp(-g[i])) * u[i]);
  const std::vector<float> expect = to_float(matmul_ref(act, F.w_down, n));
  for (int world : {2, 3}) {
    std::vector<float> sum(static_cast<size_t>(n * c.hidden_size), 0.0f);
    for (int r = 0; r < world; ++r) {
      const ModelWeights s = shard_weights(full, r, world);
      const LayerWeights& L = s.layers[0];
      const int64_t f = s.config.intermediate_size;
      std::vector<float> gate(static_cast<size_t>(n * f)), up(gate.size()), part(sum.size());
      cpu::matmul_nt(h.data(), L.w_gate.data.data(), gate.data(), n, f, c.hidden_size);
      cpu::matmul_nt(h.data(), L.w_up.data.data(), up.data(), n, f, c.hidden_size);
      cpu::silu_mul(gate.data(), up.data(), n * f);
      cpu::matmul_nt(gate.data(), L.w_down.data.data(), part.data(), n, c.hidden_size, f);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_LE(rel_err(sum, expect), 1e-5) << "world " << world;
  }
}

// ---------------------------------------------------------------------------------------------
// The in-process communicator

TEST(TensorParallelComm, AllReduceSumsOverRanksBitIdentically) {
  for (int world : {1, 2, 3, 4}) {
    InProcessGroup group(world);
    constexpr int kCalls = 20;
    std::mt19937 rng(static_cast<unsigned>(world));
    // Different lengths per call (all ranks agree), including 0 and lengths below the world size.
    std::vector<int64_t> counts(kCalls);
    for (int i = 0; i < kCalls; ++i) counts[i] = i == 0 ? 0 : (i * 37) % 301;
    std::vector<std::vector<std::vector<float>>> inputs(world, std::vector<std::vector<float>>(kCalls));
    for (int r = 0; r < world; ++r) {
      for (int i = 0; i < kCalls; ++i) inputs[r][i] = random_vector(rng, static_cast<size_t>(counts[i]));
    }
    auto results = inputs;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Communicator& comm = group.communicator(r);
        EXPECT_EQ(comm.rank(), r);
        EXPECT_EQ(comm.world_size(), world);
        for (int i = 0; i < kCalls; ++i) comm.all_reduce_sum(results[r][i].data(), counts[i]);
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kCalls; ++i) {
      std::vector<float> expect(static_cast<size_t>(counts[i]));
      for (int64_t j = 0; j < counts[i]; ++j) {
        double s = 0.0;
        for (int r = 0; r < world; ++r) s += inputs[r][i][j];
        expect[j] = static_cast<float>(s);
      }
      for (int r = 0; r < world; ++r) {
        EXPECT_LE(rel_err(results[r][i], expect), 1e-6) << "world " << world << " call " << i;
        EXPECT_EQ(results[r][i], results[0][i]) << "ranks differ: world " << world << " call " << i;
      }
    }
  }
}

TEST(TensorParallelComm, MismatchedCountsFailOnEveryRank) {
  InProcessGroup group(2);
  std::vector<float> a(8, 1.0f), b(6, 2.0f);
  std::atomic<int> failures{0};
  std::thread t([&] {
    try {
      group.communicator(1).all_reduce_sum(b.data(), 6);
    } catch (const Error&) {
      ++failures;
    }
  });
  try {
    group.communicator(0).all_reduce_sum(a.data(), 8);
  } catch (const Error& e) {
    ++failures;
    EXPECT_NE(std::string(e.what()).find("passed 6 values"), std::string::npos) << e.what();
  }
  t.join();
  EXPECT_EQ(failures.load(), 2);
  EXPECT_EQ(a, std::vector<float>(8, 1.0f));  // untouched
}

TEST(TensorParallelComm, AbortWakesAWaitingRankAndResetRestoresTheGroup) {
  InProcessGroup group(2);
  std::vector<float> a(4, 1.0f);
  std::atomic<bool> failed{false};
  std::thread waiter([&] {
    try {
      group.communicator(0).all_reduce_sum(a.data(), 4);
    } catch (const Error& e) {
      failed = std::string(e.what()).find("another rank failed") != std::string::npos;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  group.abort();
  waiter.join();
  EXPECT_TRUE(failed.load());
  group.reset();
  std::vector<float> b(4, 2.0f);
  std::thread other([&] { group.communicator(1).all_reduce_sum(b.data(), 4); });
  group.communicator(0).all_reduce_sum(a.data(), 4);
  other.join();
  EXPECT_EQ(a, std::vector<float>(4, 3.0f));
  EXPECT_EQ(b, std::vector<float>(4, 3.0f));
  EXPECT_THROW(InProcessGroup(0), Error);
}

// ---------------------------------------------------------------------------------------------
// The model over several ranks against one rank

struct SeqState {
  std::vector<int32_t> tokens;  // the prompt, then the greedy tokens
  int64_t computed = 0;
};

// Prefill (all logits) of a prompt, then greedy decode, each model following its own argmax;
// compares every step's logits and the tokens.
void expect_tp_matches_one_rank(bool qwen3, int world) {
  SCOPED_TRACE(testing::Message() << (qwen3 ? "qwen3" : "llama") << " world " << world);
  const ModelWeights& full = weights_of(qwen3);
  const ModelConfig& c = full.config;
  Transformer one(full);
  TensorParallel tp = make_tensor_parallel(full, world);
  EXPECT_EQ(tp.model->world_size(), world);
  EXPECT_EQ(tp.model->rank_attention_shape().n_kv_heads, c.n_kv_heads / world);
  EXPECT_EQ(tp.model->attention_shape().n_kv_heads, c.n_kv_heads);
  EXPECT_FLOAT_EQ(tp.model->attention_shape().scale, one.attention_shape().scale);

  // Two sequences in one batch, of different lengths.
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 200, 3, 99, 42, 7}, {250, 1, 64}};
  constexpr int64_t kDecode = 6, kMax = 32;
  std::vector<std::unique_ptr<SequenceKv>> kv_one, kv_tp;
  std::vector<SeqState> s_one, s_tp;
  for (const auto& p : prompts) {
    kv_one.push_back(std::make_unique<ContiguousAttention>(one.attention_shape(), kMax));
    kv_tp.push_back(tp.factory->create(AttentionSettings{}, kMax));
    s_one.push_back({p, 0});
    s_tp.push_back({p, 0});
  }
  std::vector<float> logits_one, logits_tp;
  for (int64_t step = 0; step <= kDecode; ++step) {
    const bool prefill = step == 0;
    auto run = [&](ForwardModel& m, std::vector<std::unique_ptr<SequenceKv>>& kv, std::vector<SeqState>& s,
                   std::vector<float>& logits) {
      std::vector<SequenceChunk> chunks;
      for (size_t i = 0; i < s.size(); ++i) {
        chunks.push_back({std::span<const int32_t>(s[i].tokens).subspan(s[i].computed), s[i].computed, kv[i].get()});
      }
      m.forward(chunks, prefill, logits);
      int64_t row = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        const int64_t n = static_cast<int64_t>(s[i].tokens.size()) - s[i].computed;
        row += prefill ? n : 1;
        s[i].computed += n;
        s[i].tokens.push_back(argmax(&logits[(row - 1) * c.vocab_size], c.vocab_size));
      }
    };
    run(one, kv_one, s_one, logits_one);
    run(*tp.model, kv_tp, s_tp, logits_tp);
    EXPECT_LE(rel_err(logits_tp, logits_one), 1e-4) << "step " << step;
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(s_tp[i].tokens, s_one[i].tokens) << "sequence " << i;
    EXPECT_EQ(kv_tp[i]->length(), kv_one[i]->length());
    EXPECT_EQ(kv_tp[i]->length(), static_cast<int64_t>(prompts[i].size()) + kDecode);
  }
}

TEST(TensorParallelModelTest, TwoAndThreeRanksMatchOneRank) {
  for (bool qwen3 : {false, true}) {
    for (int world : {2, 3}) expect_tp_matches_one_rank(qwen3, world);
  }
}

TEST(TensorParallelModelTest, OneRankIsThePlainModel) {
  // One rank: no communicator traffic, the same weights: bit-identical logits.
  const ModelWeights& full = weights_of(true);
  Transformer one(full);
  TensorParallel tp = make_tensor_parallel(full, 1);
  const std::vector<int32_t> prompt = {9, 8, 7, 6, 5};
  ContiguousAttention kv_one(one.attention_shape(), 8);
  auto kv_tp = tp.factory->create(AttentionSettings{}, 8);
  std::vector<float> a, b;
  SequenceChunk c1{prompt, 0, &kv_one}, c2{prompt, 0, kv_tp.get()};
  one.forward(std::span(&c1, 1), true, a);
  tp.model->forward(std::span(&c2, 1), true, b);
  EXPECT_EQ(a, b);
}

TEST(TensorParallelModelTest, ForeignKvIsRefused) {
  const ModelWeights& full = weights_of(false);
  TensorParallel tp = make_tensor_parallel(full, 2);
  TensorParallel tp3 = make_tensor_parallel(full, 3);
  ContiguousAttention plain(Transformer(full).attention_shape(), 8);
  const std::vector<int32_t> prompt = {1, 2};
  std::vector<float> logits;
  SequenceChunk chunk{prompt, 0, &plain};
  EXPECT_THROW(tp.model->forward(std::span(&chunk, 1), false, logits), Error);
  auto kv3 = tp3.factory->create(AttentionSettings{}, 8);
  chunk.attention = kv3.get();
  EXPECT_THROW(tp.model->forward(std::span(&chunk, 1), false, logits), Error);
}

// A rank's attention that fails at one layer (as a full pool would): the forward must report
// that failure, not hang in the other ranks' all-reduce, and the model must run again after.
class FailingAttention final : public SequenceAttention {
 public:
  FailingAttention(const AttentionShape& shape, bool fail) : inner_(shape, 16), fail_(fail) {}
  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens, float* out) override {
    if (fail_ && layer == 1) fail("rank attention failed on purpose");
    inner_.forward(layer, pos0, n, tokens, out);
  }
  int64_t length() const override { return inner_.length(); }

 private:
  ContiguousAttention inner_;
  bool fail_;
};

TEST(TensorParallelModelTest, ARankFailureFailsTheForwardWithoutHanging) {
  const ModelWeights& full = weights_of(false);
  for (int world : {2, 3}) {
    auto tp_model = make_cpu_tensor_parallel_model(full, world);
    TensorParallelModel& model = *tp_model;
    const AttentionShape shape = model.rank_attention_shape();
    std::vector<std::unique_ptr<SequenceKv>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<FailingAttention>(shape, r == world - 1));
    TensorParallelKv bad(std::move(ranks));
    const std::vector<int32_t> prompt = {4, 5, 6};
    std::vector<float> logits;
    SequenceChunk chunk{prompt, 0, &bad};
    try {
      model.forward(std::span(&chunk, 1), false, logits);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("failed on purpose"), std::string::npos) << e.what();
    }
    // Token ids outside the vocabulary fail on every rank alike.
    std::vector<std::unique_ptr<SequenceKv>> good;
    for (int r = 0; r < world; ++r) good.push_back(std::make_unique<ContiguousAttention>(shape, 16));
    TensorParallelKv kv(std::move(good));
    const std::vector<int32_t> bad_ids = {1, 9999};
    chunk = {bad_ids, 0, &kv};
    EXPECT_THROW(model.forward(std::span(&chunk, 1), false, logits), Error);
    // And the model still works, matching one rank.
    chunk = {prompt, 0, &kv};
    model.forward(std::span(&chunk, 1), false, logits);
    Transformer one(full);
    ContiguousAttention kv_one(one.attention_shape(), 16);
    std::vector<float> expect;
    SequenceChunk c1{prompt, 0, &kv_one};
    one.forward(std::span(&c1, 1), false, expect);
    EXPECT_LE(rel_err(logits, expect), 1e-4);
  }
}

// A rank model that records where it was made and destroyed.
class ProbeRank final : public ForwardModel {
 public:
  ProbeRank(const ModelConfig& config, std::atomic<int>& live, std::atomic<int>& wrong_thread)
      : config_(config), live_(live), wrong_thread_(wrong_thread), made_on_(std::this_thread::get_id()) {
    ++live_;
  }
  ~ProbeRank() override {
    --live_;
    if (std::this_thread::get_id() != made_on_) ++wrong_thread_;
  }
  const ModelConfig& config() const override { return config_; }
  AttentionShape attention_shape() const override {
    return {config_.n_layers, config_.n_heads, config_.n_kv_heads, config_.head_dim, 1.0f};
  }
  void forward(std::span<const SequenceChunk>, bool, std::vector<float>& logits) override {
    logits.assign(static_cast<size_t>(config_.vocab_size), 0.0f);
  }

 private:
  ModelConfig config_;
  std::atomic<int>& live_;
  std::atomic<int>& wrong_thread_;
  std::thread::id made_on_;
};

// Ranks are made and destroyed on their own threads (as NCCL needs); a failing setup destroys
// the ranks already made and reports its own error.
TEST(TensorParallelModelTest, RanksLiveOnTheirThreadsAndSetupFailuresAreReported) {
  const ModelConfig full = tp_config(false);
  std::atomic<int> live{0}, wrong_thread{0};
  {
    TensorParallelModel model(full, 3, [&](int) {
      return std::make_unique<ProbeRank>(shard_config(full, 3), live, wrong_thread);
    }, {});
    EXPECT_EQ(live.load(), 3);
    EXPECT_EQ(model.rank_attention_shape().n_kv_heads, 2);
  }
  EXPECT_EQ(live.load(), 0);
  EXPECT_EQ(wrong_thread.load(), 0);

  bool aborted = false;
  try {
    TensorParallelModel model(full, 3, [&](int r) -> std::unique_ptr<ForwardModel> {
      if (r == 1) fail("rank setup failed on purpose");
      return std::make_unique<ProbeRank>(shard_config(full, 3), live, wrong_thread);
    }, {.abort = [&] { aborted = true; }, .reset = nullptr});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("failed on purpose"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(aborted);
  EXPECT_EQ(live.load(), 0);
  EXPECT_EQ(wrong_thread.load(), 0);

  // A rank holding the whole model instead of its shard.
  try {
    TensorParallelModel model(full, 2, [&](int) {
      return std::make_unique<ProbeRank>(full, live, wrong_thread);
    }, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("12 query and 6 KV heads, expected 6 and 3"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(live.load(), 0);
}

// The error a rank raised itself is reported, not another rank's echo of the abort.
TEST(TensorParallelModelTest, RankThreadsReportTheFirstFailure) {
  RankThreads threads(3);
  std::vector<int> seen(3, -1);
  threads.run([&](int r) { seen[r] = r * 10; }, {});
  EXPECT_EQ(seen, (std::vector<int>{0, 10, 20}));
  std::atomic<bool> aborted{false};
  try {
    threads.run(
        [&](int r) {
          if (r == 2) fail("the real failure");
          while (!aborted) std::this_thread::yield();
          fail("echo of the abort");
        },
        [&] { aborted = true; });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "the real failure");
  }
  // Usable again.
  threads.run([&](int r) { seen[r] = r; }, {});
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
}

// ---------------------------------------------------------------------------------------------
// Through the Engine

struct Collector {
  std::map<uint64_t, std::vector<int32_t>> ids;
  std::map<uint64_t, std::string> finish;
  OutputCallback callback() {
    return [this](const RequestOutput& out) {
      auto& v = ids[out.request_id];
      v.insert(v.end(), out.token_ids.begin(), out.token_ids.end());
      if (out.finished) finish[out.request_id] = out.finish_reason;
    };
  }
};

RequestParams greedy(int64_t max_tokens, const AttentionSettings& attention = {}) {
  RequestParams p;
  p.max_tokens = max_tokens;
  p.sampling.temperature = 0.0f;
  p.ignore_eos = true;
  p.attention = attention;
  return p;
}

constexpr int64_t kMaxModelLen = 96;

EngineConfig engine_config() {
  EngineConfig c;
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = 24;  // chunked prefill next to decode
  c.max_model_len = kMaxModelLen;
  return c;
}

std::vector<std::vector<int32_t>> prompts(std::vector<int64_t> lengths = {5, 31, 12, 47, 2}) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<int32_t> id(3, 255);
  std::vector<std::vector<int32_t>> out;
  for (int64_t n : lengths) {
    std::vector<int32_t> p(n);
    for (auto& x : p) x = id(rng);
    out.push_back(p);
  }
  return out;
}

// Every request's greedy tokens from an engine.
std::vector<std::vector<int32_t>> serve_all(ForwardModel& model, std::unique_ptr<AttentionFactory> factory,
                                            const AttentionSettings& attention, int64_t max_tokens,
                                            const std::vector<std::vector<int32_t>>& requests = prompts()) {
  Engine engine(model, nullptr, engine_config(), std::move(factory));
  Collector c;
  std::vector<uint64_t> ids;
  for (const auto& p : requests) ids.push_back(engine.add_request(p, greedy(max_tokens, attention), c.callback()));
  for (int steps = 0; engine.has_work(); ++steps) {
    if (steps > 5000) {
      ADD_FAILURE() << "no progress";
      break;
    }
    engine.step();
    // What the ranks' stores hold together stays within what the engine reserved for it.
    const EngineMetrics m = engine.metrics();
    if (m.kv_store) {
      EXPECT_LE(m.kv_store->device_pages_used, m.kv_device_pages_reserved);
      EXPECT_LE(m.kv_store->host_pages_used, m.kv_host_pages_reserved);
    }
  }
  std::vector<std::vector<int32_t>> out;
  for (uint64_t id : ids) {
    EXPECT_EQ(c.finish[id], "length");
    out.push_back(c.ids[id]);
  }
  return out;
}

TEST(TensorParallelEngine, ManyRequestsGiveTheTokensOfOneRank) {
  for (bool qwen3 : {false, true}) {
    const ModelWeights& full = weights_of(qwen3);
    // Reference: each prompt alone through the single-sequence generator on one rank.
    Transformer one(full);
    std::vector<std::vector<int32_t>> expect;
    for (const auto& p : prompts()) {
      GenerationParams g;
      g.max_tokens = 8;
      g.sampling.temperature = 0.0f;
      g.ignore_eos = true;
      expect.push_back(generate(one, nullptr, p, g, nullptr).output_ids);
    }
    for (int world : {2, 3}) {
      TensorParallel tp = make_tensor_parallel(full, world);
      EXPECT_EQ(serve_all(*tp.model, std::move(tp.factory), AttentionSettings{}, 8), expect)
          << (qwen3 ? "qwen3" : "llama") << " world " << world;
    }
  }
}

PagedStoreConfig paged_store(int64_t device_pages, int64_t host_pages) {
  PagedStoreConfig s;
  s.page_size = 8;
  s.device_pages = device_pages;
  s.host_pages = host_pages;
  s.max_batch = 4;
  s.max_context = kMaxModelLen;
  return s;
}

// Quest on the paged store, every rank with its own store over its KV heads: selection is per
// KV head, so splitting the heads over ranks changes nothing. Reference: the same algorithm and
// store sizes on one rank.
TEST(TensorParallelEngine, SparseAttentionOnPerRankPagedStores) {
  const ModelWeights& full = weights_of(false);
  const ModelConfig& c = full.config;
  AttentionSettings quest;
  quest.algorithm = "quest";
  quest.budget = 8;  // Quest's minimum of 3 pages: 24 tokens
  quest.first_dense_layers = 0;
  quest.sink_tokens = 8;
  quest.window_tokens = 8;
  // Up to 12 pages of context, 6 of them attended at the last step.
  const auto requests = prompts({70, 40, 83, 55});
  // Pages for the whole model (one page: page_size tokens of one layer x KV head); each of N
  // ranks gets 1/N of them.
  const int64_t streams = c.n_layers * c.n_kv_heads;
  const int64_t device_pages = streams * 40, host_pages = streams * 60;
  Transformer one(full);
  const auto expect = serve_all(one, make_paged_attention_factory(one.attention_shape(), paged_store(device_pages, host_pages)),
                                quest, 12, requests);
  // The selection really drops KV: dense attention gives other tokens.
  EXPECT_NE(serve_all(one, make_paged_attention_factory(one.attention_shape(), paged_store(device_pages, host_pages)),
                      AttentionSettings{}, 12, requests),
            expect);
  for (int world : {2, 3}) {
    TensorParallel tp = make_tensor_parallel(full, world, [&](int, const AttentionShape& shape) {
      return make_paged_attention_factory(shape, paged_store(device_pages / world, host_pages / world));
    });
    const std::optional<KvStoreUsage> idle = tp.factory->usage();
    ASSERT_TRUE(idle.has_value());
    EXPECT_EQ(idle->device_pages_capacity, device_pages);
    EXPECT_EQ(idle->host_pages_capacity, host_pages);
    EXPECT_EQ(tp.factory->capacity().device_pages, device_pages);
    AttentionFactory& factory = *tp.factory;
    // Demand adds the ranks' pages: the same as the one-rank store's for the whole model.
    auto one_factory = make_paged_attention_factory(one.attention_shape(), paged_store(device_pages, host_pages));
    for (bool decoding : {false, true}) {
      EXPECT_EQ(factory.demand(quest, 40, 60, decoding, 16), one_factory->demand(quest, 40, 60, decoding, 16));
    }
    EXPECT_EQ(serve_all(*tp.model, std::move(tp.factory), quest, 12, requests), expect) << "world " << world;
  }
}

}  // namespace
}  // namespace spin
