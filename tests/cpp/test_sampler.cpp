// Sampling filters, penalties and stop-string streaming, checked against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "base/error.h"
#include "engine/generator.h"
#include "engine/sampler.h"

namespace spin {
namespace {

std::map<int32_t, int> histogram(SamplingParams p, const std::vector<float>& logits, int draws) {
  p.seed = 1234;
  Sampler s(p);
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) ++h[s.sample(logits)];
  return h;
}

TEST(Sampler, GreedyPicksArgmax) {
  Sampler s(SamplingParams{0.0f, 0, 1.0f, 0.0f, 1});
  EXPECT_EQ(s.sample(std::vector<float>{0.1f, 3.0f, -1.0f, 2.9f}), 1);
}

TEST(Sampler, TinyTemperaturesAreGreedy) {
  // The argmax is not the last token: a draw that fell through its loop would pick the last.
  const std::vector<float> logits{0.1f, 3.0f, -1.0f, 2.9f, 0.5f};
  for (const float t : {1e-40f, 1e-38f, 1e-6f}) {
    auto h = histogram({t, 0, 1.0f, 0.0f, {}}, logits, 200);
    EXPECT_EQ(h.size(), 1u) << t;
    EXPECT_EQ(h[1], 200) << t;
  }
}

TEST(Sampler, TopKKeepsOnlyTheKLargest) {
  const std::vector<float> logits{1.0f, 5.0f, 4.0f, 0.0f, 4.5f};
  auto h = histogram({1.0f, 2, 1.0f, 0.0f, {}}, logits, 2000);
  for (auto [id, n] : h) EXPECT_TRUE(id == 1 || id == 4) << id;
  EXPECT_EQ(h.size(), 2u);
}

TEST(Sampler, TopPKeepsSmallestPrefixReachingMass) {
  // probabilities 0.5, 0.3, 0.2 (log space): top_p 0.7 keeps the first two.
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto h = histogram({1.0f, 0, 0.7f, 0.0f, {}}, logits, 4000);
  EXPECT_EQ(h.count(2), 0u);
  const double ratio = double(h[0]) / h[1];
  EXPECT_NEAR(ratio, 0.5 / 0.3, 0.25);
}

TEST(Sampler, MinPDropsUnlikelyTokens) {
  const std::vector<float> logits{std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  auto h = histogram({1.0f, 0, 1.0f, 0.2f, {}}, logits, 4000);  // floor 0.12 drops 0.1
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_GT(h[1], 0);
}

TEST(Sampler, TemperatureFollowsSoftmaxFrequencies) {
  const std::vector<float> logits{0.0f, 1.0f};
  auto h = histogram({2.0f, 0, 1.0f, 0.0f, {}}, logits, 20000);
  const double p1 = 1.0 / (1.0 + std::exp(-0.5));
  EXPECT_NEAR(h[1] / 20000.0, p1, 0.02);
}

TEST(Sampler, SameSeedSameSequence) {
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[i] = std::sin(i * 1.7f);
  SamplingParams p{1.0f, 0, 1.0f, 0.0f, 99};
  Sampler a(p), b(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler(SamplingParams{-1.0f, 0, 1.0f, 0.0f, {}}), Error);
  EXPECT_THROW(Sampler(SamplingParams{1.0f, -2, 1.0f, 0.0f, {}}), Error);
  EXPECT_THROW(Sampler(SamplingParams{1.0f, 0, 0.0f, 0.0f, {}}), Error);
  EXPECT_THROW(Sampler(SamplingParams{1.0f, 0, 1.0f, 1.5f, {}}), Error);
  EXPECT_THROW(Sampler(SamplingParams{NAN, 0, 1.0f, 0.0f, {}}), Error);
}

// Bias and penalties as OpenAI and vLLM define them, written plainly: the bias added first, then
// repetition on every token of the prompt or output, then frequency x count and presence once for
// tokens of the output.
std::vector<float> penalized_reference(std::vector<float> logits, const SamplingParams& p,
                                       const std::vector<int32_t>& prompt, const std::vector<int32_t>& output) {
  for (const auto& [id, bias] : p.logit_bias)
    if (id < static_cast<int32_t>(logits.size())) logits[id] += bias;
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(output.begin(), output.end());
  std::map<int32_t, int> count;
  for (const int32_t id : output) ++count[id];
  for (const int32_t id : seen) {
    if (id < 0 || id >= static_cast<int32_t>(logits.size())) continue;
    float& x = logits[id];
    x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    if (count.contains(id)) x -= p.frequency_penalty * count[id] + p.presence_penalty;
  }
  return logits;
}

TEST(Sampler, GreedyBiasAndPenaltiesMatchTheReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int32_t> token(-2, 40);  // a few ids outside the 37-token vocabulary
  std::uniform_real_distribution<float> penalty(-2.0f, 2.0f), repetition(0.5f, 2.0f);
  int changed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<float> logits(37);
    for (float& x : logits) x = normal(rng);
    std::vector<int32_t> prompt(trial % 7), output(trial % 11);
    for (int32_t& id : prompt) id = token(rng);
    for (int32_t& id : output) id = token(rng);
    SamplingParams p;
    p.temperature = 0.0f;
    p.repetition_penalty = trial % 3 == 0 ? 1.0f : repetition(rng);
    p.frequency_penalty = trial % 5 == 0 ? 0.0f : penalty(rng);
    p.presence_penalty = trial % 4 == 0 ? 0.0f : penalty(rng);
    if (trial % 2 == 1) {
      std::uniform_int_distribution<int32_t> id(0, 40);  // some past the vocabulary: ignored
      for (int k = 0; k < trial % 5; ++k) p.logit_bias.emplace_back(id(rng), 3.0f * penalty(rng));
    }
    Sampler s(p, prompt);
    const int32_t expected = argmax(penalized_reference(logits, p, prompt, output));
    EXPECT_EQ(s.sample(logits, output), expected) << trial;
    // Twice: the sampler's scratch is clean between draws.
    EXPECT_EQ(s.sample(logits, output), expected) << trial;
    changed += expected != argmax(logits);
  }
  EXPECT_GT(changed, 30);  // bias and penalties moved the argmax often enough to be tested
}

TEST(Sampler, PenalizedDrawsFollowThePenalizedSoftmax) {
  // Token 0 leads by 1 but occurs twice in the output: frequency 0.5 x 2 + presence 0.5 puts it
  // 0.5 behind token 1; token 2 is in the prompt only, so repetition 2 halves its logit.
  const std::vector<float> logits{1.0f, 0.0f, 0.6f};
  SamplingParams p{.temperature = 1.0f, .seed = 5};
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.5f;
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt{2}, output{0, 0};
  const std::vector<float> ref = penalized_reference(logits, p, prompt, output);
  ASSERT_FLOAT_EQ(ref[0], 0.5f - 1.5f);
  ASSERT_FLOAT_EQ(ref[2], 0.3f);
  Sampler s(p, prompt);
  std::map<int32_t, int> h;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) ++h[s.sample(logits, output)];
  double total = 0.0;
  for (const float x : ref) total += std::exp(x);
  for (int32_t id = 0; id < 3; ++id) EXPECT_NEAR(h[id] / double(draws), std::exp(ref[id]) / total, 0.015) << id;
}

