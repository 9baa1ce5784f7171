#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "base/error.h"
#include "base/memory.h"
#include "kernels/cpu/ops.h"
#include "kv/page_pool.h"

namespace spin {

struct Engine::Request {
  uint64_t id = 0;
  std::vector<int32_t> tokens;  // prompt, then sampled tokens that will be fed back
  int64_t n_prompt = 0;
  int64_t max_len = 0;          // KV capacity: prompt + max_tokens
  RequestParams params;
  OutputCallback on_output;
  Sampler sampler;
  uint64_t seed = 0;  // of its draws on a model's device (the request's seed, else a random one)
  StopMatcher stops;
  std::optional<StreamDecoder> decoder;
  std::unique_ptr<SequenceKv> kv;
  int64_t computed = 0;   // tokens whose KV is stored
  KvDemand kv_reserved;  // KV reserved in the engine's accounting
  KvDemand kv_settled;   // what it holds once this step's forward is done
  bool decoding = false; // the reservation is a decode working set (and holds the buffer)
  bool swapped = false;  // preempted by swap: waiting with its KV in the host tier
  int64_t buffer_pages = 0;      // elastic buffer, pages per buffered stream
  int64_t max_buffer_pages = 0;  // the factory's largest useful buffer for this request
  int64_t buffer_streams = 0;
  int64_t n_sampled = 0;
  // With prompt_logprobs: those of prompt positions [0, prompt_logprobs_done) (each the next
  // token's), kept until the prefill ends; a recomputed prefill does not record them again.
  std::vector<TokenLogprob> prompt_logprobs;
  int64_t prompt_logprobs_done = 0;
  clock::time_point arrival;
  clock::time_point last_token;

  Request(std::vector<int32_t> prompt, const RequestParams& p, OutputCallback cb)
      : tokens(std::move(prompt)),
        n_prompt(static_cast<int64_t>(tokens.size())),
        max_len(n_prompt + p.max_tokens),
        params(p),
        on_output(std::move(cb)),
        sampler(p.sampling, tokens),
        seed(p.sampling.seed ? *p.sampling.seed : std::random_device{}()),
        stops(p.stop) {}
};

TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int top_n) {
  const float top = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - top);
  const double log_z = top + std::log(sum);
  TokenLogprob t;
  t.id = id;
  t.logprob = static_cast<float>(logits[id] - log_z);
  const size_t n = std::min(static_cast<size_t>(std::max(top_n, 0)), logits.size());
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (size_t i = 0; i < n; ++i) t.top.emplace_back(order[i], static_cast<float>(logits[order[i]] - log_z));
  return t;
}

Engine::Engine(ForwardModel& model, const Tokenizer* tokenizer, const EngineConfig& config,
               std::unique_ptr<AttentionFactory> factory)
    : model_(model), tokenizer_(tokenizer), config_(config), factory_(std::move(factory)) {
  const ModelConfig& mc = model.config();
  if (!factory_) factory_ = make_contiguous_attention_factory(model.attention_shape());
  SPIN_CHECK(config_.max_num_seqs > 0, "--max-num-seqs must be positive, got {}", config_.max_num_seqs);
  SPIN_CHECK(config_.max_num_batched_tokens > 0, "--max-num-batched-tokens must be positive, got {}",
             config_.max_num_batched_tokens);
  SPIN_CHECK(config_.kv_block_tokens > 0, "KV block size must be positive, got {}",
             config_.kv_block_tokens);
  SPIN_CHECK(config_.max_waiting >= 0, "the waiting limit must be >= 0, got {}", config_.max_waiting);
  SPIN_CHECK(config_.max_model_len >= 0, "--max-model-len must be >= 0, got {}", config_.max_model_len);
  if (config_.max_model_len == 0) config_.max_model_len = mc.max_position;
  SPIN_CHECK(config_.max_model_len > 1, "the context length must be > 1, got {}", config_.max_model_len);
  SPIN_CHECK(config_.max_model_len <= mc.max_position || mc.max_position <= 0,
             "--max-model-len {} exceeds the model's context length {}", config_.max_model_len,
             mc.max_position);
  const int64_t block = config_.kv_block_tokens;
  const int64_t min_blocks = (config_.max_model_len + block - 1) / block;
  if (config_.kv_token_budget == 0) {
    const int64_t per_token = kv_bytes_per_token(model.attention_shape());
    const int64_t by_memory =
        static_cast<int64_t>(usable_memory_bytes() * 2 / 5) / std::max<int64_t>(per_token, 1);
    const int64_t wanted = config_.max_num_seqs * config_.max_model_len;
    config_.kv_token_budget = std::max(std::min(wanted, by_memory), min_blocks * block);
  }
  kv_blocks_total_ = config_.kv_token_budget / block;
  SPIN_CHECK(kv_blocks_total_ >= min_blocks,
             "the KV budget of {} tokens cannot hold one request of --max-model-len {} tokens",
             config_.kv_token_budget, config_.max_model_len);
  if (tokenizer_) {
    stop_ids_ = tokenizer_->stop_ids();
  } else if (mc.eos_token_id >= 0) {
    stop_ids_ = {mc.eos_token_id};
  }
  kv_capacity_ = factory_->capacity();
  kv_capacity_.blocks = kv_blocks_total_;
  metrics_.kv_tokens_capacity = kv_blocks_total_ * block;
  metrics_.kv_store = factory_->usage();
  sampleable_vocab_ = sampleable_vocab(mc.vocab_size, tokenizer_);
}

