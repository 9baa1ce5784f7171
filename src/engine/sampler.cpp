#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace spin {

void SamplingParams::validate() const {
  SPIN_CHECK(std::isfinite(temperature) && temperature >= 0.0f,
             "temperature must be >= 0, got {}", temperature);
  SPIN_CHECK(top_k >= 0, "top_k must be >= 0 (0 disables it), got {}", top_k);
  SPIN_CHECK(top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got {}", top_p);
  SPIN_CHECK(min_p >= 0.0f && min_p <= 1.0f, "min_p must be in [0, 1], got {}", min_p);
  SPIN_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f && repetition_penalty <= 10.0f,
             "repetition_penalty must be in (0, 10] (1 disables it), got {}", repetition_penalty);
  SPIN_CHECK(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
             "frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  SPIN_CHECK(presence_penalty >= -2.0f && presence_penalty <= 2.0f,
             "presence_penalty must be in [-2, 2], got {}", presence_penalty);
  for (const auto& [id, bias] : logit_bias)
    SPIN_CHECK(id >= 0 && bias >= -100.0f && bias <= 100.0f,
               "logit_bias must map token ids >= 0 to values in [-100, 100], got {} for {}", bias, id);
}

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt) : params_(params) {
  params_.validate();
  if (params_.repetition_penalty != 1.0f) {
    prompt_tokens_.assign(prompt.begin(), prompt.end());
    std::sort(prompt_tokens_.begin(), prompt_tokens_.end());
    prompt_tokens_.erase(std::unique(prompt_tokens_.begin(), prompt_tokens_.end()), prompt_tokens_.end());
  }
  rng_.seed(params.seed ? *params.seed : std::random_device{}());
}

int32_t argmax(std::span<const float> values) {
  return static_cast<int32_t>(std::max_element(values.begin(), values.end()) - values.begin());
}

std::span<const float> Sampler::adjust(std::span<const float> logits, std::span<const int32_t> output) {
  if (!params_.adjusts_logits()) return logits;
  const size_t vocab = logits.size();
  adjusted_.assign(logits.begin(), logits.end());
  const auto in_vocab = [vocab](int32_t id) { return id >= 0 && static_cast<size_t>(id) < vocab; };
  for (const auto& [id, bias] : params_.logit_bias)
    if (in_vocab(id)) adjusted_[id] += bias;
  if (params_.repetition_penalty == 1.0f && params_.frequency_penalty == 0.0f && params_.presence_penalty == 0.0f)
    return adjusted_;
  if (counts_.size() != vocab) {
    counts_.assign(vocab, 0);
    seen_.assign(vocab, 0);
  }
  touched_.clear();
  const auto touch = [&](int32_t id) {
    if (!seen_[id]) {
      seen_[id] = 1;
      touched_.push_back(id);
    }
  };
  for (const int32_t id : prompt_tokens_)
    if (in_vocab(id)) touch(id);
  for (const int32_t id : output) {
    if (!in_vocab(id)) continue;
    touch(id);
    ++counts_[id];
  }
  const float repetition = params_.repetition_penalty;
  for (const int32_t id : touched_) {
    float& logit = adjusted_[id];
    if (repetition != 1.0f) logit = logit > 0.0f ? logit / repetition : logit * repetition;
    if (counts_[id] > 0)
      logit -= params_.frequency_penalty * static_cast<float>(counts_[id]) + params_.presence_penalty;
    counts_[id] = 0;
    seen_[id] = 0;
  }
  return adjusted_;
}

int32_t Sampler::sample(std::span<const float> raw_logits, std::span<const int32_t> output) {
  const std::span<const float> logits = adjust(raw_logits, output);
  if (params_.greedy()) return argmax(logits);
  const int32_t vocab = static_cast<int32_t>(logits.size());

  // Candidates: the top-k by logit when top-k is on (filters apply in vLLM's and llama.cpp's
  // order: top-k, then min-p and top-p on the tempered distribution), else the whole vocabulary.
  candidates_.resize(vocab);
  for (int32_t i = 0; i < vocab; ++i) candidates_[i] = {logits[i], i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (params_.top_k > 0 && params_.top_k < vocab) {
    std::nth_element(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(),
                     by_logit);
    candidates_.resize(params_.top_k);
  }

  // Unnormalised probabilities at the temperature; the largest is exactly 1.
  float top = candidates_[0].first;
  for (const auto& c : candidates_) top = std::max(top, c.first);
  const float inv_t = 1.0f / params_.temperature;
  for (auto& c : candidates_) c.first = std::exp((c.first - top) * inv_t);

  // min-p: drop tokens below min_p times the most likely one.
  if (params_.min_p > 0.0f) {
    std::erase_if(candidates_, [&](const auto& c) { return c.first < params_.min_p; });
  }
  double total = 0.0;
  for (const auto& c : candidates_) total += c.first;
  // top-p: the smallest most-likely prefix whose mass reaches top_p (needs the order).
  if (params_.top_p < 1.0f) {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
    double mass = 0.0;
    size_t keep = 0;
    while (keep < candidates_.size() && mass < params_.top_p * total) mass += candidates_[keep++].first;
    candidates_.resize(std::max<size_t>(keep, 1));
    total = mass;
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double u = uniform(rng_);
  for (const auto& c : candidates_) {
    u -= c.first;
    if (u < 0.0) return c.second;
  }
  return candidates_.back().second;
}

}  // namespace spin
