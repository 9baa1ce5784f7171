#pragma once
// The serving engine: continuous batching at iteration level. Each step schedules running
// requests' decode tokens first, then prefill chunks (partially prefilled requests, then waiting
// ones, first come first served) within a token budget, and runs them as ONE batched forward.
// KV is admitted by what the attention factory says each request holds: blocks of a token budget
// (contiguous dense attention) or device- and host-tier pages (paged sparse attention: the
// prefill's pages, then the decode working set on the device and the full KV on the host). Paged
// requests' elastic buffers grow into free device pages and shrink to make room. When a running
// request cannot grow even so, the most recently arrived running request is preempted: by swap
// (its device pages freed, its KV kept in the host tier, resumed later without recompute) when
// device pages are short and its KV is in the host tier, by recompute (its KV freed) otherwise.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine/attention_factory.h"
#include "engine/generator.h"
#include "engine/metrics.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"
#include "model/forward_model.h"

namespace spin {

struct EngineConfig {
  int64_t max_num_seqs = 16;             // requests running at once
  int64_t max_num_batched_tokens = 2048; // tokens per step (decode + prefill chunks)
  int64_t max_model_len = 0;             // prompt + output limit; 0 = the model's context length
  // KV tokens all running requests may hold together; 0 = max_num_seqs * max_model_len, capped by
  // what 40% of usable memory holds (never below max_model_len).
  int64_t kv_token_budget = 0;
  int64_t kv_block_tokens = 16;          // accounting granularity (a page)
  int64_t max_waiting = 256;             // add_request refuses more queued requests (overload)
  // Paged stores: grow decoding requests' KV buffers into free device pages and shrink them (down
  // to the working set) to admit or grow a request. false: each keeps the factory's largest
  // buffer from admission on.
  bool elastic_kv_buffers = true;
  int threads = 0;                       // CPU threads of the loop thread's kernels; 0 = default
};

struct RequestParams {
  // Tokens to sample, counting a final stop token; 0 (only with prompt_logprobs): none, the
  // request ends after its prefill.
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings (removed from the text)
  bool ignore_eos = false;
  AttentionSettings attention;
  // >= 0: report each sampled token's log-probability (of the model's distribution, before
  // temperature and filters) and this many most likely alternatives. -1: off.
  int top_logprobs = -1;
  // >= 0: also each prompt token's log-probability given the tokens before it (from the second
  // token on) and this many alternatives; the prefill then computes every position's logits.
  int prompt_logprobs = -1;
};

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// One streamed update of a request. The last one has finished set.
struct RequestOutput {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;  // tokens sampled in this step
  // With top_logprobs >= 0: one entry per sampled token except a final stop token.
  std::vector<TokenLogprob> logprobs;
  // With prompt_logprobs >= 0, in the request's first output that has any: prompt tokens 1.. in
  // order (token 0 has none).
  std::vector<TokenLogprob> prompt_logprobs;
  std::string text;                // new text (whole UTF-8 characters, stop strings removed)
  bool finished = false;
  std::string finish_reason;       // when finished: "stop", "length", "abort" or "error"
  bool stop_token = false;         // finished by a stop token: the last of token_ids, without text
  std::string error;               // message when finish_reason is "error"
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;   // tokens sampled so far
  // Final output of a paged request: device-tier hits and misses of its retrieves (since its
  // last admission; a recomputed request starts again).
  uint64_t kv_hits = 0;
  uint64_t kv_misses = 0;
};

using OutputCallback = std::function<void(const RequestOutput&)>;

// A thread-safe queue: the engine thread pushes a request's outputs, a server thread waits.
template <typename T>
class BlockingQueue {
 public:
  void push(T item) {
    {
      std::lock_guard lock(mutex_);
      items_.push_back(std::move(item));
    }
    ready_.notify_one();
  }
  // The next item, or nothing after `timeout`.
  std::optional<T> pop(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!ready_.wait_for(lock, timeout, [&] { return !items_.empty(); })) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<T> items_;
};

using OutputQueue = BlockingQueue<RequestOutput>;

// What one step ran (for tests and logs).
struct ScheduledChunk {
  uint64_t request_id = 0;
  int64_t pos0 = 0;      // position of the chunk's first token
  int64_t n_tokens = 0;
  bool samples = false;  // the chunk reaches the end of the request's tokens: a token is sampled
};

struct StepReport {
  std::vector<ScheduledChunk> chunks;
  int64_t n_tokens = 0;
  int64_t preempted = 0;
};

// Thrown by add_request when the engine cannot take more work (overload, or it stopped).
class EngineUnavailable : public Error {
 public:
  using Error::Error;
};

// Thrown by add_request and the validate_* calls when the request itself is at fault (its prompt,
// limits, sampling or attention settings); the message names the problem with the numbers.
class InvalidRequest : public Error {
 public:
  using Error::Error;
};

// The log-probability of `id` under softmax(logits) and the top_n most likely tokens.
TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int top_n);

