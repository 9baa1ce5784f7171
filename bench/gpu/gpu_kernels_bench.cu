// Benchmarks of spin's memory-bound CUDA kernels on one GPU, written as CSV rows
//   bench,config,variant,time_us,bytes,gbps
// (a) dense paged decode attention (the PyTorch SDPA side is bench/gpu/sdpa_bench.py);
// (b) sparse decode over selected pages vs the same kernel over contiguous pages of equal bytes;
// (c) retrieve gather host->device vs per-page cudaMemcpyAsync, cudaMemcpyBatchAsync and one bulk
//     copy; (d) causal prefill attention over paged KV (rows `prefill`: the `bytes` column holds
//     the causal FLOPs 2*2*heads*d*n^2/2 and `gbps` GFLOP/s). Timing: a CUDA graph of
//     `reps_per_graph` calls rotating over input copies (so L2 holds none of them), warm-up
//     replays (>= 3 and >= 50 ms), then the median over >= 25 timed replays with events.
// (e) one layer's sparse decode step on the GPU (Quest scoring, top-k select, retrieve through
//     the page cache, attention) against dense attention over the whole context and against the
//     ideal envelope of SPEC.md (attention over the selected pages + the pages Belady's optimal
//     replacement would fetch, at the bulk host->device copy rate measured in the same run).
// (f) overlap: one half-batch's decode attention that reads its misses over the host link, beside
//     the other half's weight products on a second stream (rows `overlap`; see bench_overlap).
// (g) RetroInfer's decode-side work for one layer: its select side, the decode attention and the
//     estimation, each alone and chained (rows `retro`; see bench_retro).
// (h) products: decode-sized products on gemv.h's kernel and on cuBLASLt (rows `product`; see
//     bench_products).
// Usage: spin_bench_gpu_kernels [all|dense|sparse|gather|prefill|step|overlap|retro|products] [CSV file|-] [FILTER]
// (FILTER: dense, step, retro and products run only the configs whose name contains it, e.g. "B1 ctx32K",
// "B8", "qwen3-14b o").
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/gather.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/page_cache.h"
#include "kernels/cuda/paged_attention.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/retroinfer.h"
#include "kernels/cuda/sparse_select.h"
#include "model/cuda/gemm.h"

namespace {

#define CHECK_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kTimedReps = 25;
constexpr float kWarmupMs = 50.0f;
constexpr size_t kRotateBytes = size_t{512} << 20;  // inputs per graph >= 8x the 60 MB L2

FILE* g_csv = nullptr;
std::string g_only;  // dense, step, retro, products: run only configs containing this (argv[3]; empty: all)

// Whether the config named `name` runs under g_only.
bool wanted(const std::string& name) { return name.find(g_only) != std::string::npos; }

void emit(const std::string& bench, const std::string& config, const std::string& variant,
          double time_us, double bytes) {
  const double gbps = bytes / (time_us * 1e-6) / 1e9;
  std::fprintf(g_csv, "%s,%s,%s,%.3f,%.0f,%.2f\n", bench.c_str(), config.c_str(), variant.c_str(),
               time_us, bytes, gbps);
  std::fflush(g_csv);
  std::printf("%-8s %-28s %-24s %10.2f us %9.1f GB/s\n", bench.c_str(), config.c_str(),
              variant.c_str(), time_us, gbps);
  std::fflush(stdout);
}

// Prefill rows: `flops` in the bytes column, GFLOP/s in the gbps column.
void emit_flops(const std::string& bench, const std::string& config, const std::string& variant,
                double time_us, double flops) {
  const double gflops = flops / (time_us * 1e-6) / 1e9;
  std::fprintf(g_csv, "%s,%s,%s,%.3f,%.0f,%.2f\n", bench.c_str(), config.c_str(), variant.c_str(),
               time_us, flops, gflops);
  std::fflush(g_csv);
  std::printf("%-8s %-28s %-24s %10.2f us %9.1f TFLOP/s\n", bench.c_str(), config.c_str(),
              variant.c_str(), time_us, gflops / 1e3);
  std::fflush(stdout);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time of one call: `enqueue(i)` issues call i; a graph holds `calls` of them.
double time_graph(cudaStream_t stream, int calls, const std::function<void(int)>& enqueue) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) enqueue(i);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  // Warm-up: at least 3 replays and kWarmupMs of them, so clocks settle on this workload after
  // whatever ran before (a small-batch shape timed right after a large one reads up to 10% slow).
  CHECK_CUDA(cudaEventRecord(a, stream));
  for (int i = 0;; ++i) {
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2 && ms >= kWarmupMs) break;
  }
  std::vector<double> times;
  for (int i = 0; i < kTimedReps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms * 1e3 / calls);
  }
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return median(times);
}

// Median time of `enqueue()` issued directly (work that cannot live in a graph, or whose host
// submission cost is part of what is measured).
double time_direct(cudaStream_t stream, const std::function<void()>& enqueue) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) enqueue();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> times;
  for (int i = 0; i < kTimedReps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    enqueue();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms * 1e3);
  }
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(times);
}

__global__ void fill_random_bf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16((static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 3.0f);
  }
}

// n elements of device memory, recorded in `owned` for the caller to free.
template <typename T>
T* device_array(std::vector<void*>& owned, size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  owned.push_back(p);
  return static_cast<T*>(p);
}

// A device copy of v, recorded in `owned`.
template <typename T>
T* device_copy(std::vector<void*>& owned, const std::vector<T>& v) {
  T* d = device_array<T>(owned, v.size());
  if (!v.empty()) CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

void fill(__nv_bfloat16* p, size_t n, uint32_t seed) {
  fill_random_bf16<<<1024, 256>>>(p, n, seed);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());  // the benchmarks run on a non-blocking stream
}

// Page lists for `copies` rotations of one batch. Each copy owns pages_per_item pages per item;
// `pick(item, copy, rng)` returns the page ids of one list.
struct Workload {
  int num_seqs, num_kv_heads, group, tokens;
  int copies;
  int page;
  std::vector<int32_t*> ids, offsets, num_tokens;
  std::vector<__nv_bfloat16*> q, out;
};

struct AttentionRun {
  double time_us;
  int splits;
};

// Decode attention over `pool` for seqs x kv_heads lists of at most max_tokens tokens, softmax
// scale 1/sqrt(d); lists and queries are the caller's to set.
spin::cuda::PagedDecodeParams decode_params(const __nv_bfloat16* pool, int seqs, int kv_heads, int group, int d,
                                            int page, int max_tokens) {
  spin::cuda::PagedDecodeParams p;
  p.kv_pool = pool;
  p.num_seqs = seqs;
  p.num_kv_heads = kv_heads;
  p.group = group;
  p.head_dim = d;
  p.page_size = page;
  p.max_tokens = max_tokens;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  return p;
}

AttentionRun run_attention(cudaStream_t stream, const __nv_bfloat16* pool, const Workload& w,
                           int tokens_per_split, int load_path = -1) {
  spin::cuda::PagedDecodeParams p = decode_params(pool, w.num_seqs, w.num_kv_heads, w.group, 128, w.page, w.tokens);
  p.tokens_per_split = tokens_per_split;
  p.load_path = load_path;
  const size_t ws_bytes = spin::cuda::paged_decode_workspace_bytes(p);
  void* ws = nullptr;
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  const int calls = std::max(w.copies, 4);
  const double t = time_graph(stream, calls, [&](int i) {
    spin::cuda::PagedDecodeParams pc = p;
    const int c = i % w.copies;
    pc.q = w.q[c];
    pc.page_ids = w.ids[c];
    pc.list_offsets = w.offsets[c];
    pc.num_tokens = w.num_tokens[c];
    CHECK_CUDA(spin::cuda::paged_decode_attention(pc, w.out[c], ws, ws_bytes, stream));
  });
  cudaFree(ws);
  return {t, spin::cuda::paged_decode_splits(p)};
}

// Builds the device-side lists: lists[c][item] = page ids of copy c.
Workload make_workload(int num_seqs, int num_kv_heads, int group, int tokens, int copies,
                       const std::vector<std::vector<std::vector<int32_t>>>& lists, int page = 16) {
  Workload w{num_seqs, num_kv_heads, group, tokens, copies, page, {}, {}, {}, {}, {}};
  const int items = num_seqs * num_kv_heads;
  const size_t q_elems = static_cast<size_t>(num_seqs) * num_kv_heads * group * 128;
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> flat, offsets{0}, ntok(items, tokens);
    for (int i = 0; i < items; ++i) {
      flat.insert(flat.end(), lists[c][i].begin(), lists[c][i].end());
      offsets.push_back(static_cast<int32_t>(flat.size()));
    }
    int32_t *d_ids, *d_off, *d_tok;
    CHECK_CUDA(cudaMalloc(&d_ids, flat.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_off, offsets.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_tok, ntok.size() * 4));
    CHECK_CUDA(cudaMemcpy(d_ids, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_off, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_tok, ntok.data(), ntok.size() * 4, cudaMemcpyHostToDevice));
    __nv_bfloat16 *d_q, *d_out;
    CHECK_CUDA(cudaMalloc(&d_q, q_elems * 2));
    CHECK_CUDA(cudaMalloc(&d_out, q_elems * 2));
    fill(d_q, q_elems, 1000 + c);
    w.ids.push_back(d_ids);
    w.offsets.push_back(d_off);
    w.num_tokens.push_back(d_tok);
    w.q.push_back(d_q);
    w.out.push_back(d_out);
  }
  return w;
}