Engine::~Engine() { stop(); }

namespace {

// Runs checks of a request; their spin::Error becomes InvalidRequest (the request is at fault).
template <typename Checks>
void as_invalid_request(const Checks& checks) {
  try {
    checks();
  } catch (const InvalidRequest&) {
    throw;
  } catch (const Error& e) {
    throw InvalidRequest(e.what());
  }
}

}  // namespace

void Engine::validate_attention(const AttentionSettings& settings) const {
  as_invalid_request([&] { factory_->validate(settings); });
}

void Engine::validate_request(std::span<const int32_t> prompt, const RequestParams& params) const {
  as_invalid_request([&] { check_request(prompt, params); });
}

void Engine::check_request(std::span<const int32_t> prompt, const RequestParams& params) const {
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  const int64_t context = config_.max_model_len;
  const int64_t vocab = model_.config().vocab_size;
  SPIN_CHECK(n_prompt > 0, "the prompt is empty");
  for (int32_t id : prompt) {
    SPIN_CHECK(id >= 0 && id < vocab, "prompt token id {} is outside the vocabulary (0..{})", id,
               vocab - 1);
  }
  SPIN_CHECK(params.prompt_logprobs >= -1 && params.top_logprobs >= -1, "logprobs counts must be -1 (off) or more");
  SPIN_CHECK(params.max_tokens >= 1 || (params.max_tokens == 0 && params.prompt_logprobs >= 0),
             "max_tokens must be at least 1 (0 only with prompt logprobs), got {}", params.max_tokens);
  SPIN_CHECK(n_prompt < context,
             "the prompt has {} tokens but the context length is {} (the prompt must leave room "
             "for at least one generated token)",
             n_prompt, context);
  SPIN_CHECK(n_prompt + params.max_tokens <= context,
             "the prompt has {} tokens and max_tokens is {}: {} in all, past the context length {}",
             n_prompt, params.max_tokens, n_prompt + params.max_tokens, context);
  params.sampling.validate();
  factory_->validate(params.attention);
  SPIN_CHECK(!factory_->single_token_is_decode(params.attention) || config_.max_num_batched_tokens >= 3,
             "attention '{}' prefills in chunks of 2 or more tokens that never leave the prompt's last token "
             "alone, which needs --max-num-batched-tokens >= 3 (it is {})",
             params.attention.algorithm, config_.max_num_batched_tokens);
  // The request must fit the stores alone at its largest (prefill after a preemption, and decode).
  const int64_t max_len = n_prompt + params.max_tokens;
  for (bool decoding : {false, true}) {
    KvDemand need = factory_->demand(params.attention, max_len, max_len, decoding, config_.kv_block_tokens);
    // Without elasticity a decoding request always holds its largest buffer.
    if (decoding && !config_.elastic_kv_buffers) {
      need.device_pages += factory_->buffer_streams(params.attention) *
                           factory_->max_buffer_pages(params.attention, max_len);
    }
    SPIN_CHECK(need.fits_within(kv_capacity_),
               "the request needs up to {} KV blocks, {} device pages ({} more in the dense layers' pool) and {} "
               "host pages for {} tokens but the KV store holds {} blocks, {} device pages ({} more in the dense "
               "layers' pool) and {} host pages",
               need.blocks, need.device_pages, need.dense_layer_pages, need.host_pages, max_len, kv_capacity_.blocks,
               kv_capacity_.device_pages, kv_capacity_.dense_layer_pages, kv_capacity_.host_pages);
  }
}

