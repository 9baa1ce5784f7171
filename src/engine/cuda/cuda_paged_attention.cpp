#include "engine/cuda/cuda_paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <span>
#include <unordered_set>

#include "base/half.h"
#include "engine/cuda/repeated_host_memory.h"
#include "engine/cuda/shadowkv_factors.h"
#include "engine/paged_attention_factory.h"
#include "kernels/cuda/fill.h"
#include "kernels/cuda/gather.h"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/page_cache.h"
#include "kernels/cuda/paged_attention.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/seer_gate.h"
#include "kernels/cuda/retroinfer.h"
#include "kernels/cuda/shadowkv.h"
#include "kernels/cuda/sparse_select.h"
#include "kv/page_pool.h"
#include "model/cuda/device_buffer.h"
#include "model/device_attention.h"
#include "sparse/algorithm.h"

namespace spin {

namespace {

using bf16 = __nv_bfloat16;

// Decode grids are sized for a power-of-two bound of the context (at least this), so steps whose
// longest sequence grew by a few tokens keep the same launch shape and CUDA graph.
constexpr int64_t kMinContextBucket = 64;
// Left free when the pool is sized from --gpu-memory-utilization: CUDA graphs, step tables,
// split-K workspace and the allocator's own growth come after the pool.
constexpr double kPoolMarginBytes = 1.0 * (int64_t{1} << 30);
// The decode kernel's limit on query heads per KV head.
constexpr int64_t kMaxGroup = 8;
// A logical page of a sparse request that has no device group (it lives in the host tier only).
constexpr uint32_t kNoGroup = std::numeric_limits<uint32_t>::max();
// Events per sparse layer of a profiled step: before Index+scores, select, retrieve, the key
// rebuild and attention, and after attention.
constexpr int kProfileEvents = 6;
// Blocks (so SMs) a swap's page copies may use; swaps happen between steps, so the GPU is idle.
constexpr int kSwapCopyBlocks = 64;
// RetroInfer's k-means takes as many KV heads per launch as their scratch fits in this (at least
// one): each job's sort is one block, so a launch of one head's few segments leaves most SMs idle.
// 384 MiB holds all 8 KV heads of a 32K-token prompt.
constexpr size_t kClusterScratchBudget = size_t{384} << 20;
// The algorithms that keep a request's KV in the host tier, by their registry names: Quest,
// Seer's training-free gate, ShadowKV and RetroInfer (Index and Select as sparse/quest.cpp,
// sparse/seer.cpp, sparse/shadowkv.cpp and sparse/retroinfer.cpp), and dense-offload (every page attended, those outside sinks and
// window read from the host tier at each step). Quest's published defaults set the pool's layout
// (its first dense layers).
enum class HostTierAlgorithm : uint8_t { quest, seer, shadowkv, retroinfer, dense_offload };
constexpr const char* kQuest = "quest";
constexpr const char* kSeer = "seer";
constexpr const char* kShadowKv = "shadowkv";
constexpr const char* kRetroInfer = "retroinfer";
constexpr const char* kDenseOffload = "dense-offload";

std::optional<HostTierAlgorithm> host_tier_algorithm(const std::string& name) {
  if (name == kQuest) return HostTierAlgorithm::quest;
  if (name == kSeer) return HostTierAlgorithm::seer;
  if (name == kShadowKv) return HostTierAlgorithm::shadowkv;
  if (name == kRetroInfer) return HostTierAlgorithm::retroinfer;
  if (name == kDenseOffload) return HostTierAlgorithm::dense_offload;
  return std::nullopt;
}

bool uses_host_tier(const AttentionSettings& s) { return host_tier_algorithm(s.algorithm).has_value(); }

int64_t context_bucket(int64_t tokens) {
  int64_t bucket = kMinContextBucket;
  while (bucket < tokens) bucket *= 2;
  return bucket;
}

// Quest summary chunks covering `pages` logical pages.
int64_t summary_chunks_for(int64_t pages) {
  return (pages + cuda::kSummaryChunkPages - 1) / cuda::kSummaryChunkPages;
}

// The summary chunks a store with a host tier keeps: its host groups' pages, and one chunk more
// per sequence for the pages not yet written through.
int64_t store_summary_chunks(const AttentionShape& shape, const CudaPagedKvConfig& c) {
  return summary_chunks_for(c.host_pages / (shape.n_layers * shape.n_kv_heads)) + c.max_batch;
}

// Elements (bf16) of the summaries of `chunks` chunks: each page's key minimum and maximum.
size_t summary_elems(const AttentionShape& shape, int64_t chunks) {
  return static_cast<size_t>(shape.n_layers * chunks * shape.n_kv_heads * cuda::kSummaryChunkPages * 2 *
                             shape.head_dim);
}

// A host-tier sequence's decode step whose token goes to position `pos`: its window, the pages it
// selects (dense-offload selects none; ShadowKV its `unbudgeted` outlier chunks beyond the budget)
// and the pages it attends to (sinks, then the selection or, for dense-offload, every candidate,
// then the window through the current page).
struct DecodePlan {
  sparse::DecodeWindow window;
  int64_t selected = 0;
  int64_t attended = 0;
};

DecodePlan plan_decode(const sparse::ResolvedSettings& r, bool offload, int64_t pos, int64_t unbudgeted) {
  const auto current = static_cast<uint32_t>(pos / r.page_size);
  DecodePlan plan{.window = r.decode_window(current)};
  const sparse::DecodeWindow& w = plan.window;
  plan.selected = offload ? 0
                          : std::min<int64_t>(r.budget_pages(static_cast<uint32_t>(pos + 1)) + unbudgeted,
                                              w.candidates());
  plan.attended = int64_t{w.sink_end} + (offload ? int64_t{w.candidates()} : plan.selected) + current + 1 -
                  w.window_start;
  return plan;
}

}  // namespace

class CudaSequenceKv;

// Page groups of a store: sized from the GPU's free memory or the flags.
struct PoolSizes {
  uint32_t groups = 0;      // usable page groups (the scratch group not counted)
  uint32_t low_groups = 0;  // groups of the first dense layers only
  int64_t dense_layers = 0;
  sparse::AlgorithmTraits quest_traits;  // Quest's published defaults (the pool's layout)
};

// What a sequence that decodes from the host tier (quest, seer, dense-offload) holds besides its
// device page groups.
struct SparseKv {
  sparse::ResolvedSettings settings;
  HostTierAlgorithm algorithm = HostTierAlgorithm::quest;  // settings.algorithm, for the step tables
  // dense-offload: no selection, summaries or cache; attention reads the pages between sinks and
  // window straight from the host tier (zero-copy).
  bool offload() const { return algorithm == HostTierAlgorithm::dense_offload; }
  // Cache slots per (layer, KV head): the largest selection, plus an elastic buffer the engine
  // sizes (set_buffer_pages). The cache holds selection_slots + buffer_slots groups.
  int64_t selection_slots = 0;
  int64_t buffer_slots = 0;
  int64_t cache_target() const { return selection_slots + buffer_slots; }
  std::vector<uint32_t> low;     // per logical page: its group in the first dense layers
  std::vector<uint32_t> host;    // per logical page: its host-tier group
  std::vector<uint32_t> chunks;  // per kSummaryChunkPages logical pages: the summary chunk
  std::vector<uint32_t> cache;   // the cache slots' groups, from the first decode step on
  // ShadowKV, from the first decode step on: the groups of its factors (the basis's, then A's; see
  // kernels/cuda/shadowkv.h), the prompt pages they cover (whose keys are rebuilt, not fetched),
  // and its outlier chunks per (layer, KV head), selected beyond the budget.
  // RetroInfer: `factors` are the groups of its cluster records (kernels/cuda/retroinfer.h), which
  // cover its first clustered_pages logical pages; the later ones are selected beyond the budget.
  std::vector<uint32_t> factors;
  int64_t factored_pages = 0;
  int64_t unbudgeted = 0;
  int64_t clustered_pages = 0;
  bool decoding = false;         // the prefill ended: only sinks, window and cache stay on the device
  uint32_t now = 0;              // decode steps so far (the cache's LRU stamps)
  // Preempted by swap: no device group at all; resident_pages are the logical pages that had one
  // (sinks and window), which swap_in gives back.
  bool swapped = false;
  std::vector<uint32_t> resident_pages;
};

namespace {

// Summary chunks a sequence needs for `pages` logical pages (dense-offload keeps no summaries,
// RetroInfer keeps cluster records instead).
int64_t summary_chunks(const SparseKv& sp, int64_t pages) {
  return sp.offload() || sp.algorithm == HostTierAlgorithm::retroinfer ? 0 : summary_chunks_for(pages);
}

}  // namespace

// The device pool, its page groups, the host tier, and the tables of the step being run.
class CudaKvStore final : public DeviceAttention {
 public:
  CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& config);
  CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& config, const PoolSizes& sizes);
  ~CudaKvStore() override;
  CudaKvStore(const CudaKvStore&) = delete;
  CudaKvStore& operator=(const CudaKvStore&) = delete;

  DeviceStepLayout begin_step(std::span<const SequenceChunk> chunks, int64_t rows, cudaStream_t stream) override;
  void forward(int64_t layer, const cuda::QkRopeParams& qk, bf16* out, cudaStream_t stream) override;

  int64_t pages_for(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  int64_t pages_per_group() const { return shape_.n_layers * shape_.n_kv_heads; }
  int64_t pages_per_low_group() const { return dense_layers_ * shape_.n_kv_heads; }
  int64_t usable_groups() const { return groups_total_ - 1; }
  int64_t page_size() const { return page_size_; }
  int64_t pool_bytes() const { return static_cast<int64_t>(pool_.bytes()); }
  bool has_host_tier() const { return host_groups_total_ > 0; }
  int64_t dense_layers() const { return dense_layers_; }
  int64_t shadowkv_outliers() const { return shadowkv_outliers_; }
  int64_t shadowkv_factor_groups(int64_t pages) const { return factor_groups_for(pages); }
  // RetroInfer's cluster records of `pages` logical pages, in groups.
  int64_t record_groups_for(int64_t pages) const { return (pages + retroinfer_records_ - 1) / retroinfer_records_; }
  int64_t retroinfer_segment_pages() const {
    return std::max<int64_t>(1, sparse::SparseSettings{}.retroinfer_segment_tokens / page_size_);
  }
  // Whether the token at `pos` completes a page with a segment's worth of complete pages waiting
  // unclustered before it (sparse/retroinfer.cpp clusters those then).
  bool recluster_due(const SparseKv& sp, int64_t pos) const {
    return (pos + 1) % page_size_ == 0 &&
           (pos / page_size_ - sp.clustered_pages) * page_size_ >= sparse::SparseSettings{}.retroinfer_recluster_tokens;
  }
  // Resolves a quest request's settings (spin::Error naming what the GPU store cannot run).
  sparse::ResolvedSettings resolve_sparse(const AttentionSettings& settings) const;
  // Cache slots per (layer, KV head): the largest selection of a sequence of max_tokens tokens,
  // and the most buffer slots beside it (buffer_factor times the selection, and no more than the
  // pages the selection and the always-resident pages leave out).
  int64_t selection_slots(const sparse::ResolvedSettings& r, int64_t max_tokens) const;
  int64_t max_buffer_slots(const sparse::ResolvedSettings& r, int64_t max_tokens) const;
  // Marks every slot of these cache groups empty in every (layer, KV head): on `stream` (in a step),
  // or with none at once, waiting for it (between steps).
  void reset_cache_slots(std::span<const uint32_t> groups, cudaStream_t stream);
  // Resizes a sequence's buffer; a decoding one's cache gains or loses groups at once.
  void set_buffer_slots(CudaSequenceKv& kv, int64_t slots);

  // Grows `groups` to `count` groups, all or nothing (kv::PoolExhausted when short).
  void grow(std::vector<uint32_t>& groups, int64_t count);
  // A sparse sequence's prefill growth to `pages` logical pages in every pool, all or nothing.
  void grow_prefill(std::vector<uint32_t>& groups, SparseKv& sparse, int64_t pages);
  // Gives back a sequence's groups of every pool.
  void release(std::vector<uint32_t>& groups, SparseKv* sparse);
  void randomize_device_pages(uint64_t seed);
  // Preemption by swap of a decoding host-tier sequence. swap_out copies the first dense layers'
  // pages (the only ones not written through) to their host-tier pages and gives back every device
  // group; swap_in takes groups again and copies back the dense layers and the sink and window pages.
  bool can_swap(const CudaSequenceKv& kv) const;
  void swap_out(CudaSequenceKv& kv);
  void swap_in(CudaSequenceKv& kv);
  KvStoreUsage usage() const;
  KvDemand capacity() const;
  void set_step_profiling(bool on);
  SparseStepProfile last_step_profile() const;
  std::atomic<int64_t> live_sequences{0};

 private:
  // The current step: row counts and where each table lies in the uploaded block.
  struct Step {
    int64_t rows = 0;           // rows of qkv / out, padding included
    int64_t decode_rows = 0;    // leading rows run by the decode kernel (padding included)
    int64_t prefill_seqs = 0;   // chunks of more than one token, after the decode rows
    int64_t max_new_tokens = 0; // longest prefill chunk
    int64_t context_bucket = 0; // decode kernel's max_tokens
    bool sparse_rows = false;   // some row belongs to a sparse sequence
    bool sparse_decode = false; // some decode row selects pages (Quest or Seer)
    bool quest_decode = false;  // some decode row runs Quest's Index and scores
    bool seer_decode = false;   // some decode row runs Seer's
    bool shadowkv_decode = false;  // some decode row runs ShadowKV's (and rebuilds keys)
    bool retroinfer_decode = false;  // some decode row runs RetroInfer's (and its estimation)
    // The sparse layers' decode attention reads the misses and fills their slots (no ShadowKV row,
    // whose key rebuild needs them in place first); fill_pages is then uploaded.
    bool fetch_in_attention = false;
    int32_t max_clusters = 0;        // RetroInfer's cluster slots of the context bucket
    int32_t max_candidates = 0;
    // ShadowKV: the most pages an item's key rebuild may take, the step's largest selection
    // rounded up to a power of two (>= 16), which keys the step's graph.
    int32_t rebuild_bound = 0;
    const int32_t* page_of = nullptr;
    const int32_t* low_page_of = nullptr;
    const int32_t* host_page_of = nullptr;
    const int32_t* slot_of = nullptr;
    const int32_t* decode_offsets = nullptr;
    const int32_t* decode_tokens = nullptr;
    const int32_t* decode_pages = nullptr;
    const int32_t* low_decode_offsets = nullptr;
    const int32_t* low_decode_tokens = nullptr;
    const int32_t* low_decode_pages = nullptr;
    const int32_t* prefill_offsets = nullptr;
    const int32_t* prefill_token_offsets = nullptr;
    const int32_t* prefill_first_pos = nullptr;
    const int32_t* prefill_pages = nullptr;
    const int32_t* low_prefill_pages = nullptr;
    // The sparse pipeline, per decode row (padding and dense rows select nothing).
    const int32_t* first_candidate = nullptr;
    const int32_t* end_candidate = nullptr;
    const int32_t* quest_end = nullptr;  // end_candidate for Quest rows, first_candidate for others
    const int32_t* seer_end = nullptr;   // the same for Seer rows
    const int32_t* shadowkv_end = nullptr;  // the same for ShadowKV rows
    const int32_t* retroinfer_end = nullptr;  // the same for RetroInfer rows
    // RetroInfer, per decode row: clustered pages and their cluster slots (0 for other rows), and
    // zeros (the first slot of its estimation zone's select); per item where that select writes.
    const int32_t* clustered_pages = nullptr;
    const int32_t* cluster_slots = nullptr;
    const int32_t* zeros = nullptr;
    const int32_t* zone_offsets = nullptr;
    const int32_t* rebuild_end = nullptr;   // per decode row: ShadowKV's factored pages, else 0
    const int32_t* factor_offsets = nullptr;
    const int32_t* factor_dir = nullptr;
    int32_t* rebuild_pages = nullptr;       // written by retrieve, read by the key rebuild
    int32_t* rebuild_logical = nullptr;
    int32_t* rebuild_counts = nullptr;
    // Retrieve in two launches (kernels/cuda/page_cache.h): the plan's copy lists, for the fetch.
    int32_t* copy_src = nullptr;
    int32_t* copy_dst = nullptr;
    int32_t* copy_counts = nullptr;
    // ShadowKV's transitions: per decode row the candidates the outliers come from, per item how
    // many and where the select writes them.
    const int32_t* outlier_first = nullptr;
    const int32_t* outlier_end = nullptr;
    const int32_t* outlier_counts = nullptr;
    const int32_t* outlier_offsets = nullptr;
    const int32_t* current_page = nullptr;
    const int32_t* dir_offsets = nullptr;
    const int32_t* summary_dir = nullptr;
    const int32_t* host_offsets = nullptr;
    const int32_t* host_groups = nullptr;
    const int32_t* cache_offsets = nullptr;
    const int32_t* cache_groups = nullptr;
    const uint32_t* now = nullptr;
    const int32_t* counts = nullptr;  // per decode item: pages to select
    const int32_t* needed_offsets = nullptr;
    int32_t* needed = nullptr;        // written by select, read by retrieve
    const int32_t* out_offsets = nullptr;
    int32_t* decode_pages_mutable = nullptr;  // retrieve writes the selected pages' device ids here
    // Indexed like decode_pages, with fetch_in_attention: the device page a miss fills (written by
    // retrieve's plan), -1 elsewhere.
    int32_t* fill_pages = nullptr;
    const int32_t* index_src = nullptr;       // per decode item: the page it completed (Quest), or -1
    const int32_t* seer_index_src = nullptr;  // the same for Seer
    const int32_t* shadowkv_index_src = nullptr;  // the same for ShadowKV
    const int32_t* index_dst = nullptr;
    const int32_t* index_page = nullptr;      // logical page of index_src / seer_index_src
  };

  // Complete pages to index at once (sequences whose prefill just ended): source page, summary
  // entry, logical page.
  struct IndexList {
    std::vector<int32_t> src, dst, page;
    std::vector<int32_t> runs;  // Seer: where each block's run of (src, dst, page) starts (one KV head, in page order)
  };
  // RetroInfer's k-means jobs of a step (kernels/cuda/retroinfer.h), one per (segment, KV head):
  // the pages of each (device ids, or ~host ids), its first logical page and KV head, and the
  // decode row whose summary groups it writes. Kept per launch, a group of KV heads: a head's jobs
  // read and write only that head's pages, so the launches run one after another through one
  // launch's worth of scratch.
  struct ClusterJobs {
    std::vector<int32_t> page_ids, page_offsets{0}, first_page, head;
    std::vector<int64_t> row;
  };
  // Adds jobs for logical pages [first, end) of decode row `row`, in segments of segment_pages,
  // reading page p of KV head h from id(p, h), to the launch of h's group (jobs.size() launches
  // of heads_per_cluster_launch heads).
  void add_cluster_jobs(std::vector<ClusterJobs>& jobs, int64_t row, int64_t first, int64_t end,
                        const std::function<int32_t(int64_t, int64_t)>& id) const;
  // KV heads per k-means launch when a layer's heads go in `launches` equal groups (the last smaller).
  int64_t heads_per_cluster_launch(int64_t launches) const { return (shape_.n_kv_heads + launches - 1) / launches; }
  // A ShadowKV sequence whose prefill just ended: its decode row, and its prompt's complete pages
  // to factorise: page_id of each, [page][KV head], from `first` in its IndexList's src (which
  // Index reads too).
  struct Factorisation {
    int64_t row = 0;
    int64_t pages = 0;
    int64_t first = 0;
    int64_t factor_at = 0;  // its factor groups' place in the step's factor directory
  };

  cuda::PagedDecodeParams decode_params(int64_t decode_rows, int64_t bucket) const;
  // Seer's Index over layer `layer`'s slice for the gate in use (k_gate set only for the trained
  // gate), without its page lists, and its launch.
  cuda::SeerTrainedIndexParams seer_index_params(int64_t layer) const;
  void seer_index(const cuda::SeerTrainedIndexParams& p, cudaStream_t stream, const char* what) const;
  // Where RetroInfer's cluster records of layer `layer` are (without their directory).
  cuda::RetroInferRecords retroinfer_records(int64_t layer) const;
  // Copies pages src[i] to dst[i] (ids within each layer's slice) in layers [first, end), between
  // the device pool and the host tier in the direction `to_host`, and waits for the copies.
  void copy_tier_pages(int64_t first_layer, int64_t end_layer, const std::vector<int32_t>& device_ids,
                       const std::vector<int32_t>& host_ids, bool to_host);
  // The first dense layers' pages [0, pages) of a sequence, between their device groups and
  // their host-tier pages (which the write-through skips).
  void copy_dense_layers(const SparseKv& sp, int64_t pages, bool to_host);
  // Element offset of layer l's slice of the pool (the first dense layers' slices are larger).
  size_t layer_offset(int64_t layer) const;
  size_t host_layer_offset(int64_t layer) const {
    return static_cast<size_t>(layer * host_groups_total_ * shape_.n_kv_heads) * page_elems_;
  }
  size_t summary_layer_offset(int64_t layer) const {
    return static_cast<size_t>(layer * chunks_total_ * shape_.n_kv_heads * cuda::kSummaryChunkPages * 2 *
                               shape_.head_dim);
  }
  // Id in a layer slice of group g's page of KV head h.
  int32_t page_id(uint32_t group, int64_t head) const {
    return static_cast<int32_t>(int64_t{group} * shape_.n_kv_heads + head);
  }
  int32_t low_page_id(uint32_t low, int64_t head) const { return page_id(static_cast<uint32_t>(groups_total_) + low, head); }
  // Summary entry (kernels/cuda/sparse_select.h) of logical page p of KV head h in chunk c.
  int32_t summary_entry(uint32_t chunk, int64_t head, int64_t page) const {
    return static_cast<int32_t>(
        cuda::summary_entry(chunk, static_cast<int>(shape_.n_kv_heads), static_cast<int>(head), page));
  }
  // The first decode step of a sparse sequence: keeps sinks and window, takes the cache slots (and
  // ShadowKV's factor or RetroInfer's record groups) from the rest first, leaves what remains in
  // transition_freed_, and adds every complete page to `to_index` (RetroInfer's to `jobs`).
  void end_prefill(CudaSequenceKv& kv, int64_t pos, const sparse::DecodeWindow& window, IndexList& to_index,
                   std::vector<ClusterJobs>& jobs, int64_t row, cudaStream_t stream);
  // ShadowKV's factor groups for a prompt of `pages` complete pages: the basis's, then A's.
  int64_t factor_groups_for(int64_t pages) const {
    return shadowkv_basis_groups_ + (pages + shadowkv_factor_pages_ - 1) / shadowkv_factor_pages_;
  }
  // The ShadowKV transitions' Index in layer `layer`, after the step's tables are up: landmarks of
  // their prompt pages (src / dst / score_at: num_pages entries of the step tables) and outlier
  // chunks.
  void shadowkv_transition(int64_t layer, int64_t num_pages, const int32_t* src, const int32_t* dst,
                           const int32_t* score_at, cudaStream_t stream);
  // The factorisation of each job's prompt keys (prompt_ids: the transitions' page list) in every
  // sparse layer. Waits for the stream.
  void shadowkv_factorise(const std::vector<Factorisation>& jobs, const int32_t* prompt_ids, cudaStream_t stream);

  AttentionShape shape_;
  int device_;
  int64_t page_size_;
  mutable std::mutex mutex_;  // guards the id pools (handles free into them from any thread)
  kv::IdPool groups_;         // page groups handed to sequences; the scratch group is not in it
  kv::IdPool low_groups_;     // groups of the first dense layers only
  kv::IdPool host_pool_;      // host-tier groups; the scratch group is not in it
  kv::IdPool chunk_pool_;     // summary chunks
  int64_t group_size_ = 0;    // query heads per KV head
  int64_t q_width_ = 0;
  int64_t groups_total_ = 0;  // page groups in the pool, the scratch group (the last) included
  int64_t low_total_ = 0;     // groups only the first dense layers' slices have (after groups_total_)
  int64_t dense_layers_ = 0;  // the first dense layers of sparse requests
  sparse::AlgorithmTraits quest_traits_;
  // Seer's defaults, with the pool's first dense layers (it publishes none; the pool keeps Quest's).
  sparse::AlgorithmTraits seer_traits_;
  int64_t seer_block_pages_ = 0;     // pages per Seer block; 0: seer is unavailable, for seer_refusal_
  std::string seer_refusal_;
  // Seer's trained gate, bf16, all layers ([layer][KV head][rows][head_dim], sparse/seer_gate.h),
  // and the step's gate queries; empty: the training-free gate.
  DeviceBuffer<bf16> seer_k_gate_, seer_q_gate_;
  DeviceBuffer<float> seer_gate_queries_;
  bool seer_trained() const { return seer_k_gate_.get() != nullptr; }
  void upload_seer_gate(const sparse::SeerGate& gate, int64_t max_batch);
  // ShadowKV's defaults, with the pool's first dense layers; its key rank (the store's, every
  // request's) and outlier chunks; empty refusal: available.
  sparse::AlgorithmTraits shadowkv_traits_;
  int64_t shadowkv_rank_ = 0;
  int64_t shadowkv_outliers_ = 0;
  // Its factors' layout (kernels/cuda/shadowkv.h): groups of the basis, prompt pages per A group.
  int64_t shadowkv_basis_groups_ = 0;
  int64_t shadowkv_factor_pages_ = 1;
  std::string shadowkv_refusal_;
  std::unique_ptr<ShadowKvFactorizer> factorizer_;
  // RetroInfer's defaults, with the pool's first dense layers; its records' layout
  // (kernels/cuda/retroinfer.h); empty refusal: available.
  sparse::AlgorithmTraits retroinfer_traits_;
  int64_t retroinfer_slots_ = 1;
  int64_t retroinfer_records_ = 1;
  std::string retroinfer_refusal_;
  DeviceBuffer<char> cluster_scratch_;      // RetroInfer's k-means
  // Groups the step's transitions freed and did not take back: the pool gets them once those
  // transitions' reads are launched.
  std::vector<uint32_t> transition_freed_;
  void release_transition_groups();
  DeviceBuffer<float> totals_;              // RetroInfer's cluster scores
  DeviceBuffer<uint8_t> zone_flags_;        // RetroInfer's estimation zone: candidates, scores,
  DeviceBuffer<float> zone_scores_;         // counts and clusters
  DeviceBuffer<int32_t> zone_counts_;
  DeviceBuffer<int32_t> zone_tallies_;
  DeviceBuffer<int32_t> zone_;
  DeviceBuffer<float> lse_;                 // the decode attention's log-sum-exp per query head
  DeviceBuffer<float> estimate_partials_;   // RetroInfer's estimation, per (item, split)
  DeviceBuffer<float> logits_;              // ShadowKV's and RetroInfer's per-head logits (score scratch)
  DeviceBuffer<int32_t> outlier_pages_;     // the transitions' outlier chunks (select scratch)
  DeviceBuffer<unsigned long long> value_only_;  // per decode row: misses that fetched values only
  DeviceBuffer<float> inv_freq_;     // the model's RoPE, for Seer and ShadowKV
  bool neox_ = true;
  int64_t host_groups_total_ = 0;  // host-tier groups, its scratch group (the last) included
  int64_t chunks_total_ = 0;
  int64_t max_cache_slots_ = 0;
  double buffer_factor_ = 0.0;
  int prefill_variant_ = -1;
  bool fetch_in_attention_ = true;
  size_t page_elems_ = 0;     // bf16 elements of one page (K then V)
  DeviceBuffer<bf16> pool_;
  bf16* host_ = nullptr;      // the host tier (cudaHostAlloc, mapped), unless host_copies_ stands in
  std::unique_ptr<RepeatedHostMemory> host_copies_;  // host_tier_backing_bytes, repeated (benchmarks)
  bf16* host_device_ = nullptr;
  DeviceBuffer<bf16> summaries_;
  DeviceBuffer<int32_t> slot_page_;
  DeviceBuffer<uint32_t> slot_stamp_;
  DeviceBuffer<float> scores_;
  DeviceBuffer<unsigned long long> counters_;  // per decode row: hits, misses, evictions (summed ever)
  DeviceBuffer<int> cache_error_;
  PinnedBuffer<int> cache_error_seen_;  // cache_error_ as of the end of the last sparse step

  PinnedBuffer<int32_t> tables_host_;
  DeviceBuffer<int32_t> tables_;
  DeviceBuffer<bf16> decode_q_;      // the decode rows' q heads, contiguous (the kernel's input)
  DeviceBuffer<char> workspace_;     // split-K partial results
  cudaEvent_t upload_done_ = nullptr;
  // Retrieve's own stream for ShadowKV's fetch, forked from the step's stream and joined back
  // within a layer, and its events. It has the device's highest priority, which eager steps get
  // and captured graphs keep (CudaModel instantiates them with node priorities).
  cudaStream_t retrieve_stream_ = nullptr;
  cudaEvent_t retrieve_fork_ = nullptr, retrieve_join_ = nullptr;
  uint64_t epoch_ = 0;
  Step step_;

  // Benchmarks (set_step_profiling): 5 events per sparse layer around its phases, each layer's
  // selection copied to the host, and the step's counts and offsets into it.
  bool profiling_ = false;
  std::vector<cudaEvent_t> profile_events_;
  PinnedBuffer<int32_t> profile_selected_;
  std::vector<int32_t> profile_counts_, profile_offsets_;
  int64_t profile_entries_ = 0;  // entries of the selection per layer this step

  DeviceBuffer<int32_t> swap_ids_;  // page id lists of a swap's copies
};

