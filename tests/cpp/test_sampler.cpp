// Sampling filters and stop-string streaming, checked against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
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