TEST(Sampler, RejectsBadPenaltiesAndBias) {
  for (const auto& bad : {std::pair{-1, 1.0f}, std::pair{3, 101.0f}, std::pair{3, NAN}}) {
    SamplingParams p;
    p.logit_bias.push_back(bad);
    EXPECT_THROW(Sampler{p}, Error) << bad.first << " " << bad.second;
  }
  for (const float bad : {0.0f, -1.0f, 11.0f, NAN}) {
    SamplingParams p;
    p.repetition_penalty = bad;
    EXPECT_THROW(Sampler{p}, Error) << bad;
  }
  for (const float bad : {-2.5f, 2.5f, NAN}) {
    SamplingParams p;
    p.frequency_penalty = bad;
    EXPECT_THROW(Sampler{p}, Error) << bad;
    p.frequency_penalty = 0.0f;
    p.presence_penalty = bad;
    EXPECT_THROW(Sampler{p}, Error) << bad;
  }
}

TEST(StopMatcher, HoldsBackPartialMatchesAndCutsAtStop) {
  StopMatcher m({"END", "\n\n"});
  std::string out;
  for (const char* piece : {"Hello E", "N", "ough. Then E", "N", "D more"}) out += m.push(piece);
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(out, "Hello ENough. Then ");
}

TEST(StopMatcher, ReleasesEverythingWithoutStop) {
  StopMatcher m({"xyz"});
  std::string out = m.push("abcx");
  out += m.push("y");
  EXPECT_EQ(out, "abc");
  out += m.flush();
  EXPECT_EQ(out, "abcxy");
  EXPECT_FALSE(m.stopped());
}

}  // namespace
}  // namespace spin
