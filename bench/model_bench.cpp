// Forward-pass benchmark, next to the physical bound of the same run.
// --device cpu: prefill tok/s at a few prompt lengths and decode tok/s of one sequence; the decode
//   bound is the weight bytes read per token (a GGUF's Q4_1 / Q8_0 blocks where the products read
//   them, else fp32) ÷ the read bandwidth of all the model's threads, measured in the same run.
// --device cuda: the bf16 CudaModel on its paged device KV store. Prefill tok/s, and decode tok/s
//   for each batch size x context length; the bound of a decode step is the bytes it must read
//   (bf16 weights + every sequence's K and V) ÷ device-to-device cudaMemcpy bandwidth measured in
//   the same process (median of repeats; bytes read + written per second). Long contexts are
//   not prefilled: their KV pages are allocated and left as they are (decode time depends on the
//   number of keys, not their values). A timed decode step is the engine's: greedy tokens drawn on
//   the GPU, their ids downloaded (--download-logits, and tensor parallel models, which draw on
//   the host: every row's logits copied to the host instead); the host ms/step column is its time
//   outside the final wait for the GPU.
//   --tensor-parallel-size N: the model split over GPUs 0..N-1 (NCCL all-reduces), each with its
//   own KV pool; the bound is then one GPU's share of the bytes (its weight shard plus replicated
//   tensors, its KV heads) over one GPU's bandwidth: the all-reduces are not in it.
//   --sparse-algorithm quest, seer, shadowkv or retroinfer: sparse decode over the two-tier store (a pinned host tier sized for
//   the largest batch x context). The device pages get random values, each sequence's uncomputed
//   context is indexed by its own first decode step, then the batch decodes (timed once its caches
//   are full: on one GPU right after the breakdown's profiled steps); the table gives the
//   time of that first step (the Index of the whole context: ShadowKV's factorisation is most of
//   it; RetroInfer's k-means too), the cache hit rate, the bytes retrieved from the host tier per step (GPU 0's share), and the
//   step's bound: its HBM bytes at the device copy rate plus its retrieved bytes at the bulk
//   host-to-device rate, both measured in the same process. Random
//   keys and random tokens make selections churn more than a real model's would: this is a
//   retrieval-heavy case, not a typical one. --sparse-algorithm dense-offload: the same store, every
//   page attended, those outside sinks, window and the first dense layers read over the link by
//   the attention kernel (counted in the table's retrieved bytes). On one GPU, the sparse ones add
//   a second table: where a step's time goes (phases timed by events over 12 eager steps) and the
//   step against the ideal envelope (Belady's fetches over the same selections and cache slots).
//   --seer-gate FILE|random: seer with a trained gate (`random`: weights of the model's shape drawn
//   here, for timing).
//   --context-source ledger: each sequence's context is instead a ledger-like token stream (entries
//   that reuse a few names, things and places, as spin eval's documents) computed by a chunked
//   prefill, and every decode step feeds each sequence's greedy token back: selections then move
//   as the model's attention moves, not at random (with --load-format dummy, a random-weight
//   model's). Sequences must not share host bytes (no --host-tier-backing). --context-source
//   ledger-text: the same contexts, but decode feeds the ledger's own continuation (teacher
//   forcing): a random-weight model's greedy decode loops over a few tokens, the ledger moves on.
// Prints markdown tables.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <unordered_set>
#include <vector>

#include "base/error.h"
#include "engine/sampler.h"
#include "kernels/cpu/ops.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/transformer.h"
#ifdef SPIN_WITH_CUDA
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include "engine/cuda/cuda_paged_attention.h"
#include "kernels/cuda/module_loading.h"
#include "kv/replacement_oracle.h"
#include "engine/tensor_parallel_factory.h"
#include "model/cuda/cuda_model.h"
#include "model/tensor_parallel.h"
#endif

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct BenchArgs {
  bool compare_sampling = false;
  std::string model;
  std::string load_format = "auto";
  std::string rope_scaling;
  std::string device = "cpu";
  std::vector<int64_t> prefill_lengths{512, 4096};
  int64_t decode_tokens = 64;
  std::vector<int64_t> decode_contexts{128, 8192};
  std::vector<int64_t> batches{1, 8, 32};
  int64_t prefill_chunk = 2048;
  int prefill_variant = -1;  // cuda: the prefill attention kernel (-1: the default)
  bool fetch_in_attention = true;  // cuda: misses read by the decode attention, not fetched first
  bool download_logits = false;    // cuda: decode steps copy the logits to the host (else draw greedily on the GPU)
  int repeats = 3;
  int threads = 0;
  bool cuda_graphs = true;
  std::optional<int64_t> gemv_rows;  // cuda: products of at most this many rows on gemv.h (unset: the model's default)
  std::string gemm_tuning;  // cuda, one GPU: the cuBLASLt tuning file (model/gemm_tuning.h)
  double gpu_memory_utilization = 0.9;
  int tensor_parallel_size = 1;
  std::string sparse_algorithm = "dense";
  int64_t sparse_budget = 0;  // tokens per KV head; 0: the algorithm's default
  double buffer_factor = 5.0;  // cached pages beside a sparse selection, as a multiple of it (serve's default)
  int64_t block_size = 16;    // cuda: tokens per KV page (ShadowKV's chunk is 8)
  std::string seer_gate;      // cuda: seer's trained gate file, `random`, or empty (training-free)
  double dense_layer_share = 0.2;    // cuda, sparse: the KV pool's share for the first dense layers (serve's)
  double host_tier_backing_gb = 0.0;  // cuda, sparse: the host tier over this much pinned memory, repeated (0: all its own)
  std::string context_source = "random";  // cuda: random pages and tokens, `ledger` or `ledger-text` (prefilled)
};

// Bytes read per second by the model's threads (an OpenMP sum over a buffer far larger than
// the caches): decode streams every weight once, so this is its ceiling.
double read_bandwidth(size_t bytes, int repeats) {
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  std::unique_ptr<float[]> data(new float[static_cast<size_t>(n)]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(i & 7);  // first touch per thread
  std::vector<double> rates;
  double checksum = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t = clock_type::now();
    double sum = 0.0;
    // 32 independent accumulators per block, so the adds never wait on each other.
    constexpr int64_t kLanes = 32, kBlock = 1024;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t b = 0; b < n / kBlock; ++b) {
      float acc[kLanes] = {};
      for (int64_t k = 0; k < kBlock; k += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += data[b * kBlock + k + j];
      }
      for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
    }
    rates.push_back(static_cast<double>(bytes) / seconds_since(t));
    checksum += sum;
  }
  SPIN_CHECK(checksum > 0.0, "read bandwidth: the sum was optimised away");
  return median(rates);
}

spin::LoadOptions load_options(const BenchArgs& a) {
  spin::LoadOptions load;
  load.model = a.model;
  load.load_format = a.load_format;
  load.rope_scaling = a.rope_scaling;
  return load;
}