void free_workload(Workload& w) {
  for (int c = 0; c < w.copies; ++c) {
    cudaFree(w.ids[c]);
    cudaFree(w.offsets[c]);
    cudaFree(w.num_tokens[c]);
    cudaFree(w.q[c]);
    cudaFree(w.out[c]);
  }
}

// Lists of `per_item` pages for `copies` x `items` lists, every page of a pool of `pool_pages` at most
// once, in a random physical order (as a page allocator hands them out).
std::vector<std::vector<std::vector<int32_t>>> scattered_lists(size_t pool_pages, int copies, int items, int per_item,
                                                               std::mt19937& rng) {
  std::vector<int32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<std::vector<int32_t>>> lists(copies, std::vector<std::vector<int32_t>>(items));
  size_t next = 0;
  for (int c = 0; c < copies; ++c)
    for (int i = 0; i < items; ++i) {
      lists[c][i].assign(perm.begin() + next, perm.begin() + next + per_item);
      next += per_item;
    }
  return lists;
}

// (a) dense: every page of a context, in a random physical order (as a page allocator hands them
// out). Bytes counted: K + V read, q read, out written (bf16).
void bench_dense(cudaStream_t stream, std::mt19937& rng) {
  const int kv_heads = 8, page = 16, d = 128;
  const size_t page_bytes = size_t{2} * page * d * 2;
  int shapes_run = 0;
  for (int context : {32768, 131072})
    for (int group : {5, 4})
      for (int batch : {1, 8, 32}) {
        char config[96];
        std::snprintf(config, sizeof config, "hq%d/hkv8 B%d ctx%dK", group * 8, batch, context / 1024);
        if (!wanted(config)) continue;
        ++shapes_run;
        const int items = batch * kv_heads;
        const int pages_per_item = context / page;
        const size_t kv_bytes = static_cast<size_t>(items) * pages_per_item * page_bytes;
        const int copies = static_cast<int>(std::max<size_t>(1, (kRotateBytes + kv_bytes - 1) / kv_bytes));
        const size_t pool_pages = static_cast<size_t>(copies) * items * pages_per_item;
        __nv_bfloat16* pool = nullptr;
        CHECK_CUDA(cudaMalloc(&pool, pool_pages * page_bytes));
        fill(pool, pool_pages * page_bytes / 2, 7);
        Workload w = make_workload(batch, kv_heads, group, context, copies,
                                   scattered_lists(pool_pages, copies, items, pages_per_item, rng));
        const double bytes = static_cast<double>(kv_bytes) + 2.0 * items * group * d * 2;
        const AttentionRun a = run_attention(stream, pool, w, 0);
        emit("dense", config, "spin", a.time_us, bytes);
        for (int path = 0; path <= 2; ++path)
          emit("paths", config, "spin load path " + std::to_string(path),
               run_attention(stream, pool, w, 0, path).time_us, bytes);
        // Split-size sweep, to show how the automatic choice fares: at batch 1 by splits per item
        // (16 = one block per SM), at batch 8 by split size.
        if (batch == 1 || (group == 5 && batch == 8)) {
          std::vector<int> sizes;
          if (batch == 1) {
            for (int splits : {8, 16, 24, 32, 48, 64}) sizes.push_back((context / splits + 63) / 64 * 64);
          } else {
            sizes = {512, 1024, 2048, 4096, 8192};
          }
          for (int tps : sizes) {
            const AttentionRun s = run_attention(stream, pool, w, tps);
            emit("sweep", config, "spin tps" + std::to_string(tps) + " splits" + std::to_string(s.splits),
                 s.time_us, bytes);
          }
          std::printf("  (auto: %d splits)\n", a.splits);
        }
        // The same kernel on each item's pages in physical order: what paging's scattered 8 KB
        // pages cost against contiguous K/V (the SDPA side's layout).
        if (batch == 1 || batch == 8) {
          std::vector<std::vector<std::vector<int32_t>>> in_order(copies, std::vector<std::vector<int32_t>>(items));
          for (int c = 0; c < copies; ++c)
            for (int i = 0; i < items; ++i) {
              in_order[c][i].resize(pages_per_item);
              std::iota(in_order[c][i].begin(), in_order[c][i].end(), (c * items + i) * pages_per_item);
            }
          Workload ordered = make_workload(batch, kv_heads, group, context, copies, in_order);
          emit("order", config, "spin pages in physical order", run_attention(stream, pool, ordered, 0).time_us, bytes);
          free_workload(ordered);
        }
        // The same KV bytes in larger pages (`--block-size`), scattered the same way: fewer, longer
        // contiguous runs per item.
        for (int big : {32, 64}) {
          Workload wb = make_workload(batch, kv_heads, group, context, copies,
                                      scattered_lists(pool_pages * page / big, copies, items, context / big, rng), big);
          emit("dense", config, "spin page " + std::to_string(big), run_attention(stream, pool, wb, 0).time_us, bytes);
          free_workload(wb);
        }
        free_workload(w);
        cudaFree(pool);
      }
  if (shapes_run == 0) std::fprintf(stderr, "dense: no shape's name contains \"%s\"\n", g_only.c_str());
}

// (b) sparse: per (request, KV head) a 2K-token budget = 128 pages of 16 chosen at random from a
// 128K-token context, vs the same number of pages contiguous in physical memory.
void bench_sparse(cudaStream_t stream, std::mt19937& rng) {
  const int kv_heads = 8, page = 16, d = 128, group = 5, context = 131072, budget = 2048;
  const size_t page_bytes = size_t{2} * page * d * 2;
  const int copies = 8;
  for (int batch : {1, 8, 32}) {
    const int items = batch * kv_heads;
    const int ctx_pages = context / page, sel = budget / page;
    const size_t pool_pages = static_cast<size_t>(items) * ctx_pages;
    __nv_bfloat16* pool = nullptr;
    CHECK_CUDA(cudaMalloc(&pool, pool_pages * page_bytes));
    fill(pool, pool_pages * page_bytes / 2, 11);
    std::vector<std::vector<std::vector<int32_t>>> sparse(copies, std::vector<std::vector<int32_t>>(items));
    std::vector<std::vector<std::vector<int32_t>>> dense = sparse;
    std::vector<int32_t> local(ctx_pages);
    for (int c = 0; c < copies; ++c)
      for (int i = 0; i < items; ++i) {
        std::iota(local.begin(), local.end(), i * ctx_pages);
        std::shuffle(local.begin(), local.end(), rng);
        sparse[c][i].assign(local.begin(), local.begin() + sel);
        // Contiguous window of the same size, a different one per copy.
        const int start = i * ctx_pages + c * sel;
        for (int k = 0; k < sel; ++k) dense[c][i].push_back(start + k);
      }
    Workload ws = make_workload(batch, kv_heads, group, budget, copies, sparse);
    Workload wd = make_workload(batch, kv_heads, group, budget, copies, dense);
    const double bytes = static_cast<double>(items) * sel * page_bytes + 2.0 * items * group * d * 2;
    char config[96];
    std::snprintf(config, sizeof config, "hq40/hkv8 B%d 2K-of-128K", batch);
    emit("sparse", config, "spin sparse", run_attention(stream, pool, ws, 0).time_us, bytes);
    emit("sparse", config, "spin dense-equal", run_attention(stream, pool, wd, 0).time_us, bytes);
    for (int path = 0; path <= 2; ++path)
      emit("paths", config, "spin sparse load path " + std::to_string(path),
           run_attention(stream, pool, ws, 0, path).time_us, bytes);
    free_workload(ws);
    free_workload(wd);
    if (batch == 32) {
      cudaFree(pool);
      continue;
    }
    // A Quest-sized list (512 selected + sink and window, 40 pages) at each split size: at small
    // batches such lists are cut into many splits and merged.
    const int short_pages = 40;
    std::vector<std::vector<std::vector<int32_t>>> short_lists(copies, std::vector<std::vector<int32_t>>(items));
    for (int c = 0; c < copies; ++c)
      for (int i = 0; i < items; ++i)
        short_lists[c][i].assign(sparse[c][i].begin(), sparse[c][i].begin() + short_pages);
    Workload wshort = make_workload(batch, kv_heads, group, short_pages * page, copies, short_lists);
    const double short_bytes = static_cast<double>(items) * short_pages * page_bytes + 2.0 * items * group * d * 2;
    std::snprintf(config, sizeof config, "hq40/hkv8 B%d 640-of-128K", batch);
    for (int split : {0, 64, 128, 192, 320, 640}) {
      const AttentionRun run = run_attention(stream, pool, wshort, split);
      emit("sparse", config, "split " + std::to_string(split) + " (" + std::to_string(run.splits) + ")",
           run.time_us, short_bytes);
    }
    free_workload(wshort);
    cudaFree(pool);
  }
}

