// The continuous-batching engine on the tiny dummy model: every greedy output is compared with
// the plain single-sequence greedy loop (engine_fixture.h: no batching, no preemption), and the
// scheduling rules (token budget, decode first, FCFS, KV budget, abort) with what each
// step reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine/engine.h"
#include "engine_fixture.h"
#include "model/contiguous_attention.h"

namespace spin {
namespace {

using namespace engine_test;

// Steps until idle, checking the per-step invariants; returns the reports.
std::vector<StepReport> run_to_end(Engine& engine, Collector& c, int max_steps = 10000) {
  std::vector<StepReport> reports;
  while (engine.has_work()) {
    ++c.step;
    reports.push_back(engine.step());
    const StepReport& r = reports.back();
    EXPECT_LE(r.n_tokens, engine.config().max_num_batched_tokens);
    std::set<uint64_t> ids;
    for (const ScheduledChunk& ch : r.chunks) EXPECT_TRUE(ids.insert(ch.request_id).second) << "twice in one step";
    EXPECT_LE(static_cast<int64_t>(ids.size()), engine.config().max_num_seqs);
    const EngineMetrics m = engine.metrics();
    EXPECT_LE(m.kv_tokens_used, m.kv_tokens_capacity);
    if (static_cast<int>(reports.size()) > max_steps) {
      ADD_FAILURE() << "no progress after " << max_steps << " steps";
      break;
    }
  }
  return reports;
}

TEST(EngineScheduler, SixteenConcurrentGreedyRequestsEqualEachAlone) {
  std::mt19937 rng(1);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 16; ++i) {
    prompts.push_back(random_prompt(rng, 3 + (i * 7) % 40));
    lengths.push_back(6 + i % 5);
  }
  EngineConfig config;
  config.max_num_seqs = 16;
  config.max_num_batched_tokens = 64;  // prefill chunks and decode tokens share steps
  config.max_model_len = 128;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(engine.add_request(prompts[i], greedy(lengths[i]), c.callback()));
  std::vector<StepReport> reports = run_to_end(engine, c);
  // It really batched: some step ran decode tokens and prefill chunks of several requests.
  size_t widest = 0;
  bool mixed = false;
  for (const StepReport& r : reports) {
    widest = std::max(widest, r.chunks.size());
    const bool has_decode = std::any_of(r.chunks.begin(), r.chunks.end(), [](auto& ch) { return ch.n_tokens == 1; });
    const bool has_prefill = std::any_of(r.chunks.begin(), r.chunks.end(), [](auto& ch) { return ch.n_tokens > 1; });
    mixed = mixed || (has_decode && has_prefill);
  }
  EXPECT_EQ(widest, 16u);
  EXPECT_TRUE(mixed);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], lengths[i])) << "request " << i;
    EXPECT_EQ(c.finish[ids[i]], "length");
  }
  EXPECT_EQ(engine.metrics().kv_tokens_used, 0);
  EXPECT_EQ(engine.metrics().requests_running, 0);
}

TEST(EngineScheduler, TokenBudgetDecodeFirstAndChunkedPrefill) {
  std::mt19937 rng(2);
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 7;
  config.max_model_len = 96;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    prompts.push_back(random_prompt(rng, 20 + i));
    ids.push_back(engine.add_request(prompts.back(), greedy(5), c.callback()));
  }
  std::vector<StepReport> reports = run_to_end(engine, c);
  std::map<uint64_t, int64_t> prompt_len;
  for (int i = 0; i < 5; ++i) prompt_len[ids[i]] = static_cast<int64_t>(prompts[i].size());
  std::map<uint64_t, int64_t> next_pos;  // chunks of a request are consecutive
  int64_t chunked_prefills = 0;
  for (const StepReport& r : reports) {
    int64_t total = 0;
    bool seen_prefill = false;
    for (const ScheduledChunk& ch : r.chunks) {
      total += ch.n_tokens;
      EXPECT_EQ(ch.pos0, next_pos[ch.request_id]) << "request " << ch.request_id;
      next_pos[ch.request_id] = ch.pos0 + ch.n_tokens;
      const bool decode = ch.pos0 >= prompt_len[ch.request_id];
      if (!decode && ch.pos0 > 0) ++chunked_prefills;
      if (!decode) seen_prefill = true;
      EXPECT_FALSE(decode && seen_prefill) << "a decode token scheduled after a prefill chunk";
    }
    EXPECT_EQ(total, r.n_tokens);
    EXPECT_LE(total, 7);
  }
  EXPECT_GT(chunked_prefills, 0);  // prompts of 20+ tokens under a budget of 7 were split
  for (int i = 0; i < 5; ++i) EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], 5)) << "request " << i;
}