class CudaSequenceKv final : public DeviceSequenceKv {
 public:
  CudaSequenceKv(std::shared_ptr<CudaKvStore> store, int64_t max_tokens, std::unique_ptr<SparseKv> sparse)
      : store_(std::move(store)), max_tokens_(max_tokens), sparse_(std::move(sparse)) {
    ++store_->live_sequences;
  }
  ~CudaSequenceKv() override {
    store_->release(groups_, sparse_.get());
    --store_->live_sequences;
  }
  CudaSequenceKv(const CudaSequenceKv&) = delete;
  CudaSequenceKv& operator=(const CudaSequenceKv&) = delete;

  int64_t length() const override { return length_; }
  DeviceAttention& store() override { return *store_; }

  const CudaKvStore* owner() const { return store_.get(); }
  int64_t max_tokens() const { return max_tokens_; }
  std::vector<uint32_t>& groups() { return groups_; }
  SparseKv* sparse() { return sparse_.get(); }
  const SparseKv* sparse() const { return sparse_.get(); }
  void stored(int64_t end) { length_ = std::max(length_, end); }

 private:
  std::shared_ptr<CudaKvStore> store_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  // Group j holds positions [j * page_size, (j + 1) * page_size); a sparse sequence past its
  // prefill keeps groups only for its sinks and window (kNoGroup elsewhere).
  std::vector<uint32_t> groups_;
  std::unique_ptr<SparseKv> sparse_;
};

namespace {

kv::KvLayout store_layout(const AttentionShape& shape, int64_t page_size) {
  return kv::KvLayout{static_cast<uint32_t>(shape.n_layers), static_cast<uint32_t>(shape.n_kv_heads),
                      static_cast<uint32_t>(shape.head_dim), static_cast<uint32_t>(page_size), kv::ElemType::F32};
}

// An algorithm's published defaults (they do not depend on settings).
sparse::AlgorithmTraits algorithm_traits(const char* name, const AttentionShape& shape, int64_t page_size) {
  const sparse::SparseSettings settings{.algorithm = name};
  return sparse::AlgorithmRegistry::global()
      .create(name, sparse::AlgorithmContext{shape, store_layout(shape, page_size), &settings})
      ->traits();
}

// Whether Seer's trained gate can run on a store of `page_size`-token pages: its Index keeps a
// block's running pools in the summaries of the block's first three pages, within one chunk.
bool trained_seer_blocks_fit(int64_t page_size) {
  const int64_t block = sparse::SparseSettings{}.seer_block_tokens;
  const int64_t pages = block / page_size;
  return block % page_size == 0 && pages >= 3 && cuda::kSummaryChunkPages % pages == 0;
}

// Checks what the kernels support and returns the pool's groups (the scratch group not counted).
PoolSizes pool_sizes(const AttentionShape& shape, const CudaPagedKvConfig& c) {
  SPIN_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
             "CUDA attention: bad shape ({} layers, {} heads, {} KV heads)", shape.n_layers, shape.n_heads,
             shape.n_kv_heads);
  SPIN_CHECK(shape.head_dim == 64 || shape.head_dim == 128,
             "the CUDA attention kernels support head_dim 64 or 128; this model has {}", shape.head_dim);
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  SPIN_CHECK(group >= 1 && group <= kMaxGroup,
             "the CUDA attention kernels support 1..{} query heads per KV head; this model has {}", kMaxGroup, group);
  SPIN_CHECK(c.page_size >= 8 && c.page_size <= 64 && c.page_size % 8 == 0,
             "--block-size must be a multiple of 8 in 8..64 on the CUDA backend, got {}", c.page_size);
  SPIN_CHECK(c.max_batch > 0 && c.max_context > 0 && c.max_context < std::numeric_limits<int32_t>::max(),
             "CUDA KV store: max batch {} and context {} must be positive (context < 2^31)", c.max_batch,
             c.max_context);
  SPIN_CHECK(c.host_pages >= 0, "--kv-host-pages must be >= 0, got {}", c.host_pages);
  SPIN_CHECK(std::isfinite(c.dense_layer_share) && c.dense_layer_share >= 0.0 && c.dense_layer_share < 1.0,
             "the dense-layer share of the KV pool must be in [0, 1), got {}", c.dense_layer_share);
  SPIN_CHECK(std::isfinite(c.buffer_factor) && c.buffer_factor >= 0.0 && c.buffer_factor <= 64.0,
             "the KV buffer factor must be in [0, 64], got {}", c.buffer_factor);
  cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
  if (c.seer_gate) c.seer_gate->check_shape(shape);  // before anything is allocated

  PoolSizes sizes;
  if (c.host_pages > 0) {
    sizes.quest_traits = algorithm_traits(kQuest, shape, c.page_size);
    sizes.dense_layers = std::min<int64_t>(sizes.quest_traits.first_dense_layers, shape.n_layers);
  }
  const double page_bytes = 2.0 * c.page_size * shape.head_dim * sizeof(bf16);
  const double group_bytes = static_cast<double>(shape.n_layers * shape.n_kv_heads) * page_bytes;
  const double low_group_bytes = static_cast<double>(sizes.dense_layers * shape.n_kv_heads) * page_bytes;
  double budget = 0.0;
  if (c.device_pages > 0) {
    budget = static_cast<double>(c.device_pages) * page_bytes;
    SPIN_CHECK(budget >= group_bytes, "--kv-device-pages {} is less than one page per layer and KV head ({})",
               c.device_pages, shape.n_layers * shape.n_kv_heads);
  } else {
    SPIN_CHECK(std::isfinite(c.gpu_memory_utilization) && c.gpu_memory_utilization > 0.0 &&
                   c.gpu_memory_utilization <= 1.0,
               "--gpu-memory-utilization must be in (0, 1], got {}", c.gpu_memory_utilization);
    size_t free_bytes = 0, total_bytes = 0;
    cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    const double in_use = static_cast<double>(total_bytes - free_bytes);
    budget = c.gpu_memory_utilization * static_cast<double>(total_bytes) - in_use - kPoolMarginBytes;
    SPIN_CHECK(budget >= 2.0 * group_bytes,
               "--gpu-memory-utilization {} of {:.1f} GB leaves {:.2f} GB for the KV cache after {:.1f} GB in use "
               "(weights, activations) and a {:.1f} GB margin; raise it or use a smaller model",
               c.gpu_memory_utilization, total_bytes / 1e9, std::max(budget, 0.0) / 1e9, in_use / 1e9,
               kPoolMarginBytes / 1e9);
    budget -= group_bytes;  // the padding rows' scratch group
    // The page summaries, made after the pool: a page's worth for every page_size pages of the host
    // tier (22 GB beside a 344 GB tier).
    if (c.host_pages > 0) {
      budget -= static_cast<double>(summary_elems(shape, store_summary_chunks(shape, c)) * sizeof(bf16));
      SPIN_CHECK(budget >= group_bytes,
                 "--gpu-memory-utilization {} leaves no room for a KV pool beside the summaries of a {:.1f} GB host "
                 "tier (--kv-host-pages {}); raise it or shrink the host tier",
                 c.gpu_memory_utilization, static_cast<double>(c.host_pages) * page_bytes / 1e9, c.host_pages);
    }
    // Seer's trained gate, uploaded after the pool where it can run.
    if (c.seer_gate && c.host_pages > 0 && !c.rope.inv_freq.empty() && trained_seer_blocks_fit(c.page_size))
      budget -= static_cast<double>((c.seer_gate->k.size() + c.seer_gate->q.size()) * sizeof(bf16));
  }
  const double low_budget = sizes.dense_layers > 0 ? budget * c.dense_layer_share : 0.0;
  // Page ids within a layer's slice (group * kv_heads + head) are int32 in the kernels.
  const int64_t max_groups = std::numeric_limits<int32_t>::max() / shape.n_kv_heads - 1;
  const auto low = sizes.dense_layers > 0 ? static_cast<int64_t>(low_budget / low_group_bytes) : 0;
  const auto main = static_cast<int64_t>((budget - static_cast<double>(low) * low_group_bytes) / group_bytes);
  SPIN_CHECK(main >= 1, "the KV pool holds no page group ({:.2f} GB)", budget / 1e9);
  sizes.groups = static_cast<uint32_t>(std::min(main, max_groups / 2));
  sizes.low_groups = static_cast<uint32_t>(std::min(low, max_groups / 2));
  return sizes;
}

}  // namespace