// Weight bytes one decode step reads: every matrix once, as its products read it (the GGUF's
// blocks where it has them and this CPU runs them, else fp32), and the norms; the embedding table
// contributes one row unless it doubles as the LM head.
double decode_weight_bytes(const spin::ModelWeights& w) {
  const auto matrix = [](const spin::Matrix& m) {
    return m.decodes_from_blocks() ? static_cast<double>(m.blocks.size()) : 4.0 * static_cast<double>(m.data.size());
  };
  double bytes = 4.0 * static_cast<double>(w.out_norm.size());
  for (const spin::LayerWeights& l : w.layers) {
    for (const spin::Matrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) bytes += matrix(*m);
    bytes += 4.0 * static_cast<double>(l.attn_norm.size() + l.ffn_norm.size() + l.q_norm.size() + l.k_norm.size());
  }
  const double head = w.lm_head.empty() ? matrix(w.tok_embd)
                                        : matrix(w.lm_head) + 4.0 * static_cast<double>(w.tok_embd.cols);
  return bytes + head;
}

void run_cpu(const BenchArgs& a) {
  spin::cpu::set_num_threads(a.threads);
  spin::LoadedModel model = spin::load_model(load_options(a));
  const spin::ModelConfig& c = model.weights.config;
  spin::Transformer transformer(model.weights);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  std::vector<float> logits;
  const int64_t decode_tokens = a.decode_tokens;
  const int repeats = a.repeats;

  std::printf("| measurement | value |\n|---|---|\n");
  std::printf("| threads | %d |\n", spin::cpu::num_threads());
  for (int64_t n : a.prefill_lengths) {
    std::vector<int32_t> prompt(n);
    for (int32_t& t : prompt) t = token(rng);
    std::vector<double> rates;
    for (int r = 0; r < repeats; ++r) {
      spin::ContiguousAttention kv(transformer.attention_shape(), n);
      const auto t = clock_type::now();
      for (int64_t pos = 0; pos < n; pos += 512) {
        const int64_t len = std::min<int64_t>(512, n - pos);
        spin::SequenceChunk chunk{std::span<const int32_t>(prompt).subspan(pos, len), pos, &kv};
        transformer.forward(std::span(&chunk, 1), false, logits);
      }
      rates.push_back(n / seconds_since(t));
    }
    std::printf("| prefill %lld tokens (tok/s, chunks of 512) | %.1f |\n", static_cast<long long>(n), median(rates));
  }

  // Decode after prompts of each length: the first is short, so weights dominate the step.
  std::vector<double> decode_rates;
  for (int64_t context : a.decode_contexts) {
    // One prefill per context; each repeat continues the same sequence for decode_tokens steps.
    spin::ContiguousAttention kv(transformer.attention_shape(), context + repeats * decode_tokens + 1);
    std::vector<int32_t> prompt(context);
    for (int32_t& t : prompt) t = token(rng);
    for (int64_t pos = 0; pos < context; pos += 512) {
      const int64_t len = std::min<int64_t>(512, context - pos);
      spin::SequenceChunk chunk{std::span<const int32_t>(prompt).subspan(pos, len), pos, &kv};
      transformer.forward(std::span(&chunk, 1), false, logits);
    }
    std::vector<double> rates;
    int64_t pos = context;
    for (int r = 0; r < repeats; ++r) {
      const auto t = clock_type::now();
      for (int64_t i = 0; i < decode_tokens; ++i, ++pos) {
        const int32_t id = token(rng);
        spin::SequenceChunk step{std::span(&id, 1), pos, &kv};
        transformer.forward(std::span(&step, 1), false, logits);
      }
      rates.push_back(decode_tokens / seconds_since(t));
    }
    decode_rates.push_back(median(rates));
    std::printf("| decode after %lld tokens (tok/s; ms/step) | %.1f; %.1f |\n", static_cast<long long>(context),
                decode_rates.back(), 1e3 / decode_rates.back());
  }
  const double decode = decode_rates.front();

  const double weight_bytes = decode_weight_bytes(model.weights);
  const double bandwidth = read_bandwidth(size_t{1} << 30, 7);
  const double bound = bandwidth / weight_bytes;
  std::printf("| weight bytes read per token | %.1f MB |\n", weight_bytes / 1e6);
  std::printf("| read bandwidth (%d threads, 1 GiB, median of 7) | %.2f GB/s |\n", spin::cpu::num_threads(),
              bandwidth / 1e9);
  std::printf("| decode bound = bandwidth / weight bytes (tok/s) | %.1f |\n", bound);
  std::printf("| decode after %lld tokens / bound | %.0f%% |\n", static_cast<long long>(a.decode_contexts.front()),
              100.0 * decode / bound);
}

#ifdef SPIN_WITH_CUDA

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) spin::fail("{}: {}", what, cudaGetErrorString(status));
}

// Bytes per second of cudaMemcpy from src to dst (median of repeats timed with events, after one
// warm-up copy).
double copy_rate(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int repeats) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> rates;
  for (int r = 0; r < repeats + 1; ++r) {
    cudaEventRecord(start);
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, kind), "bandwidth copy");
    cudaEventRecord(stop);
    cuda_ok(cudaEventSynchronize(stop), "bandwidth copy");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (r > 0) rates.push_back(static_cast<double>(bytes) / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(rates);
}

// Device-to-device copy of 1 GiB: bytes read + bytes written per second (the rate an ideal
// read-bound kernel approaches on HBM).
double device_copy_bandwidth(int repeats) {
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  cuda_ok(cudaMalloc(&src, bytes), "bandwidth buffer");
  cuda_ok(cudaMalloc(&dst, bytes), "bandwidth buffer");
  const double rate = 2.0 * copy_rate(dst, src, bytes, cudaMemcpyDeviceToDevice, repeats);
  cudaFree(src);
  cudaFree(dst);
  return rate;
}

constexpr int kProfileSteps = 12;

// Profiled steps before the counted ones. The replays start from empty caches, so a page last
// used before the trace is a miss only there, and Belady bridges reuse gaps longer than LRU's.
// The warm-up runs until the trace has selected, per (request, layer, KV head), twice as many
// distinct pages as its cache holds on average: a cache that hits often fills slowly ((1 +
// factor) / (1 - hit rate) steps: 15 at 5x and a 0.6 hit rate, 150 at 5x and 0.96). At least
// kMinWarmSteps, at most kMaxWarmSteps, and no longer once the trace holds kMaxWarmPages page
// references (RetroInfer at batch 8 would record half a billion in 400 steps, and replaying them
// takes minutes). The LRU replay's hit rate beside the store's shows whether that was enough for
// LRU; where Belady needs longer still, the ideal reads high.
constexpr int kMinWarmSteps = 12;
constexpr int kMaxWarmSteps = 400;
constexpr size_t kMaxWarmPages = size_t{64} << 20;

// Profiled eager decode steps of one shape (`step` runs one over the batch): their phases, the
// store's hit rate, and their selections replayed with the store's cache slots through Belady's
// replacement (for the ideal step) and through bucketed LRU (to check that the replay is warm).
struct SparseProfile {
  double eager_ms = 0.0;
  spin::SparseStepProfile phases;
  double hit_rate = 0.0;
  double lru_replay_hit_rate = 0.0;
  double belady_hit_rate = 0.0;
  double belady_bytes = 0.0;  // per step: Belady's misses at the bytes a measured miss cost
  double lru_bytes = 0.0;     // per step: the LRU replay's misses, alike
  int warm_steps = 0;
};

