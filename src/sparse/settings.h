#pragma once
// Per-request sparse-attention settings, and their resolution against the KV store and the
// algorithm's published defaults into the concrete numbers the pipeline runs with.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kv/kv_manager.h"
#include "model/attention.h"
#include "sparse/seer_gate.h"

namespace spin::sparse {

// RetroInfer's published k-means segment (the CUDA backend sizes its scratch for it at compile time).
inline constexpr uint32_t kRetroInferSegmentTokens = 8192;

struct SparseSettings {
  std::string algorithm = "dense";  // a name in AlgorithmRegistry
  // Selection budget per KV head and step, in tokens; sinks and the recent window come on top.
  uint32_t budget_tokens = 2048;
  // When > 0: the budget is this fraction (0, 1] of the tokens in context at each step, and
  // budget_tokens is ignored.
  double budget_fraction = 0.0;
  uint32_t page_size = 0;  // partition size in tokens; 0 = the store's page size (must match)
  // Always-attended tokens at the start (sinks) and complete pages before the page being written
  // (window), multiples of the page size. Default: the store's always-resident pages.
  std::optional<uint32_t> sink_tokens = std::nullopt;
  std::optional<uint32_t> window_tokens = std::nullopt;
  // Leading layers that attend densely. Default: the algorithm's (Quest: 2).
  std::optional<uint32_t> first_dense_layers = std::nullopt;
  // Algorithm-specific options (0 / empty: the algorithm's published default, see docs/sparse.md).
  uint32_t shadowkv_rank = 0;          // rank of the pre-RoPE key factorisation
  uint32_t shadowkv_outliers = 48;     // outlier chunks kept resident per KV head
  uint32_t seer_block_tokens = 64;     // Seer block (a multiple of the page size)
  std::shared_ptr<const SeerGate> seer_gate = {};  // trained gate weights; null: training-free
  uint32_t retroinfer_segment_tokens = kRetroInferSegmentTokens;  // k-means segment
  uint32_t retroinfer_cluster_tokens = 16;    // average tokens per cluster
  uint32_t retroinfer_recluster_tokens = 1024;  // decode tokens clustered together
  double retroinfer_estimate_fraction = 0.232;  // clusters estimated after the exact ones
};

// Where a request's KV lives once its prefill is done.
enum class Placement : uint8_t {
  Device,   // never offloaded: every page stays on the device tier (the dense baseline)
  Offload,  // host tier holds all; device keeps the working set + buffer (sparse algorithms)
  Stream,   // host tier holds all; each layer's pages are fetched per step and dropped after
};

// What an algorithm declares about itself (its published defaults).
struct AlgorithmTraits {
  Placement placement = Placement::Offload;
  uint32_t first_dense_layers = 0;
  uint32_t min_selected_pages = 0;  // selection never goes below this many pages (Quest: 3)
  // Pages per (sparse layer, KV head) that select() may add beyond the budget (the pages
  // unbudgeted_pages() reports: ShadowKV's outlier chunks, RetroInfer's decode pages not yet
  // clustered), at most the context's pages. Admission counts them in the device working set.
  uint32_t max_unbudgeted_pages = 0;
  // Index also gets the keys before RoPE (ShadowKV, Seer); the pipeline then keeps the pre-RoPE
  // keys of the pages not yet indexed.
  bool pre_rope_keys = false;
  // The algorithm's default sinks / recent window in tokens (rounded up to whole pages), used when
  // the settings give none; unset: the store's always-resident pages.
  std::optional<uint32_t> sink_tokens = std::nullopt;
  std::optional<uint32_t> window_tokens = std::nullopt;
};

// The pages of a decode step whose token goes into page `current`: sinks [0, sink_end),
// selectable candidates [sink_end, window_start), recent window [window_start, current].
struct DecodeWindow {
  uint32_t sink_end = 0;
  uint32_t window_start = 0;
  uint32_t candidates() const { return window_start - sink_end; }
};

struct ResolvedSettings {
  std::string algorithm;
  AlgorithmTraits traits;
  uint32_t page_size = 0;
  uint32_t budget_tokens = 0;   // used when budget_fraction == 0
  double budget_fraction = 0.0;
  uint32_t sink_pages = 0;
  uint32_t window_pages = 0;
  uint32_t first_dense_layers = 0;
  // Pages the selection may take at a step with `context_tokens` tokens in context.
  uint32_t budget_pages(uint32_t context_tokens) const;
  DecodeWindow decode_window(uint32_t current_page) const;
};

// Throws spin::Error naming the offending setting.
ResolvedSettings resolve_settings(const SparseSettings& settings, const AlgorithmTraits& traits,
                                  const AttentionShape& shape, const kv::KvConfig& store);

}  // namespace spin::sparse
