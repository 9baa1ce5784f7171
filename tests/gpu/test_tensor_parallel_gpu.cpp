// Tensor parallelism on GPUs: the same small model (host weights, rounded to bf16) on one GPU and
// split over two (make_cuda_tensor_parallel_model: shard_weights per rank, NCCL all-reduce of the
// O and down projections, a device KV store per rank). References: the one-GPU CudaModel, which
// test_cuda_model_gpu.cpp checks against the CPU, and the fp32 CPU Transformer itself.
//
// Tolerances: logits' relative error <= 2e-2 against either reference (bf16 activations; the
// split adds one bf16 rounding of each rank's partial product before the sum). Greedy tokens must
// be identical, on a model whose top-2 margins the test checks to be >= 4x the measured error.
//
// Needs 2 GPUs and NCCL; skips with a message otherwise (the startup checks run on any GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_model_test.h"
#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "engine/cuda/cuda_paged_attention.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/tensor_parallel_factory.h"
#include "model/contiguous_attention.h"
#include "model/cuda/cuda_model.h"
#include "model/loader.h"
#include "model/tensor_parallel.h"
#include "model/transformer.h"

namespace spin {
namespace {

constexpr int kWorld = 2;

using namespace gpu_test;

CudaPagedKvConfig kv_config(const AttentionShape& shape, int64_t tokens, int64_t max_batch = 8,
                            int64_t max_context = 1024) {
  return paged_kv_config(16, pages_for(shape, 16, tokens), max_batch, max_context);
}

std::unique_ptr<AttentionFactory> one_gpu_factory(const CudaModel& model, int64_t tokens, int64_t max_batch = 8,
                                                  int64_t max_context = 1024) {
  return std::make_unique<CudaPagedAttentionFactory>(model.attention_shape(),
                                                     kv_config(model.attention_shape(), tokens, max_batch, max_context));
}

// The split model's factory: a store per rank on its GPU, pages for `tokens` tokens on each.
std::unique_ptr<AttentionFactory> split_factory(const TensorParallelModel& model, int64_t tokens,
                                                int64_t max_batch = 8, int64_t max_context = 1024) {
  const AttentionShape rank_shape = model.rank_attention_shape();
  std::vector<std::unique_ptr<AttentionFactory>> ranks;
  for (auto& f : make_cuda_rank_factories(rank_shape, kv_config(rank_shape, tokens, max_batch, max_context),
                                          model.world_size())) {
    ranks.push_back(std::move(f));
  }
  return make_tensor_parallel_attention_factory(std::move(ranks));
}

CudaTensorParallel split_model(const ModelWeights& w, bool cuda_graphs = true) {
  CudaModelOptions options;
  options.cuda_graphs = cuda_graphs;
  return make_cuda_tensor_parallel_model(&w, w.config, 0, kWorld, options);
}

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

class CudaTensorParallelTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
#if !SPIN_WITH_NCCL
    GTEST_SKIP() << "spin was built without NCCL: tensor parallelism on GPUs is not available";
#endif
    const int n = visible_gpus();
    if (n < kWorld) GTEST_SKIP() << "tensor parallelism needs " << kWorld << " GPUs; " << n << " visible";
  }
  std::mt19937 rng{4321};
};

// One sequence on the CPU, one GPU and the split model.
struct Sequence {
  std::unique_ptr<SequenceKv> cpu, one, split;
  std::vector<int32_t> tokens;
};

struct StepLogits {
  std::vector<float> cpu, one, split;
};

StepLogits run_step(Transformer& cpu, CudaModel& one, TensorParallelModel& split, std::vector<Sequence>& seqs,
                    const std::vector<Part>& parts, bool all_logits) {
  StepLogits out;
  cpu.forward(step_chunks(seqs, parts, &Sequence::cpu), all_logits, out.cpu);
  one.forward(step_chunks(seqs, parts, &Sequence::one), all_logits, out.one);
  split.forward(step_chunks(seqs, parts, &Sequence::split), all_logits, out.split);
  return out;
}