uint64_t Engine::add_request(std::vector<int32_t> prompt, const RequestParams& params,
                             OutputCallback on_output) {
  validate_request(prompt, params);
  auto r = std::make_unique<Request>(std::move(prompt), params, std::move(on_output));
  r->tokens.reserve(r->max_len);
  if (tokenizer_) r->decoder.emplace(*tokenizer_);
  r->arrival = clock::now();

  uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || !alive_) throw EngineUnavailable("the engine is not running");
    const int64_t waiting_limit = config_.max_num_seqs + config_.max_waiting;
    if (queued_ >= waiting_limit) {
      throw EngineUnavailable(fmt::format(
          "the server is overloaded: {} requests are queued or running (limit {})", queued_,
          waiting_limit));
    }
    id = next_id_++;
    r->id = id;
    ++queued_;
    incoming_.push_back(std::move(r));
  }
  wake_.notify_one();
  return id;
}

void Engine::abort(uint64_t request_id) {
  {
    std::lock_guard lock(mutex_);
    aborts_.push_back(request_id);
  }
  wake_.notify_one();
}

bool Engine::has_work() const {
  std::lock_guard lock(mutex_);
  return queued_ > 0 || !aborts_.empty();
}

void Engine::take_incoming(std::vector<std::pair<OutputCallback, RequestOutput>>& outputs) {
  std::vector<std::unique_ptr<Request>> fresh;
  std::vector<uint64_t> aborts;
  {
    std::lock_guard lock(mutex_);
    fresh.swap(incoming_);
    aborts.swap(aborts_);
  }
  {
    std::lock_guard lock(metrics_mutex_);
    for (const auto& r : fresh) metrics_.prompt_tokens_total += r->n_prompt;
  }
  for (auto& r : fresh) {
    waiting_.push_back(r.get());
    requests_.emplace(r->id, std::move(r));
  }
  for (uint64_t id : aborts) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = *it->second;
    RequestOutput out;
    finish(r, "abort", out);
    outputs.emplace_back(std::move(r.on_output), std::move(out));
    requests_.erase(it);
  }
}

// What the request holds after storing `tokens` tokens: the factory's demand, and while
// decoding its buffer.
KvDemand Engine::kv_after(const Request& r, int64_t tokens, bool decoding) const {
  KvDemand after = factory_->demand(r.params.attention, tokens, r.max_len, decoding, config_.kv_block_tokens);
  if (decoding) after.device_pages += r.buffer_streams * r.buffer_pages;
  return after;
}

// Reserves what the request holds after storing `tokens` tokens. A request's KV may shrink within
// the step (a paged prefill ends and offloads), but other requests of the same step may allocate
// before that: the larger of before and after stays reserved until settle_kv after the forward.
bool Engine::reserve_kv(Request& r, int64_t tokens, bool decoding) {
  const KvDemand after = kv_after(r, tokens, decoding);
  const KvDemand during = max_of(r.kv_reserved, after);
  KvDemand used = kv_used_;
  used -= r.kv_reserved;
  used += during;
  if (!used.fits_within(kv_capacity_)) return false;
  kv_used_ = used;
  r.kv_reserved = during;
  r.kv_settled = after;
  r.decoding = decoding;
  return true;
}

void Engine::settle_kv(Request& r) {
  kv_used_ -= r.kv_reserved;
  kv_used_ += r.kv_settled;
  r.kv_reserved = r.kv_settled;
}

void Engine::free_kv(Request& r) {
  kv_used_ -= r.kv_reserved;
  r.kv_reserved = {};
  r.kv_settled = {};
  r.kv.reset();
  r.computed = 0;
  r.decoding = false;
  r.swapped = false;
  r.buffer_pages = 0;
}

// Sets the request's buffer; its reservation follows at once (a decoding one holds it), and the
// store evicts at once when it shrinks.
void Engine::resize_buffer(Request& r, int64_t pages) {
  if (pages == r.buffer_pages) return;
  if (r.decoding) {
    const KvDemand delta{.device_pages = r.buffer_streams * (pages - r.buffer_pages)};
    kv_used_ += delta;
    r.kv_reserved += delta;
    r.kv_settled += delta;
  }
  r.buffer_pages = pages;
  if (r.kv) factory_->set_buffer_pages(*r.kv, pages);
}

