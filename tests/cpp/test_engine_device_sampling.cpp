// The Engine's path for models that draw tokens on their device (ForwardModel::forward_sampled),
// on the CPU with a stand-in model: the tiny Transformer's logits and a draw rule the test knows.
// Greedy rows take the argmax, so their tokens must be the plain greedy loop's; other rows take a
// token that depends only on (seed, step), so the tokens show that the Engine passes each
// request's own seed and counts its draws 0, 1, 2, ... whatever it is batched with. Logit rows
// come down only for requests that want logprobs or penalties and draw in that step; every other
// row is NaN, so an Engine that read one would put NaN in a logprob or a penalized draw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "engine/engine.h"
#include "engine_fixture.h"

namespace spin {
namespace {

using namespace engine_test;

// The draw of a non-greedy row: a function of (seed, step) alone.
int32_t keyed_draw(uint64_t seed, uint64_t step, int64_t vocab) {
  return static_cast<int32_t>((seed * 2654435761ull + step * 40503ull + 17) % static_cast<uint64_t>(vocab));
}

class DeviceDrawingModel final : public ForwardModel {
 public:
  explicit DeviceDrawingModel(Transformer& model) : model_(model) {}
  const ModelConfig& config() const override { return model_.config(); }
  AttentionShape attention_shape() const override { return model_.attention_shape(); }
  void forward(std::span<const SequenceChunk>, bool, std::vector<float>&) override {
    ADD_FAILURE() << "the Engine asked for logits from a model that draws on its device";
  }
  bool samples_on_device() const override { return true; }
  void forward_sampled(std::span<const SequenceChunk> chunks, std::span<const DeviceSampling> sampling, int64_t vocab,
                       std::span<const int64_t> logit_rows, std::vector<float>& logits,
                       std::vector<int32_t>& tokens) override {
    EXPECT_EQ(sampling.size(), chunks.size());
    EXPECT_EQ(vocab, config().vocab_size);
    model_.forward(chunks, false, all_);
    tokens.clear();
    const int64_t width = config().vocab_size;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const std::span<const float> row(all_.data() + i * width, static_cast<size_t>(vocab));
      tokens.push_back(sampling[i].temperature == 0.0f
                           ? static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin())
                           : keyed_draw(sampling[i].seed, sampling[i].step, vocab));
    }
    EXPECT_TRUE(std::is_sorted(logit_rows.begin(), logit_rows.end()));
    if (!logit_rows.empty()) {
      logits.assign(all_.size(), std::numeric_limits<float>::quiet_NaN());
      for (const int64_t r : logit_rows) {
        std::copy_n(all_.begin() + r * width, width, logits.begin() + r * width);
      }
    }
    ++steps;
    logit_downloads += !logit_rows.empty();
    rows_downloaded += static_cast<int64_t>(logit_rows.size());
    rows_drawn += static_cast<int64_t>(chunks.size());
  }

  int64_t steps = 0;
  int64_t logit_downloads = 0;  // steps that sent any logit row
  int64_t rows_downloaded = 0;
  int64_t rows_drawn = 0;

 private:
  Transformer& model_;
  std::vector<float> all_;
};

