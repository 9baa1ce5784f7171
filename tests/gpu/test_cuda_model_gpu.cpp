// The bf16 GPU forward pass (CudaModel on CudaPagedAttentionFactory's device KV store) against the
// fp32 CPU Transformer on contiguous KV, the independent reference: same weights (rounded to bf16
// on both sides, so only the GPU's bf16 activations differ), same chunks.
//
// Tolerance: relative error of each step's logits ||gpu - cpu|| / ||cpu|| <= 2e-2. bf16 keeps 8
// mantissa bits (relative rounding 2^-9 = 2e-3 per value); activations are rounded after every
// product, norm and attention of 2 layers, and the errors add up roughly as a random walk.
//
// Also: device-made dummy weights equal host dummy weights; greedy decoding agrees with the CPU for
// 32 steps; CUDA graphs on and off give bit-identical logits; the Engine on the GPU gives every
// request the tokens it gets alone, and draws them on the GPU as the host Sampler would (greedy) or
// reproducibly by seed; foreign KV handles and impossible requests are spin::Errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_model_test.h"
#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/cuda_paged_attention.h"
#include "engine/engine.h"
#include "kv/page_pool.h"
#include "model/contiguous_attention.h"
#include "model/cuda/cuda_model.h"
#include "model/loader.h"
#include "model/transformer.h"

namespace spin {
namespace {

using namespace gpu_test;

std::unique_ptr<CudaPagedAttentionFactory> make_factory(const ForwardModel& model, int64_t page_size,
                                                        int64_t device_pages, int64_t max_batch = 8,
                                                        int64_t max_context = 1024) {
  return std::make_unique<CudaPagedAttentionFactory>(model.attention_shape(),
                                                     paged_kv_config(page_size, device_pages, max_batch, max_context));
}

// One sequence run on both sides: CPU KV and GPU KV, and its tokens.
struct Sequence {
  std::unique_ptr<SequenceKv> cpu;
  std::unique_ptr<SequenceKv> gpu;
  std::vector<int32_t> tokens;
};

class CudaModelTest : public GpuTest {
 protected:
  // Runs `parts` as one step on both models; returns the comparison, failing on a size mismatch.
  Comparison step(Transformer& cpu, CudaModel& gpu, std::vector<Sequence>& seqs, const std::vector<Part>& parts,
                  bool all_logits, std::vector<float>* gpu_logits_out = nullptr,
                  std::vector<float>* cpu_logits_out = nullptr) {
    const std::vector<SequenceChunk> cpu_chunks = step_chunks(seqs, parts, &Sequence::cpu);
    const std::vector<SequenceChunk> gpu_chunks = step_chunks(seqs, parts, &Sequence::gpu);
    std::vector<float> cpu_logits, gpu_logits;
    cpu.forward(cpu_chunks, all_logits, cpu_logits);
    gpu.forward(gpu_chunks, all_logits, gpu_logits);
    EXPECT_EQ(gpu_logits.size(), cpu_logits.size());
    const Comparison c = compare(gpu_logits, cpu_logits);
    if (gpu_logits_out) *gpu_logits_out = std::move(gpu_logits);
    if (cpu_logits_out) *cpu_logits_out = std::move(cpu_logits);
    return c;
  }