// Paged sparse attention runs a single token as a decode step (sparse) and longer chunks as a
// prefill (dense). So that neither chunking nor a recompute changes the output, its prefill ends
// with the prompt: every later token runs alone, as it did when it was sampled (after a recompute:
// fed back, not sampled again). Elsewhere everything not yet computed is prefill.
int64_t Engine::prefill_end(const Request& r) const {
  return factory_->single_token_is_decode(r.params.attention) ? r.n_prompt : static_cast<int64_t>(r.tokens.size());
}

bool Engine::runs_alone(const Request& r) const {
  return r.computed >= prefill_end(r) || static_cast<int64_t>(r.tokens.size()) - r.computed == 1;
}

int64_t Engine::chunk_tokens(const Request& r, int64_t budget) const {
  if (runs_alone(r)) return std::min<int64_t>(1, budget);
  const int64_t remaining = prefill_end(r) - r.computed;
  int64_t n = std::min(remaining, budget);
  // A sparse prefill is chunked into 2+ tokens and never leaves its last token alone.
  if (factory_->single_token_is_decode(r.params.attention)) {
    if (remaining - n == 1) --n;
    if (n == 1 && r.computed > 0) n = 0;
  }
  return n;
}

// What reserve_kv(r, tokens, decoding) lacks, per component (0 where it fits).
KvDemand Engine::shortfall(const Request& r, int64_t tokens, bool decoding) const {
  KvDemand used = kv_used_;
  used -= r.kv_reserved;
  used += max_of(r.kv_reserved, kv_after(r, tokens, decoding));
  used -= kv_capacity_;
  return max_of(used, KvDemand{});
}

// Shrinks running requests' buffers so that reserve_kv(r, tokens, decoding) fits, when device
// pages are all it lacks. False (nothing changed) when the buffers cannot free enough.
bool Engine::make_room(Request& r, int64_t tokens, bool decoding) {
  if (!config_.elastic_kv_buffers) return false;
  const KvDemand lack = shortfall(r, tokens, decoding);
  if (lack.device_pages == 0 || !(KvDemand{.device_pages = lack.device_pages} == lack)) return false;
  return shrink_buffers(lack.device_pages);
}

// Frees `device_pages` pages of the running requests' buffers, the largest first: every buffer
// above a common level comes down to it, at the highest level that frees enough. False (nothing
// changed) when all buffers together hold fewer.
bool Engine::shrink_buffers(int64_t device_pages) {
  const auto freed_at = [&](int64_t level) {
    int64_t freed = 0;
    for (const Request* r : running_) {
      if (r->decoding) freed += r->buffer_streams * std::max<int64_t>(r->buffer_pages - level, 0);
    }
    return freed;
  };
  if (freed_at(0) < device_pages) return false;
  int64_t low = 0, high = 0;
  for (const Request* r : running_) high = std::max(high, r->buffer_pages);
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (freed_at(mid) >= device_pages) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  for (Request* r : running_) {
    if (r->decoding && r->buffer_pages > low) resize_buffer(*r, low);
  }
  return true;
}

// Gives the free device pages to decoding requests' buffers, the smallest first (up to a common
// level), each up to its largest useful buffer.
void Engine::grow_buffers() {
  const int64_t free_pages = kv_capacity_.device_pages - kv_used_.device_pages;
  const auto cost_at = [&](int64_t level) {
    int64_t cost = 0;
    for (const Request* r : running_) {
      if (!r->decoding) continue;
      cost += r->buffer_streams * std::max<int64_t>(std::min(level, r->max_buffer_pages) - r->buffer_pages, 0);
    }
    return cost;
  };
  int64_t low = 0, high = 0;
  for (const Request* r : running_) {
    if (r->decoding) high = std::max(high, r->max_buffer_pages);
  }
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (cost_at(mid) <= free_pages) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  for (Request* r : running_) {
    const int64_t target = std::min(low, r->max_buffer_pages);
    if (r->decoding && target > r->buffer_pages) resize_buffer(*r, target);
  }
}

// Takes a running request back to the waiting queue, keeping its tokens (prompt and everything
// sampled so far). By swap its KV stays in the host tier and only its device pages go back: it
// resumes where it stopped. By recompute all of its KV goes back and it is prefilled again.
void Engine::preempt(Request& r, bool swap) {
  if (swap) {
    factory_->swap_out(*r.kv);
    KvDemand held = factory_->demand(r.params.attention, r.computed, r.max_len, true, config_.kv_block_tokens);
    held -= held.on_device();
    kv_used_ -= r.kv_reserved;
    kv_used_ += held;
    r.kv_reserved = held;
    r.kv_settled = held;
    r.decoding = false;
    if (config_.elastic_kv_buffers) resize_buffer(r, 0);
    r.swapped = true;
  } else {
    free_kv(r);
  }
  running_.erase(std::find(running_.begin(), running_.end(), &r));
  auto pos = std::lower_bound(waiting_.begin(), waiting_.end(), &r,
                              [](const Request* a, const Request* b) { return a->id < b->id; });
  waiting_.insert(pos, &r);
  std::lock_guard lock(metrics_mutex_);
  ++(swap ? metrics_.preemptions_swap : metrics_.preemptions_recompute);
}