// (c) host->device page retrieval: 64 MB of scattered pages per call.
void bench_gather(cudaStream_t stream, std::mt19937& rng) {
  const size_t host_bytes = size_t{2} << 30, dev_bytes = size_t{1} << 30, per_call = size_t{64} << 20;
  char* host = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, host_bytes, cudaHostAllocMapped));
  for (size_t i = 0; i < host_bytes; i += 4096) host[i] = static_cast<char>(i >> 12);
  void* host_dev = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&host_dev, host, 0));
  char* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, dev_bytes));
  for (size_t page_bytes : {size_t{4096}, size_t{8192}, size_t{16384}}) {
    const int n = static_cast<int>(per_call / page_bytes);
    const int rotations = 4;
    std::vector<std::vector<int32_t>> src(rotations), dst(rotations);
    std::vector<int32_t> hp(host_bytes / page_bytes), dp(dev_bytes / page_bytes);
    std::iota(hp.begin(), hp.end(), 0);
    std::iota(dp.begin(), dp.end(), 0);
    std::vector<int32_t*> d_src(rotations), d_dst(rotations);
    for (int r = 0; r < rotations; ++r) {
      std::shuffle(hp.begin(), hp.end(), rng);
      std::shuffle(dp.begin(), dp.end(), rng);
      src[r].assign(hp.begin(), hp.begin() + n);
      dst[r].assign(dp.begin(), dp.begin() + n);
      CHECK_CUDA(cudaMalloc(&d_src[r], n * 4));
      CHECK_CUDA(cudaMalloc(&d_dst[r], n * 4));
      CHECK_CUDA(cudaMemcpy(d_src[r], src[r].data(), n * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_dst[r], dst[r].data(), n * 4, cudaMemcpyHostToDevice));
    }
    const std::string config = std::to_string(page_bytes / 1024) + "KB x" + std::to_string(n);
    const double bytes = static_cast<double>(per_call);
    for (int sms : {4, 8, 16}) {
      const double t = time_graph(stream, rotations, [&](int i) {
        CHECK_CUDA(spin::cuda::gather_pages(host_dev, dev, d_src[i], d_dst[i], n, page_bytes, sms, stream));
      });
      emit("gather", config, "kernel " + std::to_string(sms) + " SMs", t, bytes);
    }
    int rot = 0;
    emit("gather", config, "memcpyAsync per page", time_direct(stream, [&] {
           const auto& s = src[rot % rotations];
           const auto& d = dst[rot % rotations];
           ++rot;
           for (int i = 0; i < n; ++i)
             CHECK_CUDA(cudaMemcpyAsync(dev + d[i] * page_bytes, host + s[i] * page_bytes, page_bytes,
                                        cudaMemcpyHostToDevice, stream));
         }), bytes);
    std::vector<std::vector<void*>> dsts(rotations);
    std::vector<std::vector<const void*>> srcs(rotations);
    for (int r = 0; r < rotations; ++r)
      for (int i = 0; i < n; ++i) {
        dsts[r].push_back(dev + dst[r][i] * page_bytes);
        srcs[r].push_back(host + src[r][i] * page_bytes);
      }
    std::vector<size_t> sizes(n, page_bytes);
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_idx = 0;
    // The batch API is new (CUDA 12.8); a refusal is reported, not fatal.
    cudaError_t batch_err = cudaSuccess;
    const double t_batch = time_direct(stream, [&] {
      const int r = rot++ % rotations;
      if (batch_err == cudaSuccess)
        batch_err = cudaMemcpyBatchAsync(dsts[r].data(), srcs[r].data(), sizes.data(), n, &attr,
                                         &attr_idx, 1, stream);
    });
    if (batch_err == cudaSuccess)
      emit("gather", config, "cudaMemcpyBatchAsync", t_batch, bytes);
    else
      std::printf("cudaMemcpyBatchAsync failed: %s\n", cudaGetErrorString(batch_err));
    emit("gather", config, "bulk cudaMemcpyAsync", time_direct(stream, [&] {
           const size_t off = (rot++ % rotations) * per_call;
           CHECK_CUDA(cudaMemcpyAsync(dev, host + off, per_call, cudaMemcpyHostToDevice, stream));
         }), bytes);
    for (int r = 0; r < rotations; ++r) {
      cudaFree(d_src[r]);
      cudaFree(d_dst[r]);
    }
  }
  cudaFree(dev);
  cudaFreeHost(host);
}

// (d) causal prefill of one sequence (32 query heads, 8 KV heads, d=128, page 16, pages in a
// random physical order): whole prompts of 4K/16K/32K tokens from position 0 (PyTorch SDPA runs
// the same shapes on contiguous tensors), and the last 8K-token chunk of a 32K prompt (24K
// earlier positions read from the pages; spin only). FLOPs counted as 2*2*heads*d*(n^2/2 +
// n*earlier): QK^T and PV over the causal half, as the flash-attention papers count them.
void bench_prefill(cudaStream_t stream, std::mt19937& rng) {
  const int kv_heads = 8, group = 4, d = 128, page = 16;
  const int q_heads = kv_heads * group;
  struct Shape {
    int new_tokens, first_pos;
  };
  for (const Shape shape : {Shape{4096, 0}, Shape{16384, 0}, Shape{32768, 0}, Shape{8192, 24576}}) {
    const int n = shape.new_tokens, kv_len = shape.first_pos + shape.new_tokens;
    const int pages_per_head = (kv_len + page - 1) / page;
    const size_t pool_pages = static_cast<size_t>(kv_heads) * pages_per_head;
    const size_t page_elems = size_t{2} * page * d;
    const size_t q_elems = static_cast<size_t>(n) * q_heads * d;
    __nv_bfloat16 *pool, *q, *out;
    CHECK_CUDA(cudaMalloc(&pool, pool_pages * page_elems * 2));
    CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
    CHECK_CUDA(cudaMalloc(&out, q_elems * 2));
    fill(pool, pool_pages * page_elems, 21);
    fill(q, q_elems, 22);
    std::vector<int32_t> ids(pool_pages), lists(kv_heads + 1), tokens{0, n}, first{shape.first_pos};
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int h = 0; h <= kv_heads; ++h) lists[h] = h * pages_per_head;
    int32_t *d_ids, *d_lists, *d_tokens, *d_first;
    CHECK_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_lists, lists.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_tokens, tokens.size() * 4));
    CHECK_CUDA(cudaMalloc(&d_first, first.size() * 4));
    CHECK_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_lists, lists.data(), lists.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_tokens, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_first, first.data(), first.size() * 4, cudaMemcpyHostToDevice));
    spin::cuda::PagedPrefillParams p;
    p.q = q;
    p.kv_pool = pool;
    p.page_ids = d_ids;
    p.list_offsets = d_lists;
    p.token_offsets = d_tokens;
    p.first_pos = d_first;
    p.num_seqs = 1;
    p.num_kv_heads = kv_heads;
    p.group = group;
    p.head_dim = d;
    p.page_size = page;
    p.max_new_tokens = n;
    p.scale = 1.0f / std::sqrt(static_cast<float>(d));
    const double flops =
        4.0 * q_heads * d * (0.5 * static_cast<double>(n) * n + static_cast<double>(n) * shape.first_pos);
    char config[96];
    if (shape.first_pos == 0)
      std::snprintf(config, sizeof config, "hq32/hkv8 d128 %dK", n / 1024);
    else
      std::snprintf(config, sizeof config, "hq32/hkv8 d128 %dK after %dK", n / 1024, shape.first_pos / 1024);
    for (int variant : {-1, 0, 1, 2}) {
      p.variant = variant;
      if (variant == 2 && !spin::cuda::prefill_wgmma_available()) continue;
      const double t = time_graph(stream, 2, [&](int) {
        CHECK_CUDA(spin::cuda::paged_prefill_attention(p, out, stream));
      });
      const char* names[] = {"spin", "spin variant 0 (4x32)", "spin variant 1 (8x16)", "spin variant 2 (wgmma)"};
      emit_flops("prefill", config, names[variant + 1], t, flops);
    }
    cudaFree(d_ids);
    cudaFree(d_lists);
    cudaFree(d_tokens);
    cudaFree(d_first);
    cudaFree(pool);
    cudaFree(q);
    cudaFree(out);
  }
}

}  // namespace

