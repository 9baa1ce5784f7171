#pragma once
// Single-sequence generation (`spin generate`): one request of an Engine stepped on the calling
// thread, so sampling, stop ids, stop strings and streamed text are the server's. Also the pieces
// the engine uses (stop-string matching, the sampleable part of the logits) and the logits of
// every prompt position.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "model/forward_model.h"
#include "model/tokenizer.h"

namespace spin {

struct GenerationParams {
  int64_t max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings (not included in the output)
  bool ignore_eos = false;
  int64_t prefill_chunk = 512;    // tokens per prefill step
  int64_t max_context = 0;        // 0 = the model's trained context length
};

struct GenerationResult {
  std::vector<int32_t> output_ids;  // a final stop token left out
  std::string text;
  std::string finish_reason;  // "stop" (eos or stop string) or "length"
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;  // to the first sampled token
  double decode_seconds = 0.0;   // from the first sampled token to the last
  int64_t decode_steps = 0;      // forward passes during decode
};

// Finds stop strings in streamed text, holding back any tail that could still become one.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Feeds new text; returns what can be released now. Sets stopped() when a stop string appears
  // (the text before it is released, the stop string and anything after are dropped).
  std::string push(std::string_view text);
  // Releases the held tail at the end of generation (when no stop string completed).
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

// How many leading logits may be sampled: rows past the tokenizer's vocabulary are padding
// (Qwen3 has 151936 logits for 151669 tokens) and have no text.
int64_t sampleable_vocab(int64_t model_vocab, const Tokenizer* tokenizer);

// The logits of every prompt position, [prompt, vocab] row-major, from a dense prefill in chunks
// of `chunk` tokens (`spin generate --logits-out`).
std::vector<float> prompt_logits(ForwardModel& model, std::span<const int32_t> prompt, int64_t chunk);

// Generates from one prompt, streaming text through on_text (may be empty). prompt_logits, when
// given, receives the logits of every prompt position (a separate dense prefill).
GenerationResult generate(ForwardModel& model, const Tokenizer* tokenizer, std::span<const int32_t> prompt,
                          const GenerationParams& params, const std::function<void(std::string_view)>& on_text,
                          std::vector<float>* prompt_logits = nullptr);

}  // namespace spin