// Host pages are short: the latest-arrived swapped-out request gives up its KV and will be
// recomputed. False when none is swapped out.
bool Engine::drop_swapped() {
  const auto it = std::find_if(waiting_.rbegin(), waiting_.rend(), [](const Request* r) { return r->swapped; });
  if (it == waiting_.rend()) return false;
  free_kv(**it);
  std::lock_guard lock(metrics_mutex_);
  ++metrics_.preemptions_recompute;
  return true;
}

// Removes the request from the schedule, frees its KV, and fills the final output.
void Engine::finish(Request& r, const std::string& reason, RequestOutput& out) {
  if (r.kv) {
    if (const std::optional<KvCacheCounts> counts = factory_->cache_counts(*r.kv)) {
      out.kv_hits = counts->hits;
      out.kv_misses = counts->misses;
    }
  }
  free_kv(r);
  if (auto it = std::find(running_.begin(), running_.end(), &r); it != running_.end()) running_.erase(it);
  if (auto it = std::find(waiting_.begin(), waiting_.end(), &r); it != waiting_.end()) waiting_.erase(it);
  out.request_id = r.id;
  out.finished = true;
  out.finish_reason = reason;
  out.prompt_tokens = r.n_prompt;
  out.completion_tokens = r.n_sampled;
  {
    std::lock_guard lock(mutex_);
    --queued_;
  }
  std::lock_guard lock(metrics_mutex_);
  if (reason == "stop") ++metrics_.requests_finished_stop;
  if (reason == "length") ++metrics_.requests_finished_length;
  if (reason == "abort") ++metrics_.requests_aborted;
  if (reason == "stop" || reason == "length") {
    metrics_.e2e_latency.observe(std::chrono::duration<double>(clock::now() - r.arrival).count());
  }
}

void Engine::record_prompt_logprobs(Request& r, const float* logits, int64_t n) {
  const int64_t vocab = model_.config().vocab_size;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = r.computed + j;  // its logits predict token pos + 1
    if (pos != r.prompt_logprobs_done || pos + 1 >= r.n_prompt) continue;
    const int32_t next = r.tokens[static_cast<size_t>(pos + 1)];
    // Over the tokens the sampler draws from, as the sampled tokens' logprobs are (a prompt id past
    // them, which no tokenizer makes, over every logit).
    const std::span<const float> all(logits + j * vocab, static_cast<size_t>(vocab));
    r.prompt_logprobs.push_back(token_logprob(next < sampleable_vocab_ ? all.first(static_cast<size_t>(sampleable_vocab_)) : all,
                                              next, r.params.prompt_logprobs));
    ++r.prompt_logprobs_done;
  }
}

void Engine::sample_next(Request& r, std::span<const float> all_logits, std::optional<int32_t> drawn,
                         RequestOutput& out) {
  const std::span<const float> logits =
      all_logits.empty() ? all_logits : all_logits.first(static_cast<size_t>(sampleable_vocab_));
  const int32_t id =
      drawn ? *drawn : r.sampler.sample(logits, std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.n_prompt)));
  ++r.n_sampled;
  const auto now = clock::now();
  {
    std::lock_guard lock(metrics_mutex_);
    ++metrics_.generation_tokens_total;
    if (r.n_sampled == 1) {
      metrics_.time_to_first_token.observe(std::chrono::duration<double>(now - r.arrival).count());
    } else {
      metrics_.inter_token_latency.observe(std::chrono::duration<double>(now - r.last_token).count());
    }
  }
  r.last_token = now;
  out.request_id = r.id;
  out.token_ids.push_back(id);
  out.prompt_tokens = r.n_prompt;
  out.completion_tokens = r.n_sampled;

  // Stop ids first, then text and stop strings, then the length limit.
  const bool is_stop_id = std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
  std::string reason;
  if (is_stop_id && !r.params.ignore_eos) {
    reason = "stop";
    out.stop_token = true;
  } else {
    if (r.params.top_logprobs >= 0) out.logprobs.push_back(token_logprob(logits, id, r.params.top_logprobs));
    r.tokens.push_back(id);
    if (r.decoder) {
      out.text += r.stops.push(r.decoder->push(id));
      if (r.stops.stopped()) reason = "stop";
    }
    if (reason.empty() && r.n_sampled >= r.params.max_tokens) reason = "length";
  }
  if (reason.empty()) return;
  if (r.decoder && !r.stops.stopped()) {
    out.text += r.stops.push(r.decoder->flush());
    if (!r.stops.stopped()) out.text += r.stops.flush();
  }
  finish(r, reason, out);
}