CudaKvStore::CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& c)
    : CudaKvStore(shape, c, pool_sizes(shape, c)) {}

CudaKvStore::CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& c, const PoolSizes& sizes)
    : shape_(shape),
      device_(c.device),
      page_size_(c.page_size),
      groups_("CUDA KV page groups", sizes.groups),
      low_groups_("CUDA KV page groups of the first dense layers", sizes.low_groups),
      host_pool_("CUDA KV host tier groups",
                 c.host_pages > 0 ? static_cast<uint32_t>(std::max<int64_t>(
                                        1, c.host_pages / (shape.n_layers * shape.n_kv_heads) - 1))
                                  : 0),
      chunk_pool_("CUDA KV summary chunks",
                  c.host_pages > 0 ? static_cast<uint32_t>(store_summary_chunks(shape, c)) : 0) {
  group_size_ = shape.n_heads / shape.n_kv_heads;
  q_width_ = shape.n_heads * shape.head_dim;
  groups_total_ = int64_t{groups_.capacity()} + 1;
  low_total_ = low_groups_.capacity();
  dense_layers_ = sizes.dense_layers;
  quest_traits_ = sizes.quest_traits;
  buffer_factor_ = c.buffer_factor;
  prefill_variant_ = c.prefill_variant;
  fetch_in_attention_ = c.fetch_in_attention;
  page_elems_ = static_cast<size_t>(2 * page_size_ * shape.head_dim);
  pool_.reserve(layer_offset(shape.n_layers), "KV cache pool");
  // Zeros, not leftover bytes, in pages no token has written (benchmarks time uncomputed KV).
  cuda_check(cudaMemset(pool_.get(), 0, pool_.bytes()), "KV pool clear");
  if (c.host_pages > 0) {
    host_groups_total_ = int64_t{host_pool_.capacity()} + 1;
    chunks_total_ = chunk_pool_.capacity();
    const size_t host_bytes = static_cast<size_t>(host_groups_total_ * pages_per_group()) * page_elems_ * sizeof(bf16);
    if (c.host_tier_backing_bytes > 0 && c.host_tier_backing_bytes < host_bytes) {
      host_copies_ = std::make_unique<RepeatedHostMemory>(host_bytes, c.host_tier_backing_bytes);
      host_device_ = static_cast<bf16*>(host_copies_->data());
    } else {
      void* host = nullptr;
      if (const cudaError_t pinned = cudaHostAlloc(&host, host_bytes, cudaHostAllocMapped); pinned != cudaSuccess) {
        cudaGetLastError();
        fail("cannot pin {:.2f} GB of host memory for the KV host tier (--kv-host-pages): {}", host_bytes / 1e9,
             cudaGetErrorString(pinned));
      }
      host_ = static_cast<bf16*>(host);
      void* mapped = nullptr;
      cuda_check(cudaHostGetDevicePointer(&mapped, host, 0), "host tier mapping");
      host_device_ = static_cast<bf16*>(mapped);
    }
    summaries_.reserve(summary_elems(shape, chunks_total_), "Quest page summaries");
    const auto state = static_cast<size_t>(groups_total_ * pages_per_group());
    slot_page_.reserve(state, "KV cache slot table");
    slot_stamp_.reserve(state, "KV cache slot stamps");
    cuda_check(cudaMemset(slot_page_.get(), 0xff, slot_page_.bytes()), "KV cache slot table clear");
    cuda_check(cudaMemset(slot_stamp_.get(), 0, slot_stamp_.bytes()), "KV cache slot stamps clear");
    max_cache_slots_ = std::min<int64_t>(groups_.capacity(), cuda::kMaxCacheSlots);
    seer_traits_ = algorithm_traits(kSeer, shape, page_size_);
    seer_traits_.first_dense_layers = static_cast<uint32_t>(dense_layers_);
    const uint32_t block = sparse::SparseSettings{}.seer_block_tokens;
    shadowkv_traits_ = algorithm_traits(kShadowKv, shape, page_size_);
    shadowkv_traits_.first_dense_layers = static_cast<uint32_t>(dense_layers_);
    sparse::SparseSettings shadowkv{.algorithm = kShadowKv, .shadowkv_rank = c.shadowkv_rank};
    shadowkv.shadowkv_outliers = c.shadowkv_outliers.value_or(shadowkv.shadowkv_outliers);
    shadowkv_rank_ = sparse::shadowkv_rank(shadowkv, shape);
    shadowkv_outliers_ = shadowkv.shadowkv_outliers;
    if (shadowkv_rank_ > 0) {
      shadowkv_basis_groups_ = cuda::shadowkv_basis_groups(static_cast<int>(page_size_), static_cast<int>(shape.head_dim),
                                                           static_cast<int>(shadowkv_rank_));
      shadowkv_factor_pages_ = cuda::shadowkv_pages_per_factor_group(
          static_cast<int>(shape.n_kv_heads), static_cast<int>(shape.head_dim), static_cast<int>(shadowkv_rank_));
    }
    retroinfer_traits_ = algorithm_traits(kRetroInfer, shape, page_size_);
    retroinfer_traits_.first_dense_layers = static_cast<uint32_t>(dense_layers_);
    retroinfer_slots_ = cuda::retroinfer_slots_per_page(static_cast<int>(page_size_),
                                                         static_cast<int>(sparse::SparseSettings{}.retroinfer_cluster_tokens));
    retroinfer_records_ = cuda::retroinfer_records_per_page(static_cast<int>(page_size_), static_cast<int>(shape.head_dim),
                                                            static_cast<int>(retroinfer_slots_));
    if (retroinfer_records_ < 1) {
      retroinfer_records_ = 1;
      retroinfer_refusal_ = fmt::format("retroinfer's cluster records do not fit a {}-token page on the CUDA backend",
                                        page_size_);
    }
    const int64_t width = shape.n_kv_heads * shape.head_dim;
    int shared_per_block = 0;
    cuda_check(cudaDeviceGetAttribute(&shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_),
               "shared memory per block");
    const int64_t max_rank = std::min<int64_t>(
        {width, page_size_ * shape.head_dim,
         cuda::shadowkv_max_rank(static_cast<int>(shape.head_dim), static_cast<int>(page_size_),
                                 static_cast<size_t>(shared_per_block))});
    if (c.rope.inv_freq.size() != static_cast<size_t>(shape.head_dim / 2)) {
      seer_refusal_ = "seer on the CUDA backend needs the model's RoPE table (the store was made without it)";
      shadowkv_refusal_ = "shadowkv on the CUDA backend needs the model's RoPE table (the store was made without it)";
    } else {
      inv_freq_.reserve(c.rope.inv_freq.size(), "RoPE frequencies");
      cuda_check(cudaMemcpy(inv_freq_.get(), c.rope.inv_freq.data(), inv_freq_.bytes(), cudaMemcpyHostToDevice),
                 "RoPE frequencies upload");
      neox_ = c.rope.neox;
      if (block % page_size_ != 0) {
        seer_refusal_ = fmt::format("seer's {}-token blocks are not whole {}-token pages (--block-size)", block, page_size_);
      } else if (c.seer_gate && !trained_seer_blocks_fit(page_size_)) {
        seer_refusal_ = fmt::format("seer's trained gate on the CUDA backend needs {}-token blocks of at least 3 pages "
                                    "(--block-size 8 or 16, not {})", block, page_size_);
      } else {
        seer_block_pages_ = block / page_size_;
        if (c.seer_gate) upload_seer_gate(*c.seer_gate, c.max_batch);
      }
      if (shadowkv_rank_ < 8 || shadowkv_rank_ > max_rank || shadowkv_rank_ % 8 != 0) {
        shadowkv_refusal_ = fmt::format("shadowkv's key rank {} is not a multiple of 8 in 8..{} (the CUDA backend's "
                                        "bound for this model and {}-token pages)", shadowkv_rank_, max_rank, page_size_);
      } else {
        factorizer_ = std::make_unique<ShadowKvFactorizer>(device_);
      }
    }
  }
  // The clears run on the legacy stream, which the model's non-blocking stream does not wait for.
  cuda_check(cudaDeviceSynchronize(), "KV pool clear");
  cuda_check(cudaEventCreateWithFlags(&upload_done_, cudaEventDisableTiming), "event creation");
  // Buffers for a full decode batch (rounded up as the model pads it) at full context, so serving
  // never reallocates them, which would drop the model's CUDA graphs.
  const int64_t max_rows = (c.max_batch + 7) / 8 * 8;
  decode_q_.reserve(static_cast<size_t>(max_rows * q_width_), "decode queries");
  size_t workspace_bytes = 0;
  for (int64_t rows = 1; rows <= max_rows; rows = rows < 8 ? rows * 2 : rows + 8) {
    for (int64_t bucket = kMinContextBucket;; bucket *= 2) {
      workspace_bytes = std::max(workspace_bytes, cuda::paged_decode_workspace_bytes(decode_params(rows, bucket)));
      if (bucket >= c.max_context) break;
    }
  }
  workspace_.reserve(workspace_bytes, "decode split-K workspace");
  if (has_host_tier()) {
    const int64_t candidates = pages_for(context_bucket(c.max_context));
    scores_.reserve(static_cast<size_t>(max_rows * shape.n_kv_heads * candidates), "Quest page scores");
    counters_.reserve(static_cast<size_t>(max_rows * 3), "KV cache counters");
    cuda_check(cudaMemset(counters_.get(), 0, counters_.bytes()), "KV cache counters clear");
    value_only_.reserve(static_cast<size_t>(max_rows), "KV cache counters");
    cuda_check(cudaMemset(value_only_.get(), 0, value_only_.bytes()), "KV cache counters clear");
    cache_error_.reserve(1, "KV cache error flag");
    cuda_check(cudaMemset(cache_error_.get(), 0, cache_error_.bytes()), "KV cache error flag clear");
    cache_error_seen_.reserve(1);
    cache_error_seen_[0] = 0;
    int lowest = 0, highest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "stream priorities");
    cuda_check(cudaStreamCreateWithPriority(&retrieve_stream_, cudaStreamNonBlocking, highest), "Retrieve stream");
    cuda_check(cudaEventCreateWithFlags(&retrieve_fork_, cudaEventDisableTiming), "event creation");
    cuda_check(cudaEventCreateWithFlags(&retrieve_join_, cudaEventDisableTiming), "event creation");
    cuda_check(cudaDeviceSynchronize(), "KV cache clear");
  }
  epoch_ = new_buffers_epoch();
}

CudaKvStore::~CudaKvStore() {
  // The last handle may go on any thread (the engine's): free on this store's GPU.
  cudaSetDevice(device_);
  if (upload_done_) cudaEventDestroy(upload_done_);
  if (retrieve_fork_) cudaEventDestroy(retrieve_fork_);
  if (retrieve_join_) cudaEventDestroy(retrieve_join_);
  if (retrieve_stream_) cudaStreamDestroy(retrieve_stream_);
  for (cudaEvent_t e : profile_events_) cudaEventDestroy(e);
  if (host_) cudaFreeHost(host_);
}

size_t CudaKvStore::layer_offset(int64_t layer) const {
  const int64_t wide = std::min(layer, dense_layers_);
  const int64_t groups = wide * (groups_total_ + low_total_) + (layer - wide) * groups_total_;
  return static_cast<size_t>(groups * shape_.n_kv_heads) * page_elems_;
}

sparse::ResolvedSettings CudaKvStore::resolve_sparse(const AttentionSettings& settings) const {
  SPIN_CHECK(has_host_tier(), "attention algorithm '{}' needs the KV host tier on the CUDA backend (--kv-host-pages)",
             settings.algorithm);
  const HostTierAlgorithm algorithm = *host_tier_algorithm(settings.algorithm);
  SPIN_CHECK(algorithm != HostTierAlgorithm::seer || seer_block_pages_ > 0, "{}", seer_refusal_);
  SPIN_CHECK(algorithm != HostTierAlgorithm::shadowkv || factorizer_ != nullptr, "{}", shadowkv_refusal_);
  sparse::SparseSettings s = to_sparse_settings(settings);
  if (algorithm == HostTierAlgorithm::retroinfer) {
    // One record layout and one estimation kernel per store: the published cluster size, segment,
    // re-clustering and estimation share.
    const sparse::SparseSettings published;
    SPIN_CHECK(retroinfer_refusal_.empty(), "{}", retroinfer_refusal_);
    SPIN_CHECK(s.retroinfer_cluster_tokens == published.retroinfer_cluster_tokens &&
                   s.retroinfer_segment_tokens == published.retroinfer_segment_tokens &&
                   s.retroinfer_recluster_tokens == published.retroinfer_recluster_tokens &&
                   s.retroinfer_estimate_fraction == published.retroinfer_estimate_fraction,
               "retroinfer on the CUDA backend runs with its published settings ({}-token clusters, {}-token "
               "segments, re-clustering every {} tokens, {} of the clusters estimated); the others run with --device cpu",
               published.retroinfer_cluster_tokens, published.retroinfer_segment_tokens,
               published.retroinfer_recluster_tokens, published.retroinfer_estimate_fraction);
    static_assert(sparse::kRetroInferSegmentTokens <= cuda::kRetroInferMaxSegmentTokens);
  }
  kv::KvConfig store;
  store.layout = store_layout(shape_, page_size_);
  // dense-offload keeps Quest's sinks, window and first dense layers (the pool's layout); its
  // budget is unused.
  if (algorithm == HostTierAlgorithm::dense_offload) s.algorithm = kQuest;
  const sparse::AlgorithmTraits& traits = algorithm == HostTierAlgorithm::seer         ? seer_traits_
                                          : algorithm == HostTierAlgorithm::shadowkv   ? shadowkv_traits_
                                          : algorithm == HostTierAlgorithm::retroinfer ? retroinfer_traits_
                                                                                       : quest_traits_;
  sparse::ResolvedSettings r = sparse::resolve_settings(s, traits, shape_, store);
  r.algorithm = settings.algorithm;
  SPIN_CHECK(r.first_dense_layers == static_cast<uint32_t>(dense_layers_),
             "on the CUDA backend {} runs with its {} first dense layers, not {}", settings.algorithm, dense_layers_,
             r.first_dense_layers);
  return r;
}

int64_t CudaKvStore::selection_slots(const sparse::ResolvedSettings& r, int64_t max_tokens) const {
  if (r.algorithm == kDenseOffload) return 0;
  const int64_t largest = r.budget_pages(static_cast<uint32_t>(std::min<int64_t>(max_tokens, UINT32_MAX))) +
                          (r.algorithm == kShadowKv     ? shadowkv_outliers_
                           : r.algorithm == kRetroInfer ? int64_t{retroinfer_traits_.max_unbudgeted_pages}
                                                        : 0);
  SPIN_CHECK(largest <= cuda::kMaxSelectedPages && largest <= max_cache_slots_,
             "a {}-page selection exceeds what the GPU selects per KV head ({} pages)", largest,
             std::min<int64_t>(cuda::kMaxSelectedPages, max_cache_slots_));
  return largest;
}

int64_t CudaKvStore::max_buffer_slots(const sparse::ResolvedSettings& r, int64_t max_tokens) const {
  const int64_t selection = selection_slots(r, max_tokens);
  if (selection == 0) return 0;
  const auto wanted = static_cast<int64_t>(std::ceil(static_cast<double>(selection) * buffer_factor_));
  const int64_t left_out = pages_for(max_tokens) - (int64_t{r.sink_pages} + r.window_pages + 1) - selection;
  return std::clamp<int64_t>(std::min(wanted, left_out), 0, max_cache_slots_ - selection);
}

void CudaKvStore::set_buffer_slots(CudaSequenceKv& kv, int64_t slots) {
  SparseKv& sp = *kv.sparse();
  sp.buffer_slots = slots;
  if (!sp.decoding || sp.swapped) return;  // the cache is made (or made again) at that size
  std::vector<uint32_t> fresh;
  {
    std::lock_guard lock(mutex_);
    const int64_t missing = sp.cache_target() - static_cast<int64_t>(sp.cache.size());
    if (missing > 0) groups_.require(static_cast<uint64_t>(missing));
    while (static_cast<int64_t>(sp.cache.size()) < sp.cache_target()) {
      sp.cache.push_back(groups_.alloc());
      fresh.push_back(sp.cache.back());
    }
    // The groups that leave take their cached pages with them.
    while (static_cast<int64_t>(sp.cache.size()) > sp.cache_target()) {
      groups_.free(sp.cache.back());
      sp.cache.pop_back();
    }
  }
  reset_cache_slots(fresh, nullptr);
}

void CudaKvStore::reset_cache_slots(std::span<const uint32_t> groups, cudaStream_t stream) {
  if (groups.empty()) return;
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  // A group's slot state is contiguous: one entry per (layer, KV head).
  const size_t per_group = static_cast<size_t>(pages_per_group());
  for (uint32_t g : groups) {
    cuda_check(cudaMemsetAsync(slot_page_.get() + g * per_group, 0xff, per_group * sizeof(int32_t), stream),
               "KV cache slot reset");
  }
  // The model's stream does not wait for the legacy one.
  if (stream == nullptr) cuda_check(cudaStreamSynchronize(nullptr), "KV cache slot reset");
}

void CudaKvStore::grow(std::vector<uint32_t>& groups, int64_t count) {
  std::lock_guard lock(mutex_);
  const int64_t missing = count - static_cast<int64_t>(groups.size());
  if (missing <= 0) return;
  groups_.require(static_cast<uint64_t>(missing));
  while (static_cast<int64_t>(groups.size()) < count) groups.push_back(groups_.alloc());
}

void CudaKvStore::grow_prefill(std::vector<uint32_t>& groups, SparseKv& sp, int64_t pages) {
  const int64_t chunks = summary_chunks(sp, pages);
  const auto missing = [pages](const std::vector<uint32_t>& v) {
    return static_cast<uint64_t>(std::max<int64_t>(0, pages - static_cast<int64_t>(v.size())));
  };
  std::lock_guard lock(mutex_);
  groups_.require(missing(groups));
  low_groups_.require(missing(sp.low));
  host_pool_.require(missing(sp.host));
  chunk_pool_.require(static_cast<uint64_t>(std::max<int64_t>(0, chunks - static_cast<int64_t>(sp.chunks.size()))));
  while (static_cast<int64_t>(groups.size()) < pages) groups.push_back(groups_.alloc());
  while (static_cast<int64_t>(sp.low.size()) < pages) sp.low.push_back(low_groups_.alloc());
  while (static_cast<int64_t>(sp.host.size()) < pages) sp.host.push_back(host_pool_.alloc());
  while (static_cast<int64_t>(sp.chunks.size()) < chunks) sp.chunks.push_back(chunk_pool_.alloc());
}

void CudaKvStore::randomize_device_pages(uint64_t seed) {
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  const float rms_one = std::sqrt(3.0f);  // U(-a, a) has RMS a / sqrt(3)
  cuda_check(cuda::fill_dummy_bf16(pool_.get(), static_cast<int64_t>(pool_.size()), seed, 0, 0.0f, rms_one, nullptr),
             "KV pool fill");
  cuda_check(cudaDeviceSynchronize(), "KV pool fill");
}

