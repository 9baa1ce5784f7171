#pragma once
// Shared by the GPU model tests (test_cuda_model_gpu.cpp, test_tensor_parallel_gpu.cpp): the tiny
// model configs, bf16-rounded and wide-margin weights, KV pool sizing, logits comparison, and
// running requests through an Engine.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/half.h"
#include "engine/cuda/cuda_paged_attention.h"
#include "engine/engine.h"
#include "model/loader.h"

namespace spin::gpu_test {

// Qwen3-like: q/k norms, tied embeddings, n_heads * head_dim (512) != hidden (256), GQA group 4,
// head_dim 64. Llama-like: Llama-3 RoPE scaling with adjacent-pair rotation (GGUF layout), an
// untied LM head, head_dim 128, group 2. Both have 2 KV heads, so they split over 2 ranks.
inline ModelConfig small_config(bool qwen3) {
  ModelConfig c;
  c.vocab_size = 384;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.n_layers = 2;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.n_kv_heads = 2;
  c.arch = qwen3 ? "qwen3" : "llama";
  c.qk_norm = qwen3;
  c.n_heads = qwen3 ? 8 : 4;
  c.head_dim = qwen3 ? 64 : 128;
  c.max_position = qwen3 ? 4096 : 8192;
  c.rms_eps = qwen3 ? 1e-6f : 1e-5f;
  c.tie_embeddings = qwen3;
  c.rope.theta = qwen3 ? 1000000.0f : 500000.0f;
  c.rope.neox = qwen3;
  if (!qwen3) {
    c.rope.scaling = RopeScaling::Llama3;
    c.rope.factor = 8.0f;
    c.rope.original_max_position = 1024;
  }
  return c;
}

inline void round_to_bf16(std::vector<float>& v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
}

// Rounds every tensor to bf16 in place: the values the GPU model holds.
inline ModelWeights rounded_to_bf16(ModelWeights w) {
  round_to_bf16(w.tok_embd.data);
  round_to_bf16(w.out_norm);
  round_to_bf16(w.lm_head.data);
  for (LayerWeights& l : w.layers) {
    for (std::vector<float>* v : {&l.attn_norm, &l.q_norm, &l.k_norm, &l.ffn_norm, &l.wq.data, &l.wk.data, &l.wv.data,
                                  &l.wo.data, &l.w_gate.data, &l.w_up.data, &l.w_down.data}) {
      round_to_bf16(*v);
    }
  }
  return w;
}

inline ModelWeights bf16_weights(const ModelConfig& c, uint64_t seed) {
  return rounded_to_bf16(make_dummy_weights(c, seed));
}

// A model whose greedy choices have wide margins, so bf16 noise cannot flip them. Dummy layers add
// outputs of rms ~1 to embeddings of rms 1/16, which leaves the next token to near-ties among
// random logits; here the embeddings are 8x larger, so the current token's embedding stays the
// largest part of the residual stream, and the LM head row of token j gets 0.25x the embedding of
// token (7j + 3) mod vocab added. The greedy token is then the preimage of the current one, with a
// top-2 margin >= 0.6x the logits' rms (measured on the CPU reference for the seeds used here),
// while the other logits still depend on the whole context (another context changes them by about
// their rms), which the logit and log-probability comparisons check. The tests also check every
// margin against the measured GPU error instead of trusting these numbers.
inline ModelWeights wide_margin_weights(const ModelConfig& c, uint64_t seed) {
  ModelConfig untied = c;
  untied.tie_embeddings = false;
  ModelWeights w = make_dummy_weights(untied, seed);
  for (float& x : w.tok_embd.data) x *= 8.0f;
  const int64_t hidden = c.hidden_size;
  for (int64_t j = 0; j < c.vocab_size; ++j) {
    const int64_t src = (j * 7 + 3) % c.vocab_size;
    for (int64_t i = 0; i < hidden; ++i) w.lm_head.data[j * hidden + i] += 0.25f * w.tok_embd.data[src * hidden + i];
  }
  return rounded_to_bf16(std::move(w));
}

// The best logit minus the second best.
inline double top2_margin(const std::vector<float>& logits) {
  std::vector<float> sorted = logits;
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
  return sorted[0] - sorted[1];
}

inline std::ptrdiff_t count_distinct(std::vector<int32_t> tokens) {
  std::sort(tokens.begin(), tokens.end());
  return std::unique(tokens.begin(), tokens.end()) - tokens.begin();
}

// Prompts of the given lengths, their tokens uniform over the vocabulary.
inline std::vector<std::vector<int32_t>> random_prompts(std::mt19937& rng, int64_t vocab_size,
                                                        std::initializer_list<int> lengths) {
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab_size) - 1);
  std::vector<std::vector<int32_t>> prompts;
  for (const int n : lengths) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t& t : p) t = token(rng);
    prompts.push_back(p);
  }
  return prompts;
}

// Pages (one layer x KV head each) for `tokens` tokens of every sequence together; `shape` is a
// ModelConfig or an AttentionShape.
template <typename Shape>
int64_t pages_for(const Shape& shape, int64_t page_size, int64_t tokens) {
  return shape.n_layers * shape.n_kv_heads * ((tokens + page_size - 1) / page_size);
}

inline CudaPagedKvConfig paged_kv_config(int64_t page_size, int64_t device_pages, int64_t max_batch = 8,
                                         int64_t max_context = 1024) {
  CudaPagedKvConfig c;
  c.page_size = page_size;
  c.device_pages = device_pages;
  c.max_batch = max_batch;
  c.max_context = max_context;
  return c;
}