StepReport Engine::step() {
  const clock::time_point step_start = clock::now();
  std::vector<std::pair<OutputCallback, RequestOutput>> outputs;
  take_incoming(outputs);
  StepReport report;

  // 1. Running requests in arrival order: decode tokens, then the rest of partial prefills.
  //    A request that cannot grow its KV first shrinks buffers; then, when host pages are short,
  //    swapped-out requests give theirs up; then it preempts the latest-arrived running request:
  //    by swap when device pages are all that is short and that request's KV is in the host tier,
  //    by recompute otherwise.
  std::vector<std::pair<Request*, int64_t>> scheduled;
  int64_t budget = config_.max_num_batched_tokens;
  std::vector<Request*> order = running_;
  std::stable_partition(order.begin(), order.end(), [this](const Request* r) { return runs_alone(*r); });
  for (Request* r : order) {
    if (budget == 0) break;
    if (std::find(running_.begin(), running_.end(), r) == running_.end()) continue;  // preempted
    const int64_t n = chunk_tokens(*r, budget);
    if (n == 0) continue;
    const bool decoding = n == 1 && r->computed > 0;
    bool preempted_self = false;
    while (!reserve_kv(*r, r->computed + n, decoding)) {
      if (make_room(*r, r->computed + n, decoding)) continue;
      const KvDemand lack = shortfall(*r, r->computed + n, decoding);
      if (lack.host_pages > 0 && drop_swapped()) continue;
      Request* victim = running_.back();
      // Never take back what this step already scheduled.
      for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
        const bool is_scheduled = std::any_of(scheduled.begin(), scheduled.end(),
                                              [&](const auto& s) { return s.first == *it; });
        if (!is_scheduled) {
          victim = *it;
          break;
        }
      }
      const bool device_only = lack.on_device() == lack;
      preempt(*victim, device_only && victim->decoding && factory_->can_swap(*victim->kv));
      ++report.preempted;
      if (victim == r) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) continue;
    scheduled.emplace_back(r, n);
    budget -= n;
  }

  // 2. Admit waiting requests strictly in arrival order (no overtaking, so none starves), unless
  //    this step had to preempt: memory is short, admitting now would only thrash.
  //    A new request is admitted only when its whole prompt fits now, not just this step's chunk:
  //    a prefill that cannot finish is preempted by the running requests' growth and computed
  //    again, over and over. Running requests' buffers shrink to make room; a request that does
  //    not fit even so waits, and the buffers do not grow into the pages it waits for. A
  //    swapped-out request resumes with its next decode token.
  bool kv_blocked = false;
  while (report.preempted == 0 && budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Request* r = waiting_.front();
    const int64_t n = chunk_tokens(*r, budget);
    if (n == 0) break;
    const bool resume = r->swapped;
    const int64_t tokens = r->computed + n;
    const int64_t end = prefill_end(*r);
    const auto prompt_fits = [&] { return shortfall(*r, end, false) == KvDemand{}; };
    if (!resume && !prompt_fits() && !(make_room(*r, end, false) && prompt_fits())) {
      kv_blocked = true;
      break;
    }
    if (!reserve_kv(*r, tokens, resume) && !(make_room(*r, tokens, resume) && reserve_kv(*r, tokens, resume))) {
      kv_blocked = true;
      break;
    }
    if (resume) {
      factory_->swap_in(*r->kv);
      r->swapped = false;
    } else {
      r->kv = factory_->create(r->params.attention, r->max_len);
      r->buffer_streams = factory_->buffer_streams(r->params.attention);
      r->max_buffer_pages = factory_->max_buffer_pages(r->params.attention, r->max_len);
      // Told even when it is 0: a store's own default (the GPU's: the whole buffer) must not hold
      // pages the reservation leaves out. The request is not decoding yet, so nothing is reserved.
      r->buffer_pages = config_.elastic_kv_buffers ? 0 : r->max_buffer_pages;
      if (r->buffer_streams > 0) factory_->set_buffer_pages(*r->kv, r->buffer_pages);
    }
    waiting_.pop_front();
    running_.insert(std::lower_bound(running_.begin(), running_.end(), r,
                                     [](const Request* a, const Request* b) { return a->id < b->id; }),
                    r);
    scheduled.emplace_back(r, n);
    budget -= n;
  }

  clock::time_point forward_start = clock::now(), forward_end = forward_start;
  if (!scheduled.empty()) {
    std::vector<SequenceChunk> chunks;
    chunks.reserve(scheduled.size());
    for (auto& [r, n] : scheduled) {
      chunks.push_back(SequenceChunk{std::span<const int32_t>(r->tokens).subspan(r->computed, n),
                                     r->computed, r->kv.get()});
      const bool samples = r->computed + n == static_cast<int64_t>(r->tokens.size());
      report.chunks.push_back(ScheduledChunk{r->id, r->computed, n, samples});
      report.n_tokens += n;
    }
    // Prompt logprobs need every position's logits: a step with such a prefill chunk returns a row
    // per token (the chunk's last is the one it samples from) and draws on the host.
    bool all_logits = false;
    for (const auto& [r, n] : scheduled) {
      all_logits |= r->params.prompt_logprobs >= 0 && r->prompt_logprobs_done < r->n_prompt - 1;
    }
    // A model that draws on its device gets each request's sampling rule; it downloads the logit
    // rows of the requests that want logprobs, or a logit bias or penalties (which the host's
    // Sampler applies before it draws), and no others.
    const bool draws_on_device = model_.samples_on_device() && !all_logits;
    const auto host_needs_logits = [&](size_t i) {
      const Request& r = *scheduled[i].first;
      return !draws_on_device ||
             (report.chunks[i].samples && (r.params.top_logprobs >= 0 || r.params.sampling.adjusts_logits()));
    };
    std::vector<int64_t> logit_rows;  // rows whose logits the host needs when the device draws
    std::vector<DeviceSampling> sampling;
    if (draws_on_device) {
      for (size_t i = 0; i < scheduled.size(); ++i) {
        const Request& r = *scheduled[i].first;
        const SamplingParams& p = r.params.sampling;
        sampling.push_back(DeviceSampling{.temperature = p.greedy() ? 0.0f : p.temperature,
                                          .top_k = p.top_k,
                                          .top_p = p.top_p,
                                          .min_p = p.min_p,
                                          .seed = r.seed,
                                          .step = static_cast<uint64_t>(r.n_sampled)});
        if (host_needs_logits(i)) logit_rows.push_back(static_cast<int64_t>(i));
      }
    }
    forward_start = clock::now();
    try {
      if (draws_on_device) {
        model_.forward_sampled(chunks, sampling, sampleable_vocab_, logit_rows, logits_, drawn_);
      } else {
        model_.forward(chunks, all_logits, logits_);
      }
    } catch (const kv::PoolExhausted& e) {
      // The paged store ran out inside the forward: an algorithm kept more pages than the
      // admission bound allows for (its unbudgeted pages). Every request of this step now holds
      // partial KV, so all of them recompute later (admitted by their whole context from now on);
      // one that ran alone cannot run at all.
      spdlog::warn("KV store exhausted during a step of {} requests: {}", scheduled.size(), e.what());
      {
        std::lock_guard lock(metrics_mutex_);
        ++metrics_.kv_store_exhausted_total;
      }
      report.chunks.clear();
      report.n_tokens = 0;
      for (auto& [r, n] : scheduled) {
        factory_->store_exhausted(r->params.attention);
        if (scheduled.size() > 1) {
          preempt(*r, false);
          ++report.preempted;
          continue;
        }
        RequestOutput out;
        finish(*r, "error", out);
        out.error = fmt::format("the KV store cannot hold this request: {}", e.what());
        outputs.emplace_back(std::move(r->on_output), std::move(out));
        requests_.erase(r->id);
      }
      scheduled.clear();
    }
    forward_end = clock::now();
    const int64_t vocab = model_.config().vocab_size;
    const auto row = [&](int64_t at) { return std::span<const float>(logits_.data() + at * vocab, vocab); };
    int64_t first_row = 0;  // with all_logits: chunk i's first row
    for (size_t i = 0; i < scheduled.size(); ++i) {
      Request& r = *scheduled[i].first;
      const int64_t n = scheduled[i].second;
      settle_kv(r);
      if (all_logits && r.params.prompt_logprobs >= 0) record_prompt_logprobs(r, logits_.data() + first_row * vocab, n);
      r.computed += n;
      const int64_t last_row = all_logits ? first_row + n - 1 : static_cast<int64_t>(i);
      if (all_logits) first_row += n;
      if (!report.chunks[i].samples) continue;
      RequestOutput out;
      out.prompt_logprobs.swap(r.prompt_logprobs);  // sent once: r keeps none
      if (r.params.max_tokens == 0) {  // scoring the prompt alone: nothing to sample
        finish(r, "length", out);
        outputs.emplace_back(std::move(r.on_output), std::move(out));
        requests_.erase(r.id);
        continue;
      }
      const std::span<const float> logits = host_needs_logits(i) ? row(last_row) : std::span<const float>();
      const bool drawn_on_device = draws_on_device && !r.params.sampling.adjusts_logits();
      sample_next(r, logits, drawn_on_device ? std::optional<int32_t>(drawn_[i]) : std::nullopt, out);
      if (out.finished) {
        outputs.emplace_back(std::move(r.on_output), std::move(out));
        requests_.erase(r.id);
      } else {
        outputs.emplace_back(r.on_output, std::move(out));
      }
    }
  }
  if (config_.elastic_kv_buffers && !kv_blocked) grow_buffers();
  update_gauges();
  // Callbacks run without any engine lock held, so they may call abort() or add_request().
  for (auto& [callback, out] : outputs) {
    if (callback) callback(out);
  }
  const auto seconds = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  {
    std::lock_guard lock(metrics_mutex_);
    metrics_.step_schedule_seconds += seconds(forward_start - step_start);
    metrics_.step_forward_seconds += seconds(forward_end - forward_start);
    metrics_.step_finish_seconds += seconds(clock::now() - forward_end);
  }
  return report;
}

