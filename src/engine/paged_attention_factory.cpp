#include "engine/paged_attention_factory.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>

#include "base/error.h"
#include "kv/kv_manager.h"
#include "kv/page_memory.h"
#include "model/contiguous_attention.h"
#include "sparse/algorithm.h"
#include "sparse/paged_sparse_attention.h"

namespace spin {

namespace {

uint32_t setting_u32(const char* what, int64_t value) {
  SPIN_CHECK(value >= 0 && value <= std::numeric_limits<uint32_t>::max(),
             "sparse settings: {} must be in 0..{}, got {}", what,
             std::numeric_limits<uint32_t>::max(), value);
  return static_cast<uint32_t>(value);
}

}  // namespace

sparse::SparseSettings to_sparse_settings(const AttentionSettings& s) {
  sparse::SparseSettings out;
  out.algorithm = s.algorithm;
  if (s.budget > 0) out.budget_tokens = setting_u32("budget", s.budget);
  SPIN_CHECK(std::isfinite(s.budget_fraction) && s.budget_fraction >= 0.0 && s.budget_fraction <= 1.0,
             "sparse settings: budget fraction {} is outside (0, 1]", s.budget_fraction);
  out.budget_fraction = s.budget_fraction;
  if (s.sink_tokens) out.sink_tokens = setting_u32("sink_tokens", *s.sink_tokens);
  if (s.window_tokens) out.window_tokens = setting_u32("window_tokens", *s.window_tokens);
  if (s.first_dense_layers) out.first_dense_layers = setting_u32("first_dense_layers", *s.first_dense_layers);
  return out;
}

namespace {

uint32_t checked_pages(const char* flag, int64_t pages) {
  SPIN_CHECK(pages > 0 && pages < std::numeric_limits<uint32_t>::max(),
             "{} must be in 1..{}, got {}", flag, std::numeric_limits<uint32_t>::max() - 1, pages);
  return static_cast<uint32_t>(pages);
}

class PagedAttentionFactory final : public AttentionFactory {
 public:
  PagedAttentionFactory(const AttentionShape& shape, const PagedStoreConfig& c)
      : shape_(shape), buffer_factor_(c.buffer_factor), seer_gate_(c.seer_gate) {
    SPIN_CHECK(std::isfinite(c.buffer_factor) && c.buffer_factor >= 0.0 && c.buffer_factor <= 64.0,
               "the KV buffer factor must be in [0, 64], got {}", c.buffer_factor);
    SPIN_CHECK(c.max_batch > 0 && c.max_batch <= 65536, "paged KV store: max batch {} outside 1..65536",
               c.max_batch);
    SPIN_CHECK(c.max_context > 0 && c.max_context < std::numeric_limits<int32_t>::max(),
               "paged KV store: context length {} out of range", c.max_context);
    kv::KvConfig config;
    config.layout = kv::KvLayout{static_cast<uint32_t>(shape.n_layers), static_cast<uint32_t>(shape.n_kv_heads),
                                 static_cast<uint32_t>(shape.head_dim), c.page_size, kv::ElemType::F32};
    kv::validate(config.layout);
    config.device_pages = checked_pages("--kv-device-pages", c.device_pages);
    config.host_pages = checked_pages("--kv-host-pages", c.host_pages);
    config.max_batch = static_cast<uint32_t>(c.max_batch);
    config.max_context = static_cast<uint32_t>(c.max_context);
    memory_ = std::make_unique<kv::HostPageMemory>(config.layout, config.device_pages, config.host_pages);
    kv_ = std::make_unique<kv::KvManager>(config, *memory_);
    contiguous_ = make_contiguous_attention_factory(shape);
  }

  std::vector<std::string> algorithms() const override {
    return sparse::AlgorithmRegistry::global().names();
  }

  void validate(const AttentionSettings& settings) const override {
    AttentionFactory::validate(settings);
    if (settings.algorithm == "dense") return;
    resolve(settings);
  }

  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings,
                                            int64_t max_tokens) override {
    if (settings.algorithm == "dense") return contiguous_->create(settings, max_tokens);
    SPIN_CHECK(max_tokens > 0 && max_tokens <= kv_->config().max_context,
               "attention capacity {} outside 1..{}", max_tokens, kv_->config().max_context);
    return std::make_unique<sparse::PagedSparseAttention>(*kv_, *memory_, shape_, sparse_settings(settings));
  }