TEST(EngineScheduler, ChunkedPrefillGivesTheLogitsOfOneChunk) {
  // The forward the engine issues: a prompt split into chunks, each batched with another
  // sequence's decode token, against the prompt as one chunk alone.
  Transformer& model = tiny().model;
  std::mt19937 rng(3);
  const std::vector<int32_t> prompt = random_prompt(rng, 29);
  const std::vector<int32_t> other = random_prompt(rng, 12);
  const int64_t vocab = model.config().vocab_size;

  ContiguousAttention whole(model.attention_shape(), 64);
  std::vector<float> expected;
  SequenceChunk one{prompt, 0, &whole};
  model.forward(std::span(&one, 1), false, expected);

  ContiguousAttention split(model.attention_shape(), 64);
  ContiguousAttention other_kv(model.attention_shape(), 64);
  std::vector<float> logits;
  SequenceChunk other_prefill{other, 0, &other_kv};
  model.forward(std::span(&other_prefill, 1), false, logits);
  int64_t other_pos = static_cast<int64_t>(other.size());
  const int32_t other_token = 5;
  for (int64_t pos = 0; pos < 29; pos += 8) {
    const int64_t n = std::min<int64_t>(8, 29 - pos);
    SequenceChunk chunks[2] = {{std::span(&other_token, 1), other_pos++, &other_kv},
                               {std::span(prompt).subspan(pos, n), pos, &split}};
    model.forward(chunks, false, logits);
  }
  ASSERT_EQ(logits.size(), static_cast<size_t>(2 * vocab));
  double max_abs = 0.0, scale = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::abs(logits[vocab + i] - expected[i])));
    scale = std::max(scale, static_cast<double>(std::abs(expected[i])));
  }
  EXPECT_LE(max_abs, 1e-4 * scale) << "relative error of the chunked prefill's last logits";
}

TEST(EngineScheduler, FirstComeFirstServed) {
  std::mt19937 rng(4);
  EngineConfig config;
  config.max_num_seqs = 2;
  config.max_num_batched_tokens = 16;
  config.max_model_len = 64;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(engine.add_request(random_prompt(rng, 10), greedy(4), c.callback()));
  std::vector<StepReport> reports = run_to_end(engine, c);
  // Admission (the first chunk at position 0) happens in arrival order.
  std::vector<uint64_t> admitted;
  for (const StepReport& r : reports) {
    for (const ScheduledChunk& ch : r.chunks) {
      if (ch.pos0 == 0) admitted.push_back(ch.request_id);
    }
  }
  EXPECT_EQ(admitted, ids);
  for (size_t i = 1; i < ids.size(); ++i) {
    EXPECT_LE(c.first_token_step[ids[i - 1]], c.first_token_step[ids[i]]) << i;
  }
}

TEST(EngineScheduler, PreemptionUnderATinyKvBudgetKeepsGreedyOutput) {
  std::mt19937 rng(5);
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 64;
  config.kv_token_budget = 64;  // 4 blocks of 16: one request at full length
  config.kv_block_tokens = 16;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(rng, 12 + i));
    ids.push_back(engine.add_request(prompts.back(), greedy(30), c.callback()));
  }
  run_to_end(engine, c);
  // The contiguous store cannot swap: every preemption recomputes.
  EXPECT_GT(engine.metrics().preemptions_recompute, 0u);
  EXPECT_EQ(engine.metrics().preemptions_swap, 0u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], 30)) << "request " << i;
    EXPECT_EQ(c.finish[ids[i]], "length");
  }
  EXPECT_EQ(engine.metrics().kv_tokens_used, 0);
}