void CudaKvStore::release(std::vector<uint32_t>& groups, SparseKv* sparse) {
  std::lock_guard lock(mutex_);
  for (uint32_t g : groups) {
    if (g != kNoGroup) groups_.free(g);
  }
  groups.clear();
  if (sparse == nullptr) return;
  for (uint32_t g : sparse->cache) groups_.free(g);
  for (uint32_t g : sparse->low) low_groups_.free(g);
  for (uint32_t g : sparse->host) host_pool_.free(g);
  for (uint32_t g : sparse->chunks) chunk_pool_.free(g);
  for (uint32_t g : sparse->factors) groups_.free(g);
  sparse->factors.clear();
  sparse->cache.clear();
  sparse->low.clear();
  sparse->host.clear();
  sparse->chunks.clear();
}

KvDemand CudaKvStore::capacity() const {
  return KvDemand{.device_pages = usable_groups() * pages_per_group(),
                  .host_pages = int64_t{host_pool_.capacity()} * pages_per_group(),
                  .dense_layer_pages = low_total_ * pages_per_low_group()};
}

KvStoreUsage CudaKvStore::usage() const {
  KvStoreUsage u;
  std::lock_guard lock(mutex_);
  u.device_pages_used = int64_t{groups_.num_used()} * pages_per_group() + int64_t{low_groups_.num_used()} * pages_per_low_group();
  u.device_pages_capacity = usable_groups() * pages_per_group() + low_total_ * pages_per_low_group();
  u.host_pages_used = int64_t{host_pool_.num_used()} * pages_per_group();
  u.host_pages_capacity = int64_t{host_pool_.capacity()} * pages_per_group();
  u.page_bytes = static_cast<int64_t>(page_elems_ * sizeof(bf16));
  u.requests = live_sequences.load();
  if (has_host_tier()) {
    cudaSetDevice(device_);
    std::vector<unsigned long long> counters(counters_.size());
    if (cudaMemcpy(counters.data(), counters_.get(), counters_.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess) {
      for (size_t i = 0; i + 2 < counters.size(); i += 3) {
        u.hits += counters[i];
        u.misses += counters[i + 1];
        u.evictions += counters[i + 2];
      }
      // ShadowKV's misses of prompt pages fetch only their values (the keys are rebuilt).
      uint64_t value_only = 0;
      std::vector<unsigned long long> values(value_only_.size());
      if (!values.empty() &&
          cudaMemcpy(values.data(), value_only_.get(), value_only_.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess) {
        for (unsigned long long v : values) value_only += v;
      }
      u.retrieve_bytes = (u.misses - value_only) * static_cast<uint64_t>(u.page_bytes) +
                         value_only * static_cast<uint64_t>(u.page_bytes / 2);
    } else {
      cudaGetLastError();
    }
  }
  return u;
}

bool CudaKvStore::can_swap(const CudaSequenceKv& kv) const {
  const SparseKv* sp = kv.sparse();
  // ShadowKV's factors and RetroInfer's cluster records live only on the device: they are
  // preempted by recomputation.
  return sp != nullptr && sp->decoding && !sp->swapped && sp->algorithm != HostTierAlgorithm::shadowkv &&
         sp->algorithm != HostTierAlgorithm::retroinfer;
}

void CudaKvStore::copy_tier_pages(int64_t first_layer, int64_t end_layer, const std::vector<int32_t>& device_ids,
                                  const std::vector<int32_t>& host_ids, bool to_host) {
  const auto n = static_cast<int64_t>(device_ids.size());
  if (n == 0 || first_layer >= end_layer) return;
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  swap_ids_.reserve(static_cast<size_t>(2 * n), "swap page lists");
  cuda_check(cudaMemcpy(swap_ids_.get(), device_ids.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice),
             "swap page list upload");
  cuda_check(cudaMemcpy(swap_ids_.get() + n, host_ids.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice),
             "swap page list upload");
  const int32_t* device_list = swap_ids_.get();
  const int32_t* host_list = swap_ids_.get() + n;
  const size_t page_bytes = page_elems_ * sizeof(bf16);
  for (int64_t l = first_layer; l < end_layer; ++l) {
    bf16* device = pool_.get() + layer_offset(l);
    bf16* host = host_device_ + host_layer_offset(l);
    // The gather kernel copies between any two pools the GPU addresses (mapped host memory too).
    cuda_check(to_host ? cuda::gather_pages(device, host, device_list, host_list, static_cast<int>(n), page_bytes,
                                            kSwapCopyBlocks, nullptr)
                       : cuda::gather_pages(host, device, host_list, device_list, static_cast<int>(n), page_bytes,
                                            kSwapCopyBlocks, nullptr),
               "swap page copy");
  }
  // The legacy stream: the model's stream is idle between steps, when the engine swaps.
  cuda_check(cudaDeviceSynchronize(), "swap page copy");
}

void CudaKvStore::copy_dense_layers(const SparseKv& sp, int64_t pages, bool to_host) {
  std::vector<int32_t> device_ids, host_ids;
  for (int64_t p = 0; p < pages; ++p) {
    for (int64_t h = 0; h < shape_.n_kv_heads; ++h) {
      device_ids.push_back(low_page_id(sp.low[static_cast<size_t>(p)], h));
      host_ids.push_back(page_id(sp.host[static_cast<size_t>(p)], h));
    }
  }
  copy_tier_pages(0, dense_layers_, device_ids, host_ids, to_host);
}

void CudaKvStore::swap_out(CudaSequenceKv& kv) {
  SPIN_CHECK(can_swap(kv), "KV swap: only a decoding sequence of a host-tier algorithm can be swapped out");
  SparseKv& sp = *kv.sparse();
  std::vector<uint32_t>& groups = kv.groups();
  copy_dense_layers(sp, pages_for(kv.length()), true);
  std::lock_guard lock(mutex_);
  for (uint32_t g : sp.low) low_groups_.free(g);
  sp.low.clear();
  sp.resident_pages.clear();
  for (size_t p = 0; p < groups.size(); ++p) {
    if (groups[p] == kNoGroup) continue;
    groups_.free(groups[p]);
    groups[p] = kNoGroup;
    sp.resident_pages.push_back(static_cast<uint32_t>(p));
  }
  for (uint32_t g : sp.cache) groups_.free(g);
  sp.cache.clear();
  sp.swapped = true;
}

void CudaKvStore::swap_in(CudaSequenceKv& kv) {
  SparseKv* sp = kv.sparse();
  SPIN_CHECK(sp != nullptr && sp->swapped, "KV swap: the sequence is not swapped out");
  std::vector<uint32_t>& groups = kv.groups();
  const int64_t pages = pages_for(kv.length());
  {
    std::lock_guard lock(mutex_);  // all or nothing
    groups_.require(static_cast<uint64_t>(sp->resident_pages.size()) + static_cast<uint64_t>(sp->cache_target()));
    low_groups_.require(static_cast<uint64_t>(pages));
    while (static_cast<int64_t>(sp->low.size()) < pages) sp->low.push_back(low_groups_.alloc());
    for (uint32_t p : sp->resident_pages) groups[p] = groups_.alloc();
    while (static_cast<int64_t>(sp->cache.size()) < sp->cache_target()) sp->cache.push_back(groups_.alloc());
  }
  copy_dense_layers(*sp, pages, false);
  // The sink and window pages of the other layers, from their host-tier pages.
  std::vector<int32_t> device_ids, host_ids;
  for (uint32_t p : sp->resident_pages) {
    for (int64_t h = 0; h < shape_.n_kv_heads; ++h) {
      device_ids.push_back(page_id(groups[p], h));
      host_ids.push_back(page_id(sp->host[p], h));
    }
  }
  copy_tier_pages(dense_layers_, shape_.n_layers, device_ids, host_ids, false);
  reset_cache_slots(sp->cache, nullptr);
  sp->resident_pages.clear();
  sp->swapped = false;
}

void CudaKvStore::set_step_profiling(bool on) {
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  profiling_ = on;
  profile_counts_.clear();
  const auto events = static_cast<size_t>(kProfileEvents * (shape_.n_layers - dense_layers_));
  while (on && profile_events_.size() < events) {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreate(&e), "profile event creation");
    profile_events_.push_back(e);
  }
}

SparseStepProfile CudaKvStore::last_step_profile() const {
  SPIN_CHECK(!profile_counts_.empty(), "no profiled sparse decode step to report (set_step_profiling, then a step)");
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  cuda_check(cudaEventSynchronize(profile_events_.back()), "profiled step");
  SparseStepProfile out;
  out.kv_heads = shape_.n_kv_heads;
  double* phases[kProfileEvents - 1] = {&out.score_ms, &out.select_ms, &out.retrieve_ms, &out.rebuild_ms,
                                        &out.attention_ms};
  const int64_t layers = shape_.n_layers - dense_layers_;
  for (int64_t l = 0; l < layers; ++l) {
    const cudaEvent_t* e = profile_events_.data() + kProfileEvents * l;
    for (int k = 0; k < kProfileEvents - 1; ++k) {
      float ms = 0.0f;
      cuda_check(cudaEventElapsedTime(&ms, e[k], e[k + 1]), "profile event time");
      *phases[k] += ms;
    }
    std::vector<std::vector<int32_t>>& layer = out.selected.emplace_back();
    const int32_t* selected = profile_selected_.get() + l * profile_entries_;
    for (size_t i = 0; i < profile_counts_.size(); ++i) {
      layer.emplace_back(selected + profile_offsets_[i], selected + profile_offsets_[i] + profile_counts_[i]);
    }
  }
  return out;
}

cuda::PagedDecodeParams CudaKvStore::decode_params(int64_t decode_rows, int64_t bucket) const {
  cuda::PagedDecodeParams p;
  p.q = decode_q_.get();
  p.page_ids = step_.decode_pages;
  p.list_offsets = step_.decode_offsets;
  p.num_tokens = step_.decode_tokens;
  p.num_seqs = static_cast<int>(decode_rows);
  p.num_kv_heads = static_cast<int>(shape_.n_kv_heads);
  p.group = static_cast<int>(group_size_);
  p.head_dim = static_cast<int>(shape_.head_dim);
  p.page_size = static_cast<int>(page_size_);
  p.max_tokens = static_cast<int>(bucket);
  p.scale = shape_.scale;
  return p;
}

cuda::SeerTrainedIndexParams CudaKvStore::seer_index_params(int64_t layer) const {
  cuda::SeerTrainedIndexParams p;
  p.kv_pool = pool_.get() + layer_offset(layer);
  p.head_dim = static_cast<int>(shape_.head_dim);
  p.page_size = static_cast<int>(page_size_);
  p.block_pages = static_cast<int>(seer_block_pages_);
  p.inv_freq = inv_freq_.get();
  p.neox = neox_;
  p.summaries = summaries_.get() + summary_layer_offset(layer);
  if (seer_trained()) {
    p.num_kv_heads = static_cast<int>(shape_.n_kv_heads);
    p.k_gate = seer_k_gate_.get() + layer * shape_.n_kv_heads * 3 * shape_.head_dim * shape_.head_dim;
  }
  return p;
}

void CudaKvStore::seer_index(const cuda::SeerTrainedIndexParams& p, cudaStream_t stream, const char* what) const {
  cuda_check(seer_trained() ? cuda::seer_trained_index_pages(p, stream) : cuda::seer_index_pages(p, stream), what);
}

void CudaKvStore::upload_seer_gate(const sparse::SeerGate& gate, int64_t max_batch) {
  const auto upload = [](DeviceBuffer<bf16>& to, const std::vector<float>& from, const char* what) {
    std::vector<uint16_t> rounded(from.size());
    for (size_t i = 0; i < from.size(); ++i) rounded[i] = f32_to_bf16(from[i]);
    to.reserve(rounded.size(), what);
    cuda_check(cudaMemcpy(to.get(), rounded.data(), to.bytes(), cudaMemcpyHostToDevice), what);
  };
  upload(seer_k_gate_, gate.k, "Seer key gate");
  upload(seer_q_gate_, gate.q, "Seer query gate");
  const int64_t max_rows = (max_batch + 7) / 8 * 8;
  seer_gate_queries_.reserve(static_cast<size_t>(max_rows * shape_.n_kv_heads * shape_.head_dim), "Seer gate queries");
}

void CudaKvStore::add_cluster_jobs(std::vector<ClusterJobs>& jobs, int64_t row, int64_t first, int64_t end,
                                   const std::function<int32_t(int64_t, int64_t)>& id) const {
  const int64_t segment_pages = retroinfer_segment_pages();
  const int64_t group = heads_per_cluster_launch(static_cast<int64_t>(jobs.size()));
  for (int64_t h = 0; h < shape_.n_kv_heads; ++h) {
    ClusterJobs& launch = jobs[static_cast<size_t>(h / group)];
    for (int64_t f = first; f < end; f += segment_pages) {
      for (int64_t p = f; p < std::min(end, f + segment_pages); ++p) launch.page_ids.push_back(id(p, h));
      launch.page_offsets.push_back(static_cast<int32_t>(launch.page_ids.size()));
      launch.first_page.push_back(static_cast<int32_t>(f));
      launch.head.push_back(static_cast<int32_t>(h));
      launch.row.push_back(row);
    }
  }
}

cuda::RetroInferRecords CudaKvStore::retroinfer_records(int64_t layer) const {
  cuda::RetroInferRecords r;
  r.kv_pool = pool_.get() + layer_offset(layer);
  r.num_kv_heads = static_cast<int>(shape_.n_kv_heads);
  r.head_dim = static_cast<int>(shape_.head_dim);
  r.page_size = static_cast<int>(page_size_);
  r.slots = static_cast<int>(retroinfer_slots_);
  r.records_per_page = static_cast<int>(retroinfer_records_);
  return r;
}

void CudaKvStore::end_prefill(CudaSequenceKv& kv, int64_t pos, const sparse::DecodeWindow& window,
                              IndexList& to_index, std::vector<ClusterJobs>& jobs, int64_t row,
                              cudaStream_t stream) {
  SparseKv& sp = *kv.sparse();
  std::vector<uint32_t>& groups = kv.groups();
  const int64_t heads = shape_.n_kv_heads;
  if (sp.algorithm == HostTierAlgorithm::shadowkv) sp.factored_pages = pos / page_size_;
  const bool retroinfer = sp.algorithm == HostTierAlgorithm::retroinfer;
  if (retroinfer) {  // the prompt's complete pages, read from the device before they are freed
    sp.clustered_pages = pos / page_size_;
    add_cluster_jobs(jobs, row, 0, sp.clustered_pages,
                     [&](int64_t p, int64_t h) { return page_id(groups[static_cast<size_t>(p)], h); });
  }
  const int64_t indexed = sp.offload() || retroinfer ? 0 : pos / page_size_;
  const auto add = [&](int64_t p, int64_t h) {
    to_index.src.push_back(page_id(groups[static_cast<size_t>(p)], h));
    to_index.dst.push_back(summary_entry(sp.chunks[static_cast<size_t>(p / cuda::kSummaryChunkPages)], h, p));
    to_index.page.push_back(static_cast<int32_t>(p));
  };
  if (sp.algorithm == HostTierAlgorithm::seer) {  // a run per block and KV head (Seer's Index)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t p = 0; p < indexed; ++p) {
        if (p % seer_block_pages_ == 0) to_index.runs.push_back(static_cast<int32_t>(to_index.src.size()));
        add(p, h);
      }
    }
  } else {
    for (int64_t p = 0; p < indexed; ++p) {
      for (int64_t h = 0; h < heads; ++h) add(p, h);
    }
  }
  {
    // The prompt's groups between sinks and window leave the device. The sequence's cache and its
    // ShadowKV factors or RetroInfer records take them first: its transition reads each layer's
    // prompt (Index, the factorisation's keys, the k-means' scratch) before it writes that layer's
    // factors or records. The rest go back to the pool only when the step's transitions have been
    // launched (release_transition_groups), so no other sequence's factors or records land on a
    // prompt not yet read; other writes come later, in the step's forward.
    std::lock_guard lock(mutex_);
    std::vector<uint32_t> freed;
    for (int64_t p = 0; p < static_cast<int64_t>(groups.size()); ++p) {
      if (p < int64_t{window.sink_end} || p >= int64_t{window.window_start}) continue;
      freed.push_back(std::exchange(groups[static_cast<size_t>(p)], kNoGroup));
    }
    const auto take = [&] {
      if (freed.empty()) return groups_.alloc();
      const uint32_t g = freed.back();
      freed.pop_back();
      return g;
    };
    while (static_cast<int64_t>(sp.cache.size()) < sp.cache_target()) sp.cache.push_back(take());
    const int64_t factor_groups = sp.algorithm == HostTierAlgorithm::shadowkv ? factor_groups_for(sp.factored_pages)
                                  : retroinfer                               ? record_groups_for(sp.clustered_pages)
                                                                             : 0;
    while (static_cast<int64_t>(sp.factors.size()) < factor_groups) sp.factors.push_back(take());
    transition_freed_.insert(transition_freed_.end(), freed.begin(), freed.end());
  }
  reset_cache_slots(sp.cache, stream);
  sp.decoding = true;
}

void CudaKvStore::shadowkv_transition(int64_t layer, int64_t num_pages, const int32_t* src, const int32_t* dst,
                                      const int32_t* score_at, cudaStream_t stream) {
  bf16* pool = pool_.get() + layer_offset(layer);
  bf16* summaries = summaries_.get() + summary_layer_offset(layer);
  const int heads = static_cast<int>(shape_.n_kv_heads);
  cuda::ShadowKvIndexParams index;
  index.kv_pool = pool;
  index.src_pages = src;
  index.dst_entries = dst;
  index.num_pages = static_cast<int>(num_pages);
  index.head_dim = static_cast<int>(shape_.head_dim);
  index.page_size = static_cast<int>(page_size_);
  index.summaries = summaries;
  index.min_cos = scores_.get();
  index.min_cos_at = score_at;
  cuda_check(cuda::shadowkv_index_pages(index, stream), "ShadowKV index of the prompt");
  cuda::SelectTopParams select;
  select.scores = scores_.get();
  select.max_candidates = step_.max_candidates;
  select.first_candidate = step_.outlier_first;
  select.end_candidate = step_.outlier_end;
  select.counts = step_.outlier_counts;
  select.out_offsets = step_.outlier_offsets;
  select.num_seqs = static_cast<int>(step_.decode_rows);
  select.num_kv_heads = heads;
  select.out_pages = outlier_pages_.get();
  cuda_check(cuda::select_top_pages(select, stream), "ShadowKV outlier select");
  cuda::ShadowKvOutlierParams outliers;
  outliers.pages = outlier_pages_.get();
  outliers.offsets = step_.outlier_offsets;
  outliers.counts = step_.outlier_counts;
  outliers.summary_dir = step_.summary_dir;
  outliers.dir_offsets = step_.dir_offsets;
  outliers.num_seqs = static_cast<int>(step_.decode_rows);
  outliers.num_kv_heads = heads;
  outliers.head_dim = static_cast<int>(shape_.head_dim);
  outliers.summaries = summaries;
  cuda_check(cuda::shadowkv_mark_outliers(outliers, stream), "ShadowKV outlier flags");
}

