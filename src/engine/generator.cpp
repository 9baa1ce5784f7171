#include "engine/generator.h"

#include <algorithm>

#include "base/error.h"
#include "model/contiguous_attention.h"

namespace spin {

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  held_.append(text);
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    first = std::min(first, held_.find(s));
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - (s.empty() ? 0 : 1), held_.size()); len > hold; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

int64_t sampleable_vocab(int64_t model_vocab, const Tokenizer* tokenizer) {
  return tokenizer ? std::min<int64_t>(model_vocab, tokenizer->vocab_size()) : model_vocab;
}

std::vector<float> prompt_logits(ForwardModel& model, std::span<const int32_t> prompt, int64_t chunk) {
  SPIN_CHECK(!prompt.empty(), "the prompt is empty");
  SPIN_CHECK(chunk > 0, "prefill chunk must be positive, got {}", chunk);
  const auto n_prompt = static_cast<int64_t>(prompt.size());
  ContiguousAttention kv(model.attention_shape(), n_prompt);
  std::vector<float> all, logits;
  all.reserve(static_cast<size_t>(n_prompt * model.config().vocab_size));
  for (int64_t pos = 0; pos < n_prompt; pos += chunk) {
    const int64_t n = std::min(chunk, n_prompt - pos);
    SequenceChunk piece{prompt.subspan(pos, n), pos, &kv};
    model.forward(std::span(&piece, 1), true, logits);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

}  // namespace spin