SparseProfile profile_sparse_steps(spin::CudaModel& model, spin::CudaPagedAttentionFactory& factory,
                                   const spin::AttentionSettings& settings, int64_t capacity,
                                   const std::function<void()>& step, bool cuda_graphs) {
  model.set_cuda_graphs(false);
  factory.set_step_profiling(true);
  spin::kv::SelectionTrace trace;
  SparseProfile out;
  std::vector<double> eager_seconds;
  spin::KvStoreUsage counted_from;
  size_t most_selected = 0;
  const int64_t slots = factory.cache_slots(settings, capacity);
  std::unordered_set<uint64_t> distinct;  // (item, page) pairs the trace has selected
  size_t items = 0;  // (request, layer, KV head) items: the records of one step
  int warm_steps = kMaxWarmSteps;
  for (int s = 0; s < warm_steps + kProfileSteps; ++s) {
    if (s < warm_steps && s >= kMinWarmSteps && items > 0 &&
        (distinct.size() >= 2 * static_cast<size_t>(slots) * items || trace.pages.size() >= kMaxWarmPages))
      warm_steps = s;
    if (s == warm_steps) counted_from = factory.usage().value_or(spin::KvStoreUsage{});
    const auto start = clock_type::now();
    step();
    const double seconds = seconds_since(start);
    const spin::SparseStepProfile p = factory.last_step_profile();
    for (size_t l = 0; l < p.selected.size(); ++l) {
      for (size_t i = 0; i < p.selected[l].size(); ++i) {
        const std::vector<uint32_t> pages(p.selected[l][i].begin(), p.selected[l][i].end());
        trace.add(static_cast<uint64_t>(s), static_cast<uint32_t>(i / static_cast<size_t>(p.kv_heads)),
                  static_cast<uint32_t>(l), static_cast<uint32_t>(i % static_cast<size_t>(p.kv_heads)), pages);
        most_selected = std::max(most_selected, pages.size());
        const uint64_t item = l * p.selected[l].size() + i;
        if (s < warm_steps)
          for (const uint32_t page : pages) distinct.insert(item << 32 | page);
      }
    }
    if (s == 0) items = trace.records.size();
    if (s < warm_steps) continue;
    eager_seconds.push_back(seconds);
    out.phases.score_ms += p.score_ms / kProfileSteps;
    out.phases.select_ms += p.select_ms / kProfileSteps;
    out.phases.retrieve_ms += p.retrieve_ms / kProfileSteps;
    out.phases.rebuild_ms += p.rebuild_ms / kProfileSteps;
    out.phases.attention_ms += p.attention_ms / kProfileSteps;
  }
  factory.set_step_profiling(false);
  model.set_cuda_graphs(cuda_graphs);
  const spin::KvStoreUsage end = factory.usage().value_or(spin::KvStoreUsage{});
  const auto hits = static_cast<double>(end.hits - counted_from.hits);
  const auto misses = static_cast<double>(end.misses - counted_from.misses);
  const auto replay = [&](spin::kv::ReplacementPolicy policy) {
    return spin::kv::replay_trace(trace, policy,
                                  static_cast<uint32_t>(std::max<int64_t>(0, slots - static_cast<int64_t>(most_selected))),
                                  64, static_cast<uint32_t>(warm_steps));
  };
  const spin::kv::ReplayResult belady = replay(spin::kv::ReplacementPolicy::Belady);
  // The bytes a miss costs, as measured (a whole page; ShadowKV's prompt pages fetch their values only).
  const double miss_bytes = misses > 0 ? static_cast<double>(end.retrieve_bytes - counted_from.retrieve_bytes) / misses
                                       : static_cast<double>(end.page_bytes);
  out.eager_ms = median(eager_seconds) * 1e3;
  out.hit_rate = hits + misses > 0 ? hits / (hits + misses) : 0.0;
  const spin::kv::ReplayResult lru = replay(spin::kv::ReplacementPolicy::BucketedLru);
  out.lru_replay_hit_rate = lru.hit_rate();
  out.lru_bytes = static_cast<double>(lru.misses) * miss_bytes / kProfileSteps;
  out.belady_hit_rate = belady.hit_rate();
  out.belady_bytes = static_cast<double>(belady.misses) * miss_bytes / kProfileSteps;
  out.warm_steps = warm_steps;
  return out;
}

// One row of the sparse breakdown table: the profile, and the ideal step (`hbm_seconds` of HBM
// reads plus Belady's fetches at the link rate) against the graph run's `measured_step`.
std::string sparse_breakdown_row(const SparseProfile& p, int64_t batch, int64_t context, double measured_step,
                                 double hbm_seconds, double link_bandwidth) {
  const double ideal = hbm_seconds + p.belady_bytes / link_bandwidth;
  const double ideal_lru = hbm_seconds + p.lru_bytes / link_bandwidth;
  const spin::SparseStepProfile& ph = p.phases;
  const double rest = p.eager_ms - ph.score_ms - ph.select_ms - ph.retrieve_ms - ph.rebuild_ms - ph.attention_ms;
  return fmt::format("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {:.2f} | {:.2f} |",
                     batch, context, p.warm_steps, p.eager_ms, ph.score_ms, ph.select_ms, ph.retrieve_ms, ph.rebuild_ms,
                     ph.attention_ms, rest, p.hit_rate, p.lru_replay_hit_rate, p.belady_hit_rate, ideal * 1e3,
                     ideal_lru * 1e3, measured_step / ideal);
}

// One bulk copy of 256 MiB from pinned host memory: the rate Retrieve's misses cannot beat.
double host_to_device_bandwidth(int repeats) {
  const size_t bytes = size_t{256} << 20;
  void *src = nullptr, *dst = nullptr;
  cuda_ok(cudaMallocHost(&src, bytes), "pinned bandwidth buffer");
  cuda_ok(cudaMalloc(&dst, bytes), "bandwidth buffer");
  const double rate = copy_rate(dst, src, bytes, cudaMemcpyHostToDevice, repeats);
  cudaFreeHost(src);
  cudaFree(dst);
  return rate;
}

// --seer-gate for the whole model: the file's, or `random` (scaled so a gate output has the
// spread of one input row), or null.
std::shared_ptr<const spin::sparse::SeerGate> seer_gate(const BenchArgs& a, const spin::ModelConfig& c) {
  const spin::AttentionShape shape{.n_layers = c.n_layers, .n_heads = c.n_heads, .n_kv_heads = c.n_kv_heads,
                                   .head_dim = c.head_dim};
  if (a.seer_gate.empty()) return nullptr;
  if (a.seer_gate != "random") return spin::sparse::load_seer_gate(a.seer_gate, shape);
  return spin::sparse::random_seer_gate(shape, 7);
}

// Whether the attention caches selected pages on the device (every sparse algorithm but
// dense-offload, which reads the host tier in place).
bool caches_pages(const BenchArgs& a) { return a.sparse_algorithm != "dense" && a.sparse_algorithm != "dense-offload"; }

// Untimed decode steps before the timed ones, at most: one eager, one capturing the graph, and
// where pages are cached the breakdown's profiled steps (on one GPU) or as many graph steps as
// fill a cache of (1 + factor) selections at hit rates up to 0.83, so that the timed steps run on
// full caches.
int64_t cache_fill_steps(const BenchArgs& a) { return 6 * (static_cast<int64_t>(std::ceil(a.buffer_factor)) + 1); }
int64_t untimed_steps(const BenchArgs& a) {
  if (!caches_pages(a)) return 2;
  return 2 + std::max<int64_t>(cache_fill_steps(a), kMaxWarmSteps + kProfileSteps);
}