  std::mt19937 rng{1234};
};

// Several sequences' prefill chunks (one prompt chunked across two forwards), single-token prompts
// and decode steps, mixed in one batch and alone, with all logits and last-token logits.
TEST_F(CudaModelTest, LogitsMatchTheCpuTransformerOnMixedBatches) {
  for (const bool qwen3 : {true, false}) {
    for (const int64_t page_size : {16, 8, 32}) {
      SCOPED_TRACE(std::string(qwen3 ? "qwen3-like" : "llama-like") + ", page size " + std::to_string(page_size));
      const ModelConfig c = small_config(qwen3);
      const ModelWeights w = bf16_weights(c, 11);
      Transformer cpu(w);
      CudaModel gpu(w, CudaModelOptions{});
      auto factory = make_factory(gpu, page_size, pages_for(c, page_size, 4 * 200));
      std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
      std::vector<Sequence> seqs;
      for (const int64_t n : {90, 23, 1, 41}) {  // prompt lengths; room for the decode tokens below
        Sequence s;
        s.cpu = std::make_unique<ContiguousAttention>(cpu.attention_shape(), 200);
        s.gpu = factory->create(AttentionSettings{}, 200);
        s.tokens.resize(static_cast<size_t>(n + 12));
        for (int32_t& t : s.tokens) t = token(rng);
        seqs.push_back(std::move(s));
      }
      // Sequence 0: prompt of 90 in chunks 0-40, 40-90. Sequence 1: 23. Sequence 2: 1 token.
      // Sequence 3 arrives at step 4 while the others decode.
      const std::vector<std::pair<std::vector<Part>, bool>> steps = {
          {{{0, 0, 40}, {2, 0, 1}, {1, 0, 23}}, true},   // prefill chunks with a 1-token prompt between them
          {{{0, 40, 90}, {1, 23, 24}, {2, 1, 2}}, true},  // the rest of a chunked prefill beside decodes
          {{{1, 24, 25}, {0, 90, 91}, {2, 2, 3}}, false}, // decode only (3 rows, padded to 4)
          {{{3, 0, 41}, {0, 91, 92}, {1, 25, 26}}, false},
          {{{0, 92, 93}, {1, 26, 27}, {2, 3, 4}, {3, 41, 42}}, false},
          {{{0, 93, 94}, {1, 27, 28}, {2, 4, 5}, {3, 42, 43}}, true},
          {{{0, 94, 95}, {1, 28, 29}, {2, 5, 6}, {3, 43, 44}}, false},
          {{{0, 95, 96}, {1, 29, 30}, {2, 6, 7}, {3, 44, 45}}, false},
          {{{3, 45, 46}}, false},  // a batch of one after batches of four
      };
      for (size_t i = 0; i < steps.size(); ++i) {
        const Comparison r = step(cpu, gpu, seqs, steps[i].first, steps[i].second);
        EXPECT_TRUE(r.finite && r.relative <= 2e-2) << "step " << i << ": " << describe(r, c.vocab_size);
      }
      EXPECT_EQ(seqs[0].gpu->length(), 96);
      EXPECT_EQ(seqs[3].gpu->length(), 46);
      // Decode steps of 4 rows came 4 times: warm-up, capture, then replays.
      EXPECT_GT(gpu.forward_stats()->graph_replays, 0) << "no decode step replayed a CUDA graph";
      EXPECT_GT(gpu.forward_stats()->device_wait_seconds, 0.0) << "no forward counted its wait for the device";
    }
  }
}

// Dummy weights filled on the device equal the host's dummy weights rounded to bf16 (every tensor
// enters the logits, so equal logits on a few batches mean equal weights).
TEST_F(CudaModelTest, DeviceDummyWeightsEqualHostDummyWeights) {
  for (const bool qwen3 : {true, false}) {
    SCOPED_TRACE(qwen3 ? "qwen3-like (tied)" : "llama-like (untied)");
    const ModelConfig c = small_config(qwen3);
    CudaModelOptions eager;
    eager.cuda_graphs = false;
    CudaModel from_host(make_dummy_weights(c, 99), eager);
    CudaModel on_device(c, 99, eager);
    EXPECT_EQ(from_host.weight_bytes(), on_device.weight_bytes());
    auto fa = make_factory(from_host, 16, pages_for(c, 16, 256));
    auto fb = make_factory(on_device, 16, pages_for(c, 16, 256));
    auto ka = fa->create(AttentionSettings{}, 100);
    auto kb = fb->create(AttentionSettings{}, 100);
    std::vector<int32_t> tokens(50);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
    for (int32_t& t : tokens) t = token(rng);
    std::vector<float> la, lb;
    for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 48}, {48, 49}, {49, 50}}) {
      const auto span = std::span<const int32_t>(tokens).subspan(begin, end - begin);
      SequenceChunk a{span, begin, ka.get()}, b{span, begin, kb.get()};
      from_host.forward(std::span(&a, 1), true, la);
      on_device.forward(std::span(&b, 1), true, lb);
      ASSERT_EQ(la.size(), lb.size());
      const Comparison r = compare(lb, la);
      EXPECT_EQ(r.max_abs, 0.0) << "tokens " << begin << ".." << end << ": " << describe(r, c.vocab_size);
      EXPECT_GT(std::abs(la[0]) + std::abs(la[1]), 0.0f) << "the logits are zero: the weights were not filled";
    }
  }
}