void CudaKvStore::shadowkv_factorise(const std::vector<Factorisation>& jobs, const int32_t* prompt_ids,
                                     cudaStream_t stream) {
  const int heads = static_cast<int>(shape_.n_kv_heads);
  std::vector<ShadowKvFactorizer::Layer> layers;
  for (const Factorisation& job : jobs) {
    if (job.pages == 0) continue;
    layers.clear();
    for (int64_t l = dense_layers_; l < shape_.n_layers; ++l) {
      bf16* pool = pool_.get() + layer_offset(l);
      cuda::ShadowKvUnrotateParams keys;
      keys.kv_pool = pool;
      keys.pages = prompt_ids + job.first;
      keys.num_pages = static_cast<int>(job.pages);
      keys.num_kv_heads = heads;
      keys.head_dim = static_cast<int>(shape_.head_dim);
      keys.page_size = static_cast<int>(page_size_);
      keys.inv_freq = inv_freq_.get();
      keys.neox = neox_;
      cuda::ShadowKvStoreParams store;
      store.kv_pool = pool;
      store.basis_groups = step_.factor_dir + job.factor_at;
      store.factor_groups = store.basis_groups + shadowkv_basis_groups_;
      store.num_kv_heads = heads;
      store.head_dim = keys.head_dim;
      store.page_size = keys.page_size;
      store.rank = static_cast<int>(shadowkv_rank_);
      layers.push_back({keys, store});
    }
    factorizer_->factorize(layers, stream);
  }
}

void CudaKvStore::release_transition_groups() {
  std::lock_guard lock(mutex_);
  for (uint32_t g : transition_freed_) groups_.free(g);
  transition_freed_.clear();
}