// Tokens a decode benchmark appends to a sequence after its context: (sparse) its first step, the
// untimed steps and the timed ones.
int64_t decode_steps_per_sequence(const BenchArgs& a) { return 1 + untimed_steps(a) + a.decode_tokens * a.repeats; }

// Tokens --compare-sampling appends to a sequence after its context: 2 temperatures x (host, GPU)
// + 2 logit-row choices, each 2 untimed steps + the timed ones, with room to spare.
int64_t sampling_comparison_steps(const BenchArgs& a) { return 6 * a.decode_tokens * (a.repeats + 2); }

// `n` token ids of a ledger in the shape of spin eval's documents ("Entry 12: Chen moved the red box
// to the attic."), built from a fixed lexicon of ids below 1100 instead of a tokenizer's: a
// random-weight model only tells tokens apart, so what matters is which ones repeat where.
std::vector<int32_t> ledger_tokens(int64_t n, uint64_t seed) {
  constexpr int32_t kBase = 1000, kEntry = kBase, kDigit0 = kBase + 1, kColon = kBase + 11, kMoved = kBase + 12,
                    kTo = kBase + 13, kThe = kBase + 14, kPeriod = kBase + 15, kNewline = kBase + 16,
                    kNames = kBase + 20, kAdjectives = kBase + 40, kThings = kBase + 60, kPlaces = kBase + 80;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out{kBase + 99, kBase + 98, kBase + 97, kNewline};  // the title
  for (int64_t entry = 1; static_cast<int64_t>(out.size()) < n; ++entry) {
    out.push_back(kEntry);
    for (const char digit : std::to_string(entry)) out.push_back(kDigit0 + (digit - '0'));
    const auto pick = [&](int32_t first) { return first + static_cast<int32_t>(rng() % 8); };
    const int32_t thing = static_cast<int32_t>(rng() % 8);
    for (const int32_t t : {kColon, pick(kNames), kMoved, kThe, kAdjectives + thing, kThings + thing, kTo, kThe,
                            pick(kPlaces), kPeriod, kNewline})
      out.push_back(t);
  }
  out.resize(static_cast<size_t>(n));
  return out;
}

