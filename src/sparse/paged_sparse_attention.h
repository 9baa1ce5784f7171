#pragma once
// SequenceAttention over the paged two-tier KV store, driving one sparse algorithm for one
// sequence (CPU backend). Prefill stores K/V in device pages and attends densely (exact). When
// prefill ends, the algorithm indexes the complete pages and, unless its placement is Device,
// the KV manager offloads the request so the device keeps only the working set. Each decode
// step, per layer: Index the page that just filled, Select (first dense layers: every page),
// Retrieve sink + selected + window pages through the KV manager, then Attention.
#include <memory>
#include <optional>
#include <vector>

#include "kv/kv_manager.h"
#include "kv/selection_trace.h"
#include "sparse/algorithm.h"

namespace spin::sparse {

class PagedSparseAttention final : public SequenceAttention {
 public:
  // Takes a request slot in `kv` (released by the destructor). `memory` must be the page memory
  // `kv` was built on. Throws spin::Error on bad settings or a shape the store does not hold.
  PagedSparseAttention(kv::KvManager& kv, const kv::HostPageMemory& memory,
                       const AttentionShape& shape, const SparseSettings& settings,
                       const AlgorithmRegistry& registry = AlgorithmRegistry::global());
  ~PagedSparseAttention() override;
  PagedSparseAttention(const PagedSparseAttention&) = delete;
  PagedSparseAttention& operator=(const PagedSparseAttention&) = delete;

  // Multi-token calls are prefill. A single-token call on a non-empty sequence is decode and
  // ends the prefill first if the engine has not called finish_prefill.
  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens,
               float* out) override;
  int64_t length() const override { return length_; }

  // Stores prefill K/V (and pre-RoPE keys) without computing attention: `spin eval` computes one
  // dense prefill and replays its K/V into each algorithm's store.
  void store_prefill(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens);
  // Indexes the prompt's complete pages and offloads per the algorithm's placement.
  void finish_prefill();
  // Records each decode step's selection per (sparse layer, KV head) into `trace` as `request`
  // (null: stop recording). The trace must outlive the recording.
  void record_selections(kv::SelectionTrace* trace, uint32_t request) {
    trace_ = trace;
    trace_request_ = request;
  }
  bool prefill_done() const { return prefill_done_; }

  kv::RequestId request() const { return request_; }
  const ResolvedSettings& settings() const { return settings_; }
  const SparseAlgorithm& algorithm() const { return *algorithm_; }
  // Accounting of the latest decode step (all layers).
  const StepBudget& last_step() const { return last_step_; }

 private:
  class DevicePages;
  void prefill_attention(uint32_t layer, uint32_t pos0, uint32_t n, const float* q, float* out);
  void decode_attention(uint32_t layer, uint32_t pos, const float* q, float* out);
  // Layer checks, page reservation and K/V writes shared by forward and store_prefill.
  void store_tokens(uint32_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens);
  // `prompt`: set at the end of prefill (the prompt's complete pages), with the first decode step's
  // window.
  void index_pages(uint32_t layer, uint32_t first_page, uint32_t end_page,
                   std::optional<DecodeWindow> prompt = std::nullopt);
  void keep_pre_rope_keys(uint32_t layer, uint32_t pos0, uint32_t n, const float* k_pre_rope);

  kv::KvManager& kv_;
  const kv::HostPageMemory& memory_;
  AttentionShape shape_;
  std::unique_ptr<SparseAlgorithm> algorithm_;
  ResolvedSettings settings_;
  std::unique_ptr<DevicePages> reader_;
  kv::RequestId request_;
  int64_t length_ = 0;
  bool prefill_done_ = false;
  uint64_t step_ = 0;
  StepBudget last_step_;
  const RopeTable* rope_ = nullptr;
  kv::SelectionTrace* trace_ = nullptr;
  uint32_t trace_request_ = 0;
  // Algorithms that summarise pre-RoPE keys: per (layer, KV head), the pre-RoPE keys of the
  // tokens from the first page not yet indexed on ([token][head_dim]); indexing drops them.
  std::vector<std::vector<float>> pre_rope_;
  std::vector<uint32_t> pre_rope_first_page_;  // per layer
  // Scratch reused across layers.
  kv::LayerSelection selected_;
  kv::LayerSelection attended_;
  std::vector<kv::PageId> device_pages_;
};

}  // namespace spin::sparse