TEST(EngineScheduler, AdmitsARequestOnlyWhenItsWholePromptFits) {
  // 8 blocks of 16 tokens; prompts of 80 tokens in chunks of 16, 8 tokens out each: one request
  // (6 blocks at its largest) fits at a time. Admitting the second by its first chunk would
  // start a prefill that cannot finish: the first request's growth would preempt it, again and
  // again. It waits instead, and nothing is preempted.
  std::mt19937 rng(9);
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 16;
  config.max_model_len = 128;
  config.kv_token_budget = 128;
  config.kv_block_tokens = 16;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_prompt(rng, 80));
    ids.push_back(engine.add_request(prompts.back(), greedy(8), c.callback()));
  }
  const std::vector<StepReport> reports = run_to_end(engine, c);
  EXPECT_EQ(engine.metrics().preemptions_total(), 0u);
  // Never two requests' prefills in flight at once.
  for (const StepReport& r : reports) {
    int64_t prefilling = 0;
    for (const ScheduledChunk& ch : r.chunks) prefilling += ch.n_tokens > 1;
    EXPECT_LE(prefilling, 1);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], 8)) << "request " << i;
}

TEST(EngineScheduler, AbortFreesKvAtOnce) {
  std::mt19937 rng(6);
  EngineConfig config;
  config.max_num_seqs = 2;
  config.max_model_len = 128;
  config.kv_block_tokens = 16;
  Engine engine(tiny().model, nullptr, config);
  Collector c;
  const uint64_t a = engine.add_request(random_prompt(rng, 40), greedy(50), c.callback());
  const uint64_t b = engine.add_request(random_prompt(rng, 8), greedy(50), c.callback());
  const uint64_t waiting = engine.add_request(random_prompt(rng, 8), greedy(50), c.callback());
  for (int i = 0; i < 3; ++i) engine.step();
  EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.requests_running, 2);
  EXPECT_EQ(m.requests_waiting, 1);
  EXPECT_EQ(m.kv_tokens_used, 48 + 16);  // a: 43 tokens -> 3 blocks, b: 11 -> 1 block
  engine.abort(a);
  engine.abort(waiting);
  const StepReport r = engine.step();
  for (const ScheduledChunk& ch : r.chunks) EXPECT_NE(ch.request_id, a);
  EXPECT_EQ(c.finish[a], "abort");
  EXPECT_EQ(c.finish[waiting], "abort");
  m = engine.metrics();
  EXPECT_EQ(m.requests_running, 1);
  EXPECT_EQ(m.requests_waiting, 0);
  EXPECT_EQ(m.kv_tokens_used, 16);  // b alone: 12 tokens
  EXPECT_EQ(m.requests_aborted, 2u);
  engine.abort(b);
  engine.step();
  EXPECT_EQ(engine.metrics().kv_tokens_used, 0);
  EXPECT_FALSE(engine.has_work());
}

TEST(EngineScheduler, LoopThreadStreamsThroughQueues) {
  std::mt19937 rng(7);
  EngineConfig config;
  config.max_model_len = 64;
  // The expected outputs come first: the engine thread and the reference must not share the
  // Transformer (its activation buffers) at the same time.
  std::vector<std::vector<int32_t>> prompts, expected;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(rng, 5 + 3 * i));
    expected.push_back(reference_greedy(prompts.back(), 8));
  }
  Engine engine(tiny().model, nullptr, config);
  engine.start();
  std::vector<std::shared_ptr<OutputQueue>> queues;
  for (int i = 0; i < 4; ++i) {
    auto q = std::make_shared<OutputQueue>();
    engine.add_request(prompts[i], greedy(8), [q](const RequestOutput& o) { q->push(o); });
    queues.push_back(q);
  }
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> got;
    for (;;) {
      auto out = queues[i]->pop(std::chrono::seconds(30));
      ASSERT_TRUE(out.has_value()) << "no output within 30 s";
      got.insert(got.end(), out->token_ids.begin(), out->token_ids.end());
      EXPECT_EQ(out->completion_tokens, static_cast<int64_t>(got.size()));
      if (out->finished) break;
    }
    EXPECT_EQ(got, expected[i]);
  }
  // stop() ends a long request as aborted instead of leaving its client waiting.
  auto q = std::make_shared<OutputQueue>();
  engine.add_request(random_prompt(rng, 5), greedy(50), [q](const RequestOutput& o) { q->push(o); });
  engine.stop();
  std::string reason;
  while (auto out = q->pop(std::chrono::milliseconds(10))) reason = out->finish_reason;
  EXPECT_TRUE(reason == "abort" || reason == "length") << reason;
  EXPECT_THROW(engine.add_request(random_prompt(rng, 5), greedy(4), nullptr), EngineUnavailable);
}