// Chunked prefills, a one-token prompt, mixed prefill + decode batches and decode-only batches
// (replayed from CUDA graphs with the all-reduces inside): the split model's logits agree with
// one GPU's and with the CPU's.
TEST_F(CudaTensorParallelTest, LogitsMatchOneGpuAndTheCpuOverPrefillAndDecode) {
  for (const bool qwen3 : {true, false}) {
    SCOPED_TRACE(qwen3 ? "qwen3-like" : "llama-like");
    const ModelConfig c = small_config(qwen3);
    const ModelWeights w = bf16_weights(c, 21);
    Transformer cpu(w);
    CudaModel one(w, CudaModelOptions{});
    CudaTensorParallel split = split_model(w);
    ASSERT_EQ(split.model->world_size(), kWorld);
    EXPECT_EQ(split.model->rank_attention_shape().n_kv_heads, c.n_kv_heads / kWorld);
    auto one_factory = one_gpu_factory(one, 4 * 200);
    auto split_kv = split_factory(*split.model, 4 * 200);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
    std::vector<Sequence> seqs;
    for (const int64_t n : {90, 23, 1, 41}) {
      Sequence s;
      s.cpu = std::make_unique<ContiguousAttention>(cpu.attention_shape(), 200);
      s.one = one_factory->create(AttentionSettings{}, 200);
      s.split = split_kv->create(AttentionSettings{}, 200);
      s.tokens.resize(static_cast<size_t>(n + 40));
      for (int32_t& t : s.tokens) t = token(rng);
      seqs.push_back(std::move(s));
    }
    std::vector<std::pair<std::vector<Part>, bool>> steps = {
        {{{0, 0, 40}, {2, 0, 1}, {1, 0, 23}}, true},
        {{{0, 40, 90}, {1, 23, 24}, {2, 1, 2}}, true},
        {{{3, 0, 41}, {0, 90, 91}, {1, 24, 25}}, false},
    };
    // Decode-only steps of all four: warm-up, capture, then replays.
    for (int64_t i = 0; i < 12; ++i) {
      steps.push_back({{{0, 91 + i, 92 + i}, {1, 25 + i, 26 + i}, {2, 2 + i, 3 + i}, {3, 41 + i, 42 + i}}, i % 5 == 4});
    }
    for (size_t i = 0; i < steps.size(); ++i) {
      const StepLogits l = run_step(cpu, one, *split.model, seqs, steps[i].first, steps[i].second);
      ASSERT_EQ(l.split.size(), l.one.size()) << "step " << i;
      const Comparison vs_one = compare(l.split, l.one);
      const Comparison vs_cpu = compare(l.split, l.cpu);
      EXPECT_TRUE(vs_one.finite && vs_one.relative <= 2e-2) << "step " << i << " vs one GPU: " << describe(vs_one);
      EXPECT_TRUE(vs_cpu.relative <= 2e-2) << "step " << i << " vs the CPU: " << describe(vs_cpu);
    }
    EXPECT_EQ(seqs[0].split->length(), 103);
    for (CudaModel* rank : split.ranks) {
      EXPECT_GT(rank->forward_stats()->graph_replays, 0) << "no decode step of a rank replayed a CUDA graph";
    }
  }
}

// Greedy decoding of the split model picks one GPU's token at each of 32 steps, on a model whose
// top-2 margin is checked at every step to exceed 4x the measured difference of the two.
TEST_F(CudaTensorParallelTest, GreedyTokensEqualOneGpuFor32Steps) {
  const ModelConfig c = small_config(false);
  const ModelWeights w = wide_margin_weights(c, 5);
  Transformer cpu(w);
  CudaModel one(w, CudaModelOptions{});
  CudaTensorParallel split = split_model(w);
  auto one_factory = one_gpu_factory(one, 256);
  auto split_kv = split_factory(*split.model, 256);
  std::vector<Sequence> seqs(1);
  seqs[0].cpu = std::make_unique<ContiguousAttention>(cpu.attention_shape(), 128);
  seqs[0].one = one_factory->create(AttentionSettings{}, 128);
  seqs[0].split = split_kv->create(AttentionSettings{}, 128);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  for (int i = 0; i < 20; ++i) seqs[0].tokens.push_back(token(rng));
  std::vector<int32_t> one_tokens, split_tokens;
  int64_t begin = 0;
  for (int s = 0; s <= 32; ++s) {
    const auto end = static_cast<int64_t>(seqs[0].tokens.size());
    const StepLogits l = run_step(cpu, one, *split.model, seqs, {{0, begin, end}}, false);
    const Comparison r = compare(l.split, l.one);
    ASSERT_TRUE(r.finite && r.relative <= 2e-2) << "step " << s << ": " << describe(r);
    const double margin = top2_margin(l.one);
    ASSERT_GT(margin, 4.0 * r.max_abs) << "step " << s << ": top-2 margin " << margin << " within 4x the difference "
                                       << r.max_abs << " (test construction)";
    one_tokens.push_back(argmax(l.one));
    split_tokens.push_back(argmax(l.split));
    ASSERT_EQ(split_tokens.back(), one_tokens.back()) << "step " << s;
    EXPECT_EQ(argmax(l.cpu), one_tokens.back()) << "step " << s << ": one GPU disagrees with the CPU";
    if (s == 32) break;
    begin = end;
    seqs[0].tokens.push_back(one_tokens.back());
  }
  EXPECT_EQ(split_tokens, one_tokens);
  EXPECT_GT(count_distinct(split_tokens), 4)
      << "greedy decoding repeats a few tokens: the test would not notice a position or KV bug";
}

