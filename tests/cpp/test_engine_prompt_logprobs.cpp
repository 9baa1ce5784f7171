// Prompt logprobs (the completions API's echo with logprobs): each prompt token's log-probability
// given the tokens before it, from a chunked prefill that returns every position's logits.
// Reference: for each position, a forward over that prefix alone whose last row (the row every
// sampled token comes from) gives the next token's log-softmax, in double here. The tiny model
// runs in fp32 and the two paths differ only in summation order: |difference| <= 2e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine_fixture.h"

namespace spin {
namespace {

using namespace engine_test;

constexpr double kTolerance = 2e-4;

struct ReferenceLogprob {
  double logprob;           // of the prompt's next token
  std::vector<double> top;  // the most likely tokens' logprobs, descending
};

std::vector<ReferenceLogprob> reference_prompt_logprobs(const std::vector<int32_t>& prompt, size_t top_n) {
  Transformer& model = tiny().model;
  const int64_t vocab = model.config().vocab_size;
  std::vector<ReferenceLogprob> out;
  std::vector<float> logits;
  for (size_t pos = 0; pos + 1 < prompt.size(); ++pos) {
    ContiguousAttention kv(model.attention_shape(), static_cast<int64_t>(pos + 1));
    SequenceChunk chunk{std::span(prompt).first(pos + 1), 0, &kv};
    model.forward(std::span(&chunk, 1), false, logits);
    const std::vector<double> row(logits.end() - vocab, logits.end());
    const double top = *std::max_element(row.begin(), row.end());
    double sum = 0.0;
    for (double x : row) sum += std::exp(x - top);
    const double log_z = top + std::log(sum);
    ReferenceLogprob r{row[static_cast<size_t>(prompt[pos + 1])] - log_z, {}};
    std::vector<double> sorted = row;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (size_t k = 0; k < top_n; ++k) r.top.push_back(sorted[k] - log_z);
    out.push_back(std::move(r));
  }
  return out;
}

void expect_matches_reference(const std::vector<TokenLogprob>& got, const std::vector<int32_t>& prompt,
                              size_t top_n) {
  const std::vector<ReferenceLogprob> ref = reference_prompt_logprobs(prompt, top_n);
  ASSERT_EQ(got.size(), prompt.size() - 1) << "one entry per prompt token after the first";
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].id, prompt[k + 1]) << "entry " << k;
    EXPECT_NEAR(got[k].logprob, ref[k].logprob, kTolerance) << "entry " << k;
    ASSERT_EQ(got[k].top.size(), top_n) << "entry " << k;
    for (size_t j = 0; j < top_n; ++j) {
      EXPECT_NEAR(got[k].top[j].second, ref[k].top[j], kTolerance) << "entry " << k << " alternative " << j;
    }
  }
}

// Greedy, max_tokens long, with the prompt's logprobs and `top` alternatives each.
RequestParams with_prompt_logprobs(int64_t max_tokens, int top) {
  RequestParams p = greedy(max_tokens);
  p.prompt_logprobs = top;
  return p;
}

TEST(EnginePromptLogprobs, ScoresAChunkedPromptBesideAnotherRequest) {
  // max_tokens 0: the prompt is scored and nothing sampled. Its prefill takes three steps of 16
  // tokens, batched with a request that decodes, whose tokens must not change.
  std::mt19937 rng(3);
  const std::vector<int32_t> scored = random_prompt(rng, 40), other = random_prompt(rng, 25);
  EngineConfig config;
  config.max_num_seqs = 2;
  config.max_num_batched_tokens = 16;
  config.max_model_len = 128;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  const uint64_t a = engine.add_request(scored, with_prompt_logprobs(0, 3), c.callback());
  const uint64_t b = engine.add_request(other, greedy(10), c.callback());
  while (engine.has_work()) engine.step();

  EXPECT_EQ(c.finish[a], "length");
  EXPECT_TRUE(c.ids[a].empty()) << "max_tokens 0 samples nothing";
  EXPECT_EQ(c.last[a].completion_tokens, 0);
  EXPECT_EQ(c.last[a].prompt_tokens, 40);
  EXPECT_EQ(c.prompt_logprob_outputs[a], 1) << "the prompt's logprobs come in one output";
  expect_matches_reference(c.prompt_logprobs[a], scored, 3);
  EXPECT_EQ(c.ids[b], reference_greedy(other, 10));
  EXPECT_EQ(c.prompt_logprobs.count(b), 0u) << "a request that did not ask got none";
}

TEST(EnginePromptLogprobs, ComeWithTheFirstSampledToken) {
  std::mt19937 rng(4);
  const std::vector<int32_t> prompt = random_prompt(rng, 21);
  EngineConfig config;
  config.max_num_batched_tokens = 8;
  config.max_model_len = 64;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  RequestParams params = with_prompt_logprobs(5, 0);
  params.top_logprobs = 1;
  int64_t outputs_with_tokens = 0;
  const OutputCallback collect = c.callback();
  const uint64_t id = engine.add_request(prompt, params, [&](const RequestOutput& out) {
    if (!out.token_ids.empty() && outputs_with_tokens++ == 0) {
      EXPECT_FALSE(out.prompt_logprobs.empty()) << "the first token's output carries the prompt's logprobs";
    }
    collect(out);
  });
  while (engine.has_work()) engine.step();

  EXPECT_EQ(c.ids[id], reference_greedy(prompt, 5));
  EXPECT_EQ(c.prompt_logprob_outputs[id], 1);
  expect_matches_reference(c.prompt_logprobs[id], prompt, 0);
}

TEST(EnginePromptLogprobs, ComeOnceThroughPreemptionsThatRecompute) {
  // Room for one request at full length: the others are preempted and recompute their prompts,
  // whose logprobs must not be recorded or sent again.
  std::mt19937 rng(5);
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 64;
  config.kv_token_budget = 64;
  config.kv_block_tokens = 16;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(rng, 12 + i));
    ids.push_back(engine.add_request(prompts.back(), with_prompt_logprobs(30, 1), c.callback()));
  }
  while (engine.has_work()) engine.step();
  EXPECT_GT(engine.metrics().preemptions_recompute, 0u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], 30)) << "request " << i;
    EXPECT_EQ(c.prompt_logprob_outputs[ids[i]], 1) << "request " << i;
    expect_matches_reference(c.prompt_logprobs[ids[i]], prompts[i], 1);
  }
}

TEST(EnginePromptLogprobs, RefusesZeroTokensWithoutThem) {
  EngineConfig config;
  config.max_model_len = 64;
  Engine engine(tiny().model, nullptr, config);
  const std::vector<int32_t> prompt = {5, 6, 7};
  EXPECT_THROW(engine.validate_request(prompt, greedy(0)), InvalidRequest);
  RequestParams bad = greedy(1);
  bad.prompt_logprobs = -2;
  EXPECT_THROW(engine.validate_request(prompt, bad), InvalidRequest);
}

}  // namespace
}  // namespace spin