  KvDemand demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens, bool decoding,
                  int64_t block_tokens) const override {
    if (settings.algorithm == "dense") {
      return AttentionFactory::demand(settings, tokens, max_tokens, decoding, block_tokens);
    }
    const sparse::ResolvedSettings r = resolve(settings);
    const int64_t heads = shape_.n_kv_heads;
    const int64_t streams = shape_.n_layers * heads;
    const int64_t pages = kv_->config().layout.pages_for_tokens(static_cast<uint64_t>(tokens));
    KvDemand d{.slots = 1};
    // Prefill runs on the device over every page; Device placement never leaves it.
    if (!decoding || r.traits.placement == sparse::Placement::Device) {
      d.device_pages = streams * pages;
      return d;
    }
    d.host_pages = streams * pages;
    if (r.traits.placement == sparse::Placement::Stream) {
      // Every layer keeps its always-resident pages; one layer at a time holds all of its pages.
      d.device_pages = streams * std::min(pages, always_resident_pages(r)) + heads * pages;
      return d;
    }
    if (unbounded(settings.algorithm)) {
      d.device_pages = streams * pages;
      return d;
    }
    const int64_t dense_layers = std::min<int64_t>(r.first_dense_layers, shape_.n_layers);
    d.device_pages = dense_layers * heads * pages +
                     (shape_.n_layers - dense_layers) * heads * std::min(pages, working_set_pages(r, tokens));
    return d;
  }

  void store_exhausted(const AttentionSettings& settings) override {
    if (settings.algorithm == "dense") return;
    std::lock_guard lock(unbounded_mutex_);
    unbounded_.insert(settings.algorithm);
  }

  KvDemand capacity() const override {
    return KvDemand{.device_pages = kv_->device_pool().capacity(),
                    .host_pages = kv_->host_pool().capacity(),
                    .slots = kv_->config().max_batch};
  }

  bool single_token_is_decode(const AttentionSettings& settings) const override {
    return settings.algorithm != "dense";
  }

  int64_t buffer_streams(const AttentionSettings& settings) const override {
    if (settings.algorithm == "dense") return 0;
    const sparse::ResolvedSettings r = resolve(settings);
    if (r.traits.placement != sparse::Placement::Offload) return 0;
    return (shape_.n_layers - std::min<int64_t>(r.first_dense_layers, shape_.n_layers)) * shape_.n_kv_heads;
  }

  // The configured multiple of the budget, and never more than the pages the working set leaves
  // out at the request's largest context (a larger buffer would have nothing to keep).
  int64_t max_buffer_pages(const AttentionSettings& settings, int64_t max_tokens) const override {
    if (buffer_streams(settings) == 0) return 0;
    const sparse::ResolvedSettings r = resolve(settings);
    const int64_t pages = kv_->config().layout.pages_for_tokens(static_cast<uint64_t>(max_tokens));
    const auto wanted = static_cast<int64_t>(buffer_factor_ * r.budget_pages(static_cast<uint32_t>(max_tokens)));
    return std::clamp<int64_t>(pages - working_set_pages(r, max_tokens), 0, wanted);
  }

  void set_buffer_pages(SequenceKv& kv, int64_t pages) override {
    auto* paged = dynamic_cast<sparse::PagedSparseAttention*>(&kv);
    if (paged == nullptr) return;
    SPIN_CHECK(pages >= 0 && pages <= kv_->config().max_context, "buffer of {} pages out of range", pages);
    kv_->set_buffer_pages(paged->request(), static_cast<uint32_t>(pages));
  }

  bool can_swap(const SequenceKv& kv) const override {
    const auto* paged = dynamic_cast<const sparse::PagedSparseAttention*>(&kv);
    return paged != nullptr && kv_->offloaded(paged->request()) && !kv_->suspended(paged->request());
  }

  void swap_out(SequenceKv& kv) override { kv_->suspend(paged(kv).request()); }

  void swap_in(SequenceKv& kv) override { kv_->resume(paged(kv).request()); }