TEST(EngineScheduler, RejectsBadRequestsWithTheNumbers) {
  EngineConfig config;
  config.max_model_len = 32;
  Engine engine(tiny().model, nullptr, config);
  std::mt19937 rng(8);
  try {
    engine.add_request(random_prompt(rng, 32), greedy(1), nullptr);
    ADD_FAILURE() << "a prompt filling the context was accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("32"), std::string::npos) << e.what();
  }
  try {
    engine.add_request(random_prompt(rng, 20), greedy(13), nullptr);
    ADD_FAILURE() << "max_tokens past the context was accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("33"), std::string::npos) << e.what();
  }
  EXPECT_THROW(engine.add_request({1, 512}, greedy(1), nullptr), InvalidRequest);
  EXPECT_THROW(engine.add_request({}, greedy(1), nullptr), InvalidRequest);
  RequestParams sparse = greedy(1);
  sparse.attention.algorithm = "quest";
  EXPECT_THROW(engine.add_request({1, 2, 3}, sparse, nullptr), InvalidRequest);
  EXPECT_FALSE(engine.has_work());

  EngineConfig overloaded;
  overloaded.max_model_len = 32;
  overloaded.max_num_seqs = 1;
  overloaded.max_waiting = 1;
  Engine small(tiny().model, nullptr, overloaded);
  small.add_request({5, 6}, greedy(1), nullptr);
  small.add_request({5, 6}, greedy(1), nullptr);
  EXPECT_THROW(small.add_request({5, 6}, greedy(1), nullptr), EngineUnavailable);

  EngineConfig too_small;
  too_small.max_model_len = 64;
  too_small.kv_token_budget = 32;
  EXPECT_THROW(Engine(tiny().model, nullptr, too_small), Error);
}

}  // namespace
}  // namespace spin

namespace spin {
namespace {

using namespace engine_test;

// The tiny model's contiguous KV, reported as a store whose first dense layers have a device
// pool of their own (as the GPU store's do): two pages of that pool per 16 tokens.
class DenseLayerPoolFactory final : public AttentionFactory {
 public:
  explicit DenseLayerPoolFactory(int64_t pool_pages)
      : inner_(make_contiguous_attention_factory(tiny().model.attention_shape())), pool_pages_(pool_pages) {}
  std::vector<std::string> algorithms() const override { return inner_->algorithms(); }
  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings, int64_t max_tokens) override {
    return inner_->create(settings, max_tokens);
  }
  KvDemand demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens, bool decoding,
                  int64_t block_tokens) const override {
    KvDemand d = AttentionFactory::demand(settings, tokens, max_tokens, decoding, block_tokens);
    d.dense_layer_pages = 2 * ((tokens + 15) / 16);
    return d;
  }
  KvDemand capacity() const override { return KvDemand{.dense_layer_pages = pool_pages_}; }

 private:
  std::unique_ptr<AttentionFactory> inner_;
  int64_t pool_pages_;
};