// Greedy decoding on the GPU picks the CPU's token at each of 32 steps. The model has wide margins
// (wide_margin_weights); the test checks that each step's CPU margin between the best and the
// second-best token is at least 4x the largest GPU logit error of that step, so agreement is
// implied by the measured accuracy, not by luck.
TEST_F(CudaModelTest, GreedyDecodeMatchesTheCpuFor32Steps) {
  const ModelConfig c = small_config(false);
  const ModelWeights w = wide_margin_weights(c, 5);
  Transformer cpu(w);
  CudaModel gpu(w, CudaModelOptions{});
  auto factory = make_factory(gpu, 16, pages_for(c, 16, 256));
  std::vector<Sequence> seqs(1);
  seqs[0].cpu = std::make_unique<ContiguousAttention>(cpu.attention_shape(), 128);
  seqs[0].gpu = factory->create(AttentionSettings{}, 128);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  for (int i = 0; i < 20; ++i) seqs[0].tokens.push_back(token(rng));
  std::vector<int32_t> cpu_tokens, gpu_tokens;
  int64_t begin = 0;
  for (int s = 0; s <= 32; ++s) {
    const auto end = static_cast<int64_t>(seqs[0].tokens.size());
    std::vector<float> g, k;
    const Comparison r = step(cpu, gpu, seqs, {{0, begin, end}}, false, &g, &k);
    ASSERT_TRUE(r.finite && r.relative <= 2e-2) << "step " << s << ": " << describe(r, c.vocab_size);
    const double margin = top2_margin(k);
    ASSERT_GT(margin, 4.0 * r.max_abs) << "step " << s << ": the test model's top-2 margin " << margin
                                       << " is within 4x the GPU error " << r.max_abs << " (test construction)";
    cpu_tokens.push_back(argmax(k));
    gpu_tokens.push_back(argmax(g));
    ASSERT_EQ(gpu_tokens.back(), cpu_tokens.back()) << "step " << s << " (margin " << margin << ")";
    if (s == 32) break;
    begin = end;
    seqs[0].tokens.push_back(cpu_tokens.back());
  }
  EXPECT_EQ(gpu_tokens, cpu_tokens);
  EXPECT_GT(count_distinct(gpu_tokens), 4)
      << "greedy decoding repeats a few tokens: the test would not notice a position or KV bug";
}

// Decode steps replayed from CUDA graphs compute exactly what the same steps compute eagerly:
// batches of 1..5 sequences (padded to 1, 2, 4, 8 rows), contexts crossing the decode kernel's
// power-of-two buckets (64, 128, 256), each shape seen often enough to be warmed up, captured and
// replayed.
TEST_F(CudaModelTest, CudaGraphsOnAndOffGiveIdenticalLogits) {
  const ModelConfig c = small_config(true);
  const ModelWeights w = bf16_weights(c, 3);
  CudaModelOptions with_graphs, without_graphs;
  without_graphs.cuda_graphs = false;
  CudaModel a(w, with_graphs), b(w, without_graphs);
  auto fa = make_factory(a, 16, pages_for(c, 16, 5 * 400));
  auto fb = make_factory(b, 16, pages_for(c, 16, 5 * 400));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  struct Seq {
    std::unique_ptr<SequenceKv> a, b;
    std::vector<int32_t> tokens;
  };
  std::vector<Seq> seqs;
  for (const int64_t prompt : {10, 50, 63, 120, 250}) {
    Seq s{fa->create(AttentionSettings{}, 400), fb->create(AttentionSettings{}, 400), {}};
    for (int64_t i = 0; i < prompt + 40; ++i) s.tokens.push_back(token(rng));
    std::vector<float> la, lb;
    const auto span = std::span<const int32_t>(s.tokens).first(static_cast<size_t>(prompt));
    SequenceChunk ca{span, 0, s.a.get()}, cb{span, 0, s.b.get()};
    a.forward(std::span(&ca, 1), false, la);
    b.forward(std::span(&cb, 1), false, lb);
    seqs.push_back(std::move(s));
  }
  // Which sequences decode at each step: every batch size 1..5 several times in a row.
  std::vector<std::vector<size_t>> batches;
  for (const std::vector<size_t>& batch : std::vector<std::vector<size_t>>{{4}, {0, 1}, {1, 2, 3}, {0, 1, 2, 3, 4}}) {
    for (int repeat = 0; repeat < 4; ++repeat) batches.push_back(batch);
  }
  for (int repeat = 0; repeat < 8; ++repeat) batches.push_back({0, 1, 2, 3, 4});
  for (size_t step = 0; step < batches.size(); ++step) {
    std::vector<SequenceChunk> ca, cb;
    for (size_t i : batches[step]) {
      Seq& s = seqs[i];
      const int64_t pos = s.a->length();
      ASSERT_EQ(pos, s.b->length());
      const auto span = std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(pos), 1);
      ca.push_back(SequenceChunk{span, pos, s.a.get()});
      cb.push_back(SequenceChunk{span, pos, s.b.get()});
    }
    std::vector<float> la, lb;
    a.forward(ca, false, la);
    b.forward(cb, false, lb);
    ASSERT_EQ(la.size(), lb.size());
    const Comparison r = compare(la, lb);
    EXPECT_TRUE(r.finite && r.max_abs == 0.0) << "step " << step << " (" << batches[step].size()
                                              << " sequences), graphs on vs off: " << describe(r, c.vocab_size);
  }
  EXPECT_GT(a.forward_stats()->graphs_captured, 3);
  EXPECT_GT(a.forward_stats()->graph_replays, 8);
  EXPECT_EQ(b.forward_stats()->graphs_captured, 0);
  EXPECT_EQ(b.forward_stats()->graph_replays, 0);
}