// Pages Belady's replacement (evict the page needed farthest in the future) fetches for one
// item's sequence of needed sets (each sorted), counted from step `first_counted` on, with
// `slots` slots. The cache is a set ordered by next use.
int64_t belady_misses(const std::vector<std::vector<int32_t>>& needed, int slots, int first_counted) {
  const int steps = static_cast<int>(needed.size());
  std::unordered_map<int32_t, std::vector<int>> uses;
  for (int t = 0; t < steps; ++t)
    for (int32_t p : needed[t]) uses[p].push_back(t);
  auto next_use = [&](int32_t p, int t) {
    const std::vector<int>& u = uses[p];
    const auto it = std::upper_bound(u.begin(), u.end(), t);
    return it == u.end() ? steps : *it;
  };
  std::set<std::pair<int, int32_t>> cache;  // (next use, page)
  std::unordered_map<int32_t, int> key;     // page -> its next use in `cache`
  int64_t misses = 0;
  for (int t = 0; t < steps; ++t) {
    int step_misses = 0;
    for (int32_t p : needed[t]) {
      const auto it = key.find(p);
      if (it == key.end()) {
        ++step_misses;
      } else {
        cache.erase({it->second, p});  // needed now: not a candidate
      }
    }
    if (t >= first_counted) misses += step_misses;
    const int resident = static_cast<int>(key.size()) + step_misses;
    for (int e = 0; e < resident - slots && !cache.empty(); ++e) {
      const auto victim = std::prev(cache.end());
      key.erase(victim->second);
      cache.erase(victim);
    }
    for (int32_t p : needed[t]) {
      const int k = next_use(p, t);
      key[p] = k;
      cache.insert({k, p});
    }
  }
  return misses;
}

__global__ void drift_queries(__nv_bfloat16* q, size_t n, uint32_t seed, float amount) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float noise = (static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 3.0f;
    q[i] = __float2bfloat16(__bfloat162float(q[i]) * (1.0f - amount) + noise * amount);
  }
}