TEST(EngineScheduler, TheDenseLayersOwnPoolBoundsAdmissionAndGrowth) {
  // 20 pages of that pool hold 160 tokens: two or three of these requests at a time, never six.
  // The engine must admit, grow and preempt by it (a store that ran out of it while the engine
  // saw room once made the engine retry the same step forever), and every output stays greedy.
  constexpr int64_t kPool = 20;
  EngineConfig config;
  config.max_num_seqs = 6;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 128;
  Engine engine(tiny().model, nullptr, config, std::make_unique<DenseLayerPoolFactory>(kPool));
  std::mt19937 rng(21);
  std::vector<std::vector<int32_t>> prompts;
  Collector c;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(random_prompt(rng, 30 + 4 * i));
    ids.push_back(engine.add_request(prompts.back(), greedy(24), c.callback()));
  }
  int64_t largest = 0, most_running = 0;
  while (engine.has_work()) {
    ++c.step;
    engine.step();
    const EngineMetrics m = engine.metrics();
    largest = std::max(largest, m.kv_dense_layer_pages_reserved);
    most_running = std::max(most_running, m.requests_running);
    ASSERT_LE(m.kv_dense_layer_pages_reserved, kPool);
    ASSERT_LT(c.step, 2000) << "no progress";
  }
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(c.ids[ids[i]], reference_greedy(prompts[i], 24)) << "request " << i;
  }
  EXPECT_GT(largest, kPool / 2) << "the pool was never used: does the engine count it?";
  EXPECT_LE(most_running, 3);
  EXPECT_GT(engine.metrics().preemptions_total(), 0u) << "growth never ran into the pool";
  EXPECT_EQ(engine.metrics().kv_dense_layer_pages_reserved, 0);

  // A request the pool cannot hold even alone (60 tokens: 8 pages of 6) is refused, naming it.
  Engine small(tiny().model, nullptr, config, std::make_unique<DenseLayerPoolFactory>(6));
  try {
    small.add_request(random_prompt(rng, 40), greedy(20), nullptr);
    ADD_FAILURE() << "a request larger than the dense layers' pool was accepted";
  } catch (const InvalidRequest& e) {
    EXPECT_NE(std::string(e.what()).find("dense layers' pool"), std::string::npos) << e.what();
  }
}

// The tiny model's contiguous KV behind a store with an elastic buffer of up to kMaxBuffer pages
// per sequence (one buffered stream) whose own default is the whole buffer, as the GPU store's
// is. It tallies the buffer pages its live sequences hold.
class BufferedStoreFactory final : public AttentionFactory {
 public:
  static constexpr int64_t kMaxBuffer = 4;
  BufferedStoreFactory() : inner_(make_contiguous_attention_factory(tiny().model.attention_shape())) {}
  std::vector<std::string> algorithms() const override { return inner_->algorithms(); }
  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings, int64_t max_tokens) override {
    return std::make_unique<Kv>(inner_->create(settings, max_tokens), held_);
  }
  KvDemand capacity() const override { return KvDemand{.device_pages = 1000}; }
  int64_t buffer_streams(const AttentionSettings&) const override { return 1; }
  int64_t max_buffer_pages(const AttentionSettings&, int64_t) const override { return kMaxBuffer; }
  void set_buffer_pages(SequenceKv& kv, int64_t pages) override {
    auto& buffered = dynamic_cast<Kv&>(kv);
    held_ += pages - buffered.buffer;
    buffered.buffer = pages;
  }
  int64_t held() const { return held_; }

 private:
  struct Kv final : SequenceAttention {
    Kv(std::unique_ptr<SequenceKv> kv, int64_t& tally) : inner(std::move(kv)), held(tally) { held += buffer; }
    ~Kv() override { held -= buffer; }
    int64_t length() const override { return inner->length(); }
    void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens, float* out) override {
      dynamic_cast<SequenceAttention&>(*inner).forward(layer, pos0, n, tokens, out);
    }
    std::unique_ptr<SequenceKv> inner;
    int64_t& held;
    int64_t buffer = kMaxBuffer;
  };
  std::unique_ptr<AttentionFactory> inner_;
  int64_t held_ = 0;
};