// The Engine batches requests on the GPU (decodes, chunked prefills, padded decode batches, CUDA
// graphs) and each request gets the tokens it gets alone, and log-probabilities within 0.15 of
// its own (bf16 rounding differs between batch shapes and between chunked and whole prefills;
// another context moves them by about 2); also when the KV pool is so
// small that the scheduler must preempt and recompute.
TEST_F(CudaModelTest, EngineGivesEachRequestItsTokensAlone) {
  const ModelConfig c = small_config(false);
  const ModelWeights w = wide_margin_weights(c, 8);
  CudaModel model(w, CudaModelOptions{});
  const std::vector<std::vector<int32_t>> prompts = random_prompts(rng, c.vocab_size, {5, 37, 80, 1, 120});
  const std::vector<int64_t> max_tokens{12, 20, 8, 16, 10};
  // The Engine's KV store: `pages` pages of 16 tokens, 8 sequences of up to 512 tokens.
  const auto engine_kv = [&](int64_t pages) { return make_factory(model, 16, pages, 8, 512); };
  const int64_t roomy = pages_for(c, 16, 8 * 512);
  std::vector<EngineRun> alone;
  for (size_t i = 0; i < prompts.size(); ++i) alone.push_back(run_engine(model, engine_kv(roomy), {prompts[i]}, {max_tokens[i]})[0]);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(static_cast<int64_t>(alone[i].tokens.size()), max_tokens[i]) << "request " << i << " alone";
    ASSERT_EQ(alone[i].logprobs.size(), alone[i].tokens.size()) << "request " << i << " alone";
  }
  const auto together = run_engine(model, engine_kv(roomy), prompts, max_tokens);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i << " in a batch";
    EXPECT_LE(max_logprob_difference(together[i], alone[i]), 0.15) << "request " << i << " in a batch";
  }

  // Room for the longest request (130 tokens) and little more: the engine preempts and recomputes.
  int64_t preempted = 0;
  const auto squeezed = run_engine(model, engine_kv(pages_for(c, 16, 160)), prompts, max_tokens, &preempted);
  EXPECT_GT(preempted, 0) << "the small pool did not force a preemption";
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(squeezed[i].tokens, alone[i].tokens) << "request " << i << " with preemption";
    EXPECT_LE(max_logprob_difference(squeezed[i], alone[i]), 0.15) << "request " << i << " with preemption";
  }
}

// The same CUDA model, drawing its tokens on the host from downloaded logits (the CPU Sampler).
class HostSampled final : public ForwardModel {
 public:
  explicit HostSampled(CudaModel& model) : model_(model) {}
  const ModelConfig& config() const override { return model_.config(); }
  AttentionShape attention_shape() const override { return model_.attention_shape(); }
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override {
    model_.forward(chunks, all_logits, logits);
  }