// Decode steps replayed from graphs that hold the NCCL all-reduces compute what the same steps
// compute eagerly: a capture that lost or misplaced a collective would be off by the size of the
// logits, far beyond the 1e-3 allowed (with 2 ranks a sum of two values does not depend on the
// order, so the two runs should in fact agree to the bit).
TEST_F(CudaTensorParallelTest, CudaGraphsOnAndOffAgree) {
  const ModelConfig c = small_config(true);
  const ModelWeights w = bf16_weights(c, 3);
  CudaTensorParallel graphs = split_model(w, true), eager = split_model(w, false);
  auto fa = split_factory(*graphs.model, 5 * 300);
  auto fb = split_factory(*eager.model, 5 * 300);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  struct Seq {
    std::unique_ptr<SequenceKv> a, b;
    std::vector<int32_t> tokens;
  };
  std::vector<Seq> seqs;
  std::vector<float> la, lb;
  for (const int64_t prompt : {10, 63, 120, 250}) {
    Seq s{fa->create(AttentionSettings{}, 300), fb->create(AttentionSettings{}, 300), {}};
    for (int64_t i = 0; i < prompt + 30; ++i) s.tokens.push_back(token(rng));
    const auto span = std::span<const int32_t>(s.tokens).first(static_cast<size_t>(prompt));
    SequenceChunk ca{span, 0, s.a.get()}, cb{span, 0, s.b.get()};
    graphs.model->forward(std::span(&ca, 1), false, la);
    eager.model->forward(std::span(&cb, 1), false, lb);
    seqs.push_back(std::move(s));
  }
  std::vector<std::vector<size_t>> batches;
  for (const std::vector<size_t>& batch : std::vector<std::vector<size_t>>{{3}, {0, 1}, {0, 1, 2, 3}}) {
    for (int repeat = 0; repeat < 5; ++repeat) batches.push_back(batch);
  }
  for (size_t step = 0; step < batches.size(); ++step) {
    std::vector<SequenceChunk> ca, cb;
    for (size_t i : batches[step]) {
      Seq& s = seqs[i];
      const int64_t pos = s.a->length();
      const auto span = std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(pos), 1);
      ca.push_back(SequenceChunk{span, pos, s.a.get()});
      cb.push_back(SequenceChunk{span, pos, s.b.get()});
    }
    graphs.model->forward(ca, false, la);
    eager.model->forward(cb, false, lb);
    ASSERT_EQ(la.size(), lb.size());
    const Comparison r = compare(la, lb);
    EXPECT_TRUE(r.finite && r.relative <= 1e-3) << "step " << step << ", graphs on vs off: " << describe(r);
  }
  for (CudaModel* rank : graphs.ranks) {
    EXPECT_GT(rank->forward_stats()->graphs_captured, 2);
    EXPECT_GT(rank->forward_stats()->graph_replays, 5);
  }
  for (CudaModel* rank : eager.ranks) EXPECT_EQ(rank->forward_stats()->graph_replays, 0);
}

// The Engine runs several requests together on the split model (chunked prefills beside decodes,
// padded decode batches, graphs) and each gets the tokens one GPU gives it, with log-probabilities
// within 0.15 (bf16 rounding differs between the two; another context moves them by about 2).
TEST_F(CudaTensorParallelTest, EngineGivesEachRequestTheOneGpuTokens) {
  const ModelConfig c = small_config(false);
  const ModelWeights w = wide_margin_weights(c, 8);
  CudaModel one(w, CudaModelOptions{});
  CudaTensorParallel split = split_model(w);
  const std::vector<std::vector<int32_t>> prompts = random_prompts(rng, c.vocab_size, {5, 37, 80, 1, 120});
  const std::vector<int64_t> max_tokens{12, 20, 8, 16, 10};
  const auto reference = run_engine(one, one_gpu_factory(one, 8 * 512, 8, 512), prompts, max_tokens);
  const auto got = run_engine(*split.model, split_factory(*split.model, 8 * 512, 8, 512), prompts, max_tokens);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(static_cast<int64_t>(reference[i].tokens.size()), max_tokens[i]) << "request " << i << " on one GPU";
    EXPECT_EQ(got[i].tokens, reference[i].tokens) << "request " << i;
    EXPECT_LE(max_logprob_difference(got[i], reference[i]), 0.15) << "request " << i;
  }
}

// Startup checks need no second GPU: a world that does not divide the KV heads, and more ranks
// than GPUs, are spin::Errors naming the numbers, raised before NCCL starts.
class CudaTensorParallelStartupTest : public GpuTest {};

TEST_F(CudaTensorParallelStartupTest, BadWorldSizesAreRefused) {
  const ModelConfig c = small_config(true);  // 2 KV heads
  try {
    make_cuda_tensor_parallel_model(nullptr, c, 1, 3, CudaModelOptions{});
    ADD_FAILURE() << "3 ranks over 2 KV heads were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV heads"), std::string::npos) << e.what();
  }
  ModelConfig many = c;  // as many KV heads as needed for one rank more than there are GPUs
  const int world = visible_gpus() + 1;
  many.n_kv_heads = world;
  many.n_heads = 2 * world;
  many.intermediate_size = 64 * world;
  try {
    make_cuda_tensor_parallel_model(nullptr, many, 1, world, CudaModelOptions{});
    ADD_FAILURE() << world << " ranks on " << world - 1 << " GPUs were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPUs"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spin