TEST(EngineDeviceSampling, SeedsStepsAndLogitsReachTheModel) {
  DeviceDrawingModel model(tiny().model);
  const int64_t vocab = model.config().vocab_size;
  std::mt19937 rng(5);
  const std::vector<std::vector<int32_t>> prompts = {random_prompt(rng, 30), random_prompt(rng, 7),
                                                     random_prompt(rng, 55), random_prompt(rng, 12)};
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 16;  // chunked prefills beside decodes: rows that draw nothing
  config.max_model_len = 128;
  Engine engine(model, nullptr, config);
  Collector c;
  RequestParams keyed = greedy(9);
  keyed.sampling.temperature = 0.8f;
  keyed.sampling.top_p = 0.9f;
  RequestParams nearly_greedy = greedy(12);
  nearly_greedy.sampling.temperature = 1e-30f;  // below kGreedyBelowTemperature: drawn as greedy
  std::vector<RequestParams> params = {nearly_greedy, keyed, keyed, greedy(6)};
  params[1].sampling.seed = 41;
  params[2].sampling.seed = 977;
  params[3].top_logprobs = 2;  // the only request that wants logprobs, and it finishes first
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(engine.add_request(prompts[i], params[i], c.callback()));
  int64_t steps_with_logprobs = 0;
  while (engine.has_work()) {
    const bool wants = c.finish.count(ids[3]) == 0;
    engine.step();
    steps_with_logprobs += wants;
  }

  EXPECT_EQ(c.ids[ids[0]], reference_greedy(prompts[0], 12));
  EXPECT_EQ(c.ids[ids[3]], reference_greedy(prompts[3], 6));
  for (size_t i : {size_t{1}, size_t{2}}) {
    std::vector<int32_t> expect;
    for (uint64_t step = 0; step < 9; ++step) expect.push_back(keyed_draw(*params[i].sampling.seed, step, vocab));
    EXPECT_EQ(c.ids[ids[i]], expect) << "request " << i << ": its draws were not keyed by its seed and draw count";
  }
  // Logits came down only while request 3 ran (it drew in some of those steps, not all: its
  // prefill took several).
  EXPECT_GT(model.logit_downloads, 0);
  EXPECT_LE(model.logit_downloads, steps_with_logprobs);
  EXPECT_LT(model.logit_downloads, model.steps);
  EXPECT_EQ(model.rows_downloaded, model.logit_downloads) << "a step sent more rows than request 3's";
  const std::vector<TokenLogprob>& lp = c.last[ids[3]].logprobs;
  ASSERT_FALSE(c.last[ids[3]].token_ids.empty());
  ASSERT_FALSE(lp.empty());
  EXPECT_EQ(lp.back().id, c.last[ids[3]].token_ids.back());
  EXPECT_EQ(lp.back().top.size(), 2u);
  EXPECT_EQ(lp.back().top.front().first, lp.back().id) << "a greedy token is its own most likely";
  for (const TokenLogprob& t : lp) EXPECT_TRUE(std::isfinite(t.logprob)) << "a logprob read a row never sent";
  EXPECT_TRUE(c.last[ids[0]].logprobs.empty());
}

TEST(EngineDeviceSampling, PenalizedRequestsDrawOnTheHost) {
  // The device draws without penalties: a request with them gets its row's logits and the host
  // Sampler's draw, batched with one the device draws. Reference: the greedy loop with vLLM's
  // penalties written out here.
  DeviceDrawingModel model(tiny().model);
  const int64_t vocab = model.config().vocab_size;
  std::mt19937 rng(8);
  const std::vector<int32_t> prompt = random_prompt(rng, 20), other = random_prompt(rng, 9);
  RequestParams penalized = greedy(24);
  penalized.sampling.repetition_penalty = 1.6f;
  penalized.sampling.frequency_penalty = 0.9f;
  penalized.sampling.presence_penalty = 0.4f;
  RequestParams keyed = greedy(24);
  keyed.sampling.temperature = 1.0f;
  keyed.sampling.seed = 3;
  EngineConfig config;
  config.max_num_seqs = 2;
  config.max_model_len = 128;
  Engine engine(model, nullptr, config);
  Collector c;
  const uint64_t a = engine.add_request(prompt, penalized, c.callback());
  const uint64_t b = engine.add_request(other, keyed, c.callback());
  while (engine.has_work()) engine.step();

  const SamplingParams& p = penalized.sampling;
  const auto adjust = [&p](std::vector<float>& logits, const std::vector<int32_t>& prompt_ids,
                           const std::vector<int32_t>& output) {
    std::vector<int> count(logits.size(), 0);
    std::vector<bool> seen(logits.size(), false);
    for (const int32_t id : prompt_ids) seen[id] = true;
    for (const int32_t id : output) seen[id] = true, ++count[id];
    for (size_t id = 0; id < logits.size(); ++id) {
      if (!seen[id]) continue;
      logits[id] = logits[id] > 0 ? logits[id] / p.repetition_penalty : logits[id] * p.repetition_penalty;
      if (count[id] > 0) logits[id] -= p.frequency_penalty * count[id] + p.presence_penalty;
    }
  };
  const std::vector<int32_t> expect = reference_greedy(prompt, 24, adjust);
  EXPECT_EQ(c.ids[a], expect);
  EXPECT_NE(expect, reference_greedy(prompt, 24)) << "the penalties changed nothing: the test would not see them";
  std::vector<int32_t> keyed_expect;
  for (uint64_t step = 0; step < 24; ++step) keyed_expect.push_back(keyed_draw(3, step, vocab));
  EXPECT_EQ(c.ids[b], keyed_expect);
  EXPECT_EQ(model.logit_downloads, model.steps) << "every step drew a penalized token";
  EXPECT_EQ(model.rows_downloaded, model.steps) << "the keyed request's row came down too";
  EXPECT_EQ(model.rows_drawn, 2 * model.steps);
}

}  // namespace
}  // namespace spin