 private:
  CudaModel& model_;
};

// Runs the prompts through an Engine with these sampling settings; returns each request's tokens
// and logprobs.
std::vector<EngineRun> run_sampled(ForwardModel& model, std::unique_ptr<AttentionFactory> factory,
                                   const std::vector<std::vector<int32_t>>& prompts,
                                   const std::vector<RequestParams>& params) {
  EngineConfig config;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 512;
  Engine engine(model, nullptr, config, std::move(factory));
  std::vector<EngineRun> out(prompts.size());
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const uint64_t id = engine.add_request(prompts[i], params[i], [&out, &index](const RequestOutput& o) {
      EngineRun& run = out[index.at(o.request_id)];
      run.tokens.insert(run.tokens.end(), o.token_ids.begin(), o.token_ids.end());
      run.logprobs.insert(run.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
    });
    index[id] = i;
  }
  while (engine.has_work()) engine.step();
  return out;
}

// The Engine on the CUDA model draws tokens on the GPU: greedy tokens are the host Sampler's from
// the same logits, and a middle request's logprobs equal the host's from all rows; seeded draws
// repeat exactly, depend on the seed, and leave the greedy path; a request that wants logprobs
// beside ones that do not gets them for the token drawn.
TEST_F(CudaModelTest, EngineDrawsTokensOnTheDevice) {
  const ModelConfig c = small_config(true);
  const ModelWeights w = bf16_weights(c, 9);
  CudaModel model(w, CudaModelOptions{});
  HostSampled host(model);
  ASSERT_TRUE(model.samples_on_device());
  ASSERT_FALSE(host.samples_on_device());
  const auto prompts = random_prompts(rng, c.vocab_size, {40, 7, 90});
  const auto kv = [&] { return make_factory(model, 16, pages_for(c, 16, 8 * 512), 8, 512); };
  RequestParams greedy;
  greedy.max_tokens = 24;
  greedy.ignore_eos = true;
  greedy.sampling.temperature = 0.0f;
  std::vector<RequestParams> all_greedy(prompts.size(), greedy);
  all_greedy[1].top_logprobs = 2;  // a middle row: only its logits come down, to their own place
  const auto on_device = run_sampled(model, kv(), prompts, all_greedy);
  const auto on_host = run_sampled(host, kv(), prompts, all_greedy);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(on_device[i].tokens.size(), 24u) << "request " << i;
    EXPECT_EQ(on_device[i].tokens, on_host[i].tokens) << "request " << i << ": device argmax != host argmax";
  }
  ASSERT_EQ(on_device[1].logprobs.size(), on_host[1].logprobs.size());
  for (size_t t = 0; t < on_host[1].logprobs.size(); ++t) {
    EXPECT_EQ(on_device[1].logprobs[t].logprob, on_host[1].logprobs[t].logprob) << "token " << t;
    EXPECT_EQ(on_device[1].logprobs[t].top, on_host[1].logprobs[t].top) << "token " << t;
  }

  std::vector<RequestParams> drawn(prompts.size(), greedy);
  for (size_t i = 0; i < drawn.size(); ++i) {
    drawn[i].sampling.temperature = 1.0f;
    drawn[i].sampling.top_k = i == 1 ? 40 : 0;
    drawn[i].sampling.top_p = i == 2 ? 0.9f : 1.0f;
    drawn[i].sampling.seed = 100 + i;
  }
  drawn[0].top_logprobs = 3;  // logits come down for this one only
  const auto first = run_sampled(model, kv(), prompts, drawn);
  const auto again = run_sampled(model, kv(), prompts, drawn);
  std::vector<RequestParams> reseeded = drawn;
  for (RequestParams& p : reseeded) *p.sampling.seed += 1000;
  const auto other_seed = run_sampled(model, kv(), prompts, reseeded);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(first[i].tokens.size(), 24u) << "request " << i;
    EXPECT_EQ(first[i].tokens, again[i].tokens) << "request " << i << ": a seeded rerun differs";
    EXPECT_NE(first[i].tokens, other_seed[i].tokens) << "request " << i << ": the seed changed nothing";
    EXPECT_NE(first[i].tokens, on_device[i].tokens) << "request " << i << ": temperature 1 drew the greedy tokens";
  }
  ASSERT_EQ(first[0].logprobs.size(), first[0].tokens.size());
  for (size_t t = 0; t < first[0].tokens.size(); ++t) {
    EXPECT_EQ(first[0].logprobs[t].id, first[0].tokens[t]) << "token " << t;
    EXPECT_TRUE(std::isfinite(first[0].logprobs[t].logprob) && first[0].logprobs[t].logprob <= 0.0f) << "token " << t;
    EXPECT_EQ(first[0].logprobs[t].top.size(), 3u) << "token " << t;
  }
  EXPECT_TRUE(first[1].logprobs.empty());
}

