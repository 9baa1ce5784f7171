#pragma once
// Serving metrics the engine keeps and the server renders for /metrics (Prometheus text).
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/attention_factory.h"
#include "model/forward_model.h"

namespace spin {

// Cumulative histogram with fixed upper bounds (Prometheus semantics: counts[i] counts
// observations <= bounds[i]; the +Inf bucket is `count`).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);

  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& cumulative_counts() const { return counts_; }
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ = 0.0;
};

// Latency buckets in seconds, from 1 ms to 10 min.
std::vector<double> latency_buckets();

struct EngineMetrics {
  int64_t requests_running = 0;
  int64_t requests_waiting = 0;
  int64_t kv_tokens_used = 0;      // KV tokens held by requests (whole blocks)
  int64_t kv_tokens_capacity = 0;  // the KV-token budget
  int64_t kv_device_pages_reserved = 0;  // paged store: device pages the scheduler reserved
  int64_t kv_host_pages_reserved = 0;    // paged store: host pages the scheduler reserved
  int64_t kv_buffer_pages_reserved = 0;  // paged store: of the device pages, those of elastic buffers
  // Paged store with a device pool of its own for the first dense layers (the GPU's): its pages
  // the scheduler reserved.
  int64_t kv_dense_layer_pages_reserved = 0;
  std::optional<KvStoreUsage> kv_store;  // the paged store's pools and counters, if any
  uint64_t prompt_tokens_total = 0;
  uint64_t generation_tokens_total = 0;
  uint64_t preemptions_swap = 0;       // device pages freed, KV kept in the host tier
  uint64_t preemptions_recompute = 0;  // all KV freed, prefilled again
  uint64_t preemptions_total() const { return preemptions_swap + preemptions_recompute; }
  // Steps in which the paged store ran out inside the forward (an algorithm kept more device
  // pages than its admission bound): their requests were preempted.
  uint64_t kv_store_exhausted_total = 0;
  uint64_t requests_finished_stop = 0;
  uint64_t requests_finished_length = 0;
  uint64_t requests_aborted = 0;
  uint64_t steps_total = 0;
  // The engine thread's time in its steps, in seconds: choosing each step's work (schedule; a
  // swap's copies happen here), the model's forward (forward), then drawing tokens, growing
  // buffers and handing outputs to the clients (finish).
  double step_schedule_seconds = 0.0;
  double step_forward_seconds = 0.0;
  double step_finish_seconds = 0.0;
  std::optional<ForwardStats> forward;  // the model's counts of its forwards, where it keeps them
  Histogram time_to_first_token{latency_buckets()};
  Histogram inter_token_latency{latency_buckets()};
  Histogram e2e_latency{latency_buckets()};
};

}  // namespace spin