class Engine {
 public:
  // tokenizer may be null (dummy weights): no text, eos from the model config.
  // factory: null = dense contiguous attention.
  Engine(ForwardModel& model, const Tokenizer* tokenizer, const EngineConfig& config,
         std::unique_ptr<AttentionFactory> factory = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // The configuration with defaults resolved.
  const EngineConfig& config() const { return config_; }
  std::vector<std::string> algorithms() const { return factory_->algorithms(); }
  const ModelConfig& model_config() const { return model_.config(); }
  // Throws InvalidRequest when requests with these attention settings would be refused.
  void validate_attention(const AttentionSettings& settings) const;
  // Throws InvalidRequest when add_request would refuse this request.
  void validate_request(std::span<const int32_t> prompt, const RequestParams& params) const;

  // Validates and queues a request; on_output runs on the engine thread for every update.
  // Throws InvalidRequest for a bad request and EngineUnavailable when overloaded or stopped.
  // Thread-safe.
  uint64_t add_request(std::vector<int32_t> prompt, const RequestParams& params,
                       OutputCallback on_output);
  // Ends a request at the next step boundary, freeing its KV; it gets a final "abort" output.
  // Unknown or finished ids are ignored. Thread-safe.
  void abort(uint64_t request_id);

  // One iteration. Call from one thread only: the loop thread after start(), or a test.
  StepReport step();
  // Requests queued, waiting or running.
  bool has_work() const;

  // The loop on its own thread; stop() ends it and aborts whatever is left.
  void start();
  void stop();
  // False once a step failed (the engine then fails every request).
  bool alive() const { return alive_; }

  EngineMetrics metrics() const;

 private:
  struct Request;
  using clock = std::chrono::steady_clock;

  // The checks of validate_request, throwing spin::Error.
  void check_request(std::span<const int32_t> prompt, const RequestParams& params) const;
  void take_incoming(std::vector<std::pair<OutputCallback, RequestOutput>>& outputs);
  bool reserve_kv(Request& r, int64_t tokens, bool decoding);
  KvDemand kv_after(const Request& r, int64_t tokens, bool decoding) const;
  KvDemand shortfall(const Request& r, int64_t tokens, bool decoding) const;
  // Where r's prefill ends (tokens past it run one per step), whether its next chunk is one token,
  // and the tokens of r to run this step within `budget` (0: none now).
  int64_t prefill_end(const Request& r) const;
  bool runs_alone(const Request& r) const;
  int64_t chunk_tokens(const Request& r, int64_t budget) const;
  void settle_kv(Request& r);
  // Elastic buffers (EngineConfig::elastic_kv_buffers).
  void resize_buffer(Request& r, int64_t pages);
  bool make_room(Request& r, int64_t tokens, bool decoding);
  bool shrink_buffers(int64_t device_pages);
  void grow_buffers();
  void free_kv(Request& r);
  void preempt(Request& r, bool swap);
  bool drop_swapped();
  void finish(Request& r, const std::string& reason, RequestOutput& out);
  // Records r's prompt logprobs from the logits of its chunk of n tokens at r.computed (one row
  // each).
  void record_prompt_logprobs(Request& r, const float* logits, int64_t n);
  // Appends r's next token: `drawn` where the model drew it on its device, else sampled here from
  // the logits (which also give its logprobs when asked for).
  void sample_next(Request& r, std::span<const float> logits, std::optional<int32_t> drawn, RequestOutput& out);
  void end_all(const std::string& reason, const std::string& error);
  void update_gauges();
  void loop();

  ForwardModel& model_;
  const Tokenizer* tokenizer_;
  EngineConfig config_;
  std::unique_ptr<AttentionFactory> factory_;
  std::vector<int32_t> stop_ids_;
  int64_t sampleable_vocab_ = 0;  // leading logits that may be sampled (see sampleable_vocab)
  int64_t kv_blocks_total_ = 0;
  // KV held by all requests and what the stores can hold (blocks: the contiguous store's
  // budget; pages: the paged store's pools, from the factory).
  KvDemand kv_used_;
  KvDemand kv_capacity_;

  // Owned by the stepping thread.
  std::map<uint64_t, std::unique_ptr<Request>> requests_;
  std::vector<Request*> running_;  // ascending id (arrival order)
  std::deque<Request*> waiting_;   // ascending id
  std::vector<float> logits_;
  std::vector<int32_t> drawn_;  // tokens the model drew on its device this step (samples_on_device)

  // Shared with other threads.
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::unique_ptr<Request>> incoming_;
  std::vector<uint64_t> aborts_;
  uint64_t next_id_ = 1;
  int64_t queued_ = 0;  // requests added and not finished
  bool stopping_ = false;
  std::atomic<bool> alive_{true};
  std::thread thread_;
  mutable std::mutex metrics_mutex_;
  EngineMetrics metrics_;
};

}  // namespace spin
