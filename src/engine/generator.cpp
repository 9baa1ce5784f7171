#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "base/error.h"
#include "engine/engine.h"
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

GenerationResult generate(ForwardModel& model, const Tokenizer* tokenizer, std::span<const int32_t> prompt,
                          const GenerationParams& params, const std::function<void(std::string_view)>& on_text,
                          std::vector<float>* prompt_logits_out) {
  using clock = std::chrono::steady_clock;
  const ModelConfig& config = model.config();
  SPIN_CHECK(!prompt.empty(), "the prompt is empty");
  SPIN_CHECK(params.max_tokens >= 0, "max tokens must be >= 0, got {}", params.max_tokens);
  SPIN_CHECK(params.prefill_chunk > 0, "prefill chunk must be positive, got {}", params.prefill_chunk);
  SPIN_CHECK(params.max_context <= config.max_position, "max context {} is longer than the model's context length {}",
             params.max_context, config.max_position);
  const int64_t context = params.max_context > 0 ? params.max_context : config.max_position;
  const auto n_prompt = static_cast<int64_t>(prompt.size());
  SPIN_CHECK(n_prompt < context || (n_prompt == context && params.max_tokens == 0),
             "the prompt has {} tokens but the context length is {}", n_prompt, context);
  if (prompt_logits_out) *prompt_logits_out = prompt_logits(model, prompt, params.prefill_chunk);

  GenerationResult result;
  result.prompt_tokens = n_prompt;
  result.finish_reason = "length";
  const int64_t max_new = std::min(params.max_tokens, context - n_prompt);
  if (max_new == 0) return result;
  EngineConfig engine_config;
  engine_config.max_num_seqs = 1;
  engine_config.max_num_batched_tokens = params.prefill_chunk;
  engine_config.max_model_len = context;
  Engine engine(model, tokenizer, engine_config);
  RequestParams request;
  request.max_tokens = max_new;
  request.sampling = params.sampling;
  request.stop = params.stop;
  request.ignore_eos = params.ignore_eos;
  const auto t_start = clock::now();
  std::optional<clock::time_point> t_first;
  engine.add_request(std::vector<int32_t>(prompt.begin(), prompt.end()), request, [&](const RequestOutput& out) {
    if (!t_first && !out.token_ids.empty()) t_first = clock::now();
    result.output_ids.insert(result.output_ids.end(), out.token_ids.begin(),
                             out.token_ids.end() - (out.stop_token ? 1 : 0));
    result.text += out.text;
    if (on_text && !out.text.empty()) on_text(out.text);
    if (out.finished) result.finish_reason = out.finish_reason;
  });
  while (engine.has_work()) {
    const bool decoding = t_first.has_value();  // a step after the first token feeds one back
    engine.step();
    result.decode_steps += decoding;
  }
  const auto t_end = clock::now();
  result.prefill_seconds = std::chrono::duration<double>(t_first.value_or(t_end) - t_start).count();
  result.decode_seconds = std::chrono::duration<double>(t_end - t_first.value_or(t_end)).count();
  return result;
}

}  // namespace spin
