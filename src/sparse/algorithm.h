#pragma once
// The sparse-attention algorithm interface. An algorithm is one class in one file:
//  - Index: build per-partition summaries when pages become complete (end of prefill, and each
//    time decode fills a page);
//  - Select: score the summaries with the current query and return, per KV head, the pages to
//    attend within the step's budget (default: top pages by score_pages);
//  - Attention (optional override): the default is exact attention over sink + selected +
//    window pages.
// Offload and Retrieve belong to the system (kv::KvManager, driven by PagedSparseAttention).
// Algorithms register by name (registry.cpp); nothing else in spin names one. See docs/sparse.md.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_manager.h"
#include "model/attention.h"
#include "sparse/settings.h"

namespace spin::sparse {

// What one decode step of one sequence attended, summed over layers and KV heads. Selected
// tokens are the budgeted part; sinks, window and outliers are reported beside it, never in it.
struct StepBudget {
  uint32_t context_tokens = 0;        // tokens in context, the current one included
  uint32_t budget_tokens = 0;         // selection budget per (layer, KV head) this step
  uint32_t sparse_heads = 0;          // (layer, KV head) pairs that ran Select
  uint32_t max_selected_per_head = 0; // largest selection of one pair, in tokens
  uint64_t selected_tokens = 0;       // sparse layers: tokens of selected pages
  uint64_t sink_tokens = 0;           // sparse layers: sink pages
  uint64_t window_tokens = 0;         // sparse layers: recent window + the page being written
  uint64_t outlier_tokens = 0;        // kept resident by the algorithm itself (e.g. ShadowKV)
  uint64_t estimated_tokens = 0;      // approximated rather than attended (e.g. RetroInfer)
  uint64_t dense_layer_tokens = 0;    // first dense layers: every token of every KV head
};

// Index: pages [first_page, end_page) of every KV head of `layer` just became complete.
struct IndexInput {
  uint32_t layer = 0;
  uint32_t first_page = 0;
  uint32_t end_page = 0;
  // Keys (page_size rows of head_dim floats, RoPE applied) of one complete page of a KV head.
  std::function<const float*(uint32_t kv_head, uint32_t page)> page_keys;
  // The same keys before RoPE; set only for algorithms whose traits ask for pre_rope_keys.
  std::function<const float*(uint32_t kv_head, uint32_t page)> page_keys_pre_rope = nullptr;
  // Values of the same page (RetroInfer's value sums).
  std::function<const float*(uint32_t kv_head, uint32_t page)> page_values = nullptr;
  const RopeTable* rope = nullptr;  // the model's RoPE (null if the caller did not pass it)
  // The prompt's Index at the end of prefill (a prompt with no complete page has none: its first
  // Index is a decode step's), and the pages that are Select candidates at the first decode step
  // (outside sinks and window; 0 and 0 at later calls). They stay candidates for good, so what an
  // algorithm keeps among them (ShadowKV's outlier chunks) is always selectable.
  bool prompt = false;
  uint32_t first_candidate = 0;
  uint32_t end_candidate = 0;
};

struct SelectQuery {
  uint32_t layer = 0;
  const float* q = nullptr;  // [n_heads][head_dim] of the current token, RoPE applied
  uint32_t num_kv_heads = 0;
  uint32_t group = 1;        // KV head g serves query heads [g * group, (g + 1) * group)
  uint32_t context_tokens = 0;
  // Selectable pages: complete, indexed, outside the sinks and the window.
  uint32_t first_candidate = 0;
  uint32_t end_candidate = 0;
  uint32_t budget_pages = 0;  // most pages Select may return per KV head
  const RopeTable* rope = nullptr;  // the model's RoPE (null if the caller did not pass it)
};

// Read access to resident pages (CPU backend: plain pointers into the device tier).
class PageReader {
 public:
  virtual ~PageReader() = default;
  virtual const float* keys(kv::PageId device_page) const = 0;    // page_size rows
  virtual const float* values(kv::PageId device_page) const = 0;  // page_size rows
};

struct AttendInput {
  AttentionShape shape;
  uint32_t page_size = 0;
  uint32_t layer = 0;
  uint32_t context_tokens = 0;  // the last attended page may be partial
  const float* q = nullptr;     // [n_heads][head_dim]
  const kv::LayerSelection* pages = nullptr;  // attended logical pages per KV head, ascending
  std::span<const kv::PageId> device_pages;   // device page of each entry of pages->pages
  const PageReader* memory = nullptr;
  const RopeTable* rope = nullptr;  // the model's RoPE (null if the caller did not pass it)
};

// Every candidate page for every KV head (the dense baselines' Select).
void select_all(const SelectQuery& query, kv::LayerSelection& out);

// Keeps the `keep` ids (keep <= ids.size()) of highest score(id), best first, ties to the lower id:
// the rule of every Select's top-k here (and of the GPU's select_top_pages).
template <typename Score>
void keep_top(std::vector<uint32_t>& ids, size_t keep, Score score) {
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(), [&](uint32_t a, uint32_t b) {
    const float sa = score(a), sb = score(b);
    return sa > sb || (sa == sb && a < b);
  });
  ids.resize(keep);
}

