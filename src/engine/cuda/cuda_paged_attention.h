#pragma once
// Paged attention on the GPU: the KV store the CUDA model attends through and the AttentionFactory
// the Engine gets per-request KV from (admitting and preempting by its pages). Six algorithms run
// here: `dense` (every page on the device), `quest`, `seer`, `shadowkv` and `retroinfer` (sparse
// decode over a two-tier store; Seer with its training-free gate) and `dense-offload` (every page attended,
// those between sinks and window read from the host tier by the attention kernel itself,
// zero-copy, at each step: the offloading baseline).
//
// The pool is one device allocation of bf16 pages; a page holds page_size tokens of K and V for
// ONE (layer, KV head), as on the CPU (kv/layout.h). Dense attention needs the same positions in
// every (layer, KV head) at once, so pages are handed out in groups, one page per (layer, KV head)
// for the same page_size positions, through kv::IdPool (the pool code of the CPU store). Group g's
// page of (layer l, KV head h) has id g * kv_heads + h in layer l's slice of the pool, so one page
// list per (sequence, KV head) serves every layer and a step uploads lists for one layer's worth of
// pages, not n_layers of them.
//
// Per step (DeviceAttention::begin_step) the store allocates the new tokens' groups, builds the
// slot maps and page lists once on the host, uploads them, and per layer launches
// store_kv_pages_bf16, then paged_decode_attention for single-token chunks and
// paged_prefill_attention for longer ones (kernels/cuda).
//
// Sparse requests, when the store has a host tier (pinned host memory the GPU reads directly):
// prefill is dense, with every token also written through to the host tier. At the first decode
// step the store indexes every complete page (Quest's min/max key summaries, Seer's key sums,
// ShadowKV's landmarks, outlier chunks and the low-rank factors of the prompt's pre-RoPE keys, or
// RetroInfer's k-means clusters and their records, on the device) and keeps on the device only the sink and recent-window pages plus a cache of slots
// per (layer, KV head) (and ShadowKV's factors); the first dense layers keep all their pages, in
// groups that exist only in those layers' slices of the pool (which are larger). Each decode step,
// per sparse layer, with no host round trip: Index the page that just filled, score the candidate
// pages against the queries, select the top pages per KV head, Retrieve them into the cache slots
// (bucketed LRU, zero-copy gather of the misses from the host tier; ShadowKV fetches only the
// values of prompt pages and rebuilds their keys from the factors), then attend over sinks +
// selected + window (RetroInfer then adds its estimation zone's clusters to the attention's
// output, merged through its log-sum-exp). RetroInfer clusters the decode pages that wait
// unclustered once they make a segment, eagerly at the start of that step, from the host tier.
// dense-offload shares Quest's prefill, write-through and transition (without summaries or cache
// slots), so its first dense layers also stay on the device (the pool's layout); its decode lists
// name the host-tier pages directly (negative ids, kernels/cuda/paged_attention.h), and a step
// with only dense-offload rows runs no Index or Select kernels. A decoding host-tier sequence
// (ShadowKV's and RetroInfer's excepted: their factors and records live only on the device) can be
// swapped out under device
// pressure: its first dense layers' pages (not written through) are copied to the host tier and
// every device page goes; swap_in brings back those layers, sinks and window, and its cache
// restarts empty.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/attention_factory.h"
#include "model/rope.h"
#include "sparse/seer_gate.h"

namespace spin {

// Benchmarks: where the GPU time of one sparse decode step went, and what it selected.
struct SparseStepProfile {
  // GPU time summed over the sparse layers (events between the phases).
  double score_ms = 0.0;      // Index of the page that filled, and the candidates' scores
  double select_ms = 0.0;     // per-(row, KV head) top-k
  double retrieve_ms = 0.0;   // cache check, gather of the misses from the host tier
  double rebuild_ms = 0.0;    // ShadowKV's keys of the fetched prompt pages, from the factors
  double attention_ms = 0.0;  // decode attention of the sparse layers
  int64_t kv_heads = 0;
  // [sparse layer][decode row * kv_heads + KV head]: the logical pages it selected, ascending.
  std::vector<std::vector<std::vector<int32_t>>> selected;
};

struct CudaPagedKvConfig {
  int device = 0;
  int64_t page_size = 16;    // tokens per page: a multiple of 8 in [8, 64]
  // Pages (one layer x KV head each) in the pool; 0: as many as --gpu-memory-utilization leaves.
  int64_t device_pages = 0;
  // Share of the GPU's memory the whole process may take (vLLM's meaning): the pool gets what
  // is left of it after what is allocated already (weights, activations), less a margin.
  double gpu_memory_utilization = 0.9;
  int64_t max_batch = 1;     // requests decoding together (sizes the step tables up front)
  int64_t max_context = 0;   // tokens per request
  // Host tier in pages (one layer x KV head each), pinned and mapped; 0: none, and only `dense`
  // runs. Sparse requests hold their whole KV there after the prefill.
  int64_t host_pages = 0;
  // Benchmarks only: when > 0 and below the host tier's bytes, the tier is this much pinned memory
  // mapped over and over (RepeatedHostMemory), so a tier larger than the machine's RAM can be
  // timed. Sequences then share their host pages' bytes: their KV is not kept apart.
  size_t host_tier_backing_bytes = 0;
  // With a host tier: the share of the device pool's bytes for the first dense layers of sparse
  // requests (every page of those layers stays on the device).
  double dense_layer_share = 0.2;
  // Cache slots of a sparse request per (layer, KV head): (1 + buffer_factor) x its largest
  // selection (SPEC: a buffer of up to 5x the mandatory pages).
  double buffer_factor = 5.0;
  // The model's RoPE: Seer and ShadowKV turn the stored keys back to pre-RoPE ones. Empty: both
  // are refused.
  RopeTable rope;
  // ShadowKV's key rank for every request of this store; 0: the published share of the model's
  // key dimensions (sparse::shadowkv_rank).
  uint32_t shadowkv_rank = 0;
  // ShadowKV's outlier chunks per (layer, KV head) for every request; unset: the published 48.
  std::optional<uint32_t> shadowkv_outliers;
  // The prefill attention kernel of every prefill (cuda::PagedPrefillParams::variant; -1: the
  // default). For benchmarks that compare kernels in one process.
  int prefill_variant = -1;
  // Quest, Seer and RetroInfer read a step's cache misses from the host tier in the decode
  // attention, which also fills their cache slots (one pass over the link, no separate fetch);
  // false: Retrieve fetches them into the slots first. For benchmarks that compare the two.
  bool fetch_in_attention = true;
  // Seer's trained gate for every Seer request (shaped for this store's KV heads; a
  // tensor-parallel rank's share); null: the training-free gate.
  std::shared_ptr<const sparse::SeerGate> seer_gate;
};

class CudaKvStore;

class CudaPagedAttentionFactory final : public AttentionFactory {
 public:
  CudaPagedAttentionFactory(const AttentionShape& shape, const CudaPagedKvConfig& config);
  ~CudaPagedAttentionFactory() override;

