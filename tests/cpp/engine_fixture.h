#pragma once
// What the engine tests share: the tiny dummy model, random prompts, greedy request parameters,
// an output collector, and the reference every batched output is compared with: a plain greedy
// loop over one sequence with dense contiguous attention (no engine, no batching, no preemption).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/transformer.h"

namespace spin::engine_test {

struct TinyModel {
  ModelWeights weights = make_dummy_weights(preset_config("tiny-llama"), 11);
  Transformer model{weights};
};

// One instance for every test: the model is read-only, but its activation buffers are not shared
// across threads (an engine thread and the reference must not run at the same time).
inline TinyModel& tiny() {
  static TinyModel m;
  return m;
}

inline std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int32_t> id(3, 511);  // not bos/eos
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = id(rng);
  return p;
}

// Greedy with a fixed length (end-of-sequence ignored), so every token is compared.
inline RequestParams greedy(int64_t max_tokens, const AttentionSettings& attention = {}) {
  RequestParams p;
  p.max_tokens = max_tokens;
  p.sampling.temperature = 0.0f;
  p.ignore_eos = true;
  p.attention = attention;
  return p;
}

// Changes a step's logits given the prompt and the output so far (the reference's penalties).
using LogitAdjust = std::function<void(std::vector<float>& logits, const std::vector<int32_t>& prompt,
                                       const std::vector<int32_t>& output)>;

// The reference: prefill the prompt, then take the most likely token (the lowest id among equal
// logits, after `adjust` where given) and feed it back, max_tokens times.
inline std::vector<int32_t> reference_greedy(const std::vector<int32_t>& prompt, int64_t max_tokens,
                                             const LogitAdjust& adjust = {}) {
  Transformer& model = tiny().model;
  const int64_t vocab = model.config().vocab_size;
  ContiguousAttention kv(model.attention_shape(), static_cast<int64_t>(prompt.size()) + max_tokens);
  std::vector<float> logits;
  SequenceChunk chunk{prompt, 0, &kv};
  model.forward(std::span(&chunk, 1), false, logits);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_tokens; ++i) {
    std::vector<float> last(logits.end() - vocab, logits.end());
    if (adjust) adjust(last, prompt, out);
    out.push_back(static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
    if (i + 1 == max_tokens) break;
    SequenceChunk next{std::span(&out.back(), 1), static_cast<int64_t>(prompt.size()) + i, &kv};
    model.forward(std::span(&next, 1), false, logits);
  }
  return out;
}

// Collects every request's outputs (callbacks run on the stepping thread).
struct Collector {
  std::map<uint64_t, std::vector<int32_t>> ids;
  std::map<uint64_t, std::string> finish;
  std::map<uint64_t, RequestOutput> last;  // the final output of each request
  std::map<uint64_t, int64_t> first_token_step;
  std::map<uint64_t, std::vector<TokenLogprob>> prompt_logprobs;
  std::map<uint64_t, int64_t> prompt_logprob_outputs;  // outputs that carried any
  int64_t step = 0;  // advanced by the test before each Engine::step
  OutputCallback callback() {
    return [this](const RequestOutput& out) {
      if (!out.prompt_logprobs.empty()) {
        auto& p = prompt_logprobs[out.request_id];
        p.insert(p.end(), out.prompt_logprobs.begin(), out.prompt_logprobs.end());
        ++prompt_logprob_outputs[out.request_id];
      }
      auto& v = ids[out.request_id];
      if (v.empty() && !out.token_ids.empty()) first_token_step[out.request_id] = step;
      v.insert(v.end(), out.token_ids.begin(), out.token_ids.end());
      if (out.finished) {
        finish[out.request_id] = out.finish_reason;
        last[out.request_id] = out;
      }
    };
  }
};

}  // namespace spin::engine_test