// Handles from the wrong factory, mixed stores, unsupported algorithms, gaps and a full pool are
// errors that leave the store consistent, never crashes.
TEST_F(CudaModelTest, ForeignKvAndImpossibleStepsAreErrors) {
  const ModelConfig c = small_config(true);
  const ModelWeights w = bf16_weights(c, 2);
  CudaModel gpu(w, CudaModelOptions{});
  Transformer cpu(w);
  auto factory = make_factory(gpu, 16, pages_for(c, 16, 32));  // two pages per (layer, KV head)
  auto other = make_factory(gpu, 16, pages_for(c, 16, 32));
  std::vector<int32_t> tokens(40, 5);
  std::vector<float> logits;

  ContiguousAttention host_kv(cpu.attention_shape(), 64);
  SequenceChunk host_chunk{std::span<const int32_t>(tokens).first(4), 0, &host_kv};
  EXPECT_THROW(gpu.forward(std::span(&host_chunk, 1), false, logits), Error);

  auto kv = factory->create(AttentionSettings{}, 64);
  SequenceChunk device_chunk{std::span<const int32_t>(tokens).first(4), 0, kv.get()};
  EXPECT_THROW(cpu.forward(std::span(&device_chunk, 1), false, logits), Error);

  auto foreign = other->create(AttentionSettings{}, 64);
  std::vector<SequenceChunk> mixed{device_chunk, SequenceChunk{std::span<const int32_t>(tokens).first(3), 0, foreign.get()}};
  EXPECT_THROW(gpu.forward(mixed, false, logits), Error);

  AttentionSettings quest;
  quest.algorithm = "quest";
  EXPECT_THROW(factory->validate(quest), Error);
  EXPECT_THROW(factory->create(quest, 64), Error);

  SequenceChunk gap{std::span<const int32_t>(tokens).first(2), 10, kv.get()};
  EXPECT_THROW(gpu.forward(std::span(&gap, 1), false, logits), Error);
  SequenceChunk bad_token{std::span<const int32_t>(tokens).first(2), 0, kv.get()};
  std::vector<int32_t> out_of_vocab{1, static_cast<int32_t>(c.vocab_size)};
  bad_token.tokens = out_of_vocab;
  EXPECT_THROW(gpu.forward(std::span(&bad_token, 1), false, logits), Error);

  // 40 tokens need three pages per (layer, KV head); the pool has two.
  SequenceChunk too_long{std::span<const int32_t>(tokens), 0, kv.get()};
  EXPECT_THROW(gpu.forward(std::span(&too_long, 1), false, logits), kv::PoolExhausted);
  EXPECT_EQ(kv->length(), 0);
  EXPECT_EQ(factory->usage()->device_pages_used, 0) << "a failed step kept pages";

  // The store still works, and pages come back when a sequence ends.
  ASSERT_NO_THROW(gpu.forward(std::span(&device_chunk, 1), false, logits));
  EXPECT_EQ(kv->length(), 4);
  EXPECT_EQ(factory->usage()->device_pages_used, pages_for(c, 16, 4));
  kv.reset();
  EXPECT_EQ(factory->usage()->device_pages_used, 0);

  // Shapes the kernels do not support are refused when the store is made.
  AttentionShape head_dim_16 = gpu.attention_shape();
  head_dim_16.head_dim = 16;
  CudaPagedKvConfig config;
  config.device_pages = 1024;
  config.max_context = 64;
  EXPECT_THROW(std::make_unique<CudaPagedAttentionFactory>(head_dim_16, config), Error);
  config.page_size = 12;
  EXPECT_THROW(std::make_unique<CudaPagedAttentionFactory>(gpu.attention_shape(), config), Error);
}

}  // namespace
}  // namespace spin