// (e) Qwen3-14B's attention shape (40 query / 8 KV heads, d=128), pages of 16, 2K-token budget
// (128 pages) per KV head, 1 sink page and 3 window pages always resident, a cache of 5x the
// budget per KV head (buffer 5x mandatory) plus the budget itself. Each step the queries drift
// (q <- 0.85 q + 0.15 noise), which gives the selections step-to-step locality; 8 warm-up steps
// fill the caches, 16 steps are timed phase by phase with events.
void bench_step(cudaStream_t stream, std::mt19937& rng) {
  namespace sc = spin::cuda;
  const int heads = 8, group = 5, d = 128, page = 16, budget_pages = 128, sink = 1, window = 3;
  const int slots = budget_pages * 6, warm_steps = 8, timed_steps = 16;
  const size_t page_bytes = size_t{2} * page * d * 2;
  const size_t page_elems = page_bytes / 2;
  // Bulk host->device rate for the ideal envelope, measured here.
  double link_gbps = 0;
  {
    const size_t bytes = size_t{256} << 20;
    char* host = nullptr;
    char* dev = nullptr;
    CHECK_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    CHECK_CUDA(cudaMalloc(&dev, bytes));
    std::memset(host, 1, bytes);
    const double t = time_direct(stream, [&] {
      CHECK_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
    });
    link_gbps = bytes / (t * 1e-6) / 1e9;
    emit("step", "bulk 256MB", "host->device copy", t, static_cast<double>(bytes));
    cudaFree(dev);
    cudaFreeHost(host);
  }
  for (int context : {32768, 131072}) {
    for (int batch : {1, 8, 32}) {
      const int P = context / page;  // pages per (request, KV head)
      const int items = batch * heads;
      const int list_len = sink + budget_pages + window;
      const int chunks = P / sc::kSummaryChunkPages;
      char config[64];
      std::snprintf(config, sizeof config, "hq40/hkv8 B%d %dK", batch, context / 1024);
      if (!wanted(config)) continue;

      // The whole context of every request: device pool (dense attention reads it and Quest
      // indexes it) and the same bytes in the host tier (pinned, mapped), page id p * heads + h
      // for page p = seq * P + logical page.
      const size_t ctx_pages = static_cast<size_t>(batch) * P * heads;
      std::vector<void*> owned;  // every device array of this configuration, freed at its end
      __nv_bfloat16 *host = nullptr, *host_dev = nullptr;
      __nv_bfloat16* full = device_array<__nv_bfloat16>(owned, ctx_pages * page_elems);
      fill(full, ctx_pages * page_elems, 21);
      CHECK_CUDA(cudaHostAlloc(&host, ctx_pages * page_bytes, cudaHostAllocMapped));
      CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
      CHECK_CUDA(cudaMemcpy(host, full, ctx_pages * page_bytes, cudaMemcpyDeviceToHost));

      // Quest summaries of every page (not timed: Index runs once per page as it completes).
      __nv_bfloat16* summaries = device_array<__nv_bfloat16>(owned, ctx_pages * 2 * d);
      {
        std::vector<int32_t> src(ctx_pages), dst(ctx_pages);
        for (int s = 0; s < batch; ++s)
          for (int p = 0; p < P; ++p)
            for (int h = 0; h < heads; ++h) {
              const size_t i = (static_cast<size_t>(s) * P + p) * heads + h;
              src[i] = static_cast<int32_t>(i);
              const int chunk = s * chunks + p / sc::kSummaryChunkPages;
              dst[i] = (chunk * heads + h) * sc::kSummaryChunkPages + p % sc::kSummaryChunkPages;
            }
        sc::QuestIndexParams ip;
        ip.kv_pool = full;
        ip.src_pages = device_copy(owned, src);
        ip.dst_entries = device_copy(owned, dst);
        ip.num_pages = static_cast<int>(ctx_pages);
        ip.head_dim = d;
        ip.page_size = page;
        ip.summaries = summaries;
        CHECK_CUDA(sc::quest_index_pages(ip, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
      }

      // Device tier of the sparse path: per request 1 sink + 3 window groups, then its cache slots.
      const int groups_per_seq = sink + window + slots;
      const size_t dev_pages = static_cast<size_t>(batch) * groups_per_seq * heads;
      __nv_bfloat16* pool = device_array<__nv_bfloat16>(owned, dev_pages * page_elems);
      fill(pool, dev_pages * page_elems, 22);
      std::vector<int32_t> h_list(static_cast<size_t>(items) * list_len, -1), list_off(items + 1), out_off(items),
          ntok(items, list_len * page), need_off(items), need_cnt(items, budget_pages), cache_groups, cache_off{0},
          host_groups, host_off(batch), dir, dir_off(batch), first(batch, sink), end(batch, P - window);
      for (int s = 0; s < batch; ++s) {
        const int g0 = s * groups_per_seq;
        for (int j = 0; j < slots; ++j) cache_groups.push_back(g0 + sink + window + j);
        cache_off.push_back(static_cast<int32_t>(cache_groups.size()));
        host_off[s] = static_cast<int32_t>(host_groups.size());
        for (int p = 0; p < P; ++p) host_groups.push_back(s * P + p);
        dir_off[s] = static_cast<int32_t>(dir.size());
        for (int c = 0; c < chunks; ++c) dir.push_back(s * chunks + c);
        for (int h = 0; h < heads; ++h) {
          const int i = s * heads + h;
          int32_t* list = h_list.data() + static_cast<size_t>(i) * list_len;
          list[0] = g0 * heads + h;  // sink
          for (int w = 0; w < window; ++w) list[list_len - window + w] = (g0 + sink + w) * heads + h;
          list_off[i] = i * list_len;
          out_off[i] = i * list_len + sink;
          need_off[i] = i * budget_pages;
        }
      }
      list_off[items] = items * list_len;
      int32_t *d_list = device_copy(owned, h_list), *d_list_off = device_copy(owned, list_off),
              *d_out_off = device_copy(owned, out_off), *d_ntok = device_copy(owned, ntok),
              *d_need_off = device_copy(owned, need_off), *d_need_cnt = device_copy(owned, need_cnt),
              *d_cache_groups = device_copy(owned, cache_groups), *d_cache_off = device_copy(owned, cache_off),
              *d_host_groups = device_copy(owned, host_groups), *d_host_off = device_copy(owned, host_off),
              *d_dir = device_copy(owned, dir), *d_dir_off = device_copy(owned, dir_off),
              *d_first = device_copy(owned, first), *d_end = device_copy(owned, end);
      const size_t state_entries = static_cast<size_t>(batch) * groups_per_seq * heads;
      auto* d_slot_page = device_array<int32_t>(owned, state_entries);
      CHECK_CUDA(cudaMemset(d_slot_page, 0xff, state_entries * 4));
      auto* d_stamp = device_array<uint32_t>(owned, state_entries);
      CHECK_CUDA(cudaMemset(d_stamp, 0, state_entries * 4));
      auto* d_now = device_array<uint32_t>(owned, batch);
      auto* d_needed = device_array<int32_t>(owned, static_cast<size_t>(items) * budget_pages);
      auto* d_error = device_array<int32_t>(owned, 1);
      CHECK_CUDA(cudaMemset(d_error, 0, 4));
      auto* d_counters = device_array<unsigned long long>(owned, size_t{3} * batch);
      CHECK_CUDA(cudaMemset(d_counters, 0, batch * 3 * 8));
      auto* d_scores = device_array<float>(owned, static_cast<size_t>(items) * P);
      const size_t q_elems = static_cast<size_t>(items) * group * d;
      auto* d_q = device_array<__nv_bfloat16>(owned, q_elems);
      auto* d_out = device_array<__nv_bfloat16>(owned, q_elems);
      fill(d_q, q_elems, 23);

      sc::QuestScoreParams qs;
      qs.q = d_q;
      qs.summaries = summaries;
      qs.summary_dir = d_dir;
      qs.dir_offsets = d_dir_off;
      qs.first_candidate = d_first;
      qs.end_candidate = d_end;
      qs.num_seqs = batch;
      qs.num_kv_heads = heads;
      qs.group = group;
      qs.head_dim = d;
      qs.max_candidates = P;
      qs.scores = d_scores;
      sc::SelectTopParams st;
      st.scores = d_scores;
      st.max_candidates = P;
      st.first_candidate = d_first;
      st.end_candidate = d_end;
      st.counts = d_need_cnt;
      st.out_offsets = d_need_off;
      st.num_seqs = batch;
      st.num_kv_heads = heads;
      st.out_pages = d_needed;
      sc::PageCacheParams pc;
      pc.num_seqs = batch;
      pc.num_kv_heads = heads;
      pc.num_layers = 1;
      pc.layer = 0;
      pc.head_dim = d;
      pc.page_size = page;
      pc.needed = d_needed;
      pc.needed_offsets = d_need_off;
      pc.needed_counts = d_need_cnt;
      pc.cache_groups = d_cache_groups;
      pc.cache_offsets = d_cache_off;
      pc.host_groups = d_host_groups;
      pc.host_offsets = d_host_off;
      pc.now = d_now;
      pc.slot_page = d_slot_page;
      pc.slot_stamp = d_stamp;
      pc.host_pool = host_dev;
      pc.device_pool = pool;
      pc.out_pages = d_list;
      pc.out_offsets = d_out_off;
      pc.counters = d_counters;
      pc.error = d_error;
      sc::PagedDecodeParams ap = decode_params(pool, batch, heads, group, d, page, list_len * page);
      ap.q = d_q;
      ap.page_ids = d_list;
      ap.list_offsets = d_list_off;
      ap.num_tokens = d_ntok;
      const size_t ws_bytes = sc::paged_decode_workspace_bytes(ap);
      char* ws = ws_bytes ? device_array<char>(owned, ws_bytes) : nullptr;

      cudaEvent_t ev[5];
      for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
      std::vector<std::vector<double>> phase(4);
      std::vector<std::vector<std::vector<int32_t>>> trace(items);
      std::vector<int32_t> needed_host(static_cast<size_t>(items) * budget_pages);
      std::vector<unsigned long long> counters_before(batch * 3), counters_after(batch * 3);
      for (int step = 0; step < warm_steps + timed_steps; ++step) {
        std::vector<uint32_t> now(batch, static_cast<uint32_t>(step + 1));
        CHECK_CUDA(cudaMemcpy(d_now, now.data(), batch * 4, cudaMemcpyHostToDevice));
        drift_queries<<<256, 256, 0, stream>>>(d_q, q_elems, 1000u + static_cast<uint32_t>(step), 0.15f);
        CHECK_CUDA(cudaGetLastError());
        if (step == warm_steps)
          CHECK_CUDA(cudaMemcpy(counters_before.data(), d_counters, batch * 3 * 8, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaEventRecord(ev[0], stream));
        CHECK_CUDA(sc::quest_score_pages(qs, stream));
        CHECK_CUDA(cudaEventRecord(ev[1], stream));
        CHECK_CUDA(sc::select_top_pages(st, stream));
        CHECK_CUDA(cudaEventRecord(ev[2], stream));
        CHECK_CUDA(sc::retrieve_cached_pages(pc, stream));
        CHECK_CUDA(cudaEventRecord(ev[3], stream));
        CHECK_CUDA(sc::paged_decode_attention(ap, d_out, ws, ws_bytes, stream));
        CHECK_CUDA(cudaEventRecord(ev[4], stream));
        CHECK_CUDA(cudaEventSynchronize(ev[4]));
        if (step >= warm_steps) {
          for (int k = 0; k < 4; ++k) {
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
            phase[k].push_back(ms * 1e3);
          }
        }
        CHECK_CUDA(cudaMemcpy(needed_host.data(), d_needed, needed_host.size() * 4, cudaMemcpyDeviceToHost));
        for (int i = 0; i < items; ++i)
          trace[i].emplace_back(needed_host.begin() + static_cast<ptrdiff_t>(i) * budget_pages,
                                needed_host.begin() + static_cast<ptrdiff_t>(i + 1) * budget_pages);
      }
      int error = 0;
      CHECK_CUDA(cudaMemcpy(&error, d_error, 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(counters_after.data(), d_counters, batch * 3 * 8, cudaMemcpyDeviceToHost));
      uint64_t hits = 0, misses = 0;
      for (int s = 0; s < batch; ++s) {
        hits += counters_after[s * 3] - counters_before[s * 3];
        misses += counters_after[s * 3 + 1] - counters_before[s * 3 + 1];
      }
      int64_t optimal = 0;
      for (int i = 0; i < items; ++i) optimal += belady_misses(trace[i], slots, warm_steps);

      // Dense attention over every page of the context (the vLLM-style baseline of this layer).
      std::vector<int32_t> dense_ids(ctx_pages), dense_off(items + 1), dense_tok(items, context);
      for (int i = 0; i < items; ++i) {
        const int s = i / heads, h = i % heads;
        for (int p = 0; p < P; ++p) dense_ids[static_cast<size_t>(i) * P + p] = (s * P + p) * heads + h;
        dense_off[i + 1] = (i + 1) * P;
      }
      int32_t *dd_ids = device_copy(owned, dense_ids), *dd_off = device_copy(owned, dense_off),
              *dd_tok = device_copy(owned, dense_tok);
      sc::PagedDecodeParams dp = ap;
      dp.kv_pool = full;
      dp.page_ids = dd_ids;
      dp.list_offsets = dd_off;
      dp.num_tokens = dd_tok;
      dp.max_tokens = context;
      const size_t dws_bytes = sc::paged_decode_workspace_bytes(dp);
      char* dws = dws_bytes ? device_array<char>(owned, dws_bytes) : nullptr;
      const double t_dense = time_direct(stream, [&] {
        CHECK_CUDA(sc::paged_decode_attention(dp, d_out, dws, dws_bytes, stream));
      });

      const double t_score = median(phase[0]), t_select = median(phase[1]), t_retrieve = median(phase[2]),
                   t_attend = median(phase[3]);
      const double t_sparse = t_score + t_select + t_retrieve + t_attend;
      const double optimal_bytes_per_step = static_cast<double>(optimal) * page_bytes / timed_steps;
      const double t_ideal = t_attend + optimal_bytes_per_step / (link_gbps * 1e9) * 1e6;
      const double miss_bytes_per_step = static_cast<double>(misses) * page_bytes / timed_steps;
      emit("step", config, "dense attention", t_dense, static_cast<double>(ctx_pages) * page_bytes);
      emit("step", config, "sparse score", t_score, static_cast<double>(items) * (P - sink - window) * 2 * d * 2);
      emit("step", config, "sparse select", t_select, static_cast<double>(items) * P * 4);
      emit("step", config, "sparse retrieve", t_retrieve, miss_bytes_per_step);
      emit("step", config, "sparse attention", t_attend, static_cast<double>(items) * list_len * page_bytes);
      emit("step", config, "sparse total", t_sparse, static_cast<double>(items) * list_len * page_bytes);
      emit("step", config, "ideal envelope", t_ideal, static_cast<double>(items) * list_len * page_bytes);
      std::printf("step     %-28s hit rate %.3f, Belady hit rate %.3f, measured/ideal %.2f, dense/sparse %.2f%s\n",
                  config, hits + misses ? static_cast<double>(hits) / (hits + misses) : 0.0,
                  1.0 - static_cast<double>(optimal) / (static_cast<double>(items) * budget_pages * timed_steps),
                  t_sparse / t_ideal, t_dense / t_sparse, error ? " (CACHE ERROR FLAG SET)" : "");
      std::fflush(stdout);

      for (auto& e : ev) cudaEventDestroy(e);
      for (void* p : owned) cudaFree(p);
      cudaFreeHost(host);
    }
  }
  (void)rng;
}

// (f) Can a fetch-bound decode batch gain by running as two halves, one half's attention reading
// its cache misses over the host link while the other half's products read the weights from HBM?
// One Qwen3-14B layer at 8 rows a half: the decode attention over 64 (row, KV head) lists of 32
// pages of 16 tokens, 60% of them read from mapped pinned host memory and written into their
// device slots (fill pages, as the store's Quest and Seer steps run it), and the layer's four
// products (qkv, o, gate_up, down) at 8 rows. Timed alone, one after the other on one stream, and
// on two streams at once; the attention also with one block per list (fewer SMs held while they
// wait on the link). Lists rotate over 16 copies (160 MB of host pages) so no copy is in L2.
void bench_overlap(cudaStream_t stream, std::mt19937& rng) {
  const int rows = 8, kv_heads = 8, group = 5, d = 128, page = 16, pages_per_item = 32, copies = 16;
  const int64_t hidden = 5120, ffn = 17408, qkv_out = (kv_heads * group + 2 * kv_heads) * d;
  const int items = rows * kv_heads;
  const size_t page_elems = size_t{2} * page * d, page_bytes = page_elems * 2;
  const size_t pool_pages = static_cast<size_t>(copies) * items * pages_per_item;
  __nv_bfloat16* pool = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, pool_pages * page_bytes));
  fill(pool, pool_pages * page_elems, 11);
  __nv_bfloat16* host = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, pool_pages * page_bytes, cudaHostAllocMapped));
  std::memset(host, 0x3c, pool_pages * page_bytes);  // small finite bf16 values
  __nv_bfloat16* host_dev = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));

  // Copy c's lists: page k = (c * items + i) * pages_per_item + j, a miss (host page k, filled into
  // device page k) with probability 0.6, else a hit (device page k).
  std::bernoulli_distribution miss(0.6);
  std::vector<int32_t*> ids(copies), fills(copies), offsets(copies), tokens(copies), missed(copies);
  std::vector<int> missed_count(copies);
  size_t misses = 0;
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> id, fl, off{0}, tok(items, pages_per_item * page), ms;
    for (int i = 0; i < items; ++i) {
      for (int j = 0; j < pages_per_item; ++j) {
        const int32_t k = (c * items + i) * pages_per_item + j;
        const bool m = miss(rng);
        misses += m;
        id.push_back(m ? ~k : k);
        fl.push_back(m ? k : -1);
        if (m) ms.push_back(k);
      }
      off.push_back(static_cast<int32_t>(id.size()));
    }
    missed_count[c] = static_cast<int>(ms.size());
    for (auto [dst, src] : {std::pair{&ids[c], &id}, {&fills[c], &fl}, {&offsets[c], &off}, {&tokens[c], &tok},
                            {&missed[c], &ms}}) {
      CHECK_CUDA(cudaMalloc(dst, src->size() * 4));
      CHECK_CUDA(cudaMemcpy(*dst, src->data(), src->size() * 4, cudaMemcpyHostToDevice));
    }
  }
  const double fetched = static_cast<double>(misses) / copies * page_bytes;  // per call
  __nv_bfloat16 *q, *att_out;
  CHECK_CUDA(cudaMalloc(&q, size_t{2} * rows * kv_heads * group * d));
  CHECK_CUDA(cudaMalloc(&att_out, size_t{2} * rows * kv_heads * group * d));
  fill(q, size_t{1} * rows * kv_heads * group * d, 12);

  struct Product { int64_t out, in; };
  const Product products[] = {{qkv_out, hidden}, {hidden, kv_heads * group * d}, {2 * ffn, hidden}, {hidden, ffn}};
  std::vector<__nv_bfloat16*> weights, ins, outs;
  double weight_bytes = 0;
  for (const Product& p : products) {
    __nv_bfloat16 *w, *x, *y;
    CHECK_CUDA(cudaMalloc(&w, size_t{2} * p.out * p.in));
    CHECK_CUDA(cudaMalloc(&x, size_t{2} * rows * p.in));
    CHECK_CUDA(cudaMalloc(&y, size_t{2} * rows * p.out));
    fill(w, static_cast<size_t>(p.out * p.in), 13);
    fill(x, static_cast<size_t>(rows * p.in), 14);
    weights.push_back(w), ins.push_back(x), outs.push_back(y);
    weight_bytes += 2.0 * p.out * p.in;
  }
  spin::GemmRunner gemm_main, gemm_side;  // one per stream: each has its own workspace
  cudaStream_t side;
  CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

  spin::cuda::PagedDecodeParams p = decode_params(pool, rows, kv_heads, group, d, page, pages_per_item * page);
  p.host_pool = host_dev;
  p.fill_pool = pool;
  p.q = q;
  size_t ws_bytes = 0;
  for (int tps : {0, pages_per_item * page}) {
    p.tokens_per_split = tps;
    ws_bytes = std::max(ws_bytes, spin::cuda::paged_decode_workspace_bytes(p));
  }
  void* ws = nullptr;
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  const auto attention = [&](int i, int tokens_per_split, cudaStream_t s) {
    spin::cuda::PagedDecodeParams pc = p;
    const int c = i % copies;
    pc.page_ids = ids[c];
    pc.fill_pages = fills[c];
    pc.list_offsets = offsets[c];
    pc.num_tokens = tokens[c];
    pc.tokens_per_split = tokens_per_split;
    CHECK_CUDA(spin::cuda::paged_decode_attention(pc, att_out, ws, ws_bytes, s));
  };
  const auto layer_products = [&](spin::GemmRunner& g, cudaStream_t s) {
    for (size_t k = 0; k < weights.size(); ++k)
      g.matmul_nt(ins[k], weights[k], outs[k], rows, products[k].out, products[k].in, s);
  };
  // Eager first calls: cuBLASLt picks its algorithms and loads its kernels outside the captures.
  layer_products(gemm_main, stream);
  layer_products(gemm_side, side);
  attention(0, 0, stream);
  CHECK_CUDA(cudaDeviceSynchronize());
  const int calls = 8;
  const std::string config = "qwen3-14b layer, 2 x 8 rows";
  emit("overlap", config, "products alone", time_graph(stream, calls, [&](int) { layer_products(gemm_main, stream); }),
       weight_bytes);
  // The misses fetched apart, by the Retrieve gather on at most 16 SMs (host page k into device
  // page k): the copy holds few SMs while it waits on the link.
  const auto gather = [&](int i, cudaStream_t s) {
    const int c = i % copies;
    CHECK_CUDA(spin::cuda::gather_pages(host_dev, pool, missed[c], missed[c], missed_count[c], page_bytes, 16, s));
  };
  const std::pair<std::string, std::function<void(int, cudaStream_t)>> fetches[] = {
      {"attention, auto splits", [&](int i, cudaStream_t s) { attention(i, 0, s); }},
      {"attention, one block per list", [&](int i, cudaStream_t s) { attention(i, pages_per_item * page, s); }},
      {"gather 16 SMs", gather}};
  for (const auto& entry : fetches) {
    const std::string& name = entry.first;
    const auto& fetch = entry.second;
    emit("overlap", config, name + " alone", time_graph(stream, calls, [&](int i) { fetch(i, stream); }), fetched);
    emit("overlap", config, "one stream, " + name, time_graph(stream, calls, [&](int i) {
           fetch(i, stream);
           layer_products(gemm_main, stream);
         }),
         fetched + weight_bytes);
    emit("overlap", config, "two streams, " + name, time_graph(stream, calls, [&](int i) {
           CHECK_CUDA(cudaEventRecord(fork, stream));
           CHECK_CUDA(cudaStreamWaitEvent(side, fork));
           fetch(i, stream);
           layer_products(gemm_side, side);
           CHECK_CUDA(cudaEventRecord(join, side));
           CHECK_CUDA(cudaStreamWaitEvent(stream, join));
         }),
         fetched + weight_bytes);
  }
  std::printf("  (%.1f MB fetched per attention call, %.0f MB of weights per layer)\n", fetched / 1e6,
              weight_bytes / 1e6);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(side);
  for (auto* v : {&weights, &ins, &outs})
    for (__nv_bfloat16* ptr : *v) cudaFree(ptr);
  for (auto* v : {&ids, &fills, &offsets, &tokens, &missed})
    for (int32_t* ptr : *v) cudaFree(ptr);
  cudaFree(ws);
  cudaFree(q);
  cudaFree(att_out);
  cudaFreeHost(host);
  cudaFree(pool);
}