  std::vector<std::string> algorithms() const override;
  void validate(const AttentionSettings& settings) const override;
  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings, int64_t max_tokens) override;
  // Dense: one device page per (layer, KV head) per page_size tokens. Quest: the same during the
  // prefill, then the sinks, window and cache slots of every layer plus all pages of the first
  // dense layers; every page also in the host tier.
  KvDemand demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens, bool decoding,
                  int64_t block_tokens) const override;
  KvDemand capacity() const override;
  bool single_token_is_decode(const AttentionSettings& settings) const override;
  std::optional<KvStoreUsage> usage() const override;
  // Elastic buffer (quest, seer): cache slots beyond the selection, in groups of a page per
  // (layer, KV head); demand() counts only the selection's slots.
  int64_t buffer_streams(const AttentionSettings& settings) const override;
  int64_t max_buffer_pages(const AttentionSettings& settings, int64_t max_tokens) const override;
  void set_buffer_pages(SequenceKv& kv, int64_t pages) override;
  // Preemption by swap of a decoding quest, seer or dense-offload sequence: its KV stays in the
  // host tier (the first dense layers' pages are copied there first) and every device page goes.
  bool can_swap(const SequenceKv& kv) const override;
  void swap_out(SequenceKv& kv) override;
  void swap_in(SequenceKv& kv) override;

  // Benchmarks: makes `kv` hold `tokens` more tokens without computing them (their K/V are
  // whatever the pages hold). Dense decode time depends on how many keys there are, not on their
  // values, so long contexts can be timed without prefilling them. A sparse sequence must still be
  // in its prefill: it takes the pages a prefill of those tokens would (device, first dense layers,
  // host tier, summary chunks), and its first decode step indexes them. Throws kv::PoolExhausted
  // when short.
  void append_uncomputed(SequenceKv& kv, int64_t tokens);
  // Benchmarks: every device page gets uniform random values of RMS 1 (in [-√3, √3)), so uncomputed
  // keys rank differently for different queries (a sparse selection over all-equal keys would never
  // change). RMS 1 is the scale of the keys and values the dummy models compute (normed inputs,
  // weights of standard deviation 1/sqrt(fan_in), norm gains near 1): at a smaller scale the pages
  // decode writes would likely outrank the uncomputed ones and take more of the selections as
  // decode goes on.
  void randomize_device_pages(uint64_t seed);
  int64_t pool_bytes() const;
  int64_t page_size() const;
  // Benchmarks: device pages (one layer x KV head each) a decode step's attention reads for one
  // sequence with `tokens` tokens in context, the new one included: every page for dense and in
  // the first dense layers; in the others, sinks, selection (Quest) and window. dense-offload
  // reads the rest of its pages from the host tier.
  int64_t decode_pages_read(const AttentionSettings& settings, int64_t tokens) const;
  // Cache slots per (sparse layer, KV head) of a sequence with these settings and capacity, its
  // whole buffer included.
  int64_t cache_slots(const AttentionSettings& settings, int64_t max_tokens) const;
  // Benchmarks: while on, every decode step that selects pages records its SparseStepProfile. Its
  // events and copies cannot be captured: run those steps with CUDA graphs off. Read a step's
  // profile after its outputs reached the host, before the next step.
  void set_step_profiling(bool on);
  SparseStepProfile last_step_profile() const;

 private:
  AttentionShape shape_;
  std::shared_ptr<CudaKvStore> store_;  // shared with every sequence handle (they free into it)
};

// Tensor parallelism: rank r's store on GPU r (config.device is ignored) for one rank's share of
// the heads, every rank with the same number of pages: config.device_pages each, or (0) the
// smallest pool that --gpu-memory-utilization leaves on any of the GPUs, so whatever fits one
// rank's store fits them all. Call after the ranks' models are on their GPUs.
std::vector<std::unique_ptr<CudaPagedAttentionFactory>> make_cuda_rank_factories(const AttentionShape& rank_shape,
                                                                                 CudaPagedKvConfig config, int world);

}  // namespace spin
