#pragma once
// Pieces of single-sequence generation the engine and `spin generate` share: stop-string matching
// on streamed text, the sampleable part of the logits, and the logits of every prompt position.
// Generation itself (sampling, stop ids and strings, streaming) is the Engine's.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/forward_model.h"
#include "model/tokenizer.h"

namespace spin {

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

}  // namespace spin