// Exact attention of each KV head's query group over its attended pages; out: [n_heads][head_dim].
void attend_pages(const AttendInput& in, float* out);

class SparseAlgorithm {
 public:
  virtual ~SparseAlgorithm() = default;
  virtual AlgorithmTraits traits() const = 0;
  // Index (summaries). Called only for sparse layers (not the first dense ones).
  virtual void index(const IndexInput& in);
  // Criticality of candidate pages [first_candidate, end_candidate) for one KV head; higher is
  // more important. An algorithm implements this or overrides select.
  virtual void score_pages(const SelectQuery& query, uint32_t kv_head,
                           std::span<float> scores) const;
  // Appends one head per KV head to `out`: distinct candidate pages, at most budget_pages.
  // Default: the budget_pages highest-scoring pages (ties: the lower page).
  virtual void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget& budget);
  // Pages of the latest select's list for `kv_head` that the algorithm keeps outside the budget
  // (ShadowKV's outlier chunks, RetroInfer's not yet clustered decode pages): the pipeline
  // reports them as outlier_tokens instead of selected_tokens. traits().max_unbudgeted_pages
  // bounds them (admission counts that many device pages per KV head).
  virtual uint32_t unbudgeted_pages(uint32_t /*kv_head*/) const { return 0; }
  // Decode attention of one layer; default: attend_pages.
  virtual void attend(const AttendInput& in, float* out);
  // Bytes of summaries the algorithm keeps (metadata accounting).
  virtual uint64_t summary_bytes() const { return 0; }
};

// What a factory gets: the model's attention shape, the store's layout, the raw settings.
struct AlgorithmContext {
  AttentionShape shape;
  kv::KvLayout layout;
  const SparseSettings* settings = nullptr;
};

using AlgorithmFactory =
    std::function<std::unique_ptr<SparseAlgorithm>(const AlgorithmContext& context)>;

class AlgorithmRegistry {
 public:
  // The process-wide registry, holding the built-in algorithms (registry.cpp) from first use.
  static AlgorithmRegistry& global();
  // Throws spin::Error on an empty or duplicate name.
  void add(const std::string& name, AlgorithmFactory factory);
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  // Throws spin::Error listing the registered names when `name` is unknown.
  std::unique_ptr<SparseAlgorithm> create(const std::string& name,
                                          const AlgorithmContext& context) const;

 private:
  std::vector<std::pair<std::string, AlgorithmFactory>> entries_;
};

// ShadowKV's key rank for a model: the settings' or the published share of a layer's key
// dimensions (sparse/shadowkv.cpp). The GPU store factorises at the same rank.
uint32_t shadowkv_rank(const SparseSettings& settings, const AttentionShape& shape);

// For algorithms outside the library (tests, plugins linked as object files):
//   static const AlgorithmRegistrar reg("name", [](const AlgorithmContext& c) { ... });
struct AlgorithmRegistrar {
  AlgorithmRegistrar(const std::string& name, AlgorithmFactory factory) {
    AlgorithmRegistry::global().add(name, std::move(factory));
  }
};

}  // namespace spin::sparse
