#include "engine/tensor_parallel_factory.h"

#include <algorithm>

#include "base/error.h"

namespace spin {

namespace {

class TensorParallelAttentionFactory final : public AttentionFactory {
 public:
  explicit TensorParallelAttentionFactory(std::vector<std::unique_ptr<AttentionFactory>> ranks)
      : ranks_(std::move(ranks)) {
    SPIN_CHECK(!ranks_.empty(), "tensor parallel: no rank attention factories");
    for (const auto& r : ranks_) SPIN_CHECK(r != nullptr, "tensor parallel: a rank's attention factory is missing");
  }

  std::vector<std::string> algorithms() const override { return ranks_.front()->algorithms(); }

  void validate(const AttentionSettings& settings) const override {
    for (const auto& r : ranks_) r->validate(settings);
  }

  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings, int64_t max_tokens) override {
    std::vector<std::unique_ptr<SequenceKv>> kv;
    kv.reserve(ranks_.size());
    for (const auto& r : ranks_) kv.push_back(r->create(settings, max_tokens));
    return std::make_unique<TensorParallelKv>(std::move(kv));
  }

  KvDemand demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens, bool decoding,
                  int64_t block_tokens) const override {
    KvDemand total;
    for (const auto& r : ranks_) {
      const KvDemand d = r->demand(settings, tokens, max_tokens, decoding, block_tokens);
      total.blocks = std::max(total.blocks, d.blocks);
      total.device_pages += d.device_pages;
      total.host_pages += d.host_pages;
      total.dense_layer_pages += d.dense_layer_pages;
      total.slots = std::max(total.slots, d.slots);
    }
    return total;
  }

  void store_exhausted(const AttentionSettings& settings) override {
    for (const auto& r : ranks_) r->store_exhausted(settings);
  }

  KvDemand capacity() const override {
    KvDemand total;
    for (const auto& r : ranks_) {
      const KvDemand c = r->capacity();
      total.blocks = std::max(total.blocks, c.blocks);
      total.device_pages += c.device_pages;
      total.host_pages += c.host_pages;
      total.dense_layer_pages += c.dense_layer_pages;
      total.slots = total.slots == 0 ? c.slots : std::min(total.slots, c.slots);
    }
    return total;
  }

  // Buffers and swapping: every rank's share of the request, alike.
  int64_t buffer_streams(const AttentionSettings& settings) const override {
    int64_t streams = 0;
    for (const auto& r : ranks_) streams += r->buffer_streams(settings);
    return streams;
  }

  int64_t max_buffer_pages(const AttentionSettings& settings, int64_t max_tokens) const override {
    return ranks_.front()->max_buffer_pages(settings, max_tokens);
  }

  void set_buffer_pages(SequenceKv& kv, int64_t pages) override {
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->set_buffer_pages(rank_kv(kv, r), pages);
  }

  std::optional<KvCacheCounts> cache_counts(const SequenceKv& kv) const override {
    std::optional<KvCacheCounts> total;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const std::optional<KvCacheCounts> c = ranks_[r]->cache_counts(rank_kv(const_cast<SequenceKv&>(kv), r));
      if (!c) continue;
      if (!total) total.emplace();
      total->hits += c->hits;
      total->misses += c->misses;
    }
    return total;
  }

  bool can_swap(const SequenceKv& kv) const override {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (!ranks_[r]->can_swap(rank_kv(const_cast<SequenceKv&>(kv), r))) return false;
    }
    return true;
  }

  void swap_out(SequenceKv& kv) override {
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->swap_out(rank_kv(kv, r));
  }

  void swap_in(SequenceKv& kv) override {
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->swap_in(rank_kv(kv, r));
  }

  bool single_token_is_decode(const AttentionSettings& settings) const override {
    return ranks_.front()->single_token_is_decode(settings);
  }

  std::optional<KvStoreUsage> usage() const override {
    std::optional<KvStoreUsage> total;
    for (const auto& r : ranks_) {
      const std::optional<KvStoreUsage> u = r->usage();
      if (!u) continue;
      if (!total) {
        total = u;
        continue;
      }
      total->device_pages_used += u->device_pages_used;
      total->device_pages_capacity += u->device_pages_capacity;
      total->host_pages_used += u->host_pages_used;
      total->host_pages_capacity += u->host_pages_capacity;
      total->logical_segments_used += u->logical_segments_used;
      total->resident_segments_used += u->resident_segments_used;
      total->hits += u->hits;
      total->misses += u->misses;
      total->retrieve_bytes += u->retrieve_bytes;
      total->offload_bytes += u->offload_bytes;
      total->evictions += u->evictions;
      total->metadata_device_bytes += u->metadata_device_bytes;
      total->metadata_host_bytes += u->metadata_host_bytes;
      // page_bytes and requests: the same on every rank.
    }
    return total;
  }

 private:
  static SequenceKv& rank_kv(SequenceKv& kv, size_t rank) {
    auto* tp = dynamic_cast<TensorParallelKv*>(&kv);
    SPIN_CHECK(tp != nullptr, "tensor parallel: the sequence was not made by this factory");
    return tp->rank(static_cast<int>(rank));
  }

  std::vector<std::unique_ptr<AttentionFactory>> ranks_;
};

}  // namespace

std::unique_ptr<AttentionFactory> make_tensor_parallel_attention_factory(
    std::vector<std::unique_ptr<AttentionFactory>> ranks) {
  return std::make_unique<TensorParallelAttentionFactory>(std::move(ranks));
}

TensorParallel make_tensor_parallel(const ModelWeights& weights, int world,
                                    const RankFactoryMaker& make_rank_factory, int threads) {
  TensorParallel tp;
  tp.model = make_cpu_tensor_parallel_model(weights, world, threads);
  const AttentionShape shape = tp.model->rank_attention_shape();
  std::vector<std::unique_ptr<AttentionFactory>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(make_rank_factory ? make_rank_factory(r, shape) : make_contiguous_attention_factory(shape));
  }
  tp.factory = make_tensor_parallel_attention_factory(std::move(ranks));
  return tp;
}

}  // namespace spin