DeviceStepLayout CudaKvStore::begin_step(std::span<const SequenceChunk> chunks, int64_t rows, cudaStream_t stream) {
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  release_transition_groups();  // left by a step that failed after its transitions
  // The previous step's tables may still be on their way to the device.
  cuda_check(cudaEventSynchronize(upload_done_), "KV table upload");
  // The previous step has ended (its logits reached the host). A selection that did not fit its
  // cache slots was left out of its attention: stop rather than go on with wrong outputs.
  SPIN_CHECK(!has_host_tier() || cache_error_seen_[0] == 0,
             "KV cache: a selection outgrew its cache slots in an earlier step, whose attention is wrong (a bug "
             "in the store's bounds)");
  const int64_t heads = shape_.n_kv_heads;
  const int64_t ps = page_size_;
  const auto is_decode = [](const CudaSequenceKv& kv, const SparseKv& sp, int64_t n) {
    return sp.decoding || (n == 1 && kv.length() > 0);
  };

  // Check the chunks and count the groups they need before changing anything.
  std::vector<CudaSequenceKv*> seqs(chunks.size());
  std::vector<DecodePlan> plans(chunks.size());  // per host-tier decode chunk (zeros elsewhere)
  std::unordered_set<const CudaSequenceKv*> seen;
  int64_t n_tokens = 0, n_single = 0;
  int64_t need_main = 0, need_low = 0, need_host = 0, need_chunks = 0;
  int64_t cluster_pages = 0, cluster_segments = 0;  // RetroInfer's k-means per KV head
  bool sparse_rows = false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& chunk = chunks[i];
    auto* kv = dynamic_cast<CudaSequenceKv*>(chunk.attention);
    SPIN_CHECK(kv != nullptr && kv->owner() == this,
               "attention step: chunk {} holds KV that this CUDA store did not make", i);
    SPIN_CHECK(seen.insert(kv).second, "attention step: chunk {} repeats a sequence of the same step", i);
    const auto n = static_cast<int64_t>(chunk.tokens.size());
    SPIN_CHECK(n > 0, "attention step: chunk {} is empty", i);
    SPIN_CHECK(chunk.pos0 >= 0 && chunk.pos0 <= kv->length(),
               "KV cache: write at position {} leaves a gap after {}", chunk.pos0, kv->length());
    SPIN_CHECK(chunk.pos0 + n <= kv->max_tokens(), "KV cache full: {} tokens requested, capacity {}", chunk.pos0 + n,
               kv->max_tokens());
    if (n == 1) {
      SPIN_CHECK(n_single == static_cast<int64_t>(i),
                 "attention step: single-token chunks must come before longer ones (chunk {})", i);
      ++n_single;
    }
    const int64_t end = chunk.pos0 + n;
    const auto held = static_cast<int64_t>(kv->groups().size());
    SparseKv* sp = kv->sparse();
    n_tokens += n;
    seqs[i] = kv;
    if (sp == nullptr) {
      need_main += std::max<int64_t>(0, pages_for(end) - held);
      continue;
    }
    SPIN_CHECK(!sp->swapped, "attention step: chunk {} belongs to a sequence swapped out of the device", i);
    sparse_rows = true;
    need_chunks += std::max<int64_t>(0, summary_chunks(*sp, pages_for(end)) - static_cast<int64_t>(sp->chunks.size()));
    if (!is_decode(*kv, *sp, n)) {
      SPIN_CHECK(chunk.pos0 == kv->length(), "attention step: sparse KV cannot rewrite position {}", chunk.pos0);
      need_main += std::max<int64_t>(0, pages_for(end) - held);
      need_low += std::max<int64_t>(0, pages_for(end) - static_cast<int64_t>(sp->low.size()));
      need_host += std::max<int64_t>(0, pages_for(end) - static_cast<int64_t>(sp->host.size()));
      continue;
    }
    SPIN_CHECK(n == 1 && chunk.pos0 == kv->length(),
               "attention step: chunk {} of a sparse sequence past its prefill must be its next single token", i);
    const bool new_page = chunk.pos0 % ps == 0;
    const bool shadowkv = sp->algorithm == HostTierAlgorithm::shadowkv;
    const bool retroinfer = sp->algorithm == HostTierAlgorithm::retroinfer;
    const int64_t current = chunk.pos0 / ps;
    if (shadowkv && !sp->decoding) {
      // The outliers come from the first decode step's candidates (sparse/shadowkv.cpp).
      sp->unbudgeted = std::min<int64_t>(shadowkv_outliers_,
                                         sp->settings.decode_window(static_cast<uint32_t>(current)).candidates());
    }
    // RetroInfer's pages clustered once this step's Index ran: the prompt's at the first decode
    // step, later the waiting ones when they make a segment. The candidates past them are selected
    // beyond the budget.
    if (retroinfer) {
      const int64_t clustered =
          !sp->decoding || recluster_due(*sp, chunk.pos0) ? current : sp->clustered_pages;
      const sparse::DecodeWindow w = sp->settings.decode_window(static_cast<uint32_t>(current));
      sp->unbudgeted = int64_t{w.window_start} - std::clamp<int64_t>(clustered, w.sink_end, w.window_start);
      const int64_t pages = clustered - (sp->decoding ? sp->clustered_pages : 0);
      cluster_pages += pages;
      cluster_segments += (pages + retroinfer_segment_pages() - 1) / retroinfer_segment_pages();
      // A new segment's records (the first step's are counted with its cache below).
      if (sp->decoding) need_main += record_groups_for(clustered) - static_cast<int64_t>(sp->factors.size());
    }
    plans[i] = plan_decode(sp->settings, sp->offload(), chunk.pos0, sp->unbudgeted);
    const sparse::DecodeWindow& w = plans[i].window;
    if (!sp->decoding) {
      int64_t kept = 0;
      for (int64_t p = 0; p < held; ++p) kept += p < int64_t{w.sink_end} || p >= int64_t{w.window_start};
      // Its cache and factors or records take its freed prompt groups first (end_prefill).
      const int64_t taken = sp->cache_target() + (shadowkv     ? factor_groups_for(current)
                                                   : retroinfer ? record_groups_for(current)
                                                                : 0);
      need_main += std::max<int64_t>(0, taken - (held - kept)) + (new_page ? 1 : 0);
    } else if (new_page) {
      const int64_t leaving = int64_t{w.window_start} - 1;
      const bool recycled =
          leaving >= int64_t{w.sink_end} && leaving < held && kv->groups()[static_cast<size_t>(leaving)] != kNoGroup;
      need_main += recycled ? 0 : 1;
    }
    if (new_page) {
      need_low += 1;
      need_host += 1;
    }
  }
  const auto n_chunks = static_cast<int64_t>(chunks.size());
  SPIN_CHECK(rows >= n_tokens && rows < std::numeric_limits<int32_t>::max(),
             "attention step: {} rows for {} tokens", rows, n_tokens);
  SPIN_CHECK(rows == n_tokens || n_single == n_chunks,
             "attention step: padding rows are only allowed when every chunk has one token");
  int64_t cluster_launches = 1;  // RetroInfer's k-means launches per layer, each for a group of KV heads
  if (cluster_pages > 0) {  // may throw: nothing changed yet
    const auto scratch = [&](int64_t group) {
      return cuda::retroinfer_cluster_scratch_bytes(group * cluster_pages, group * cluster_segments,
                                                    static_cast<int>(ps), static_cast<int>(shape_.head_dim),
                                                    static_cast<int>(retroinfer_slots_));
    };
    const int64_t fitting = std::clamp<int64_t>(static_cast<int64_t>(kClusterScratchBudget / scratch(1)), 1, heads);
    cluster_launches = (heads + fitting - 1) / fitting;
    cluster_scratch_.reserve(scratch(heads_per_cluster_launch(cluster_launches)), "RetroInfer k-means scratch");
  }
  {
    std::lock_guard lock(mutex_);  // throws before anything changed
    if (need_main > 0) groups_.require(static_cast<uint64_t>(need_main));
    if (need_low > 0) low_groups_.require(static_cast<uint64_t>(need_low));
    if (need_host > 0) host_pool_.require(static_cast<uint64_t>(need_host));
    if (need_chunks > 0) chunk_pool_.require(static_cast<uint64_t>(need_chunks));
  }

  // Allocate: dense growth, sparse prefill growth, and each sparse decode's new page.
  IndexList quest_transitions, seer_transitions, shadowkv_transitions;
  std::vector<Factorisation> factorisations;
  std::vector<ClusterJobs> cluster_jobs(static_cast<size_t>(cluster_launches));
  for (size_t i = 0; i < chunks.size(); ++i) {
    CudaSequenceKv& kv = *seqs[i];
    SparseKv* sp = kv.sparse();
    const auto n = static_cast<int64_t>(chunks[i].tokens.size());
    const int64_t pos = chunks[i].pos0, end = pos + n;
    if (sp == nullptr) {
      grow(kv.groups(), pages_for(end));
      continue;
    }
    if (!is_decode(kv, *sp, n)) {
      grow_prefill(kv.groups(), *sp, pages_for(end));
      continue;
    }
    {
      std::lock_guard lock(mutex_);
      while (static_cast<int64_t>(sp->chunks.size()) < summary_chunks(*sp, pages_for(end))) {
        sp->chunks.push_back(chunk_pool_.alloc());
      }
    }
    const sparse::DecodeWindow w = plans[i].window;
    if (!sp->decoding) {  // takes the lock itself
      const auto first_id = static_cast<int64_t>(shadowkv_transitions.src.size());
      IndexList& to_index = sp->algorithm == HostTierAlgorithm::seer       ? seer_transitions
                            : sp->algorithm == HostTierAlgorithm::shadowkv ? shadowkv_transitions
                                                                           : quest_transitions;
      end_prefill(kv, pos, w, to_index, cluster_jobs, static_cast<int64_t>(i), stream);
      if (sp->algorithm == HostTierAlgorithm::shadowkv) {
        factorisations.push_back({static_cast<int64_t>(i), sp->factored_pages, first_id});
      }
    } else if (sp->algorithm == HostTierAlgorithm::retroinfer && recluster_due(*sp, pos)) {
      // The waiting complete pages, read from the host tier (most have left the device).
      const int64_t current = pos / ps;
      add_cluster_jobs(cluster_jobs, static_cast<int64_t>(i), sp->clustered_pages, current,
                       [&](int64_t p, int64_t h) { return ~page_id(sp->host[static_cast<size_t>(p)], h); });
      sp->clustered_pages = current;
      std::lock_guard lock(mutex_);
      while (static_cast<int64_t>(sp->factors.size()) < record_groups_for(current)) sp->factors.push_back(groups_.alloc());
    }
    ++sp->now;
    if (pos % ps != 0) continue;
    std::lock_guard lock(mutex_);
    std::vector<uint32_t>& groups = kv.groups();
    const int64_t leaving = int64_t{w.window_start} - 1;
    uint32_t group = kNoGroup;
    if (leaving >= int64_t{w.sink_end} && leaving < static_cast<int64_t>(groups.size()) &&
        groups[static_cast<size_t>(leaving)] != kNoGroup) {
      group = std::exchange(groups[static_cast<size_t>(leaving)], kNoGroup);  // in the host tier already
    } else {
      group = groups_.alloc();
    }
    groups.push_back(group);
    sp->low.push_back(low_groups_.alloc());
    sp->host.push_back(host_pool_.alloc());
  }

  // Table layout. Fixed-size sections first, then lists; in a decode-only step every list gets
  // the room its row count and context bucket allow, so a step's table addresses depend on those
  // alone (a CUDA graph captured for them stays valid).
  const int64_t decode_rows = n_single + (rows - n_tokens);
  const int64_t prefill_seqs = n_chunks - n_single;
  const bool decode_only = prefill_seqs == 0;
  int64_t max_decode_tokens = 0, max_new_tokens = 0;
  for (int64_t i = 0; i < n_chunks; ++i) {
    const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
    const int64_t end = chunk.pos0 + static_cast<int64_t>(chunk.tokens.size());
    if (i < n_single) {
      max_decode_tokens = std::max(max_decode_tokens, end);
    } else {
      max_new_tokens = std::max<int64_t>(max_new_tokens, static_cast<int64_t>(chunk.tokens.size()));
    }
  }
  const int64_t bucket = context_bucket(max_decode_tokens);
  const int64_t max_pages = pages_for(bucket);
  int64_t total = 0;
  const auto take = [&total](int64_t entries) {
    const int64_t at = total;
    total += entries;
    return at;
  };
  const int64_t items = decode_rows * heads;
  const int64_t at_page_of = take(rows * heads), at_low_page_of = take(rows * heads), at_host_page_of = take(rows * heads);
  const int64_t at_slot_of = take(rows);
  const int64_t at_decode_offsets = take(items + 1), at_decode_tokens = take(items);
  const int64_t at_low_decode_offsets = take(items + 1), at_low_decode_tokens = take(items);
  const int64_t at_prefill_offsets = take(prefill_seqs * heads + 1);
  const int64_t at_prefill_token_offsets = take(prefill_seqs + 1), at_prefill_first_pos = take(prefill_seqs);
  const int64_t at_first = take(decode_rows), at_end = take(decode_rows), at_quest_end = take(decode_rows),
                at_seer_end = take(decode_rows), at_current_page = take(decode_rows), at_dir_offsets = take(decode_rows),
                at_host_offsets = take(decode_rows), at_cache_offsets = take(decode_rows + 1), at_now = take(decode_rows);
  const int64_t at_retroinfer_end = take(decode_rows), at_clustered = take(decode_rows),
                at_cluster_slots = take(decode_rows), at_zeros = take(decode_rows), at_zone_offsets = take(items);
  const int64_t at_shadowkv_end = take(decode_rows), at_rebuild_end = take(decode_rows),
                at_factor_offsets = take(decode_rows), at_outlier_first = take(decode_rows),
                at_outlier_end = take(decode_rows);
  const int64_t at_counts = take(items), at_needed_offsets = take(items), at_out_offsets = take(items),
                at_index_src = take(items), at_seer_index_src = take(items), at_shadowkv_index_src = take(items),
                at_index_dst = take(items), at_index_page = take(items), at_outlier_counts = take(items),
                at_outlier_offsets = take(items);
  const int64_t fixed_end = total;
  const int64_t at_rebuild_counts = take(items), at_copy_counts = take(2 * items);  // written on the device

  // List sizes of this step.
  int64_t decode_entries = 0, low_decode_entries = 0, prefill_entries = 0, needed_entries = 0, dir_entries = 0,
          host_entries = 0, cache_entries = 0, factor_entries = 0;
  for (int64_t i = 0; i < n_chunks; ++i) {
    const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
    CudaSequenceKv& kv = *seqs[static_cast<size_t>(i)];
    const SparseKv* sp = kv.sparse();
    const int64_t end = chunk.pos0 + static_cast<int64_t>(chunk.tokens.size());
    if (i >= n_single) {
      prefill_entries += heads * pages_for(end);
      continue;
    }
    if (sparse_rows) low_decode_entries += heads * pages_for(end);
    if (sp == nullptr) {
      decode_entries += heads * pages_for(end);
      continue;
    }
    decode_entries += heads * plans[static_cast<size_t>(i)].attended;
    needed_entries += heads * plans[static_cast<size_t>(i)].selected;
    dir_entries += static_cast<int64_t>(sp->chunks.size());
    host_entries += static_cast<int64_t>(sp->host.size());
    cache_entries += static_cast<int64_t>(sp->cache.size());
    factor_entries += static_cast<int64_t>(sp->factors.size());
  }
  const auto room = [&](int64_t used, int64_t bound) { return decode_only ? std::max(used, bound) : used; };
  const int64_t at_decode_pages = take(room(decode_entries, items * max_pages));
  const int64_t at_fill_pages = take(room(decode_entries, items * max_pages));
  const int64_t at_low_decode_pages = take(room(low_decode_entries, items * max_pages));
  const int64_t at_needed = take(room(needed_entries, items * max_pages));
  const int64_t at_summary_dir = take(room(dir_entries, decode_rows * summary_chunks_for(max_pages)));
  const int64_t at_host_groups = take(room(host_entries, decode_rows * max_pages));
  const int64_t at_cache_groups = take(room(cache_entries, decode_rows * max_cache_slots_));
  const int64_t at_factor_dir = take(room(
      factor_entries, decode_rows * std::max(shadowkv_rank_ > 0 ? factor_groups_for(max_pages) : 0, record_groups_for(max_pages))));
  const int64_t at_rebuild_pages = take(room(needed_entries, items * max_pages));
  const int64_t at_rebuild_logical = take(room(needed_entries, items * max_pages));
  const int64_t at_copy_src = take(room(needed_entries, items * max_pages));
  const int64_t at_copy_dst = take(room(needed_entries, items * max_pages));
  const int64_t at_prefill_pages = take(prefill_entries), at_low_prefill_pages = take(prefill_entries);
  const auto transitions = static_cast<int64_t>(quest_transitions.src.size());
  const int64_t at_transition_src = take(transitions), at_transition_dst = take(transitions);
  const auto seer_transitions_n = static_cast<int64_t>(seer_transitions.src.size());
  const int64_t at_seer_transition_src = take(seer_transitions_n), at_seer_transition_dst = take(seer_transitions_n),
                at_seer_transition_page = take(seer_transitions_n);
  const auto seer_runs_n = static_cast<int64_t>(seer_transitions.runs.size());
  const int64_t at_seer_transition_runs = take(seer_runs_n + 1);
  const auto shadowkv_transitions_n = static_cast<int64_t>(shadowkv_transitions.src.size());
  const int64_t at_shadowkv_transition_src = take(shadowkv_transitions_n),
                at_shadowkv_transition_dst = take(shadowkv_transitions_n),
                at_shadowkv_transition_score = take(shadowkv_transitions_n);
  int64_t n_jobs = 0, n_job_pages = 0;
  for (const ClusterJobs& launch : cluster_jobs) {
    n_jobs += static_cast<int64_t>(launch.first_page.size());
    n_job_pages += static_cast<int64_t>(launch.page_ids.size());
  }
  const int64_t at_job_pages = take(n_job_pages), at_job_page_offsets = take(n_jobs + cluster_launches),
                at_job_first = take(n_jobs), at_job_head = take(n_jobs), at_job_dir = take(n_jobs);
  SPIN_CHECK(total < std::numeric_limits<int32_t>::max(), "attention step: {} table entries", total);

  // Buffers the kernels read; any that moves changes the epoch (the model drops its graphs).
  bool moved = false;
  if (static_cast<size_t>(total) > tables_.size()) {
    moved |= tables_.reserve(static_cast<size_t>(total + total / 2), "KV step tables");
    tables_host_.reserve(tables_.size());
  }
  moved |= decode_q_.reserve(static_cast<size_t>(std::max<int64_t>(decode_rows, 1) * q_width_), "decode queries");
  if (seer_trained()) {
    moved |= seer_gate_queries_.reserve(
        static_cast<size_t>(std::max<int64_t>(decode_rows, 1) * shape_.n_kv_heads * shape_.head_dim), "Seer gate queries");
  }
  if (decode_rows > 0) {
    moved |= workspace_.reserve(cuda::paged_decode_workspace_bytes(decode_params(decode_rows, bucket)),
                                "decode split-K workspace");
    if (has_host_tier()) {
      moved |= scores_.reserve(static_cast<size_t>(items * max_pages), "Quest page scores");
      const bool shadowkv_rows = std::any_of(seqs.begin(), seqs.begin() + n_single, [](const CudaSequenceKv* kv) {
        return kv->sparse() != nullptr && kv->sparse()->algorithm == HostTierAlgorithm::shadowkv;
      });
      if (shadowkv_rows) {
        moved |= logits_.reserve(static_cast<size_t>(cuda::shadowkv_score_scratch(items, static_cast<int>(group_size_),
                                                                                  static_cast<int>(max_pages))),
                                 "ShadowKV logits");
      }
      const bool retroinfer_rows = std::any_of(seqs.begin(), seqs.begin() + n_single, [](const CudaSequenceKv* kv) {
        return kv->sparse() != nullptr && kv->sparse()->algorithm == HostTierAlgorithm::retroinfer;
      });
      if (retroinfer_rows) {
        const int64_t clusters = items * max_pages * retroinfer_slots_;
        moved |= logits_.reserve(static_cast<size_t>(cuda::retroinfer_score_scratch(
                                     items, static_cast<int>(group_size_), static_cast<int>(max_pages * retroinfer_slots_))),
                                 "RetroInfer logits");
        moved |= totals_.reserve(static_cast<size_t>(clusters), "RetroInfer cluster scores");
        moved |= zone_flags_.reserve(static_cast<size_t>(clusters), "RetroInfer zone flags");
        moved |= zone_scores_.reserve(static_cast<size_t>(clusters), "RetroInfer zone scores");
        moved |= zone_.reserve(static_cast<size_t>(clusters), "RetroInfer zone");
        moved |= zone_counts_.reserve(static_cast<size_t>(items), "RetroInfer zone counts");
        moved |= zone_tallies_.reserve(static_cast<size_t>(items * 2), "RetroInfer zone tallies");
        moved |= lse_.reserve(static_cast<size_t>(items * group_size_), "decode log-sum-exp");
        moved |= estimate_partials_.reserve(
            static_cast<size_t>(cuda::retroinfer_estimate_scratch(
                items, static_cast<int>(group_size_), static_cast<int>(shape_.head_dim),
                cuda::retroinfer_estimate_splits(static_cast<int>(max_pages * retroinfer_slots_)))),
            "RetroInfer estimation partials");
      }
      moved |= counters_.reserve(static_cast<size_t>(decode_rows * 3), "KV cache counters");
      moved |= value_only_.reserve(static_cast<size_t>(decode_rows), "KV cache counters");
    }
  }
  if (moved) epoch_ = new_buffers_epoch();

  // Fill the tables on the host.
  int32_t* t = tables_host_.get();
  const auto scratch = static_cast<uint32_t>(groups_total_ - 1);
  const auto host_scratch = static_cast<uint32_t>(std::max<int64_t>(host_groups_total_ - 1, 0));
  {
    int64_t row = 0;
    for (int64_t i = 0; i < n_chunks; ++i) {
      const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
      CudaSequenceKv& kv = *seqs[static_cast<size_t>(i)];
      const SparseKv* sp = kv.sparse();
      const std::vector<uint32_t>& groups = kv.groups();
      for (size_t k = 0; k < chunk.tokens.size(); ++k, ++row) {
        const int64_t pos = chunk.pos0 + static_cast<int64_t>(k);
        const auto page = static_cast<size_t>(pos / ps);
        for (int64_t h = 0; h < heads; ++h) {
          const int32_t main = page_id(groups[page], h);
          t[at_page_of + row * heads + h] = main;
          t[at_low_page_of + row * heads + h] = sp ? low_page_id(sp->low[page], h) : main;
          t[at_host_page_of + row * heads + h] = page_id(sp ? sp->host[page] : host_scratch, h);
        }
        t[at_slot_of + row] = static_cast<int32_t>(pos % ps);
      }
    }
    for (; row < rows; ++row) {  // padding: the scratch groups, slot 0
      for (int64_t h = 0; h < heads; ++h) {
        t[at_page_of + row * heads + h] = t[at_low_page_of + row * heads + h] = page_id(scratch, h);
        t[at_host_page_of + row * heads + h] = page_id(host_scratch, h);
      }
      t[at_slot_of + row] = 0;
    }
  }
  bool quest_decode = false, seer_decode = false, shadowkv_decode = false, retroinfer_decode = false;
  const int64_t max_clusters = max_pages * retroinfer_slots_;
  int32_t max_selected = 0;
  {
    int64_t decode_at = 0, low_decode_at = 0, prefill_at = 0, token_at = 0, needed_at = 0, dir_at = 0, host_at = 0,
            cache_at = 0, factor_at = 0;
    t[at_decode_offsets] = t[at_low_decode_offsets] = t[at_prefill_offsets] = t[at_prefill_token_offsets] = 0;
    t[at_cache_offsets] = 0;
    // An item that selects and indexes nothing (dense and padding rows; sparse rows overwrite).
    const auto select_nothing = [&](int64_t item) {
      t[at_counts + item] = 0;
      t[at_needed_offsets + item] = static_cast<int32_t>(needed_at);
      t[at_out_offsets + item] = 0;
      t[at_index_src + item] = t[at_seer_index_src + item] = t[at_shadowkv_index_src + item] = -1;
      t[at_index_dst + item] = t[at_index_page + item] = 0;
      t[at_outlier_counts + item] = 0;
      t[at_outlier_offsets + item] = static_cast<int32_t>(item * shadowkv_outliers_);
      t[at_zone_offsets + item] = static_cast<int32_t>(item * max_clusters);
    };
    for (int64_t i = 0; i < n_chunks; ++i) {
      const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
      CudaSequenceKv& kv = *seqs[static_cast<size_t>(i)];
      const SparseKv* sp = kv.sparse();
      const std::vector<uint32_t>& groups = kv.groups();
      const auto n = static_cast<int64_t>(chunk.tokens.size());
      const int64_t end = chunk.pos0 + n;
      const int64_t pages = pages_for(end);
      // Prefill: every page, in both layer kinds (the low list only in steps with sparse rows).
      if (i >= n_single) {
        const int64_t s = i - n_single;
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t j = 0; j < pages; ++j) {
            const int32_t main = page_id(groups[static_cast<size_t>(j)], h);
            t[at_prefill_pages + prefill_at + j] = main;
            if (sparse_rows) {
              t[at_low_prefill_pages + prefill_at + j] = sp ? low_page_id(sp->low[static_cast<size_t>(j)], h) : main;
            }
          }
          prefill_at += pages;
          t[at_prefill_offsets + s * heads + h + 1] = static_cast<int32_t>(prefill_at);
        }
        token_at += n;
        t[at_prefill_token_offsets + s + 1] = static_cast<int32_t>(token_at);
        t[at_prefill_first_pos + s] = static_cast<int32_t>(chunk.pos0);
        continue;
      }
      // Decode row i.
      const int64_t cur = chunk.pos0 / ps;
      const sparse::DecodeWindow& w = plans[static_cast<size_t>(i)].window;
      const int64_t k = plans[static_cast<size_t>(i)].selected;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t item = i * heads + h;
        if (sparse_rows) {
          int32_t* low_list = t + at_low_decode_pages + low_decode_at;
          for (int64_t j = 0; j < pages; ++j) {
            const auto page = static_cast<size_t>(j);
            low_list[j] = sp ? low_page_id(sp->low[page], h) : page_id(groups[page], h);
          }
          low_decode_at += pages;
        }
        t[at_low_decode_offsets + item + 1] = static_cast<int32_t>(low_decode_at);
        t[at_low_decode_tokens + item] = static_cast<int32_t>(end);
        int32_t* list = t + at_decode_pages + decode_at;
        int64_t len = 0;
        select_nothing(item);
        if (sp == nullptr) {
          for (int64_t j = 0; j < pages; ++j) list[len++] = page_id(groups[static_cast<size_t>(j)], h);
          t[at_decode_tokens + item] = static_cast<int32_t>(end);
        } else {
          for (int64_t j = 0; j < int64_t{w.sink_end}; ++j) list[len++] = page_id(groups[static_cast<size_t>(j)], h);
          t[at_out_offsets + item] = static_cast<int32_t>(decode_at + len);
          if (sp->offload()) {  // every page between sinks and window, read from the host tier
            for (int64_t j = w.sink_end; j < int64_t{w.window_start}; ++j) {
              list[len++] = ~page_id(sp->host[static_cast<size_t>(j)], h);
            }
          }
          for (int64_t j = 0; j < k; ++j) list[len++] = -1;  // the selected pages' slots (retrieve)
          for (int64_t j = w.window_start; j <= cur; ++j) list[len++] = page_id(groups[static_cast<size_t>(j)], h);
          t[at_decode_tokens + item] = static_cast<int32_t>((len - 1) * ps + chunk.pos0 % ps + 1);
          t[at_counts + item] = static_cast<int32_t>(k);
          max_selected = std::max(max_selected, static_cast<int32_t>(k));
          needed_at += k;
          // This token completes page cur: index it (RetroInfer clusters in begin_step instead).
          if (!sp->offload() && sp->algorithm != HostTierAlgorithm::retroinfer && (chunk.pos0 + 1) % ps == 0) {
            const int64_t at_src = sp->algorithm == HostTierAlgorithm::seer       ? at_seer_index_src
                                   : sp->algorithm == HostTierAlgorithm::shadowkv ? at_shadowkv_index_src
                                                                                  : at_index_src;
            t[at_src + item] = page_id(groups[static_cast<size_t>(cur)], h);
            t[at_index_dst + item] =
                summary_entry(sp->chunks[static_cast<size_t>(cur / cuda::kSummaryChunkPages)], h, cur);
            t[at_index_page + item] = static_cast<int32_t>(cur);
          }
        }
        decode_at += len;
        t[at_decode_offsets + item + 1] = static_cast<int32_t>(decode_at);
      }
      // Candidates [sink_end, window_start) for each algorithm's scores, empty for the others (and
      // for dense-offload, which has no summaries).
      const auto scored_by = [&](HostTierAlgorithm a) {
        return static_cast<int32_t>(sp != nullptr && sp->algorithm == a ? w.window_start : w.sink_end);
      };
      t[at_first + i] = static_cast<int32_t>(w.sink_end);
      t[at_end + i] = static_cast<int32_t>(sp != nullptr && sp->offload() ? w.sink_end : w.window_start);
      t[at_quest_end + i] = scored_by(HostTierAlgorithm::quest);
      t[at_seer_end + i] = scored_by(HostTierAlgorithm::seer);
      t[at_shadowkv_end + i] = scored_by(HostTierAlgorithm::shadowkv);
      t[at_retroinfer_end + i] = scored_by(HostTierAlgorithm::retroinfer);
      const int64_t clustered = sp != nullptr && sp->algorithm == HostTierAlgorithm::retroinfer ? sp->clustered_pages : 0;
      t[at_clustered + i] = static_cast<int32_t>(clustered);
      t[at_cluster_slots + i] = static_cast<int32_t>(clustered * retroinfer_slots_);
      t[at_zeros + i] = 0;
      t[at_current_page + i] = static_cast<int32_t>(cur);
      t[at_dir_offsets + i] = static_cast<int32_t>(dir_at);
      t[at_host_offsets + i] = static_cast<int32_t>(host_at);
      t[at_now + i] = static_cast<int32_t>(sp ? sp->now : 0);
      t[at_rebuild_end + i] = static_cast<int32_t>(sp ? sp->factored_pages : 0);
      t[at_factor_offsets + i] = static_cast<int32_t>(factor_at);
      t[at_outlier_first + i] = t[at_outlier_end + i] = 0;
      if (sp != nullptr) {
        quest_decode |= sp->algorithm == HostTierAlgorithm::quest;
        seer_decode |= sp->algorithm == HostTierAlgorithm::seer;
        shadowkv_decode |= sp->algorithm == HostTierAlgorithm::shadowkv;
        retroinfer_decode |= sp->algorithm == HostTierAlgorithm::retroinfer;
        for (uint32_t c : sp->chunks) t[at_summary_dir + dir_at++] = static_cast<int32_t>(c);
        for (uint32_t g : sp->host) t[at_host_groups + host_at++] = static_cast<int32_t>(g);
        for (uint32_t g : sp->cache) t[at_cache_groups + cache_at++] = static_cast<int32_t>(g);
        for (uint32_t g : sp->factors) t[at_factor_dir + factor_at++] = static_cast<int32_t>(g);
      }
      t[at_cache_offsets + i + 1] = static_cast<int32_t>(cache_at);
    }
    for (int64_t i = n_single; i < decode_rows; ++i) {  // padding rows: no keys, nothing to select
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t item = i * heads + h;
        t[at_decode_offsets + item + 1] = static_cast<int32_t>(decode_at);
        t[at_decode_tokens + item] = 0;
        t[at_low_decode_offsets + item + 1] = static_cast<int32_t>(low_decode_at);
        t[at_low_decode_tokens + item] = 0;
        select_nothing(item);
      }
      t[at_first + i] = t[at_end + i] = t[at_quest_end + i] = t[at_seer_end + i] = t[at_current_page + i] = 0;
      t[at_shadowkv_end + i] = t[at_rebuild_end + i] = t[at_outlier_first + i] = t[at_outlier_end + i] = 0;
      t[at_retroinfer_end + i] = t[at_clustered + i] = t[at_cluster_slots + i] = t[at_zeros + i] = 0;
      t[at_dir_offsets + i] = static_cast<int32_t>(dir_at);
      t[at_host_offsets + i] = static_cast<int32_t>(host_at);
      t[at_factor_offsets + i] = static_cast<int32_t>(factor_at);
      t[at_now + i] = 0;
      t[at_cache_offsets + i + 1] = static_cast<int32_t>(cache_at);
    }
  }
  std::copy(quest_transitions.src.begin(), quest_transitions.src.end(), t + at_transition_src);
  std::copy(quest_transitions.dst.begin(), quest_transitions.dst.end(), t + at_transition_dst);
  std::copy(seer_transitions.src.begin(), seer_transitions.src.end(), t + at_seer_transition_src);
  std::copy(seer_transitions.dst.begin(), seer_transitions.dst.end(), t + at_seer_transition_dst);
  std::copy(seer_transitions.page.begin(), seer_transitions.page.end(), t + at_seer_transition_page);
  std::copy(seer_transitions.runs.begin(), seer_transitions.runs.end(), t + at_seer_transition_runs);
  t[at_seer_transition_runs + seer_runs_n] = static_cast<int32_t>(seer_transitions_n);
  // ShadowKV's transitions: the outliers are the `unbudgeted` lowest cosines among the first
  // decode step's candidates; their negated cosines go where select_top_pages reads the row's
  // scores.
  std::copy(shadowkv_transitions.src.begin(), shadowkv_transitions.src.end(), t + at_shadowkv_transition_src);
  std::copy(shadowkv_transitions.dst.begin(), shadowkv_transitions.dst.end(), t + at_shadowkv_transition_dst);
  for (Factorisation& f : factorisations) {
    const SparseKv& sp = *seqs[static_cast<size_t>(f.row)]->sparse();
    const sparse::DecodeWindow& w = plans[static_cast<size_t>(f.row)].window;
    t[at_outlier_first + f.row] = static_cast<int32_t>(w.sink_end);
    t[at_outlier_end + f.row] = static_cast<int32_t>(w.window_start);
    for (int64_t h = 0; h < heads; ++h) t[at_outlier_counts + f.row * heads + h] = static_cast<int32_t>(sp.unbudgeted);
    for (int64_t p = 0; p < f.pages; ++p) {
      for (int64_t h = 0; h < heads; ++h) {
        const bool candidate = p >= int64_t{w.sink_end} && p < int64_t{w.window_start};
        t[at_shadowkv_transition_score + f.first + p * heads + h] =
            candidate ? static_cast<int32_t>((f.row * heads + h) * max_pages + (p - w.sink_end)) : -1;
      }
    }
    f.factor_at = t[at_factor_offsets + f.row];
  }

  // RetroInfer's k-means jobs, one launch after another; each launch's page offsets start at 0.
  struct LaunchJobs {
    int64_t pages_at, offsets_at, jobs_at, pages, jobs;
  };
  std::vector<LaunchJobs> launch_jobs;
  {
    int64_t pages_at = 0, offsets_at = 0, jobs_at = 0;
    for (const ClusterJobs& launch : cluster_jobs) {
      const auto jobs = static_cast<int64_t>(launch.first_page.size());
      const auto pages = static_cast<int64_t>(launch.page_ids.size());
      if (jobs == 0) continue;
      launch_jobs.push_back({pages_at, offsets_at, jobs_at, pages, jobs});
      std::copy(launch.page_ids.begin(), launch.page_ids.end(), t + at_job_pages + pages_at);
      std::copy(launch.page_offsets.begin(), launch.page_offsets.end(), t + at_job_page_offsets + offsets_at);
      std::copy(launch.first_page.begin(), launch.first_page.end(), t + at_job_first + jobs_at);
      std::copy(launch.head.begin(), launch.head.end(), t + at_job_head + jobs_at);
      for (int64_t j = 0; j < jobs; ++j) {
        t[at_job_dir + jobs_at + j] = t[at_factor_offsets + launch.row[static_cast<size_t>(j)]];
      }
      pages_at += pages;
      offsets_at += jobs + 1;
      jobs_at += jobs;
    }
  }

  int32_t rebuild_bound = 0;
  if (shadowkv_decode) {
    rebuild_bound = 16;
    while (rebuild_bound < max_selected) rebuild_bound *= 2;
  }

  profile_counts_.clear();
  if (profiling_ && (quest_decode || seer_decode || shadowkv_decode || retroinfer_decode)) {
    profile_counts_.assign(t + at_counts, t + at_counts + items);
    profile_offsets_.assign(t + at_needed_offsets, t + at_needed_offsets + items);
    profile_entries_ = needed_entries;
    profile_selected_.reserve(static_cast<size_t>(std::max<int64_t>(1, (shape_.n_layers - dense_layers_) * needed_entries)));
  }

  // Upload what this step filled: the fixed block, then each list's used part.
  const auto upload = [&](int64_t at, int64_t count) {
    if (count <= 0) return;
    cuda_check(cudaMemcpyAsync(tables_.get() + at, t + at, static_cast<size_t>(count) * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream),
               "KV table upload");
  };
  upload(0, fixed_end);
  upload(at_decode_pages, decode_entries);
  const bool fetch_in_attention =
      fetch_in_attention_ && (quest_decode || seer_decode || retroinfer_decode) && !shadowkv_decode;
  if (fetch_in_attention) {  // the plan fills its misses' entries; dense-offload's host pages stay unfilled
    std::fill_n(t + at_fill_pages, decode_entries, -1);
    upload(at_fill_pages, decode_entries);
  }
  upload(at_low_decode_pages, low_decode_entries);
  upload(at_summary_dir, dir_entries);
  upload(at_host_groups, host_entries);
  upload(at_cache_groups, cache_entries);
  upload(at_factor_dir, factor_entries);
  upload(at_prefill_pages, total - at_prefill_pages);
  cuda_check(cudaEventRecord(upload_done_, stream), "KV table upload");

  for (size_t i = 0; i < chunks.size(); ++i) {
    seqs[i]->stored(chunks[i].pos0 + static_cast<int64_t>(chunks[i].tokens.size()));
  }
  int32_t* d = tables_.get();
  step_ = Step{.rows = rows,
               .decode_rows = decode_rows,
               .prefill_seqs = prefill_seqs,
               .max_new_tokens = max_new_tokens,
               .context_bucket = bucket,
               .sparse_rows = sparse_rows,
               .sparse_decode = quest_decode || seer_decode || shadowkv_decode || retroinfer_decode,
               .quest_decode = quest_decode,
               .seer_decode = seer_decode,
               .shadowkv_decode = shadowkv_decode,
               .retroinfer_decode = retroinfer_decode,
               .fetch_in_attention = fetch_in_attention,
               .max_clusters = static_cast<int32_t>(max_clusters),
               .max_candidates = static_cast<int32_t>(max_pages),
               .rebuild_bound = rebuild_bound,
               .page_of = d + at_page_of,
               .low_page_of = d + at_low_page_of,
               .host_page_of = d + at_host_page_of,
               .slot_of = d + at_slot_of,
               .decode_offsets = d + at_decode_offsets,
               .decode_tokens = d + at_decode_tokens,
               .decode_pages = d + at_decode_pages,
               .low_decode_offsets = d + at_low_decode_offsets,
               .low_decode_tokens = d + at_low_decode_tokens,
               .low_decode_pages = d + at_low_decode_pages,
               .prefill_offsets = d + at_prefill_offsets,
               .prefill_token_offsets = d + at_prefill_token_offsets,
               .prefill_first_pos = d + at_prefill_first_pos,
               .prefill_pages = d + at_prefill_pages,
               .low_prefill_pages = d + at_low_prefill_pages,
               .first_candidate = d + at_first,
               .end_candidate = d + at_end,
               .quest_end = d + at_quest_end,
               .seer_end = d + at_seer_end,
               .shadowkv_end = d + at_shadowkv_end,
               .retroinfer_end = d + at_retroinfer_end,
               .clustered_pages = d + at_clustered,
               .cluster_slots = d + at_cluster_slots,
               .zeros = d + at_zeros,
               .zone_offsets = d + at_zone_offsets,
               .rebuild_end = d + at_rebuild_end,
               .factor_offsets = d + at_factor_offsets,
               .factor_dir = d + at_factor_dir,
               .rebuild_pages = d + at_rebuild_pages,
               .rebuild_logical = d + at_rebuild_logical,
               .rebuild_counts = d + at_rebuild_counts,
               .copy_src = d + at_copy_src,
               .copy_dst = d + at_copy_dst,
               .copy_counts = d + at_copy_counts,
               .outlier_first = d + at_outlier_first,
               .outlier_end = d + at_outlier_end,
               .outlier_counts = d + at_outlier_counts,
               .outlier_offsets = d + at_outlier_offsets,
               .current_page = d + at_current_page,
               .dir_offsets = d + at_dir_offsets,
               .summary_dir = d + at_summary_dir,
               .host_offsets = d + at_host_offsets,
               .host_groups = d + at_host_groups,
               .cache_offsets = d + at_cache_offsets,
               .cache_groups = d + at_cache_groups,
               .now = reinterpret_cast<const uint32_t*>(d + at_now),
               .counts = d + at_counts,
               .needed_offsets = d + at_needed_offsets,
               .needed = d + at_needed,
               .out_offsets = d + at_out_offsets,
               .decode_pages_mutable = d + at_decode_pages,
               .fill_pages = d + at_fill_pages,
               .index_src = d + at_index_src,
               .seer_index_src = d + at_seer_index_src,
               .shadowkv_index_src = d + at_shadowkv_index_src,
               .index_dst = d + at_index_dst,
               .index_page = d + at_index_page};

  // Sparse sequences that just ended their prefill: summaries of all their complete pages, in every
  // sparse layer (eagerly, before the step's kernels; never part of a captured graph).
  for (int64_t l = dense_layers_; l < shape_.n_layers && transitions > 0; ++l) {
    cuda::QuestIndexParams p;
    p.kv_pool = pool_.get() + layer_offset(l);
    p.src_pages = d + at_transition_src;
    p.dst_entries = d + at_transition_dst;
    p.num_pages = static_cast<int>(transitions);
    p.head_dim = static_cast<int>(shape_.head_dim);
    p.page_size = static_cast<int>(page_size_);
    p.summaries = summaries_.get() + summary_layer_offset(l);
    cuda_check(cuda::quest_index_pages(p, stream), "Quest index of the prompt");
  }
  for (int64_t l = dense_layers_; l < shape_.n_layers && seer_transitions_n > 0; ++l) {
    cuda::SeerTrainedIndexParams p = seer_index_params(l);
    p.src_pages = d + at_seer_transition_src;
    p.dst_entries = d + at_seer_transition_dst;
    p.logical_pages = d + at_seer_transition_page;
    p.run_offsets = d + at_seer_transition_runs;
    p.num_runs = static_cast<int>(seer_runs_n);
    seer_index(p, stream, "Seer index of the prompt");
  }
  if (!factorisations.empty()) {
    // The outlier selection writes its pages per item at item * outliers.
    outlier_pages_.reserve(static_cast<size_t>(std::max<int64_t>(1, items * shadowkv_outliers_)), "ShadowKV outliers");
    for (int64_t l = dense_layers_; l < shape_.n_layers; ++l) {
      shadowkv_transition(l, shadowkv_transitions_n, d + at_shadowkv_transition_src, d + at_shadowkv_transition_dst,
                          d + at_shadowkv_transition_score, stream);
    }
    shadowkv_factorise(factorisations, d + at_shadowkv_transition_src, stream);
  }
  // RetroInfer's k-means, a group of KV heads at a time in every sparse layer (the check pass
  // reserved the scratch of the largest group).
  for (int64_t l = dense_layers_; l < shape_.n_layers; ++l) {
    for (const LaunchJobs& launch : launch_jobs) {
      cuda::RetroInferClusterParams c;
      c.records = retroinfer_records(l);
      c.host_pool = host_device_ + host_layer_offset(l);
      c.page_ids = d + at_job_pages + launch.pages_at;
      c.page_offsets = d + at_job_page_offsets + launch.offsets_at;
      c.first_page = d + at_job_first + launch.jobs_at;
      c.head = d + at_job_head + launch.jobs_at;
      c.dir = d + at_factor_dir;
      c.dir_offsets = d + at_job_dir + launch.jobs_at;
      c.num_jobs = static_cast<int>(launch.jobs);
      c.total_pages = static_cast<int>(launch.pages);
      c.cluster_tokens = static_cast<int>(sparse::SparseSettings{}.retroinfer_cluster_tokens);
      c.scratch = cluster_scratch_.get();
      cuda_check(cuda::retroinfer_cluster(c, stream), "RetroInfer k-means");
    }
  }
  release_transition_groups();
  // Graphs differ by whether the host-tier write-through and each algorithm's pipeline run, and by
  // the key rebuild's grid (its bound's log2 above ShadowKV's bit, RetroInfer's above it).
  uint32_t rebuild_bits = 0;
  for (int32_t b = rebuild_bound; b > 1; b /= 2) ++rebuild_bits;
  return DeviceStepLayout{decode_rows > 0 ? bucket : 0, epoch_,
                          (sparse_rows ? 1u : 0u) | (quest_decode ? 2u : 0u) | (seer_decode ? 4u : 0u) |
                              (shadowkv_decode ? 8u : 0u) | (rebuild_bits << 4) | (retroinfer_decode ? 1u << 12 : 0u)};
}