void Engine::update_gauges() {
  std::lock_guard lock(metrics_mutex_);
  metrics_.requests_running = static_cast<int64_t>(running_.size());
  metrics_.requests_waiting = static_cast<int64_t>(waiting_.size());
  metrics_.kv_tokens_used = kv_used_.blocks * config_.kv_block_tokens;
  metrics_.kv_device_pages_reserved = kv_used_.device_pages;
  metrics_.kv_dense_layer_pages_reserved = kv_used_.dense_layer_pages;
  metrics_.kv_host_pages_reserved = kv_used_.host_pages;
  metrics_.kv_buffer_pages_reserved = 0;
  for (const Request* r : running_) {
    if (r->decoding) metrics_.kv_buffer_pages_reserved += r->buffer_streams * r->buffer_pages;
  }
  metrics_.kv_store = factory_->usage();
  metrics_.forward = model_.forward_stats();
  ++metrics_.steps_total;
}

EngineMetrics Engine::metrics() const {
  std::lock_guard lock(metrics_mutex_);
  EngineMetrics m = metrics_;
  std::lock_guard queue_lock(mutex_);
  m.requests_waiting += static_cast<int64_t>(incoming_.size());
  return m;
}

void Engine::start() {
  std::lock_guard lock(mutex_);
  SPIN_CHECK(!thread_.joinable(), "the engine is already running");
  thread_ = std::thread([this] { loop(); });
}