struct Comparison {
  double relative = 0.0;  // ||a - ref|| / ||ref||
  double max_abs = 0.0;
  size_t worst = 0;       // index of the largest difference
  bool finite = true;     // a holds no NaN or infinity
};

inline Comparison compare(const std::vector<float>& a, const std::vector<float>& ref) {
  Comparison r;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size() && i < a.size(); ++i) {
    if (!std::isfinite(a[i])) r.finite = false;
    const double d = static_cast<double>(a[i]) - ref[i];
    diff += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
    if (std::abs(d) > r.max_abs) {
      r.max_abs = std::abs(d);
      r.worst = i;
    }
  }
  r.relative = std::sqrt(diff / std::max(norm, 1e-30));
  return r;
}

inline std::string error_summary(const Comparison& c) {
  return "relative error " + std::to_string(c.relative) + ", max abs error " + std::to_string(c.max_abs);
}

inline std::string describe(const Comparison& c) { return error_summary(c) + (c.finite ? "" : ", NON-FINITE values"); }

// Also where the largest difference is, for logits of `vocab` per row compared with the CPU's.
inline std::string describe(const Comparison& c, int64_t vocab) {
  return error_summary(c) + " at row " + std::to_string(c.worst / vocab) + " token " + std::to_string(c.worst % vocab) +
         (c.finite ? "" : ", NON-FINITE values in the GPU logits");
}

// A chunk of a step: sequence index and its token range [begin, end).
struct Part {
  size_t seq;
  int64_t begin;
  int64_t end;
};

// A step's chunks on one model: each part's tokens of its sequence, on that sequence's KV handle
// `kv` (the member of Sequence, which also holds `tokens`, that belongs to the model).
template <typename Sequence>
std::vector<SequenceChunk> step_chunks(std::vector<Sequence>& seqs, const std::vector<Part>& parts,
                                       std::unique_ptr<SequenceKv> Sequence::*kv) {
  std::vector<SequenceChunk> chunks;
  for (const Part& p : parts) {
    Sequence& s = seqs[p.seq];
    const auto tokens = std::span<const int32_t>(s.tokens).subspan(p.begin, p.end - p.begin);
    chunks.push_back(SequenceChunk{tokens, p.begin, (s.*kv).get()});
  }
  return chunks;
}

struct EngineRun {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;  // per token: its log-probability and the 5 most likely
};

// Adds the prompts to `engine` as greedy requests (end-of-sequence ignored, top 5 logprobs), with
// attention[i] where given; their outputs collect into runs[i] (runs is sized to the prompts).
inline void add_greedy_requests(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                const std::vector<int64_t>& max_tokens, const std::vector<AttentionSettings>& attention,
                                std::vector<EngineRun>& runs) {
  runs.assign(prompts.size(), EngineRun{});
  for (size_t i = 0; i < prompts.size(); ++i) {
    RequestParams params;
    params.max_tokens = max_tokens[i];
    params.sampling.temperature = 0.0f;
    params.ignore_eos = true;
    params.top_logprobs = 5;
    if (i < attention.size()) params.attention = attention[i];
    engine.add_request(prompts[i], params, [&runs, i](const RequestOutput& o) {
      runs[i].tokens.insert(runs[i].tokens.end(), o.token_ids.begin(), o.token_ids.end());
      runs[i].logprobs.insert(runs[i].logprobs.end(), o.logprobs.begin(), o.logprobs.end());
    });
  }
}

// Runs the requests through one Engine (greedy) and returns each one's tokens by request index;
// `preempted`, where given, receives the number of preemptions; `attention`, where given, holds each
// request's attention settings; `usage`, where given, receives the store's usage after the run.
inline std::vector<EngineRun> run_engine(ForwardModel& model, std::unique_ptr<AttentionFactory> factory,
                                         const std::vector<std::vector<int32_t>>& prompts,
                                         const std::vector<int64_t>& max_tokens, int64_t* preempted = nullptr,
                                         const std::vector<AttentionSettings>& attention = {},
                                         KvStoreUsage* usage = nullptr, int64_t max_model_len = 512) {
  const AttentionFactory* store = factory.get();
  EngineConfig config;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 48;  // long prompts are prefilled in chunks beside decodes
  config.max_model_len = max_model_len;
  Engine engine(model, nullptr, config, std::move(factory));
  std::vector<EngineRun> out;
  add_greedy_requests(engine, prompts, max_tokens, attention, out);
  int64_t preemptions = 0;
  while (engine.has_work()) preemptions += engine.step().preempted;
  if (preempted) *preempted = preemptions;
  if (usage) *usage = store->usage().value_or(KvStoreUsage{});
  return out;
}

// The largest difference between two runs' log-probabilities: each token's own and its 5 most
// likely alternatives' (by rank; their values depend on every logit, so on the whole context).
inline double max_logprob_difference(const EngineRun& a, const EngineRun& b) {
  double worst = 0.0;
  for (size_t t = 0; t < a.logprobs.size() && t < b.logprobs.size(); ++t) {
    worst = std::max(worst, std::abs(static_cast<double>(a.logprobs[t].logprob) - b.logprobs[t].logprob));
    for (size_t k = 0; k < a.logprobs[t].top.size() && k < b.logprobs[t].top.size(); ++k) {
      worst = std::max(worst, std::abs(static_cast<double>(a.logprobs[t].top[k].second) - b.logprobs[t].top[k].second));
    }
  }
  return worst;
}

}  // namespace spin::gpu_test