// (g) RetroInfer's decode-side work for one layer (rows `retro`), over records its Index builds
// from random keys: the select side (cluster and page scores, the top pages, the estimation zone
// and its top clusters), the decode attention over sinks + selected pages + window (all resident),
// and the estimation merged into its output. Each phase is timed alone, then the whole chain,
// rotating over `copies` layers whose records and pages together exceed the L2.
__global__ void retro_attention_lists(const int32_t* selected, int budget_pages, int pages, int heads, int sink,
                                      int window, int items, int32_t* lists) {
  const int item = blockIdx.x;
  if (item >= items) return;
  const int seq = item / heads, h = item % heads;
  const int len = sink + budget_pages + window;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const int logical = j < sink ? j : j < sink + budget_pages ? selected[item * budget_pages + j - sink]
                                                                : pages - window + (j - sink - budget_pages);
    lists[item * len + j] = (seq * pages + logical) * heads + h;
  }
}

void bench_retro(cudaStream_t stream, std::mt19937&) {
  namespace sc = spin::cuda;
  // Qwen3-14B's attention shape; RetroInfer's defaults (sparse/settings.h's SparseSettings, which
  // this C++17 file cannot include, and sparse/retroinfer.cpp): 16-token clusters, 8K-token
  // segments, 10 rounds, budget 2048 tokens, 4 sink tokens and a 64-token window in whole pages,
  // zone 23.2% of the clusters.
  const int heads = 8, group = 5, d = 128, page = 16, context = 32768, budget_pages = 128, sink = 1, window = 4;
  const int cluster_tokens = 16;
  const double estimate_fraction = 0.232;
  const int pages = context / page, segment_pages = sc::kRetroInferMaxSegmentTokens / page;
  const int slots = sc::retroinfer_slots_per_page(page, cluster_tokens);
  const int per_page = sc::retroinfer_records_per_page(page, d, slots);
  const int record_groups = (pages + per_page - 1) / per_page;
  const int list_len = sink + budget_pages + window, max_clusters = pages * slots;
  const size_t page_elems = size_t{2} * page * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int batch : {1, 8}) {
    const int items = batch * heads;
    const int copies = batch == 1 ? 8 : 2;  // each copy: 128 MB of pages and 15 MB of records a request
    char config[64];
    std::snprintf(config, sizeof config, "hq40/hkv8 B%d %dK", batch, context / 1024);
    if (!wanted(config)) continue;
    // A copy's pool: group s * pages + p holds page p of request s (every head), then each
    // request's record groups; the directory of request s is record_dir[s * record_groups ..].
    const size_t groups = static_cast<size_t>(batch) * (pages + record_groups);
    std::vector<int32_t> record_dir(static_cast<size_t>(batch) * record_groups), dir_offsets(batch);
    for (int s = 0; s < batch; ++s) {
      dir_offsets[s] = s * record_groups;
      for (int r = 0; r < record_groups; ++r) record_dir[s * record_groups + r] = batch * pages + s * record_groups + r;
    }
    const std::vector<int32_t> clustered(batch, pages), first(batch, sink), end(batch, pages - window),
        cluster_slots(batch, max_clusters), zeros(batch, 0), budget(items, budget_pages),
        tokens(items, list_len * page);
    std::vector<int32_t> selected_offsets(items), zone_offsets(items), list_offsets(items + 1);
    for (int i = 0; i < items; ++i) {
      selected_offsets[i] = i * budget_pages;
      zone_offsets[i] = i * max_clusters;
    }
    for (int i = 0; i <= items; ++i) list_offsets[i] = i * list_len;
    std::vector<void*> owned;  // every device array of this batch, freed at its end
    int32_t *d_dir = device_copy(owned, record_dir), *d_dir_offsets = device_copy(owned, dir_offsets),
            *d_clustered = device_copy(owned, clustered), *d_first = device_copy(owned, first),
            *d_end = device_copy(owned, end), *d_slots = device_copy(owned, cluster_slots),
            *d_zeros = device_copy(owned, zeros), *d_budget = device_copy(owned, budget),
            *d_tokens = device_copy(owned, tokens), *d_selected_offsets = device_copy(owned, selected_offsets),
            *d_zone_offsets = device_copy(owned, zone_offsets), *d_list_offsets = device_copy(owned, list_offsets);

    // The Index of every copy: k-means over each (request, head, segment), a request at a time.
    std::vector<__nv_bfloat16*> pool(copies), q(copies), out(copies);
    const size_t q_elems = static_cast<size_t>(items) * group * d;
    for (int c = 0; c < copies; ++c) {
      pool[c] = device_array<__nv_bfloat16>(owned, groups * heads * page_elems);
      fill(pool[c], groups * heads * page_elems, 31 + c);
      q[c] = device_array<__nv_bfloat16>(owned, q_elems);
      out[c] = device_array<__nv_bfloat16>(owned, q_elems);
      fill(q[c], q_elems, 51 + c);
    }
    // Copy c's records.
    const auto records = [&](int c) {
      sc::RetroInferRecords r;
      r.kv_pool = pool[c];
      r.num_kv_heads = heads;
      r.head_dim = d;
      r.page_size = page;
      r.slots = slots;
      r.records_per_page = per_page;
      return r;
    };
    {
      const int jobs = heads * (pages / segment_pages);
      char* scratch = device_array<char>(
          owned, sc::retroinfer_cluster_scratch_bytes(int64_t{heads} * pages, jobs, page, d, slots));
      for (int s = 0; s < batch; ++s) {
        std::vector<int32_t> ids, offsets{0}, first_page, head, job_dir;
        for (int h = 0; h < heads; ++h)
          for (int f = 0; f < pages; f += segment_pages) {
            for (int p = f; p < f + segment_pages; ++p) ids.push_back((s * pages + p) * heads + h);
            offsets.push_back(static_cast<int32_t>(ids.size()));
            first_page.push_back(f);
            head.push_back(h);
            job_dir.push_back(s * record_groups);
          }
        sc::RetroInferClusterParams cp;
        cp.page_ids = device_copy(owned, ids);
        cp.page_offsets = device_copy(owned, offsets);
        cp.first_page = device_copy(owned, first_page);
        cp.head = device_copy(owned, head);
        cp.dir = d_dir;
        cp.dir_offsets = device_copy(owned, job_dir);
        cp.num_jobs = jobs;
        cp.total_pages = static_cast<int>(ids.size());
        cp.cluster_tokens = cluster_tokens;
        cp.scratch = scratch;
        for (int c = 0; c < copies; ++c) {
          cp.records = records(c);
          CHECK_CUDA(sc::retroinfer_cluster(cp, stream));
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
      }
    }

    // Per copy: the step's scratch and outputs (the select side writes what the attention and
    // the estimation read).
    struct Step {
      float *logits, *totals, *page_scores, *zone_scores, *lse, *partials;
      uint8_t* zone_flags;
      int32_t *zone_tallies, *zone_counts, *selected, *zone, *lists;
    };
    const int splits = sc::retroinfer_estimate_splits(max_clusters);
    std::vector<Step> steps(copies);
    const auto clusters_of_items = static_cast<size_t>(items) * max_clusters;
    for (Step& st : steps) {
      st.logits = device_array<float>(owned, sc::retroinfer_score_scratch(items, group, max_clusters));
      st.totals = device_array<float>(owned, clusters_of_items);
      st.page_scores = device_array<float>(owned, static_cast<size_t>(items) * pages);
      st.zone_scores = device_array<float>(owned, clusters_of_items);
      st.lse = device_array<float>(owned, static_cast<size_t>(items) * group);
      st.partials = device_array<float>(owned, sc::retroinfer_estimate_scratch(items, group, d, splits));
      st.zone_flags = device_array<uint8_t>(owned, clusters_of_items);
      st.zone_tallies = device_array<int32_t>(owned, size_t{2} * items);
      st.zone_counts = device_array<int32_t>(owned, items);
      st.selected = device_array<int32_t>(owned, static_cast<size_t>(items) * budget_pages);
      st.zone = device_array<int32_t>(owned, clusters_of_items);
      st.lists = device_array<int32_t>(owned, static_cast<size_t>(items) * list_len);
    }
    const auto select_side = [&](int c) {
      const Step& st = steps[c];
      sc::RetroInferSelectParams sp;
      sp.records = records(c);
      sp.q = q[c];
      sp.dir = d_dir;
      sp.dir_offsets = d_dir_offsets;
      sp.clustered_pages = d_clustered;
      sp.first_candidate = d_first;
      sp.end_candidate = d_end;
      sp.num_seqs = batch;
      sp.group = group;
      sp.scale = scale;
      sp.max_clusters = max_clusters;
      sp.max_candidates = pages;
      sp.logits = st.logits;
      sp.totals = st.totals;
      sp.page_scores = st.page_scores;
      sp.selected = st.selected;
      sp.selected_offsets = d_selected_offsets;
      sp.selected_counts = d_budget;
      sp.estimate_fraction = estimate_fraction;
      sp.zone_flags = st.zone_flags;
      sp.zone_tallies = st.zone_tallies;
      sp.zone_scores = st.zone_scores;
      sp.zone_counts = st.zone_counts;
      CHECK_CUDA(sc::retroinfer_score(sp, stream));
      sc::SelectTopParams top;
      top.scores = st.page_scores;
      top.max_candidates = pages;
      top.first_candidate = d_first;
      top.end_candidate = d_end;
      top.counts = d_budget;
      top.out_offsets = d_selected_offsets;
      top.num_seqs = batch;
      top.num_kv_heads = heads;
      top.out_pages = st.selected;
      CHECK_CUDA(sc::select_top_pages(top, stream));
      CHECK_CUDA(sc::retroinfer_zone(sp, stream));
      sc::SelectTopParams zone = top;
      zone.scores = st.zone_scores;
      zone.max_candidates = max_clusters;
      zone.first_candidate = d_zeros;
      zone.end_candidate = d_slots;
      zone.counts = st.zone_counts;
      zone.out_offsets = d_zone_offsets;
      zone.out_pages = st.zone;
      CHECK_CUDA(sc::select_top_pages(zone, stream));
      retro_attention_lists<<<items, 128, 0, stream>>>(st.selected, budget_pages, pages, heads, sink, window, items,
                                                      st.lists);
      CHECK_CUDA(cudaGetLastError());
    };
    sc::PagedDecodeParams dp = decode_params(nullptr, batch, heads, group, d, page, list_len * page);
    const size_t ws_bytes = sc::paged_decode_workspace_bytes(dp);
    char* ws = ws_bytes ? device_array<char>(owned, ws_bytes) : nullptr;
    const auto attention = [&](int c) {
      sc::PagedDecodeParams p = dp;
      p.kv_pool = pool[c];
      p.q = q[c];
      p.page_ids = steps[c].lists;
      p.list_offsets = d_list_offsets;
      p.num_tokens = d_tokens;
      p.lse = steps[c].lse;
      CHECK_CUDA(sc::paged_decode_attention(p, out[c], ws, ws_bytes, stream));
    };
    const auto estimate = [&](int c) {
      const Step& st = steps[c];
      sc::RetroInferEstimateParams e;
      e.records = records(c);
      e.q = q[c];
      e.dir = d_dir;
      e.dir_offsets = d_dir_offsets;
      e.first_candidate = d_first;
      e.end_candidate = d_end;
      e.selected = st.selected;
      e.selected_offsets = d_selected_offsets;
      e.selected_counts = d_budget;
      e.zone = st.zone;
      e.zone_offsets = d_zone_offsets;
      e.zone_counts = st.zone_counts;
      e.decode_pages = st.lists;
      e.decode_offsets = d_list_offsets;
      e.num_seqs = batch;
      e.group = group;
      e.scale = scale;
      e.lse = st.lse;
      e.out = out[c];
      e.splits = splits;
      e.partials = st.partials;
      e.max_candidates = pages;
      CHECK_CUDA(sc::retroinfer_estimate(e, stream));
    };
    for (int c = 0; c < copies; ++c) {
      select_side(c);
      attention(c);
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // What the estimation reads at least: per zone cluster its record's start, size, value sum and
    // centroid and its member entries, cluster_tokens on average (its members on attended pages
    // also have their values read; not counted).
    double zone_clusters = 0;
    {
      std::vector<int32_t> counts(items);
      CHECK_CUDA(cudaMemcpy(counts.data(), steps[0].zone_counts, size_t{4} * items, cudaMemcpyDeviceToHost));
      for (int32_t n : counts) zone_clusters += n;
    }
    const double zone_bytes = zone_clusters * (8 + 4 * d + 2 * d + 4 * cluster_tokens);
    const double list_bytes = static_cast<double>(items) * list_len * page_elems * 2;
    std::printf("retro    %-28s zone: %.0f clusters an item, %d pages attended, %d splits\n", config,
                zone_clusters / items, list_len, splits);
    emit("retro", config, "select side", time_graph(stream, copies, select_side), 0.0);
    emit("retro", config, "decode attention", time_graph(stream, copies, attention), list_bytes);
    emit("retro", config, "estimation", time_graph(stream, copies, estimate), zone_bytes);
    emit("retro", config, "layer", time_graph(stream, copies, [&](int c) {
           select_side(c);
           attention(c);
           estimate(c);
         }),
         list_bytes + zone_bytes);

    for (void* p : owned) cudaFree(p);
  }
}

// (h) decode-sized products: each product of a layer of Llama-3.1-8B and Qwen3-14B (and their
// output heads) at 1 to 8 rows, through a GemmRunner that sends up to kMaxGemvRows rows to gemv.h's
// kernel (variant "gemv_rows N"; larger products run cuBLASLt there too) and one that sends none
// ("cublasLt"), and a device-to-device copy of the weights for the HBM's rate (its bytes count the
// read and the write). Weights rotate over copies of at least kRotateBytes in all, so L2 holds none
// of them between calls.
void bench_products(cudaStream_t stream) {
  struct Product {
    const char* name;
    int64_t out, in;
  };
  const Product products[] = {
      {"llama-3.1-8b qkv", 6144, 4096},    {"llama-3.1-8b o", 4096, 4096},      {"llama-3.1-8b gate_up", 28672, 4096},
      {"llama-3.1-8b down", 4096, 14336},  {"llama-3.1-8b head", 128256, 4096}, {"qwen3-14b qkv", 7168, 5120},
      {"qwen3-14b o", 5120, 5120},         {"qwen3-14b gate_up", 34816, 5120},  {"qwen3-14b down", 5120, 17408},
      {"qwen3-14b head", 151936, 5120}};
  constexpr int64_t kRowCounts[] = {1, 2, 3, 4, 8};  // ascending
  constexpr int64_t kMaxRows = kRowCounts[std::size(kRowCounts) - 1];
  spin::GemmRunner on_gemv({}, spin::cuda::kMaxGemvRows), on_cublas({}, 0);
  const std::string gemv_variant = "gemv_rows " + std::to_string(spin::cuda::kMaxGemvRows);
  for (const Product& p : products) {
    if (!wanted(p.name)) continue;
    const size_t w_elems = static_cast<size_t>(p.out * p.in), w_bytes = 2 * w_elems;
    const int copies = static_cast<int>(std::max<size_t>(2, (kRotateBytes + w_bytes - 1) / w_bytes));
    std::vector<__nv_bfloat16*> w(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK_CUDA(cudaMalloc(&w[c], w_bytes));
      fill(w[c], w_elems, 20 + c);
    }
    __nv_bfloat16 *x, *y;
    CHECK_CUDA(cudaMalloc(&x, size_t{2} * kMaxRows * p.in));
    CHECK_CUDA(cudaMalloc(&y, size_t{2} * kMaxRows * p.out));
    fill(x, static_cast<size_t>(kMaxRows * p.in), 19);
    const int calls = 2 * copies;
    for (const int64_t rows : kRowCounts) {
      const std::string config = std::string(p.name) + " rows" + std::to_string(rows);
      const double bytes = static_cast<double>(w_bytes) + 2.0 * rows * (p.in + p.out);
      for (const auto& side : {std::pair{gemv_variant, &on_gemv}, {std::string("cublasLt"), &on_cublas}}) {
        spin::GemmRunner* runner = side.second;
        runner->matmul_nt(x, w[0], y, rows, p.out, p.in, stream);  // cuBLASLt's choice, outside the capture
        CHECK_CUDA(cudaStreamSynchronize(stream));
        emit("product", config, side.first, time_graph(stream, calls, [&](int i) {
               runner->matmul_nt(x, w[i % copies], y, rows, p.out, p.in, stream);
             }),
             bytes);
      }
    }
    emit("product", p.name, "weights copy (read + write)", time_graph(stream, calls, [&](int i) {
           CHECK_CUDA(cudaMemcpyAsync(w[(i + 1) % copies], w[i % copies], w_bytes, cudaMemcpyDeviceToDevice, stream));
         }),
         2.0 * static_cast<double>(w_bytes));
    for (__nv_bfloat16* c : w) cudaFree(c);
    cudaFree(x);
    cudaFree(y);
  }
}

int main(int argc, char** argv) {
  // Line by line even into a file: a run killed by its time limit keeps the rows it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string what = argc > 1 ? argv[1] : "all";
  const char* csv_path = argc > 2 && std::strcmp(argv[2], "-") != 0 ? argv[2] : nullptr;
  if (argc > 3) g_only = argv[3];
  g_csv = csv_path ? std::fopen(csv_path, "w") : stdout;
  if (!g_csv) {
    std::fprintf(stderr, "cannot write %s\n", csv_path);
    return 1;
  }
  if (csv_path) std::fprintf(g_csv, "bench,config,variant,time_us,bytes,gbps\n");
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(12345);
  if (what == "all" || what == "dense") bench_dense(stream, rng);
  if (what == "all" || what == "sparse") bench_sparse(stream, rng);
  if (what == "all" || what == "gather") bench_gather(stream, rng);
  if (what == "all" || what == "prefill") bench_prefill(stream, rng);
  if (what == "all" || what == "step") bench_step(stream, rng);
  if (what == "all" || what == "overlap") bench_overlap(stream, rng);
  if (what == "all" || what == "retro") bench_retro(stream, rng);
  if (what == "all" || what == "products") bench_products(stream);
  if (csv_path) std::fclose(g_csv);
  return 0;
}