void Engine::loop() {
  // OpenMP thread counts are per thread: the loop thread sets its own.
  cpu::set_num_threads(config_.threads);
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || queued_ > 0 || !aborts_.empty(); });
      if (stopping_) return;
    }
    try {
      step();
    } catch (const std::exception& e) {
      spdlog::error("engine step failed: {}", e.what());
      alive_ = false;
      end_all("error", e.what());
      return;
    }
  }
}

// Ends every request still known (queued, waiting or running) with `reason`, so that no client
// waits for an engine that no longer steps.
void Engine::end_all(const std::string& reason, const std::string& error) {
  std::vector<std::pair<OutputCallback, RequestOutput>> outputs;
  {
    std::lock_guard lock(mutex_);
    for (auto& r : incoming_) {
      waiting_.push_back(r.get());
      requests_.emplace(r->id, std::move(r));
    }
    incoming_.clear();
  }
  for (auto& [id, r] : requests_) {
    RequestOutput out;
    finish(*r, reason, out);
    out.error = error;
    outputs.emplace_back(std::move(r->on_output), std::move(out));
  }
  requests_.clear();
  update_gauges();
  for (auto& [callback, out] : outputs) {
    if (callback) callback(out);
  }
}

void Engine::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  end_all("abort", {});
}

}  // namespace spin