  std::optional<KvCacheCounts> cache_counts(const SequenceKv& kv) const override {
    const auto* paged = dynamic_cast<const sparse::PagedSparseAttention*>(&kv);
    if (paged == nullptr) return std::nullopt;
    const kv::KvCounters& c = kv_->counters(paged->request());
    return KvCacheCounts{c.hits, c.misses};
  }

  std::optional<KvStoreUsage> usage() const override {
    KvStoreUsage u;
    u.device_pages_used = kv_->device_pool().num_used();
    u.device_pages_capacity = kv_->device_pool().capacity();
    u.host_pages_used = kv_->host_pool().num_used();
    u.host_pages_capacity = kv_->host_pool().capacity();
    u.page_bytes = static_cast<int64_t>(kv_->config().layout.page_bytes());
    u.logical_segments_used = kv_->logical_segment_pool().num_used();
    u.resident_segments_used = kv_->resident_segment_pool().num_used();
    u.requests = kv_->num_active_requests();
    const kv::KvCounters& c = kv_->global_counters();
    u.hits = c.hits;
    u.misses = c.misses;
    u.retrieve_bytes = c.h2d_bytes;
    u.offload_bytes = c.d2h_bytes;
    u.evictions = c.evictions;
    const kv::MetadataBytes m = kv_->metadata_bytes();
    u.metadata_device_bytes = m.device();
    u.metadata_host_bytes = m.host();
    return u;
  }

 private:
  sparse::SparseSettings sparse_settings(const AttentionSettings& settings) const {
    sparse::SparseSettings s = to_sparse_settings(settings);
    s.seer_gate = seer_gate_;
    return s;
  }

  sparse::ResolvedSettings resolve(const AttentionSettings& settings) const {
    const sparse::SparseSettings s = sparse_settings(settings);
    const sparse::AlgorithmContext context{shape_, kv_->config().layout, &s};
    const auto algorithm = sparse::AlgorithmRegistry::global().create(s.algorithm, context);
    return sparse::resolve_settings(s, algorithm->traits(), shape_, kv_->config());
  }

  bool unbounded(const std::string& algorithm) const {
    std::lock_guard lock(unbounded_mutex_);
    return unbounded_.count(algorithm) > 0;
  }

  static sparse::PagedSparseAttention& paged(SequenceKv& kv) {
    auto* p = dynamic_cast<sparse::PagedSparseAttention*>(&kv);
    SPIN_CHECK(p != nullptr, "the sequence is not in the paged KV store");
    return *p;
  }

  // Sinks, window, the page being written, and one page that just slid out of the window
  // (evicted at the next retrieve): resident in every stream of an offloaded request.
  int64_t always_resident_pages(const sparse::ResolvedSettings& r) const {
    const kv::KvConfig& store = kv_->config();
    return int64_t{std::max(store.sink_pages, r.sink_pages)} + std::max(store.window_pages, r.window_pages) + 2;
  }

  // Device pages one sparse stream holds at a decode step with `tokens` in context, before the
  // cap of the context's pages: the always-resident pages, the budget, and the pages the
  // algorithm declares it selects outside the budget. An algorithm that adds more than it
  // declares is caught by store_exhausted and admitted by its whole context from then on.
  int64_t working_set_pages(const sparse::ResolvedSettings& r, int64_t tokens) const {
    return always_resident_pages(r) + r.budget_pages(static_cast<uint32_t>(tokens)) + r.traits.max_unbudgeted_pages;
  }

  AttentionShape shape_;
  double buffer_factor_;
  std::shared_ptr<const sparse::SeerGate> seer_gate_;
  std::unique_ptr<kv::HostPageMemory> memory_;
  std::unique_ptr<kv::KvManager> kv_;
  std::unique_ptr<AttentionFactory> contiguous_;
  // Algorithms whose decode working set proved larger than the budget bound (any thread reads).
  mutable std::mutex unbounded_mutex_;
  std::set<std::string> unbounded_;
};

}  // namespace

std::unique_ptr<AttentionFactory> make_paged_attention_factory(const AttentionShape& shape,
                                                               const PagedStoreConfig& config) {
  return std::make_unique<PagedAttentionFactory>(shape, config);
}

}  // namespace spin