void CudaKvStore::forward(int64_t layer, const cuda::QkRopeParams& qk, bf16* out, cudaStream_t stream) {
  SPIN_CHECK(step_.rows > 0, "attention forward before begin_step");
  SPIN_CHECK(layer >= 0 && layer < shape_.n_layers, "attention forward: layer {} of {}", layer, shape_.n_layers);
  SPIN_CHECK(qk.n_tokens == step_.rows, "attention forward: {} rows in a step of {}", qk.n_tokens, step_.rows);
  SPIN_CHECK(qk.n_heads == shape_.n_heads && qk.n_kv_heads == shape_.n_kv_heads && qk.head_dim == shape_.head_dim,
             "attention forward: q/k heads {}/{} x {} for a store of {}/{} x {}", qk.n_heads, qk.n_kv_heads,
             qk.head_dim, shape_.n_heads, shape_.n_kv_heads, shape_.head_dim);
  const bf16* qkv = qk.qkv;
  const int64_t row_stride = qk.row_stride;
  SPIN_CHECK(row_stride >= q_width_ + 2 * shape_.n_kv_heads * shape_.head_dim,
             "attention forward: row stride {} is narrower than q, k and v", row_stride);
  // The first dense layers of sparse sequences attend over every page, kept in their own groups.
  // A step without sparse rows has no such groups: its low tables would repeat the main ones, so
  // begin_step leaves its low lists unfilled and every layer reads the main tables.
  const bool dense_layer = layer < dense_layers_ && step_.sparse_rows;
  bf16* pool = pool_.get() + layer_offset(layer);
  const int heads = static_cast<int>(shape_.n_kv_heads);
  const int head_dim = static_cast<int>(shape_.head_dim);
  // Norm and RoPE of q and k in the launch that stores K/V. The decode kernels read q as
  // [rows][heads][head_dim] without a row stride: the same launch packs it.
  cuda::QkRopeParams finish = qk;
  finish.kv_pool = pool;
  finish.page_of = dense_layer ? step_.low_page_of : step_.page_of;
  finish.slot_of = step_.slot_of;
  finish.page_size = static_cast<int>(page_size_);
  finish.q_copy = cuda::QueryCopy{decode_q_.get(), step_.decode_rows};
  cuda_check(cuda::qk_norm_rope_bf16(finish, stream), "q/k norm, RoPE and KV store");
  if (step_.sparse_rows && !dense_layer) {  // write-through to the host tier
    cuda_check(cuda::store_kv_pages_bf16(qkv, row_stride, q_width_, step_.host_page_of, step_.slot_of, step_.rows,
                                         heads, head_dim, static_cast<int>(page_size_),
                                         host_device_ + host_layer_offset(layer), stream),
               "KV host-tier write");
  }
  if (step_.decode_rows > 0) {
    const int decode_rows = static_cast<int>(step_.decode_rows);
    const bool profiled = !profile_counts_.empty() && step_.sparse_decode && !dense_layer;
    cudaEvent_t* events = profiled ? profile_events_.data() + kProfileEvents * (layer - dense_layers_) : nullptr;
    const auto mark = [&](int phase) {
      if (events) cuda_check(cudaEventRecord(events[phase], stream), "profile event");
    };
    const bool fetch_in_attention = step_.fetch_in_attention && !dense_layer;
    if (step_.sparse_decode && !dense_layer) {
      mark(0);
      bf16* summaries = summaries_.get() + summary_layer_offset(layer);
      if (step_.quest_decode) {
        cuda::QuestIndexParams index;
        index.kv_pool = pool;
        index.src_pages = step_.index_src;
        index.dst_entries = step_.index_dst;
        index.num_pages = decode_rows * heads;
        index.head_dim = head_dim;
        index.page_size = static_cast<int>(page_size_);
        index.summaries = summaries;
        cuda_check(cuda::quest_index_pages(index, stream), "Quest index");
        cuda::QuestScoreParams score;
        score.q = decode_q_.get();
        score.summaries = summaries;
        score.summary_dir = step_.summary_dir;
        score.dir_offsets = step_.dir_offsets;
        score.first_candidate = step_.first_candidate;
        score.end_candidate = step_.quest_end;
        score.num_seqs = decode_rows;
        score.num_kv_heads = heads;
        score.group = static_cast<int>(group_size_);
        score.head_dim = head_dim;
        score.max_candidates = step_.max_candidates;
        score.scores = scores_.get();
        cuda_check(cuda::quest_score_pages(score, stream), "Quest scores");
      }
      if (step_.seer_decode) {
        cuda::SeerScoreParams score;
        cuda::SeerTrainedIndexParams index = seer_index_params(layer);
        index.src_pages = step_.seer_index_src;  // a run per (row, KV head): the page it completes, if any
        index.dst_entries = step_.index_dst;
        index.logical_pages = step_.index_page;
        index.num_runs = decode_rows * heads;
        seer_index(index, stream, "Seer index");
        if (seer_trained()) {
          cuda::SeerGateQueryParams queries;
          queries.q = decode_q_.get();
          queries.q_gate = seer_q_gate_.get() + layer * q_width_ * head_dim;  // [KV head][group * head_dim][head_dim]
          queries.num_items = decode_rows * heads;
          queries.num_kv_heads = heads;
          queries.group = static_cast<int>(group_size_);
          queries.head_dim = head_dim;
          queries.out = seer_gate_queries_.get();
          cuda_check(cuda::seer_gate_queries(queries, stream), "Seer gate queries");
          score.gate_queries = seer_gate_queries_.get();
        }
        score.q = decode_q_.get();
        score.summaries = summaries;
        score.summary_dir = step_.summary_dir;
        score.dir_offsets = step_.dir_offsets;
        score.first_candidate = step_.first_candidate;
        score.end_candidate = step_.seer_end;
        score.current_page = step_.current_page;
        score.num_seqs = decode_rows;
        score.num_kv_heads = heads;
        score.group = static_cast<int>(group_size_);
        score.head_dim = head_dim;
        score.page_size = static_cast<int>(page_size_);
        score.block_pages = static_cast<int>(seer_block_pages_);
        score.inv_freq = inv_freq_.get();
        score.neox = neox_;
        score.max_candidates = step_.max_candidates;
        score.scores = scores_.get();
        cuda_check(cuda::seer_score_pages(score, stream), "Seer scores");
      }
      if (step_.shadowkv_decode) {
        cuda::ShadowKvIndexParams index;
        index.kv_pool = pool;
        index.src_pages = step_.shadowkv_index_src;
        index.dst_entries = step_.index_dst;
        index.num_pages = decode_rows * heads;
        index.head_dim = head_dim;
        index.page_size = static_cast<int>(page_size_);
        index.summaries = summaries;
        cuda_check(cuda::shadowkv_index_pages(index, stream), "ShadowKV index");
        cuda::ShadowKvScoreParams score;
        score.q = decode_q_.get();
        score.summaries = summaries;
        score.summary_dir = step_.summary_dir;
        score.dir_offsets = step_.dir_offsets;
        score.first_candidate = step_.first_candidate;
        score.end_candidate = step_.shadowkv_end;
        score.num_seqs = decode_rows;
        score.num_kv_heads = heads;
        score.group = static_cast<int>(group_size_);
        score.head_dim = head_dim;
        score.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));  // the CPU's landmark scale
        score.max_candidates = step_.max_candidates;
        score.logits = logits_.get();
        score.scores = scores_.get();
        cuda_check(cuda::shadowkv_score_pages(score, stream), "ShadowKV scores");
      }
      cuda::RetroInferSelectParams retro;
      if (step_.retroinfer_decode) {
        retro.records = retroinfer_records(layer);
        retro.q = decode_q_.get();
        retro.dir = step_.factor_dir;
        retro.dir_offsets = step_.factor_offsets;
        retro.clustered_pages = step_.clustered_pages;
        retro.first_candidate = step_.first_candidate;
        retro.end_candidate = step_.retroinfer_end;
        retro.num_seqs = decode_rows;
        retro.group = static_cast<int>(group_size_);
        retro.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));  // the CPU's centroid scale
        retro.max_clusters = step_.max_clusters;
        retro.max_candidates = step_.max_candidates;
        retro.logits = logits_.get();
        retro.totals = totals_.get();
        retro.page_scores = scores_.get();
        retro.selected = step_.needed;
        retro.selected_offsets = step_.needed_offsets;
        retro.selected_counts = step_.counts;
        retro.estimate_fraction = sparse::SparseSettings{}.retroinfer_estimate_fraction;
        retro.zone_flags = zone_flags_.get();
        retro.zone_tallies = zone_tallies_.get();
        retro.zone_scores = zone_scores_.get();
        retro.zone_counts = zone_counts_.get();
        cuda_check(cuda::retroinfer_score(retro, stream), "RetroInfer scores");
      }
      mark(1);
      cuda::SelectTopParams select;
      select.scores = scores_.get();
      select.max_candidates = step_.max_candidates;
      select.first_candidate = step_.first_candidate;
      select.end_candidate = step_.end_candidate;
      select.counts = step_.counts;
      select.out_offsets = step_.needed_offsets;
      select.num_seqs = decode_rows;
      select.num_kv_heads = heads;
      select.out_pages = step_.needed;
      cuda_check(cuda::select_top_pages(select, stream), "top-page select");
      const auto estimation_zone = [&] {  // RetroInfer's: the best clusters with a token left out
        if (!step_.retroinfer_decode) return;
        cuda_check(cuda::retroinfer_zone(retro, stream), "RetroInfer estimation zone");
        cuda::SelectTopParams zone;
        zone.scores = zone_scores_.get();
        zone.max_candidates = step_.max_clusters;
        zone.first_candidate = step_.zeros;
        zone.end_candidate = step_.cluster_slots;
        zone.counts = zone_counts_.get();
        zone.out_offsets = step_.zone_offsets;
        zone.num_seqs = decode_rows;
        zone.num_kv_heads = heads;
        zone.out_pages = zone_.get();
        cuda_check(cuda::select_top_pages(zone, stream), "RetroInfer zone select");
      };
      cuda::PageCacheParams cache;
      cache.num_seqs = decode_rows;
      cache.num_kv_heads = heads;
      cache.num_layers = static_cast<int>(shape_.n_layers);
      cache.layer = static_cast<int>(layer);
      cache.head_dim = head_dim;
      cache.page_size = static_cast<int>(page_size_);
      cache.needed = step_.needed;
      cache.needed_offsets = step_.needed_offsets;
      cache.needed_counts = step_.counts;
      cache.cache_groups = step_.cache_groups;
      cache.cache_offsets = step_.cache_offsets;
      cache.host_groups = step_.host_groups;
      cache.host_offsets = step_.host_offsets;
      cache.now = step_.now;
      cache.slot_page = slot_page_.get();
      cache.slot_stamp = slot_stamp_.get();
      cache.host_pool = host_device_ + host_layer_offset(layer);
      cache.device_pool = pool;
      cache.out_pages = step_.decode_pages_mutable;
      cache.out_offsets = step_.out_offsets;
      cache.counters = counters_.get();
      cache.error = cache_error_.get();
      if (step_.shadowkv_decode) {
        cache.rebuild_end = step_.rebuild_end;
        cache.rebuild_pages = step_.rebuild_pages;
        cache.rebuild_logical = step_.rebuild_logical;
        cache.rebuild_counts = step_.rebuild_counts;
        cache.value_only = value_only_.get();
      }
      const auto rebuild_keys = [&] {  // ShadowKV's, of the misses whose values alone were fetched
        if (!step_.shadowkv_decode) return;
        cuda::ShadowKvRebuildParams rebuild;
        rebuild.kv_pool = pool;
        rebuild.pages = step_.rebuild_pages;
        rebuild.logical = step_.rebuild_logical;
        rebuild.offsets = step_.needed_offsets;
        rebuild.counts = step_.rebuild_counts;
        rebuild.factor_dir = step_.factor_dir;
        rebuild.factor_offsets = step_.factor_offsets;
        rebuild.basis_groups = static_cast<int>(shadowkv_basis_groups_);
        rebuild.max_count = step_.rebuild_bound;
        rebuild.num_seqs = decode_rows;
        rebuild.num_kv_heads = heads;
        rebuild.head_dim = head_dim;
        rebuild.page_size = static_cast<int>(page_size_);
        rebuild.rank = static_cast<int>(shadowkv_rank_);
        rebuild.inv_freq = inv_freq_.get();
        rebuild.neox = neox_;
        cuda_check(cuda::shadowkv_rebuild_keys(rebuild, stream), "ShadowKV key rebuild");
      };
      // Quest, Seer and RetroInfer plan here and fetch in the attention. With ShadowKV rows,
      // Retrieve's fetch runs on its own stream beside the key rebuild, which needs Retrieve's plan
      // (which misses go to which slots) but not the bytes it fetches. A profiled step runs the
      // phases one after another, so that each is timed alone.
      if (fetch_in_attention) {
        estimation_zone();
        mark(2);
        cache.fill_pages = step_.fill_pages;
        cuda_check(cuda::plan_cached_pages(cache, stream), "KV cache retrieve plan");
        mark(3);
      } else if (profiled || retrieve_stream_ == nullptr || !step_.shadowkv_decode) {
        estimation_zone();
        mark(2);
        cuda_check(cuda::retrieve_cached_pages(cache, stream), "KV cache retrieve");
        mark(3);
        rebuild_keys();
      } else {
        cache.copy_src = step_.copy_src;
        cache.copy_dst = step_.copy_dst;
        cache.copy_counts = step_.copy_counts;
        cuda_check(cuda::plan_cached_pages(cache, stream), "KV cache retrieve plan");
        cuda_check(cudaEventRecord(retrieve_fork_, stream), "Retrieve fork");
        cuda_check(cudaStreamWaitEvent(retrieve_stream_, retrieve_fork_), "Retrieve fork");
        cuda_check(cuda::fetch_planned_pages(cache, retrieve_stream_), "KV cache retrieve");
        cuda_check(cudaEventRecord(retrieve_join_, retrieve_stream_), "Retrieve join");
        estimation_zone();
        rebuild_keys();
        cuda_check(cudaStreamWaitEvent(stream, retrieve_join_), "Retrieve join");
      }
      if (layer == shape_.n_layers - 1) {
        cuda_check(cudaMemcpyAsync(cache_error_seen_.get(), cache_error_.get(), sizeof(int), cudaMemcpyDeviceToHost,
                                   stream),
                   "KV cache error flag");
      }
    }
    mark(4);
    cuda::PagedDecodeParams p = decode_params(step_.decode_rows, step_.context_bucket);
    p.kv_pool = pool;
    if (has_host_tier()) p.host_pool = host_device_ + host_layer_offset(layer);  // dense-offload's pages
    if (dense_layer) {
      p.page_ids = step_.low_decode_pages;
      p.list_offsets = step_.low_decode_offsets;
      p.num_tokens = step_.low_decode_tokens;
    }
    if (fetch_in_attention) {
      p.fill_pages = step_.fill_pages;
      p.fill_pool = pool;
    }
    const bool estimate = step_.retroinfer_decode && !dense_layer;
    if (estimate) p.lse = lse_.get();
    cuda_check(cuda::paged_decode_attention(p, out, workspace_.get(), workspace_.bytes(), stream),
               "paged decode attention");
    if (estimate) {
      cuda::RetroInferEstimateParams e;
      e.records = retroinfer_records(layer);
      e.q = decode_q_.get();
      e.dir = step_.factor_dir;
      e.dir_offsets = step_.factor_offsets;
      e.first_candidate = step_.first_candidate;
      e.end_candidate = step_.retroinfer_end;
      e.selected = step_.needed;
      e.selected_offsets = step_.needed_offsets;
      e.selected_counts = step_.counts;
      e.zone = zone_.get();
      e.zone_offsets = step_.zone_offsets;
      e.zone_counts = zone_counts_.get();
      e.decode_pages = step_.decode_pages;
      e.decode_offsets = step_.decode_offsets;
      if (fetch_in_attention) e.fill_pages = step_.fill_pages;
      e.num_seqs = decode_rows;
      e.group = static_cast<int>(group_size_);
      e.scale = shape_.scale;  // the attention's, as the CPU's estimation
      e.lse = lse_.get();
      e.out = out;
      e.splits = cuda::retroinfer_estimate_splits(step_.max_clusters);
      e.partials = estimate_partials_.get();
      e.max_candidates = static_cast<int>(step_.max_candidates);
      cuda_check(cuda::retroinfer_estimate(e, stream), "RetroInfer estimation");
    }
    mark(5);
    if (profiled && profile_entries_ > 0) {
      cuda_check(cudaMemcpyAsync(profile_selected_.get() + (layer - dense_layers_) * profile_entries_, step_.needed,
                                 static_cast<size_t>(profile_entries_) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 stream),
                 "profile selection copy");
    }
  }
  if (step_.prefill_seqs > 0) {
    cuda::PagedPrefillParams p;
    p.q = qkv + step_.decode_rows * row_stride;
    p.q_row_stride = row_stride;
    p.kv_pool = pool;
    p.page_ids = dense_layer ? step_.low_prefill_pages : step_.prefill_pages;
    p.list_offsets = step_.prefill_offsets;
    p.token_offsets = step_.prefill_token_offsets;
    p.first_pos = step_.prefill_first_pos;
    p.num_seqs = static_cast<int>(step_.prefill_seqs);
    p.num_kv_heads = heads;
    p.group = static_cast<int>(group_size_);
    p.head_dim = head_dim;
    p.page_size = static_cast<int>(page_size_);
    p.max_new_tokens = static_cast<int>(step_.max_new_tokens);
    p.scale = shape_.scale;
    p.variant = prefill_variant_;
    cuda_check(cuda::paged_prefill_attention(p, out + step_.decode_rows * q_width_, stream),
               "paged prefill attention");
  }
}