void run_cuda(const BenchArgs& a) {
  spin::LoadOptions load = load_options(a);
  load.dummy_weights_on_host = false;
  spin::LoadedModel loaded = spin::load_model(load);
  const spin::ModelConfig c = loaded.weights.config;
  const int64_t max_batch = *std::max_element(a.batches.begin(), a.batches.end());
  const bool sparse = a.sparse_algorithm != "dense";
  const bool misses_in_attention = a.fetch_in_attention && a.sparse_algorithm != "shadowkv";  // as the store decides
  const int world = a.tensor_parallel_size;
  const bool compare_sampling = a.compare_sampling && !sparse && world == 1;
  const int64_t max_context =
      std::max(*std::max_element(a.decode_contexts.begin(), a.decode_contexts.end()),
               *std::max_element(a.prefill_lengths.begin(), a.prefill_lengths.end())) +
      std::max({a.decode_tokens * (a.repeats + 2), decode_steps_per_sequence(a),
                compare_sampling ? sampling_comparison_steps(a) : int64_t{0}}) +
      8;
  spin::CudaModelOptions options;
  options.cuda_graphs = a.cuda_graphs;
  options.gemm_tuning_file = a.gemm_tuning;
  if (a.gemv_rows) options.gemv_rows = *a.gemv_rows;
  options.max_batch_tokens = std::max(a.prefill_chunk, max_batch);
  options.max_sequences = max_batch;
  const auto load_start = clock_type::now();
  // One GPU: a CudaModel; several: the tensor-parallel model over per-rank CudaModels. `ranks`
  // are the CudaModels either way (weight bytes and statistics per GPU).
  std::unique_ptr<spin::ForwardModel> model;
  std::vector<spin::CudaModel*> ranks;
  const bool dummy = a.load_format == "dummy";
  if (world > 1) {
    spin::CudaTensorParallel tp =
        spin::make_cuda_tensor_parallel_model(dummy ? nullptr : &loaded.weights, c, load.seed, world, options);
    ranks = tp.ranks;
    model = std::move(tp.model);
  } else {
    auto single = dummy ? std::make_unique<spin::CudaModel>(c, load.seed, options)
                        : std::make_unique<spin::CudaModel>(loaded.weights, options);
    ranks = {single.get()};
    model = std::move(single);
  }
  loaded.weights = spin::ModelWeights{};
  const double load_seconds = seconds_since(load_start);
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  const double bandwidth = device_copy_bandwidth(9);  // before the pool takes the free memory
  const double link_bandwidth = host_to_device_bandwidth(5);

  const spin::AttentionShape rank_shape = ranks.front()->attention_shape();
  // Per GPU from here on: pages, pool and bytes read are one rank's.
  const int64_t pages_per_group = rank_shape.n_layers * rank_shape.n_kv_heads;
  spin::CudaPagedKvConfig kv_config;
  kv_config.gpu_memory_utilization = a.gpu_memory_utilization;
  kv_config.max_batch = max_batch;
  kv_config.max_context = max_context;
  kv_config.rope = spin::make_rope_table(c.rope, c.head_dim);
  kv_config.page_size = a.block_size;
  kv_config.buffer_factor = a.buffer_factor;
  kv_config.seer_gate = seer_gate(a, c);
  kv_config.prefill_variant = a.prefill_variant;
  kv_config.fetch_in_attention = a.fetch_in_attention;
  if (sparse) {
    // One group more than the sequences' pages: the store keeps one for itself.
    kv_config.host_pages =
        (max_batch * ((max_context + kv_config.page_size - 1) / kv_config.page_size) + 1) * pages_per_group;
    kv_config.host_tier_backing_bytes = static_cast<size_t>(a.host_tier_backing_gb * 1e9);
    kv_config.dense_layer_share = a.dense_layer_share;
  }
  spin::AttentionSettings settings;
  settings.algorithm = a.sparse_algorithm;
  settings.budget = a.sparse_budget;
  const auto host_start = clock_type::now();
  std::vector<std::unique_ptr<spin::CudaPagedAttentionFactory>> rank_factories =
      spin::make_cuda_rank_factories(rank_shape, kv_config, world);
  const double pool_seconds = seconds_since(host_start);
  const spin::CudaPagedAttentionFactory& factory = *rank_factories.front();
  factory.validate(settings);
  // A sequence's KV: one handle per rank (TensorParallelKv) when split, else the store's own.
  auto create_kv = [&](int64_t capacity) -> std::unique_ptr<spin::SequenceKv> {
    if (world == 1) return rank_factories.front()->create(settings, capacity);
    std::vector<std::unique_ptr<spin::SequenceKv>> parts;
    for (auto& f : rank_factories) parts.push_back(f->create(settings, capacity));
    return std::make_unique<spin::TensorParallelKv>(std::move(parts));
  };
  auto append_uncomputed = [&](spin::SequenceKv& kv, int64_t tokens) {
    if (world == 1) return rank_factories.front()->append_uncomputed(kv, tokens);
    auto& split = dynamic_cast<spin::TensorParallelKv&>(kv);
    for (int r = 0; r < world; ++r) rank_factories[static_cast<size_t>(r)]->append_uncomputed(split.rank(r), tokens);
  };
  const int64_t pool_tokens = factory.capacity().device_pages / pages_per_group * factory.page_size();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  // bf16 K and V of one token in every layer and KV head of one rank.
  const double kv_bytes_per_token =
      2.0 * 2.0 * static_cast<double>(rank_shape.n_layers * rank_shape.n_kv_heads * rank_shape.head_dim);
  // Every weight matrix is read once per step, except the embedding table, of which a step reads
  // one row per sequence (unless it is also the LM head).
  const double embedding_unread = c.tie_embeddings ? 0.0 : 2.0 * static_cast<double>(c.vocab_size * c.hidden_size);

  std::printf("## %s on %d x %s (bf16, CUDA graphs %s, tensor parallel %d)\n\n", loaded.name.c_str(), world,
              prop.name, a.cuda_graphs ? "on" : "off", world);
  std::printf("| measurement | value |\n|---|---|\n");
  std::printf("| products of at most %lld rows (decode steps of that batch) | kernels/cuda/gemv.h |\n",
              static_cast<long long>(options.gemv_rows));
  std::printf("| weights (bf16, per GPU) | %.2f GB (made in %.1f s) |\n", ranks.front()->weight_bytes() / 1e9,
              load_seconds);
  std::printf("| KV pool (per GPU) | %.2f GB, %lld tokens of one sequence |\n", factory.pool_bytes() / 1e9,
              static_cast<long long>(pool_tokens));
  std::printf("| device copy bandwidth (read + write, 1 GiB cudaMemcpy, median of 9) | %.0f GB/s |\n", bandwidth / 1e9);
  if (sparse) {
    std::printf("| attention | %s%s, budget %lld tokens per KV head (0: its default), buffers up to %gx it |\n",
                a.sparse_algorithm.c_str(), a.seer_gate.empty() ? "" : (" (trained gate: " + a.seer_gate + ")").c_str(),
                static_cast<long long>(a.sparse_budget), a.buffer_factor);
    std::printf("| cache misses read | %s |\n", misses_in_attention
                                                     ? "by the decode attention, which fills their slots"
                                                     : "by Retrieve, into their slots, before the attention");
    std::printf("| host to device bandwidth (256 MiB pinned cudaMemcpy, median of 5) | %.1f GB/s |\n",
                link_bandwidth / 1e9);
    const double host_gb =
        static_cast<double>(factory.capacity().host_pages * factory.page_size() * rank_shape.head_dim) * 4.0 / 1e9;
    std::printf("| KV host tier (per GPU, pinned) | %.2f GB (pools made in %.1f s) |\n", host_gb, pool_seconds);
    if (a.host_tier_backing_gb > 0.0 && a.host_tier_backing_gb < host_gb) {
      std::printf("| KV host tier backing | %.2f GB of pinned memory mapped over and over: the link moves every page's "
                  "bytes, but sequences share their contents |\n",
                  a.host_tier_backing_gb);
    }
  }

  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
  std::vector<float> logits;
  std::vector<std::string> breakdown_rows;  // sparse, one GPU: where the step's time goes
  std::vector<std::string> ledger_notes;    // ledger contexts: how much the decode's tokens vary
  for (int64_t n : a.prefill_lengths) {
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (int32_t& t : prompt) t = token(rng);
    std::vector<double> rates;
    for (int r = 0; r < a.repeats + 1; ++r) {
      std::unique_ptr<spin::SequenceKv> kv = create_kv(n);
      const auto t = clock_type::now();
      for (int64_t pos = 0; pos < n; pos += a.prefill_chunk) {
        const int64_t len = std::min(a.prefill_chunk, n - pos);
        spin::SequenceChunk chunk{std::span<const int32_t>(prompt).subspan(pos, len), pos, kv.get()};
        model->forward(std::span(&chunk, 1), false, logits);
      }
      if (r > 0) rates.push_back(static_cast<double>(n) / seconds_since(t));  // first: warm-up
    }
    std::printf("| prefill %lld tokens (tok/s, chunks of %lld%s) | %.0f |\n", static_cast<long long>(n),
                static_cast<long long>(a.prefill_chunk),
                a.prefill_variant < 0 ? "" : (", attention kernel variant " + std::to_string(a.prefill_variant)).c_str(),
                median(rates));
  }

  // Decode steps draw their tokens where the engine would (see decode_step below).
  const bool draws_on_device = !a.download_logits && model->samples_on_device();
  const bool ledger = a.context_source != "random";
  const bool ledger_text = a.context_source == "ledger-text";  // else the greedy tokens are fed back
  SPIN_CHECK(!ledger || ledger_text || draws_on_device,
             "--context-source ledger feeds the GPU's greedy tokens back: not with --download-logits or tensor parallelism");
  SPIN_CHECK(!ledger || a.host_tier_backing_gb == 0.0,
             "--context-source {}: sequences sharing host bytes (--host-tier-backing) would read each other's KV",
             a.context_source);
  if (sparse) {
    // The bound of a sparse step: the bytes it reads from HBM (weights; every page of the dense
    // layers; sinks, selection and window of the sparse ones) at the device copy rate, plus the
    // bytes it retrieves at the bulk host-to-device rate, with no overlap between the two.
    std::printf("\n| batch | context | first step ms/seq | decode tok/s | ms/step | cache hit rate | "
                "retrieved GB/step (GPU 0) | HBM GB/step | bound ms/step | of bound |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  } else {
    std::printf("\n| batch | context | decode tok/s | ms/step | host ms/step | bytes read/step | bound tok/s | "
                "of bound |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
  }
  for (int64_t batch : a.batches) {
    for (int64_t context : a.decode_contexts) {
      const int64_t capacity = context + decode_steps_per_sequence(a);
      // Sparse: every sequence decoding with its whole buffer (no engine sizes it here), and the
      // device pages of one still holding its whole context (until its first decode step frees
      // them; its host pages are counted already).
      spin::KvDemand each = factory.demand(settings, capacity, capacity, sparse, factory.page_size());
      each.device_pages += factory.buffer_streams(settings) * factory.max_buffer_pages(settings, capacity);
      spin::KvDemand need;
      for (int64_t b = 0; b < batch; ++b) need += each;
      if (sparse) need.device_pages += factory.demand(settings, context, capacity, false, factory.page_size()).device_pages;
      if (!need.fits_within(factory.capacity())) {
        std::printf("| %lld | %lld | (does not fit the pools: %.1f GB of KV, %.1f GB of it on the device) |%s\n",
                    static_cast<long long>(batch), static_cast<long long>(context),
                    batch * capacity * kv_bytes_per_token / 1e9,
                    static_cast<double>(need.device_pages + need.dense_layer_pages) * factory.page_size() *
                        kv_bytes_per_token / static_cast<double>(rank_shape.n_layers * rank_shape.n_kv_heads) / 1e9,
                    sparse ? " | | | | | | |" : " | | | | |");
        continue;
      }
      // Fresh random pages: an earlier shape's factors or summaries left in them would read as
      // keys out of any model's range (fp32 bytes as bf16).
      if (sparse) {
        for (auto& f : rank_factories) f->randomize_device_pages(7 + static_cast<uint64_t>(batch * context));
      }
      std::vector<std::unique_ptr<spin::SequenceKv>> seqs;
      std::vector<int32_t> ids(static_cast<size_t>(batch));
      std::vector<spin::SequenceChunk> chunks(static_cast<size_t>(batch));
      const std::vector<spin::DeviceSampling> greedy(static_cast<size_t>(batch));
      std::vector<int32_t> drawn;
      // One decode step of sequences [first, end), as the engine runs one: the next tokens drawn on
      // the GPU (greedy) and only their ids downloaded; --download-logits, or a model that draws on
      // the host (tensor parallel), copies every row's logits to the host instead.
      // A ledger's sequences decode their own greedy tokens (ids[b]: the next one to feed) or, with
      // ledger-text, the ledger's next token.
      std::vector<std::vector<int32_t>> texts(static_cast<size_t>(batch));
      auto decode_step = [&](int64_t first, int64_t end) {
        for (int64_t b = first; b < end; ++b) {
          if (!ledger) ids[b] = token(rng);
          if (ledger_text) ids[b] = texts[b][static_cast<size_t>(seqs[b]->length())];
          chunks[b - first] = spin::SequenceChunk{std::span(&ids[b], 1), seqs[b]->length(), seqs[b].get()};
        }
        const auto n = static_cast<size_t>(end - first);
        if (!draws_on_device) {
          model->forward(std::span(chunks).first(n), false, logits);
        } else {
          model->forward_sampled(std::span(chunks).first(n), std::span(greedy).first(n), c.vocab_size, {}, logits,
                                 drawn);
          if (ledger && !ledger_text) std::copy(drawn.begin(), drawn.end(), ids.begin() + first);
        }
      };
      // The ledger of sequence b (its context and every token decode may feed), its context
      // prefilled in chunks; its next token is fed first.
      auto prefill_ledger = [&](int64_t b) {
        texts[b] = ledger_tokens(capacity, 1000 + static_cast<uint64_t>(b));
        const std::vector<int32_t>& text = texts[b];
        for (int64_t pos = 0; pos < context; pos += a.prefill_chunk) {
          const int64_t len = std::min(a.prefill_chunk, context - pos);
          spin::SequenceChunk chunk{std::span<const int32_t>(text).subspan(pos, len), pos, seqs[b].get()};
          model->forward(std::span(&chunk, 1), false, logits);
        }
        ids[b] = text[context];
      };
      std::vector<double> first_steps;
      for (int64_t b = 0; b < batch; ++b) {
        seqs.push_back(create_kv(capacity));
        if (ledger) {
          prefill_ledger(b);
        } else {
          append_uncomputed(*seqs.back(), context);
        }
        if (!sparse) continue;
        const auto start = clock_type::now();
        decode_step(b, b + 1);  // indexes its context and frees the prefill's pages
        first_steps.push_back(seconds_since(start));
      }
      // Untimed: one eager step, one capturing the graph, then where pages are cached the
      // breakdown's profiled steps (on one GPU) or as many graph steps, which fill the caches.
      decode_step(0, batch);
      decode_step(0, batch);
      // A ledger's untimed steps also count the distinct tokens each sequence decodes: a decode
      // looping over a few tokens would keep its selections still.
      std::vector<std::unordered_set<int32_t>> drawn_tokens(static_cast<size_t>(batch));
      int64_t untimed = 0;
      const auto untimed_step = [&] {
        decode_step(0, batch);
        ++untimed;
        if (ledger)
          for (int64_t b = 0; b < batch; ++b) drawn_tokens[b].insert(ids[b]);
      };
      std::optional<SparseProfile> profile;
      if (caches_pages(a) && world == 1) {
        profile = profile_sparse_steps(*ranks.front(), *rank_factories.front(), settings, capacity, untimed_step,
                                       a.cuda_graphs);
      } else if (caches_pages(a)) {
        for (int64_t i = 0; i < cache_fill_steps(a); ++i) untimed_step();
      }
      if (ledger && untimed > 0) {
        std::vector<double> counts;
        for (const auto& d : drawn_tokens) counts.push_back(static_cast<double>(d.size()));
        ledger_notes.push_back(fmt::format("batch {}, context {}: {} distinct tokens per sequence (median) in {} "
                                           "untimed steps",
                                           batch, context, median(counts), untimed));
      }
      const int64_t timed_from = seqs.front()->length();
      const spin::KvStoreUsage before = factory.usage().value_or(spin::KvStoreUsage{});
      // The host's share of a step: its time outside the final wait for GPU 0, during which a lone
      // batch's GPU has nothing queued (the bench's inputs, tables, uploads, the graph launch; with
      // tensor parallelism also waiting for the other ranks). Not measured where the logits are
      // copied to pageable host memory: that copy waits for the whole forward itself.
      std::vector<double> step_seconds, host_seconds;
      // A range profilers can filter on (ncu --nvtx --nvtx-include "timed decode/").
      nvtxRangePushA("timed decode");
      for (int r = 0; r < a.repeats; ++r) {
        const double wait_before = ranks.front()->forward_stats()->device_wait_seconds;
        const auto t = clock_type::now();
        for (int64_t i = 0; i < a.decode_tokens; ++i) decode_step(0, batch);
        const double wall = seconds_since(t);
        const double waited = ranks.front()->forward_stats()->device_wait_seconds - wait_before;
        step_seconds.push_back(wall / static_cast<double>(a.decode_tokens));
        host_seconds.push_back((wall - waited) / static_cast<double>(a.decode_tokens));
      }
      nvtxRangePop();
      const double step = median(step_seconds);
      if (sparse) {
        const spin::KvStoreUsage after = factory.usage().value_or(spin::KvStoreUsage{});
        const auto hits = static_cast<double>(after.hits - before.hits);
        const auto misses = static_cast<double>(after.misses - before.misses);
        const auto steps = static_cast<double>(a.decode_tokens * a.repeats);
        const int64_t mid_context = timed_from + a.decode_tokens * a.repeats / 2;
        // dense-offload's attention reads its other pages over the link itself (no Retrieve).
        const double link_pages = a.sparse_algorithm == "dense-offload"
                                      ? static_cast<double>(batch * (factory.decode_pages_read(spin::AttentionSettings{}, mid_context) -
                                                                     factory.decode_pages_read(settings, mid_context)))
                                      : 0.0;
        const double retrieved = static_cast<double>(after.retrieve_bytes - before.retrieve_bytes) / steps +
                                 link_pages * static_cast<double>(after.page_bytes);
        const double hbm = static_cast<double>(ranks.front()->weight_bytes()) - embedding_unread +
                           static_cast<double>(batch * factory.decode_pages_read(settings, mid_context)) *
                               static_cast<double>(after.page_bytes);
        const double bound = hbm / bandwidth + retrieved / link_bandwidth;
        const std::string hit_rate = hits + misses > 0 ? fmt::format("{:.3f}", hits / (hits + misses)) : "-";
        std::printf("| %lld | %lld | %.1f | %.1f | %.2f | %s | %.3f | %.2f | %.2f | %.0f%% |\n",
                    static_cast<long long>(batch), static_cast<long long>(context), median(first_steps) * 1e3,
                    batch / step, step * 1e3, hit_rate.c_str(), retrieved / 1e9, hbm / 1e9, bound * 1e3,
                    100.0 * bound / step);
        std::fflush(stdout);
        if (profile) {
          breakdown_rows.push_back(
              sparse_breakdown_row(*profile, batch, context, step, hbm / bandwidth, link_bandwidth));
        }
        continue;
      }
      const double mean_context = static_cast<double>(context) + 2.0 + a.decode_tokens * (a.repeats / 2.0);
      const double bytes = static_cast<double>(ranks.front()->weight_bytes()) - embedding_unread +
                           static_cast<double>(batch) * mean_context * kv_bytes_per_token;
      const double bound = static_cast<double>(batch) / (bytes / bandwidth);
      const std::string host_step = draws_on_device ? fmt::format("{:.3f}", median(host_seconds) * 1e3) : "-";
      std::printf("| %lld | %lld | %.1f | %.2f | %s | %.2f GB | %.1f | %.0f%% |\n", static_cast<long long>(batch),
                  static_cast<long long>(context), batch / step, step * 1e3, host_step.c_str(), bytes / 1e9, bound,
                  100.0 * (batch / step) / bound);
      std::fflush(stdout);
    }
  }
  if (compare_sampling) {
    // The same decode steps with the next tokens drawn on the host (logits downloaded, the engine's
    // Sampler per row) and on the GPU (forward_sampled: token ids downloaded); then greedy GPU
    // draws with the logit rows of the whole batch downloaded beside them, against the one row a
    // lone request with logprobs needs.
    std::printf("\nDrawing the next tokens (decode, context %lld, medians of %d x %lld steps): ms per step\n\n",
                static_cast<long long>(a.decode_contexts.front()), a.repeats, static_cast<long long>(a.decode_tokens));
    std::printf("| batch | greedy, host | greedy, GPU | host / GPU | T=1 top-p 0.9, host | T=1 top-p 0.9, GPU | host / GPU "
                "| greedy GPU + every row's logits | greedy GPU + one row's logits | every / one |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    enum class Draw { host, device, device_every_row, device_one_row };
    for (int64_t batch : a.batches) {
      const int64_t context = a.decode_contexts.front();
      const int64_t capacity = context + sampling_comparison_steps(a) + 8;
      std::vector<std::unique_ptr<spin::SequenceKv>> seqs;
      for (int64_t b = 0; b < batch; ++b) {
        seqs.push_back(create_kv(capacity));
        append_uncomputed(*seqs.back(), context);
      }
      std::vector<int32_t> ids(static_cast<size_t>(batch));
      std::vector<spin::SequenceChunk> chunks(static_cast<size_t>(batch));
      std::vector<int32_t> drawn;
      std::vector<int64_t> every_row(static_cast<size_t>(batch));
      std::iota(every_row.begin(), every_row.end(), int64_t{0});
      const std::vector<int64_t> one_row{batch / 2};
      std::string row = fmt::format("| {} ", batch), logit_rows_cells;
      for (const float temperature : {0.0f, 1.0f}) {
        const spin::SamplingParams params{.temperature = temperature, .top_p = temperature > 0.0f ? 0.9f : 1.0f,
                                          .seed = 1};
        std::vector<spin::Sampler> samplers(static_cast<size_t>(batch), spin::Sampler(params));
        const std::vector<spin::DeviceSampling> device(
            static_cast<size_t>(batch),
            spin::DeviceSampling{.temperature = params.temperature, .top_p = params.top_p, .seed = 1});
        auto step = [&](Draw draw) {
          for (int64_t b = 0; b < batch; ++b) {
            chunks[b] = spin::SequenceChunk{std::span(&ids[b], 1), seqs[b]->length(), seqs[b].get()};
          }
          if (draw != Draw::host) {
            const std::span<const int64_t> rows = draw == Draw::device_every_row ? std::span<const int64_t>(every_row)
                                                  : draw == Draw::device_one_row ? std::span<const int64_t>(one_row)
                                                                                 : std::span<const int64_t>();
            model->forward_sampled(chunks, device, c.vocab_size, rows, logits, drawn);
            std::copy(drawn.begin(), drawn.end(), ids.begin());
            return;
          }
          model->forward(chunks, false, logits);
          for (int64_t b = 0; b < batch; ++b) {
            ids[b] = samplers[b].sample(std::span<const float>(logits).subspan(b * c.vocab_size, c.vocab_size));
          }
        };
        const auto time_steps = [&](Draw draw) {
          step(draw);  // eager, then the graph's capture
          step(draw);
          std::vector<double> seconds;
          for (int r = 0; r < a.repeats; ++r) {
            const auto t = clock_type::now();
            for (int64_t i = 0; i < a.decode_tokens; ++i) step(draw);
            seconds.push_back(seconds_since(t) / static_cast<double>(a.decode_tokens));
          }
          return median(seconds) * 1e3;
        };
        const double host = time_steps(Draw::host), on_device = time_steps(Draw::device);
        row += fmt::format("| {:.2f} | {:.2f} | {:.2f} ", host, on_device, host / on_device);
        if (temperature > 0.0f) continue;
        const double every = time_steps(Draw::device_every_row), one = time_steps(Draw::device_one_row);
        logit_rows_cells = fmt::format("| {:.2f} | {:.2f} | {:.2f} ", every, one, every / one);
      }
      std::printf("%s%s|\n", row.c_str(), logit_rows_cells.c_str());
      std::fflush(stdout);
    }
  }
  if (!breakdown_rows.empty()) {
    std::printf("\nWhere a sparse step's time goes: %d eager steps (CUDA graphs off) with events between the "
                "phases of each sparse layer, summed over layers, right before the timed graph steps, after warm-up "
                "steps that fill the caches and are not counted (until each cache's worth of distinct pages was "
                "selected twice over, %d to %d steps, or %zu M page references recorded). Ideal = HBM bytes at the device copy rate + the pages Belady's "
                "replacement would fetch (same trace, same cache slots; each at the bytes a measured miss cost) at the "
                "bulk host-to-device rate; with LRU: the same with the LRU replay's fetches, the step this store's "
                "policy allows at the physical limits. The replays start from empty caches: where the LRU replay's "
                "hit rate is below the store's, the replays are short of the store's history and Belady's is low "
                "too.%s\n\n",
                kProfileSteps, kMinWarmSteps, kMaxWarmSteps, kMaxWarmPages >> 20,
                misses_in_attention ? " The misses are fetched inside the attention: retrieve is the plan alone." : "");
    std::printf("| batch | context | warm-up steps | eager ms/step | index+score ms | select ms | retrieve ms | "
                "key rebuild ms | attention ms | rest ms | hit rate | LRU replay hit rate | Belady hit rate | "
                "ideal ms/step | ideal with LRU ms/step | measured (graphs) / ideal |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const std::string& row : breakdown_rows) std::printf("%s\n", row.c_str());
  }
  if (!ledger_notes.empty()) {
    std::printf("\nContexts: ledgers computed by a prefill; decode feeds each sequence's %s.\n\n",
                ledger_text ? "ledger's next token" : "greedy token back");
    for (const std::string& note : ledger_notes) std::printf("- %s\n", note.c_str());
  }
  const spin::ForwardStats s = *ranks.front()->forward_stats();
  std::printf("\nsteps: %lld eager, %lld graph replays (%lld graphs captured); decode steps %s\n",
              static_cast<long long>(s.eager_steps), static_cast<long long>(s.graph_replays),
              static_cast<long long>(s.graphs_captured),
              draws_on_device ? "draw greedy tokens on the GPU and download their ids (as the engine does)"
                              : "include the logits' copy to the host");
}

#endif

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a file: a run killed by its time limit keeps the rows it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"spin model benchmark (CPU or GPU forward pass)"};
  BenchArgs a;
  app.add_option("--model", a.model, ".gguf file, HF directory, or preset name (with --load-format dummy)")->required();
  app.add_option("--load-format", a.load_format, "auto | gguf | safetensors | dummy")->capture_default_str();
  app.add_option("--rope-scaling", a.rope_scaling, "JSON rope_scaling replacing the model's (as spin serve)");
  app.add_option("--device", a.device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--prefill", a.prefill_lengths, "prompt lengths to time")->capture_default_str();
  app.add_option("--prefill-chunk", a.prefill_chunk, "cuda: tokens per prefill forward")->capture_default_str();
  app.add_option("--prefill-variant", a.prefill_variant,
                 "cuda: prefill attention kernel (kernels/cuda/prefill_attention.h: 0 mma.sync, 1 mma.sync 8x16, "
                 "2 wgmma; -1 the default)")
      ->check(CLI::Range(-1, 2))
      ->capture_default_str();
  app.add_option("--decode-tokens", a.decode_tokens, "decode steps to time per repeat")->capture_default_str();
  app.add_option("--decode-context", a.decode_contexts, "context lengths to decode after")->capture_default_str();
  app.add_option("--batch", a.batches, "cuda: decode batch sizes")->capture_default_str();
  app.add_option("--repeats", a.repeats, "repeats (median reported)")->capture_default_str();
  app.add_option("--threads", a.threads, "cpu: threads (default: all cores)");
  app.add_flag("--cuda-graphs,!--no-cuda-graphs", a.cuda_graphs, "cuda: replay decode steps as CUDA graphs");
  app.add_option("--gemv-rows", a.gemv_rows,
                 "cuda: products of at most this many rows (decode steps of that batch) run kernels/cuda/gemv.h's "
                 "kernel, larger ones cuBLASLt; 0: all cuBLASLt (default: the model's, model/cuda/gemm.h)");
  app.add_option("--gemm-tuning", a.gemm_tuning,
                 "cuda, one GPU: cuBLASLt tuning file for decode-sized products (timed on first use, then reused)");
  app.add_flag("--download-logits", a.download_logits,
               "cuda: decode steps copy every row's logits to the host instead of drawing greedy tokens on the GPU");
  app.add_flag("--compare-sampling", a.compare_sampling,
               "cuda, dense, one GPU: also time decode steps that draw the next tokens on the host vs on the GPU");
  app.add_option("--tensor-parallel-size,--tp", a.tensor_parallel_size,
                 "cuda: split the model over GPUs 0..N-1 (dummy weights: each rank fills its shard on its GPU)")
      ->capture_default_str();
  app.add_option("--gpu-memory-utilization", a.gpu_memory_utilization, "cuda: memory share for weights + KV pool")
      ->capture_default_str();
  app.add_option("--sparse-algorithm", a.sparse_algorithm,
                 "cuda: dense | quest | seer | shadowkv | retroinfer (sparse decode over a host tier) | dense-offload (every "
                 "page, read from it)")
      ->check(CLI::IsMember({"dense", "quest", "seer", "shadowkv", "retroinfer", "dense-offload"}))
      ->capture_default_str();
  app.add_option("--block-size", a.block_size, "cuda: tokens per KV page, a multiple of 8 in 8..64")
      ->capture_default_str();
  app.add_option("--sparse-budget", a.sparse_budget, "cuda: tokens selected per KV head (0: the algorithm's default)")
      ->capture_default_str();
  app.add_option("--kv-buffer-factor", a.buffer_factor,
                 "cuda: the cached pages a sparse request keeps beside its selection, as a multiple of it (as spin serve)")
      ->capture_default_str();
  app.add_flag("--fetch-in-attention,!--no-fetch-in-attention", a.fetch_in_attention,
               "cuda: Quest, Seer and RetroInfer read their cache misses from the host tier in the decode attention "
               "(else Retrieve fetches them first)")
      ->capture_default_str();
  app.add_option("--seer-gate", a.seer_gate,
                 "cuda, seer: trained gate weights (safetensors), or `random` for the model's shape (default: the "
                 "training-free gate)");
  app.add_option("--dense-layer-share", a.dense_layer_share,
                 "cuda, sparse: the KV pool's share for the first dense layers, whose every page stays on the device "
                 "(larger batches at long contexts need more than serve's default)")
      ->check(CLI::Range(0.0, 0.95))
      ->capture_default_str();
  app.add_option("--host-tier-backing", a.host_tier_backing_gb,
                 "cuda, sparse: GB of pinned memory that back the KV host tier, mapped over and over, to time batches "
                 "whose host tier exceeds the machine's RAM (sequences then share host bytes; 0: the tier is its own)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--context-source", a.context_source,
                 "cuda: random (decode contexts' KV pages left random, random decode tokens) | ledger (each context a "
                 "ledger-like token stream computed by a prefill; decode feeds the greedy tokens back) | ledger-text "
                 "(decode feeds the ledger's own continuation)")
      ->check(CLI::IsMember({"random", "ledger", "ledger-text"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    SPIN_CHECK(a.repeats > 0 && a.decode_tokens > 0 && a.prefill_chunk > 0 && !a.prefill_lengths.empty() &&
                   !a.decode_contexts.empty() && !a.batches.empty(),
               "--repeats, --decode-tokens, --prefill-chunk must be positive and the lists non-empty");
    for (int64_t v : a.prefill_lengths) SPIN_CHECK(v > 0, "--prefill lengths must be positive, got {}", v);
    for (int64_t v : a.decode_contexts) SPIN_CHECK(v > 0, "--decode-context lengths must be positive, got {}", v);
    for (int64_t v : a.batches) SPIN_CHECK(v > 0 && v <= 4096, "--batch sizes must be in 1..4096, got {}", v);
    SPIN_CHECK(a.sparse_budget >= 0, "--sparse-budget must be >= 0, got {}", a.sparse_budget);
    SPIN_CHECK(a.sparse_algorithm == "dense" || a.device == "cuda", "--sparse-algorithm needs --device cuda");
    SPIN_CHECK(a.seer_gate.empty() || a.sparse_algorithm == "seer", "--seer-gate needs --sparse-algorithm seer");
    SPIN_CHECK(a.context_source == "random" || a.device == "cuda", "--context-source {} needs --device cuda",
               a.context_source);
    SPIN_CHECK(a.tensor_parallel_size >= 1 && (a.tensor_parallel_size == 1 || a.device == "cuda"),
               "--tensor-parallel-size must be >= 1, and > 1 only with --device cuda (got {})",
               a.tensor_parallel_size);
    SPIN_CHECK(a.gemm_tuning.empty() || (a.device == "cuda" && a.tensor_parallel_size == 1),
               "--gemm-tuning needs --device cuda and one GPU");
    if (a.device == "cuda") {
#ifdef SPIN_WITH_CUDA
      if (a.tensor_parallel_size > 1) spin::cuda::request_eager_module_loading();
      run_cuda(a);
#else
      spin::fail("--device cuda: this build has no CUDA (configure with -DSPIN_CUDA=ON)");
#endif
    } else {
      run_cpu(a);
    }
  } catch (const spin::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
