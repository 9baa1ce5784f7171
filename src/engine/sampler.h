#pragma once
// Next-token sampling: logit bias, repetition, frequency and presence penalties, then greedy or
// temperature with top-k, top-p and min-p, with a seeded RNG.
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
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
  // Added to the logits of these tokens before anything else (OpenAI's logit_bias; ids outside
  // the logits are ignored).
  std::vector<std::pair<int32_t, float>> logit_bias = {};
  // vLLM's (and OpenAI's) penalties, in vLLM's order. Repetition: the logit of each token of the
  // prompt or the output so far is divided by it where positive, multiplied where negative (1 =
  // off). Then frequency and presence: each token's logit drops by frequency x its count in the
  // output so far, and by presence once if it occurs there (0 = off).
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;

  // Throws spin::Error naming the bad field (negative temperature, top_p outside (0, 1], ...).
  void validate() const;
  bool greedy() const { return temperature < kGreedyBelowTemperature || top_k == 1; }
  // Whether the logits change before the draw (bias or penalties): the host Sampler draws then.
  bool adjusts_logits() const {
    return !logit_bias.empty() || repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

class Sampler {
 public:
  // A Sampler draws for one sequence; `prompt` is its prompt, which the repetition penalty reads.
  explicit Sampler(const SamplingParams& params, std::span<const int32_t> prompt = {});
  // The next token of the sequence whose output so far is `output` (the penalties' history; ids
  // outside the logits are ignored).
  int32_t sample(std::span<const float> logits, std::span<const int32_t> output = {});

 private:
  // The logits with bias and penalties applied (in adjusted_), or `logits` itself without them.
  std::span<const float> adjust(std::span<const float> logits, std::span<const int32_t> output);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
  std::vector<float> adjusted_;
  std::vector<uint32_t> counts_;   // per token: occurrences in the output (zero between draws)
  std::vector<uint8_t> seen_;      // per token: in the prompt or output (zero between draws)
  std::vector<int32_t> touched_;   // the tokens whose counts_ or seen_ are set
  std::vector<int32_t> prompt_tokens_;  // the prompt's distinct tokens (with a repetition penalty)
};

// Index of the largest value (the lowest index among equals).
int32_t argmax(std::span<const float> values);

}  // namespace spin