CudaPagedAttentionFactory::CudaPagedAttentionFactory(const AttentionShape& shape, const CudaPagedKvConfig& config)
    : shape_(shape), store_(std::make_shared<CudaKvStore>(shape, config)) {}

CudaPagedAttentionFactory::~CudaPagedAttentionFactory() = default;

std::vector<std::string> CudaPagedAttentionFactory::algorithms() const {
  if (store_->has_host_tier()) return {"dense", kDenseOffload, kQuest, kSeer, kShadowKv, kRetroInfer};
  return {"dense"};
}

void CudaPagedAttentionFactory::validate(const AttentionSettings& settings) const {
  if (uses_host_tier(settings)) {
    store_->resolve_sparse(settings);
    return;
  }
  SPIN_CHECK(settings.algorithm == "dense",
             "attention algorithm '{}' is not available on the CUDA backend yet (available: dense{}; the others run "
             "with --device cpu)",
             settings.algorithm,
             store_->has_host_tier() ? ", dense-offload, quest, seer, shadowkv, retroinfer"
                                     : "; dense-offload, quest, seer, shadowkv and retroinfer with --kv-host-pages");
  AttentionFactory::validate(settings);
}

std::unique_ptr<SequenceKv> CudaPagedAttentionFactory::create(const AttentionSettings& settings, int64_t max_tokens) {
  validate(settings);
  SPIN_CHECK(max_tokens > 0 && max_tokens < std::numeric_limits<int32_t>::max(),
             "attention capacity must be in 1..2^31-1, got {}", max_tokens);
  std::unique_ptr<SparseKv> sparse;
  if (uses_host_tier(settings)) {
    sparse = std::make_unique<SparseKv>();
    sparse->settings = store_->resolve_sparse(settings);
    sparse->algorithm = *host_tier_algorithm(settings.algorithm);
    sparse->selection_slots = store_->selection_slots(sparse->settings, max_tokens);
    // The whole buffer until the engine sizes it (benchmarks and tests that use no engine).
    sparse->buffer_slots = store_->max_buffer_slots(sparse->settings, max_tokens);
  }
  return std::make_unique<CudaSequenceKv>(store_, max_tokens, std::move(sparse));
}

KvDemand CudaPagedAttentionFactory::demand(const AttentionSettings& settings, int64_t tokens, int64_t max_tokens,
                                           bool decoding, int64_t) const {
  const int64_t pages = store_->pages_for(tokens);
  if (!uses_host_tier(settings)) return KvDemand{.device_pages = pages * store_->pages_per_group()};
  const sparse::ResolvedSettings r = store_->resolve_sparse(settings);
  // ShadowKV's factors cover its prompt, RetroInfer's records its clustered pages: at most `pages`.
  const int64_t resident =
      decoding ? std::min<int64_t>(pages, int64_t{r.sink_pages} + r.window_pages + 1) +
                     store_->selection_slots(r, max_tokens) +
                     (settings.algorithm == kShadowKv     ? store_->shadowkv_factor_groups(pages)
                      : settings.algorithm == kRetroInfer ? store_->record_groups_for(pages)
                                                          : 0)
               : pages;
  return KvDemand{.device_pages = resident * store_->pages_per_group(),
                  .host_pages = pages * store_->pages_per_group(),
                  .dense_layer_pages = pages * store_->pages_per_low_group()};
}

KvDemand CudaPagedAttentionFactory::capacity() const { return store_->capacity(); }

bool CudaPagedAttentionFactory::single_token_is_decode(const AttentionSettings& settings) const {
  return uses_host_tier(settings);
}

std::optional<KvStoreUsage> CudaPagedAttentionFactory::usage() const { return store_->usage(); }

void CudaPagedAttentionFactory::append_uncomputed(SequenceKv& kv, int64_t tokens) {
  auto* seq = dynamic_cast<CudaSequenceKv*>(&kv);
  SPIN_CHECK(seq != nullptr && seq->owner() == store_.get(), "append_uncomputed: KV from another store");
  const int64_t end = seq->length() + tokens;
  SPIN_CHECK(tokens >= 0 && end <= seq->max_tokens(), "KV cache full: {} tokens requested, capacity {}", end,
             seq->max_tokens());
  if (seq->sparse() == nullptr) {
    store_->grow(seq->groups(), store_->pages_for(end));
  } else {
    SPIN_CHECK(!seq->sparse()->decoding, "append_uncomputed: the sparse sequence is past its prefill");
    store_->grow_prefill(seq->groups(), *seq->sparse(), store_->pages_for(end));
  }
  seq->stored(end);
}

void CudaPagedAttentionFactory::randomize_device_pages(uint64_t seed) { store_->randomize_device_pages(seed); }

int64_t CudaPagedAttentionFactory::decode_pages_read(const AttentionSettings& settings, int64_t tokens) const {
  SPIN_CHECK(tokens > 0 && tokens <= UINT32_MAX, "decode_pages_read: {} tokens", tokens);
  const int64_t all = store_->pages_for(tokens) * shape_.n_kv_heads;
  if (!uses_host_tier(settings)) return all * shape_.n_layers;
  const bool offload = settings.algorithm == kDenseOffload;
  const sparse::ResolvedSettings r = store_->resolve_sparse(settings);
  const int64_t outliers = settings.algorithm == kShadowKv ? store_->shadowkv_outliers() : 0;
  const DecodePlan plan = plan_decode(r, offload, tokens - 1, outliers);
  // dense-offload attends to its candidates in the host tier: only sinks and window are on the device.
  const int64_t device_pages = plan.attended - (offload ? int64_t{plan.window.candidates()} : 0);
  return store_->dense_layers() * all + (shape_.n_layers - store_->dense_layers()) * device_pages * shape_.n_kv_heads;
}

int64_t CudaPagedAttentionFactory::cache_slots(const AttentionSettings& settings, int64_t max_tokens) const {
  const sparse::ResolvedSettings r = store_->resolve_sparse(settings);
  return store_->selection_slots(r, max_tokens) + store_->max_buffer_slots(r, max_tokens);
}

int64_t CudaPagedAttentionFactory::buffer_streams(const AttentionSettings& settings) const {
  // A buffer slot is one more cache group: a page in every (layer, KV head).
  if (!uses_host_tier(settings) || settings.algorithm == kDenseOffload) return 0;
  return store_->pages_per_group();
}

int64_t CudaPagedAttentionFactory::max_buffer_pages(const AttentionSettings& settings, int64_t max_tokens) const {
  if (buffer_streams(settings) == 0) return 0;
  return store_->max_buffer_slots(store_->resolve_sparse(settings), max_tokens);
}

void CudaPagedAttentionFactory::set_buffer_pages(SequenceKv& kv, int64_t pages) {
  auto* seq = dynamic_cast<CudaSequenceKv*>(&kv);
  SPIN_CHECK(seq != nullptr && seq->owner() == store_.get(), "KV buffer: KV from another store");
  SparseKv* sp = seq->sparse();
  if (sp == nullptr || sp->offload()) return;
  const int64_t most = store_->max_buffer_slots(sp->settings, seq->max_tokens());
  SPIN_CHECK(pages >= 0 && pages <= most, "KV buffer of {} slots out of range (0..{})", pages, most);
  store_->set_buffer_slots(*seq, pages);
}

void CudaPagedAttentionFactory::set_step_profiling(bool on) { store_->set_step_profiling(on); }

bool CudaPagedAttentionFactory::can_swap(const SequenceKv& kv) const {
  const auto* seq = dynamic_cast<const CudaSequenceKv*>(&kv);
  return seq != nullptr && seq->owner() == store_.get() && store_->can_swap(*seq);
}

void CudaPagedAttentionFactory::swap_out(SequenceKv& kv) {
  auto* seq = dynamic_cast<CudaSequenceKv*>(&kv);
  SPIN_CHECK(seq != nullptr && seq->owner() == store_.get(), "KV swap: KV from another store");
  store_->swap_out(*seq);
}

void CudaPagedAttentionFactory::swap_in(SequenceKv& kv) {
  auto* seq = dynamic_cast<CudaSequenceKv*>(&kv);
  SPIN_CHECK(seq != nullptr && seq->owner() == store_.get(), "KV swap: KV from another store");
  store_->swap_in(*seq);
}

SparseStepProfile CudaPagedAttentionFactory::last_step_profile() const { return store_->last_step_profile(); }

int64_t CudaPagedAttentionFactory::pool_bytes() const { return store_->pool_bytes(); }

int64_t CudaPagedAttentionFactory::page_size() const { return store_->page_size(); }

std::vector<std::unique_ptr<CudaPagedAttentionFactory>> make_cuda_rank_factories(const AttentionShape& rank_shape,
                                                                                 CudaPagedKvConfig config, int world) {
  SPIN_CHECK(world >= 1, "tensor parallel: the world size must be >= 1, got {}", world);
  int caller_device = 0;
  cuda_check(cudaGetDevice(&caller_device), "cudaGetDevice");
  // Each rank's share of Seer's trained gate: its KV heads.
  const std::shared_ptr<const sparse::SeerGate> gate = config.seer_gate;
  const auto rank_config = [&](int r) {
    config.device = r;
    const auto heads = static_cast<uint32_t>(rank_shape.n_kv_heads);
    config.seer_gate = world == 1 ? gate : sparse::seer_gate_heads(gate, static_cast<uint32_t>(r) * heads, heads);
    return config;
  };
  std::vector<std::unique_ptr<CudaPagedAttentionFactory>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<CudaPagedAttentionFactory>(rank_shape, rank_config(r)));
  // Device pages of a rank's pools: the main one and the first dense layers' one.
  const auto pool_pages = [](const CudaPagedAttentionFactory& f) {
    const KvDemand c = f.capacity();
    return c.device_pages + c.dense_layer_pages;
  };
  int64_t smallest = pool_pages(*ranks.front());
  for (const auto& f : ranks) smallest = std::min(smallest, pool_pages(*f));
  for (int r = 0; r < world; ++r) {
    if (pool_pages(*ranks[static_cast<size_t>(r)]) == smallest) continue;
    // Free this rank's larger pool before allocating the smaller one.
    ranks[static_cast<size_t>(r)].reset();
    config.device_pages = smallest;
    ranks[static_cast<size_t>(r)] = std::make_unique<CudaPagedAttentionFactory>(rank_shape, rank_config(r));
  }
  cuda_check(cudaSetDevice(caller_device), "cudaSetDevice");  // each store set its own GPU
  return ranks;
}

}  // namespace spin
