#pragma once
// Next-token sampling: greedy, temperature, top-k, top-p, min-p, with a seeded RNG.
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

namespace spin {

// Temperatures below this draw greedily, as vLLM's do: 1 / temperature overflows float below
// about 1e-38, and long before that every draw is the argmax anyway.
inline constexpr float kGreedyBelowTemperature = 1e-5f;

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::optional<uint64_t> seed;

  // Throws spin::Error naming the bad field (negative temperature, top_p outside (0, 1], ...).
  void validate() const;
  bool greedy() const { return temperature < kGreedyBelowTemperature || top_k == 1; }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

// Index of the largest value (the lowest index among equals).
int32_t argmax(std::span<const float> values);

}  // namespace spin
