#include "engine/generator.h"

#include <algorithm>
#include <chrono>

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

GenerationResult generate(ForwardModel& model, const Tokenizer* tokenizer,
                          std::span<const int32_t> prompt, const GenerationParams& params,
                          const std::function<void(std::string_view)>& on_text,
                          std::vector<float>* prompt_logits) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& config = model.config();
  SPIN_CHECK(!prompt.empty(), "the prompt is empty");
  SPIN_CHECK(params.max_tokens >= 0, "max tokens must be >= 0, got {}", params.max_tokens);
  SPIN_CHECK(params.prefill_chunk > 0, "prefill chunk must be positive, got {}", params.prefill_chunk);
  SPIN_CHECK(params.max_context <= config.max_position,
             "max context {} is longer than the model's context length {}", params.max_context,
             config.max_position);
  const int64_t context = params.max_context > 0 ? params.max_context : config.max_position;
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  SPIN_CHECK(n_prompt < context || (n_prompt == context && params.max_tokens == 0),
             "the prompt has {} tokens but the context length is {}", n_prompt, context);
  const int64_t max_new = std::min(params.max_tokens, context - n_prompt);

  Sampler sampler(params.sampling);
  ContiguousAttention kv(model.attention_shape(), n_prompt + std::max<int64_t>(max_new, 1));
  GenerationResult result;
  result.prompt_tokens = n_prompt;

  // Prefill in chunks; only the last chunk's last row is needed unless all logits are asked for.
  std::vector<float> logits;
  const auto t_prefill = clock::now();
  for (int64_t pos = 0; pos < n_prompt; pos += params.prefill_chunk) {
    const int64_t n = std::min(params.prefill_chunk, n_prompt - pos);
    SequenceChunk chunk{prompt.subspan(pos, n), pos, &kv};
    model.forward(std::span(&chunk, 1), prompt_logits != nullptr, logits);
    if (prompt_logits) prompt_logits->insert(prompt_logits->end(), logits.begin(), logits.end());
  }
  result.prefill_seconds = std::chrono::duration<double>(clock::now() - t_prefill).count();
  const int64_t vocab = config.vocab_size;
  const int64_t usable = sampleable_vocab(vocab, tokenizer);
  std::span<const float> last(logits.data() + logits.size() - vocab, usable);

  StopMatcher stops(params.stop);
  std::optional<StreamDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer);
  const std::vector<int32_t> no_stop_ids;
  const std::vector<int32_t>& stop_ids = tokenizer ? tokenizer->stop_ids() : no_stop_ids;
  auto emit = [&](std::string_view text) {
    if (text.empty()) return;
    result.text.append(text);
    if (on_text) on_text(text);
  };

  result.finish_reason = "length";
  const auto t_decode = clock::now();
  std::vector<float> step_logits(last.begin(), last.end());
  for (int64_t i = 0; i < max_new; ++i) {
    const int32_t id = sampler.sample(step_logits);
    const bool is_stop_id = std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end() ||
                            (!tokenizer && id == config.eos_token_id);
    if (is_stop_id && !params.ignore_eos) {
      result.finish_reason = "stop";
      break;
    }
    result.output_ids.push_back(id);
    if (decoder) {
      emit(stops.push(decoder->push(id)));
      if (stops.stopped()) {
        result.finish_reason = "stop";
        break;
      }
    }
    if (i + 1 == max_new) break;
    const int32_t token = id;
    SequenceChunk chunk{std::span(&token, 1), n_prompt + i, &kv};
    model.forward(std::span(&chunk, 1), false, logits);
    ++result.decode_steps;
    step_logits.assign(logits.begin(), logits.begin() + usable);
  }
  if (decoder && !stops.stopped()) {
    emit(stops.push(decoder->flush()));
    if (!stops.stopped()) emit(stops.flush());
  }
  result.decode_seconds = std::chrono::duration<double>(clock::now() - t_decode).count();
  return result;
}

}  // namespace spin
