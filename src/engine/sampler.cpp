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
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  params_.validate();
  rng_.seed(params.seed ? *params.seed : std::random_device{}());
}

int32_t argmax(std::span<const float> values) {
  return static_cast<int32_t>(std::max_element(values.begin(), values.end()) - values.begin());
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0.0f || params_.top_k == 1) return argmax(logits);
  const int32_t vocab = static_cast<int32_t>(logits.size());

  // Candidates sorted by logit, cut by top-k first (as vLLM and llama.cpp order the filters).
  candidates_.resize(vocab);
  for (int32_t i = 0; i < vocab; ++i) candidates_[i] = {logits[i], i};
  const int32_t k = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::partial_sort(candidates_.begin(), candidates_.begin() + k, candidates_.end(), by_logit);
  candidates_.resize(k);

  // Probabilities at the temperature.
  const double inv_t = 1.0 / params_.temperature;
  const double top = candidates_[0].first;
  std::vector<double> probs(k);
  double sum = 0.0;
  for (int32_t i = 0; i < k; ++i) {
    probs[i] = std::exp((candidates_[i].first - top) * inv_t);
    sum += probs[i];
  }
  for (double& p : probs) p /= sum;

  // min-p: drop tokens below min_p times the most likely one.
  int32_t keep = k;
  if (params_.min_p > 0.0f) {
    const double floor = params_.min_p * probs[0];
    keep = static_cast<int32_t>(std::find_if(probs.begin(), probs.begin() + keep,
                                             [&](double p) { return p < floor; }) -
                                probs.begin());
  }
  // top-p: the smallest prefix whose mass reaches top_p.
  if (params_.top_p < 1.0f) {
    double mass = 0.0;
    for (int32_t i = 0; i < keep; ++i) {
      mass += probs[i];
      if (mass >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  keep = std::max(keep, 1);
  std::discrete_distribution<int32_t> pick(probs.begin(), probs.begin() + keep);
  return candidates_[pick(rng_)].second;
}

}  // namespace spin