TEST(EngineScheduler, ANewRequestsBufferIsTheEnginesNotTheStoresDefault) {
  // The engine starts an elastic buffer at 0 and grows it once the request decodes. It must tell
  // the store so even at 0: a GPU store left at its default held whole buffers the reservation
  // did not count, and ran out of pages outside the step's error handling (the engine stopped).
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 128;
  auto factory = std::make_unique<BufferedStoreFactory>();
  const BufferedStoreFactory* store = factory.get();
  Engine engine(tiny().model, nullptr, config, std::move(factory));
  std::mt19937 rng(22);
  Collector c;
  for (int i = 0; i < 4; ++i) engine.add_request(random_prompt(rng, 40 + 8 * i), greedy(8), c.callback());
  int64_t largest = 0;
  while (engine.has_work()) {
    ++c.step;
    engine.step();
    const EngineMetrics m = engine.metrics();
    ASSERT_EQ(store->held(), m.kv_buffer_pages_reserved) << "step " << c.step;
    largest = std::max(largest, m.kv_buffer_pages_reserved);
    ASSERT_LT(c.step, 500) << "no progress";
  }
  EXPECT_GT(largest, 0) << "no buffer ever grew: the check above saw only zeros";
  EXPECT_EQ(store->held(), 0);
}

// The tiny model behind a device model's counters: each forward takes at least 2 ms (a device
// wait), and decode-only forwards count as graph launches.
class CountingModel final : public ForwardModel {
 public:
  const ModelConfig& config() const override { return tiny().model.config(); }
  AttentionShape attention_shape() const override { return tiny().model.attention_shape(); }
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override {
    tiny().model.forward(chunks, all_logits, logits);
    const bool decode_only =
        std::all_of(chunks.begin(), chunks.end(), [](const SequenceChunk& c) { return c.tokens.size() == 1; });
    ++(decode_only ? stats_.graph_replays : stats_.eager_steps);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    stats_.device_wait_seconds += 0.002;
  }
  std::optional<ForwardStats> forward_stats() const override { return stats_; }

 private:
  ForwardStats stats_;
};

TEST(EngineScheduler, StepTimeByPhaseAndTheModelsForwardCounts) {
  EngineConfig config;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 32;
  config.max_model_len = 96;
  std::mt19937 rng(23);
  {
    Engine plain(tiny().model, nullptr, config);
    Collector c;
    plain.add_request(random_prompt(rng, 10), greedy(3), c.callback());
    run_to_end(plain, c);
    EXPECT_FALSE(plain.metrics().forward.has_value()) << "the CPU model has no forward counts";
    EXPECT_GT(plain.metrics().step_forward_seconds, 0.0);
  }
  CountingModel model;
  Engine engine(model, nullptr, config);
  Collector c;
  // Each output takes 1 ms to hand over: that time is the finish phase's, not the forward's.
  int64_t outputs = 0;
  const OutputCallback collect = c.callback();
  const OutputCallback slow = [&](const RequestOutput& out) {
    ++outputs;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    collect(out);
  };
  for (int i = 0; i < 3; ++i) engine.add_request(random_prompt(rng, 40 + 5 * i), greedy(6), slow);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<StepReport> reports = run_to_end(engine, c);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const EngineMetrics m = engine.metrics();
  ASSERT_TRUE(m.forward.has_value());
  const auto forwards = static_cast<int64_t>(
      std::count_if(reports.begin(), reports.end(), [](const StepReport& r) { return !r.chunks.empty(); }));
  EXPECT_EQ(m.forward->eager_steps + m.forward->graph_replays, forwards);
  EXPECT_GT(m.forward->graph_replays, 0);
  EXPECT_GT(m.forward->eager_steps, 0);
  EXPECT_GE(m.step_forward_seconds, 0.002 * static_cast<double>(forwards));
  EXPECT_GE(m.step_finish_seconds, 0.001 * static_cast<double>(outputs));
  EXPECT_GE(outputs, 3 * 6);
  EXPECT_GE(m.step_schedule_seconds, 0.0);
  EXPECT_LE(m.step_schedule_seconds + m.step_forward_seconds + m.step_finish_seconds, wall);
}

}  // namespace
}  // namespace spin
