#include "kernels/cuda/retroinfer.h"

#include <cub/block/block_radix_sort.cuh>

#include <climits>
#include <cmath>

#include "kernels/cuda/block_softmax.cuh"
#include "kernels/cuda/copy_async.cuh"
#include "kernels/cuda/group_dispatch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/launch.cuh"

// Index: per job (one segment of one KV head), blocks of 256 tokens read keys and values once into
// fp32 scratch, then centre the keys (the mean from the blocks' partial sums, added in one order);
// each k-means round is an assignment kernel (tensor cores over the bf16-rounded centred keys and
// centroids, fp32 sums), a sort kernel (one block radix-sorts the job's (cluster, token) keys, so
// each cluster's members are contiguous and in token order) and a block per 8 clusters summing
// each one's members, its warps over contiguous shares added in warp order (no atomics: the same
// inputs always give the same centroids). After the last round's sort, a block per 8 slots writes
// the records' sums the same way and a thread per token its entries.
//
// Select: blocks of (256 cluster slots, item) for the logits and their per-block (max, sum of
// exp), then the totals; blocks of (256 pages, item) for the page scores. The zone: blocks of
// pages flag the clusters of the pages left out (each page found in the selection by binary
// search), blocks of slots score and count them (integer atomics: the counts never depend on the
// order), and a thread per item takes the count.
//
// Estimate: blocks of (split, item), a warp per zone cluster; the warp's lanes place 32 members at
// once, the values of those on attended pages are subtracted (their rows found by the lanes at
// once, read four at a time), and each warp keeps an online softmax per query head; a second pass
// merges the splits and the attention's output.
namespace spin::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSortItems = kRetroInferMaxSegmentTokens / kThreads;
constexpr int kTokenBits = 13;
constexpr int kLoadTokens = 256;  // tokens per block of the load and centring kernels
constexpr int kLoadChunks = kRetroInferMaxSegmentTokens / kLoadTokens;
static_assert((1 << kTokenBits) == kRetroInferMaxSegmentTokens, "sort keys pack a segment's token index");

// Where `value` is in the ascending list[0, n), or -1.
__device__ __forceinline__ int find_sorted(const int32_t* list, int n, int value) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (list[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo < n && list[lo] == value ? lo : -1;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
  return v;
}

// A record's fields (layout in retroinfer.h).
struct Record {
  char* base;
  int page_size, slots, head_dim;
  __device__ int32_t& cluster(int i) const { return reinterpret_cast<int32_t*>(base)[i]; }
  __device__ int32_t& member(int i) const { return reinterpret_cast<int32_t*>(base)[page_size + i]; }
  __device__ int32_t& start(int s) const { return reinterpret_cast<int32_t*>(base)[2 * page_size + s]; }
  __device__ int32_t& size(int s) const { return reinterpret_cast<int32_t*>(base)[2 * page_size + slots + s]; }
  __device__ float* value_sum(int s) const {
    return reinterpret_cast<float*>(base + retroinfer_values_at(page_size, slots)) + static_cast<int64_t>(s) * head_dim;
  }
  __device__ bf16* centroid(int s) const {
    return reinterpret_cast<bf16*>(base + retroinfer_values_at(page_size, slots) + int64_t{4} * slots * head_dim) +
           static_cast<int64_t>(s) * head_dim;
  }
};

__device__ __forceinline__ Record record_of(const RetroInferRecords& r, const int32_t* dir, int h, int64_t page) {
  const int64_t group = dir[page / r.records_per_page];
  const int64_t page_elems = int64_t{2} * r.page_size * r.head_dim;
  char* base = reinterpret_cast<char*>(r.kv_pool + (group * r.num_kv_heads + h) * page_elems) +
               (page % r.records_per_page) * retroinfer_record_bytes(r.page_size, r.head_dim, r.slots);
  return Record{base, r.page_size, r.slots, r.head_dim};
}
// The record holding cluster slot c, and holding member entry / token i.
__device__ __forceinline__ Record slot_record(const RetroInferRecords& r, const int32_t* dir, int h, int64_t c) {
  return record_of(r, dir, h, c / r.slots);
}
__device__ __forceinline__ Record token_record(const RetroInferRecords& r, const int32_t* dir, int h, int64_t i) {
  return record_of(r, dir, h, i / r.page_size);
}

// ---------------------------------------------------------------------------------------------
// Index

// Scratch of the clustering, laid out from the job tables' totals.
struct ClusterScratch {
  float* x;       // [tokens][head_dim] centred keys
  float* values;  // [tokens][head_dim]
  float* mean;    // [jobs][head_dim]
  float* centroids;  // [pages * slots][head_dim]: job j's cluster c at page_offsets[j] * slots + c
  int32_t* assign;   // [tokens]
  uint32_t* sorted;  // [tokens]
  int32_t* start;    // [pages * slots]
  int32_t* size;     // [pages * slots]
  bf16* x16;         // x and the centroids rounded to bf16: the assignment's tensor-core inputs
  bf16* centroids16;
  float* partial;    // [jobs][kLoadChunks][head_dim]: each chunk's sums of its keys
};

__host__ __device__ inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The scratch's layout from `base`; `bytes` receives its size.
__host__ __device__ inline ClusterScratch cluster_scratch(void* base, int64_t pages, int64_t jobs, int page_size,
                                                         int head_dim, int slots, size_t* bytes = nullptr) {
  const auto tokens = static_cast<size_t>(pages * page_size);
  const auto clusters = static_cast<size_t>(pages * slots);
  size_t offset = 0;
  const auto take = [&](size_t size) {
    char* p = static_cast<char*>(base) + offset;
    offset += align256(size);
    return p;
  };
  ClusterScratch s{};
  s.x = reinterpret_cast<float*>(take(tokens * head_dim * sizeof(float)));
  s.values = reinterpret_cast<float*>(take(tokens * head_dim * sizeof(float)));
  s.mean = reinterpret_cast<float*>(take(static_cast<size_t>(jobs) * head_dim * sizeof(float)));
  s.centroids = reinterpret_cast<float*>(take(clusters * head_dim * sizeof(float)));
  s.assign = reinterpret_cast<int32_t*>(take(tokens * sizeof(int32_t)));
  s.sorted = reinterpret_cast<uint32_t*>(take(tokens * sizeof(uint32_t)));
  s.start = reinterpret_cast<int32_t*>(take(clusters * sizeof(int32_t)));
  s.size = reinterpret_cast<int32_t*>(take(clusters * sizeof(int32_t)));
  s.x16 = reinterpret_cast<bf16*>(take(tokens * head_dim * sizeof(bf16)));
  s.centroids16 = reinterpret_cast<bf16*>(take(clusters * head_dim * sizeof(bf16)));
  s.partial = reinterpret_cast<float*>(take(static_cast<size_t>(jobs) * kLoadChunks * head_dim * sizeof(float)));
  if (bytes) *bytes = offset;
  return s;
}

struct JobShape {
  int64_t token0;    // first token of the job in the scratch
  int64_t cluster0;  // first centroid of the job in the scratch
  int n;             // tokens
  int k;             // clusters
};

__device__ __forceinline__ JobShape job_shape(const RetroInferClusterParams& p, int job) {
  const int32_t page0 = p.page_offsets[job];
  const int n = (p.page_offsets[job + 1] - page0) * p.records.page_size;
  return JobShape{int64_t{page0} * p.records.page_size, int64_t{page0} * p.records.slots, n,
                  max(1, n / p.cluster_tokens)};
}

// Block (256 tokens, job): the chunk's keys and values into fp32 scratch, and its sums of the keys
// (each thread keeps one dimension: blockDim is a multiple of head_dim).
__global__ void __launch_bounds__(kThreads) retro_load_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  __shared__ float partial[kThreads];
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const int t0 = blockIdx.x * kLoadTokens;
  if (t0 >= js.n) return;  // whole block
  const int D = p.records.head_dim, ps = p.records.page_size;
  const int64_t page_elems = int64_t{2} * ps * D;
  const int32_t* ids = p.page_ids + p.page_offsets[job];
  float* x = s.x + js.token0 * D;
  float* v = s.values + js.token0 * D;
  const int d = threadIdx.x % D;
  float sum = 0.0f;
  for (int t = t0 + threadIdx.x / D; t < min(js.n, t0 + kLoadTokens); t += kThreads / D) {
    const int32_t id = ids[t / ps];
    const bf16* page = id >= 0 ? p.records.kv_pool + id * page_elems : p.host_pool + int64_t{~id} * page_elems;
    const float key = __bfloat162float(page[(t % ps) * D + d]);
    x[int64_t{t} * D + d] = key;
    v[int64_t{t} * D + d] = __bfloat162float(page[int64_t{ps} * D + (t % ps) * D + d]);
    sum += key;
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x < D) {
    float total = 0.0f;
    for (int i = threadIdx.x; i < kThreads; i += D) total += partial[i];
    s.partial[(int64_t{job} * kLoadChunks + blockIdx.x) * D + threadIdx.x] = total;
  }
}

// Block (256 tokens, job): the segment's mean from the chunks' sums (every block adds them in the
// same order), the chunk's keys centred (fp32 and bf16), and the seeds among its tokens.
__global__ void __launch_bounds__(kThreads) retro_centre_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  __shared__ float mean[128];
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const int t0 = blockIdx.x * kLoadTokens;
  if (t0 >= js.n) return;  // whole block
  const int D = p.records.head_dim;
  if (threadIdx.x < D) {
    float total = 0.0f;
    for (int c = 0; c * kLoadTokens < js.n; ++c) total += s.partial[(int64_t{job} * kLoadChunks + c) * D + threadIdx.x];
    mean[threadIdx.x] = total / static_cast<float>(js.n);
    if (blockIdx.x == 0) s.mean[int64_t{job} * D + threadIdx.x] = mean[threadIdx.x];
  }
  __syncthreads();
  const int d = threadIdx.x % D;
  float* x = s.x + js.token0 * D;
  bf16* x16 = s.x16 + js.token0 * D;
  const int t_end = min(js.n, t0 + kLoadTokens);
  for (int t = t0 + threadIdx.x / D; t < t_end; t += kThreads / D) {
    const float centred = x[int64_t{t} * D + d] - mean[d];
    x[int64_t{t} * D + d] = centred;
    x16[int64_t{t} * D + d] = __float2bfloat16(centred);
  }
  __syncthreads();
  // Seed j is token j * n / k: the seeds of this chunk, from the smallest j with j n / k >= t0.
  float* c = s.centroids + js.cluster0 * D;
  bf16* c16 = s.centroids16 + js.cluster0 * D;
  const auto first_seed = static_cast<int>((int64_t{t0} * js.k + js.n - 1) / js.n);
  for (int j = first_seed + threadIdx.x / D; j < js.k; j += kThreads / D) {
    const auto t = static_cast<int>(static_cast<int64_t>(j) * js.n / js.k);
    if (t >= t_end) break;
    c[int64_t{j} * D + d] = x[int64_t{t} * D + d];
    c16[int64_t{j} * D + d] = x16[int64_t{t} * D + d];
  }
}

// Block (128 tokens, job): each token's nearest centroid by inner product (ties: the lower one),
// on tensor cores: the block's centred keys and 128 centroids at a time in shared memory (bf16),
// the next 128 copied in (cp.async) while these are multiplied; warp w multiplies its 16 tokens by
// them (mma m16n8k16, fp32 sums) and takes each row's best straight from the accumulators: a
// lane's columns of a row, then the row's quad of lanes.
constexpr int kAssignRows = 128;
constexpr int kAssignCols = 128;
template <int D>
constexpr int assign_ld() { return D + 8; }  // bf16 row stride in shared memory: ldmatrix conflict-free
template <int D>
constexpr size_t assign_shared_bytes() {
  return (size_t{kAssignRows} + 2 * kAssignCols) * assign_ld<D>() * sizeof(bf16);
}

// The better of (v, j) and (ov, oj): the larger value, the lower index on a tie.
__device__ __forceinline__ void keep_best(float& v, int& j, float ov, int oj) {
  if (ov > v || (ov == v && oj < j)) v = ov, j = oj;
}

// Rows [0, count) of src (D bf16 each) into shared memory at `to` (row stride ld), zeros up to
// `rows`, by the block's threads.
template <int D>
__device__ __forceinline__ void copy_rows_async(uint32_t to, const bf16* src, int count, int rows) {
  constexpr int kVectors = D / 8;  // 16-byte vectors per row
  for (int i = threadIdx.x; i < rows * kVectors; i += kThreads) {
    const int row = i / kVectors, v = i % kVectors;
    const bool real = row < count;
    copy_async(to + static_cast<uint32_t>((row * assign_ld<D>() + v * 8) * sizeof(bf16)),
               src + (real ? int64_t{row} * D + v * 8 : 0), real ? 16 : 0);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) retro_assign_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  extern __shared__ __align__(128) unsigned char shared[];
  constexpr int ld = assign_ld<D>();
  constexpr uint32_t kTileBytes = kAssignCols * ld * sizeof(bf16);
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const int t0 = blockIdx.x * kAssignRows;
  if (t0 >= js.n) return;  // whole block
  const int rows = min(kAssignRows, js.n - t0);
  const bf16* c = s.centroids16 + js.cluster0 * D;
  const auto xs_addr = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  const uint32_t cs_addr = xs_addr + kAssignRows * ld * sizeof(bf16);  // two tiles of centroids
  copy_rows_async<D>(xs_addr, s.x16 + (js.token0 + t0) * D, rows, kAssignRows);
  copy_rows_async<D>(cs_addr, c, min(kAssignCols, js.k), kAssignCols);
  copy_async_commit();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float best[2] = {-INFINITY, -INFINITY};  // rows warp * 16 + lane / 4 and + 8
  int best_j[2] = {0, 0};
  for (int j0 = 0, tile = 0; j0 < js.k; j0 += kAssignCols, tile ^= 1) {
    const int cols = min(kAssignCols, js.k - j0);
    if (j0 + kAssignCols < js.k) {  // the next tile into the other buffer, read two tiles ago
      copy_rows_async<D>(cs_addr + (tile ^ 1) * kTileBytes, c + int64_t{j0 + kAssignCols} * D,
                         min(kAssignCols, js.k - j0 - kAssignCols), kAssignCols);
      copy_async_commit();
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();  // this tile (and the keys) landed for every thread
    const uint32_t tile_addr = cs_addr + tile * kTileBytes;
    float acc[kAssignCols / 8][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, xs_addr + ((warp * 16 + lane % 16) * ld + k0 + (lane / 16) * 8) * 2);
#pragma unroll
      for (int nb = 0; nb < kAssignCols / 16; ++nb) {
        uint32_t b[4];
        ldmatrix_x4(b, tile_addr + ((nb * 16 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8) * 2);
        mma_bf16(acc[2 * nb], a, b[0], b[1]);
        mma_bf16(acc[2 * nb + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp read this tile before the next iteration copies over it
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v = -INFINITY;
      int j = INT_MAX;
#pragma unroll
      for (int n = 0; n < kAssignCols / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = n * 8 + 2 * (lane % 4) + e;  // ascending: the lower wins a tie
          if (col < cols && acc[n][2 * half + e] > v) v = acc[n][2 * half + e], j = j0 + col;
        }
#pragma unroll
      for (int offset = 1; offset < 4; offset <<= 1) {
        keep_best(v, j, __shfl_xor_sync(kFull, v, offset), __shfl_xor_sync(kFull, j, offset));
      }
      keep_best(best[half], best_j[half], v, j);
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * 16 + lane / 4 + 8 * half;
      if (row < rows) s.assign[js.token0 + t0 + row] = best_j[half];
    }
  }
}

// Block per job: members sorted by (cluster, token), each cluster's first member and count.
__global__ void __launch_bounds__(kThreads) retro_sort_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kSortItems>;
  __shared__ typename Sort::TempStorage sort_storage;
  const int job = blockIdx.x;
  const JobShape js = job_shape(p, job);
  constexpr uint32_t kPad = (1u << (2 * kTokenBits)) - 1;  // past every (cluster, token) key of a short job
  uint32_t keys[kSortItems];
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int t = threadIdx.x * kSortItems + i;
    keys[i] = t < js.n ? (static_cast<uint32_t>(s.assign[js.token0 + t]) << kTokenBits) | static_cast<uint32_t>(t) : kPad;
  }
  Sort(sort_storage).Sort(keys, 0, 2 * kTokenBits);
  uint32_t* sorted = s.sorted + js.token0;
  int32_t* start = s.start + js.cluster0;
  int32_t* size = s.size + js.cluster0;
  for (int j = threadIdx.x; j < js.k; j += kThreads) start[j] = -1, size[j] = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int at = threadIdx.x * kSortItems + i;
    if (at < js.n) sorted[at] = keys[i];
  }
  __syncthreads();
  // Each run of one cluster: its first entry writes the start, its last the end (into size).
  for (int at = threadIdx.x; at < js.n; at += kThreads) {
    const uint32_t c = sorted[at] >> kTokenBits;
    if (at == 0 || (sorted[at - 1] >> kTokenBits) != c) start[c] = at;
    if (at == js.n - 1 || (sorted[at + 1] >> kTokenBits) != c) size[c] = at + 1;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < js.k; j += kThreads) {
    if (start[j] >= 0) size[j] -= start[j];
  }
  __syncthreads();

}

// visit(t) for the token t of each member entry [start, end) of a job's sorted list, in entry
// order, by a whole warp. The lanes read 32 entries at once and each visit's token comes by
// shuffle, so the loads of consecutive visits overlap.
template <typename Visit>
__device__ __forceinline__ void for_each_member(const uint32_t* sorted, int start, int end, Visit visit) {
  const int lane = threadIdx.x % 32;
  for (int m0 = start; m0 < end; m0 += 32) {
    const int count = min(32, end - m0);
    const uint32_t entry = lane < count ? sorted[m0 + lane] & ((1u << kTokenBits) - 1) : 0;
#pragma unroll 8
    for (int i = 0; i < count; ++i) visit(int64_t{__shfl_sync(kFull, entry, i)});
  }
}

// The sum of rows[t] (D floats each) over the tokens of member entries [start, start + size), by
// the whole block, for thread d < D (dimension d). Each warp sums a contiguous share of the
// entries in order (lanes over dimensions), then the shares are added in warp order: the same
// inputs always give the same sum. Clusters can be uneven (on random keys every other round puts
// 350-480 of 8192 tokens in one), and one warp summing the largest cluster alone bounded the
// launch. Every thread calls it with the same arguments; `partial` is the block's scratch.
template <int D>
__device__ float block_member_sum(const float* rows, const uint32_t* sorted, int start, int size,
                                  float (&partial)[kWarps][D]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int share = (size + kWarps - 1) / kWarps;
  float sum[D / 32] = {};
  for_each_member(sorted, start + min(size, warp * share), start + min(size, (warp + 1) * share), [&](int64_t t) {
#pragma unroll
    for (int e = 0; e < D / 32; ++e) sum[e] += rows[t * D + lane + 32 * e];
  });
#pragma unroll
  for (int e = 0; e < D / 32; ++e) partial[warp][lane + 32 * e] = sum[e];
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x < D) {
    for (int w = 0; w < kWarps; ++w) total += partial[w][threadIdx.x];
  }
  __syncthreads();  // partial is free for the next sum
  return total;
}

// Block (8 clusters, job), the clusters one after another: each new centroid, the mean of its
// members' centred keys (an empty cluster keeps its own).
template <int D>
__global__ void __launch_bounds__(kThreads) retro_update_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  __shared__ float partial[kWarps][D];
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const int last = min(js.k, static_cast<int>(blockIdx.x + 1) * kWarps);
  for (int j = blockIdx.x * kWarps; j < last; ++j) {
    const int size = s.size[js.cluster0 + j];
    if (size == 0) continue;
    const float total = block_member_sum<D>(s.x + js.token0 * D, s.sorted + js.token0, s.start[js.cluster0 + j], size, partial);
    if (threadIdx.x < D) {
      const int64_t at = (js.cluster0 + j) * D + threadIdx.x;
      s.centroids[at] = total / static_cast<float>(size);
      s.centroids16[at] = __float2bfloat16(s.centroids[at]);
    }
  }
}

// Block (8 slots, job), the slots of the segment one after another: each one's start and size (an
// empty one past k, or with no member, gets size 0), value sum and centroid (the mean stored key).
template <int D>
__global__ void __launch_bounds__(kThreads) retro_records_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  __shared__ float partial[kWarps][D];
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const RetroInferRecords& r = p.records;
  const int h = p.head[job];
  const int32_t* dir = p.dir + p.dir_offsets[job];
  const int64_t first_token = int64_t{p.first_page[job]} * r.page_size;
  const float* x = s.x + js.token0 * D;
  const float* values = s.values + js.token0 * D;
  const float* mean = s.mean + int64_t{job} * D;
  const int last = min(js.n / r.page_size * r.slots, static_cast<int>(blockIdx.x + 1) * kWarps);
  for (int j = blockIdx.x * kWarps; j < last; ++j) {
    const int64_t slot = int64_t{p.first_page[job]} * r.slots + j;
    const Record rec = slot_record(r, dir, h, slot);
    const int sj = static_cast<int>(slot % r.slots);
    const int start = j < js.k ? s.start[js.cluster0 + j] : 0, size = j < js.k ? s.size[js.cluster0 + j] : 0;
    if (threadIdx.x == 0) {
      rec.start(sj) = size > 0 ? static_cast<int32_t>(first_token + start) : 0;
      rec.size(sj) = size;
    }
    if (size == 0) continue;
    const float key_sum = block_member_sum<D>(x, s.sorted + js.token0, start, size, partial);
    const float value_sum = block_member_sum<D>(values, s.sorted + js.token0, start, size, partial);
    if (threadIdx.x < D) {
      rec.value_sum(sj)[threadIdx.x] = value_sum;
      rec.centroid(sj)[threadIdx.x] = __float2bfloat16(key_sum / static_cast<float>(size) + mean[threadIdx.x]);
    }
  }
}

// Block (256 tokens, job): the segment's member entries and each token's cluster.
__global__ void __launch_bounds__(kThreads) retro_members_kernel(RetroInferClusterParams p, ClusterScratch s) {
  enter_dependent_grid();
  const int job = blockIdx.y;
  const JobShape js = job_shape(p, job);
  const int at = blockIdx.x * kLoadTokens + threadIdx.x;
  static_assert(kLoadTokens == kThreads, "a thread per token");
  if (at >= js.n) return;
  const RetroInferRecords& r = p.records;
  const int h = p.head[job];
  const int32_t* dir = p.dir + p.dir_offsets[job];
  const int64_t first_token = int64_t{p.first_page[job]} * r.page_size;
  const int64_t i = first_token + at;
  const Record rec = token_record(r, dir, h, i);
  rec.member(static_cast<int>(i % r.page_size)) =
      static_cast<int32_t>(first_token + (s.sorted[js.token0 + at] & ((1u << kTokenBits) - 1)));
  rec.cluster(static_cast<int>(i % r.page_size)) =
      static_cast<int32_t>(int64_t{p.first_page[job]} * r.slots + s.assign[js.token0 + at]);
}

// ---------------------------------------------------------------------------------------------
// Select

__device__ __forceinline__ int num_slots(const RetroInferSelectParams& p, int seq) {
  return min(p.clustered_pages[seq] * p.records.slots, p.max_clusters);
}

// Pass 1, block (256 slots, item): logits of the non-empty slots (-inf for the others) and the
// block's (max, sum of exp) per query head. A warp takes its 32 slots 4 at a time, 8 lanes over
// each centroid (whole 32-byte sectors), then lane L keeps slot L's dots. q sits in shared memory
// in per-lane chunks padded by 4 floats, so the 8 chunks a warp reads at once fall in distinct banks.
template <int D, int G>
__global__ void __launch_bounds__(kThreads) retro_logits_kernel(RetroInferSelectParams p) {
  enter_dependent_grid();
  constexpr int kSlotLanes = 8;
  constexpr int kVecs = D / (8 * kSlotLanes);  // 16-byte pieces of a centroid per lane
  constexpr int kDims = kVecs * 8;
  constexpr int kSlotsAtOnce = 32 / kSlotLanes;
  __shared__ __align__(16) float q[G][kSlotLanes][kDims + 4];
  const int item = blockIdx.y;
  const int heads = p.records.num_kv_heads;
  const int seq = item / heads, h = item % heads;
  const int n = num_slots(p, seq);
  const int c0 = static_cast<int>(blockIdx.x) * kThreads;
  if (blockIdx.x == 0 && threadIdx.x < 2) p.zone_tallies[item * 2 + threadIdx.x] = 0;
  if (c0 >= n) return;  // whole block
  const bf16* qh = p.q + static_cast<int64_t>(item) * G * D;
  for (int k = threadIdx.x; k < G * D; k += kThreads) {
    const int g = k / D, d = k % D;
    q[g][d / kDims][d % kDims] = __bfloat162float(qh[k]) * p.scale;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int sub = lane / kSlotLanes, part = lane % kSlotLanes;
  const int32_t* dir = p.dir + p.dir_offsets[seq];
  float mine[G];
#pragma unroll
  for (int g = 0; g < G; ++g) mine[g] = -INFINITY;
  for (int round = 0; round < 32 / kSlotsAtOnce; ++round) {
    const int c = c0 + warp * 32 + round * kSlotsAtOnce + sub;
    float dot[G];
#pragma unroll
    for (int g = 0; g < G; ++g) dot[g] = 0.0f;
    bool live = false;
    if (c < n) {
      const Record rec = slot_record(p.records, dir, h, c);
      const int sc = c % p.records.slots;
      live = rec.size(sc) > 0;
      if (live) {
        const uint4* row = reinterpret_cast<const uint4*>(rec.centroid(sc)) + part * kVecs;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          const uint4 raw = __ldg(row + v);
          const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
          for (int e4 = 0; e4 < 2; ++e4) {
            const float2 lo = __bfloat1622float2(x[e4 * 2]), hi = __bfloat1622float2(x[e4 * 2 + 1]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
              const float4 qv = *reinterpret_cast<const float4*>(&q[g][part][v * 8 + e4 * 4]);
              dot[g] = fmaf(qv.x, lo.x, dot[g]);
              dot[g] = fmaf(qv.y, lo.y, dot[g]);
              dot[g] = fmaf(qv.z, hi.x, dot[g]);
              dot[g] = fmaf(qv.w, hi.y, dot[g]);
            }
          }
        }
      }
    }
    const bool owner = lane / kSlotsAtOnce == round;  // lane L keeps slot L
    const int from = (lane % kSlotsAtOnce) * kSlotLanes;
    const bool live_from = __shfl_sync(kFull, live, from);
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int offset = kSlotLanes / 2; offset > 0; offset >>= 1) dot[g] += __shfl_xor_sync(kFull, dot[g], offset);
      const float got = __shfl_sync(kFull, dot[g], from);
      if (owner && live_from) mine[g] = got;
    }
  }
  const int c = c0 + static_cast<int>(threadIdx.x);
  if (c < n) {
    float* logits = p.logits + static_cast<int64_t>(item) * G * p.max_clusters + c;
#pragma unroll
    for (int g = 0; g < G; ++g) logits[static_cast<int64_t>(g) * p.max_clusters] = mine[g];
  }
  block_softmax_partials<G, kWarps>(mine, p.logits + static_cast<int64_t>(p.num_seqs) * heads * G * p.max_clusters +
                                               (static_cast<int64_t>(item) * gridDim.x + blockIdx.x) * G * 2);
}

// Pass 2, block (256 slots, item): the normalisers from every block's partials, then the totals,
// and each slot's total over its size in row 0 of the item's logits (read, per token, by the page
// scores: one gather there instead of the size's record and the total).
template <int G>
__global__ void __launch_bounds__(kThreads) retro_totals_kernel(RetroInferSelectParams p) {
  enter_dependent_grid();
  __shared__ float norm_max[G], norm_scale[G];
  const int item = blockIdx.y;
  const int heads = p.records.num_kv_heads;
  const int seq = item / heads, h = item % heads;
  const int n = num_slots(p, seq);
  const int c0 = static_cast<int>(blockIdx.x) * kThreads;
  if (c0 >= n) return;  // whole block
  if (threadIdx.x < G) {
    const float* partial = p.logits + static_cast<int64_t>(p.num_seqs) * heads * G * p.max_clusters +
                           static_cast<int64_t>(item) * gridDim.x * G * 2 + threadIdx.x * 2;
    merge_softmax_partials(partial, (n + kThreads - 1) / kThreads, G * 2, norm_max[threadIdx.x],
                           norm_scale[threadIdx.x]);
  }
  __syncthreads();
  const int c = c0 + static_cast<int>(threadIdx.x);
  bool non_empty = false;
  if (c < n) {
    const float* logits = p.logits + static_cast<int64_t>(item) * G * p.max_clusters + c;
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float l = logits[static_cast<int64_t>(g) * p.max_clusters];
      non_empty |= l != -INFINITY;
      if (l != -INFINITY) total += __expf(l - norm_max[g]) * norm_scale[g];
    }
    p.totals[static_cast<int64_t>(item) * p.max_clusters + c] = total;
    p.zone_flags[static_cast<int64_t>(item) * p.max_clusters + c] = 0;
    float per_token = 0.0f;
    if (non_empty) {
      const Record rec = slot_record(p.records, p.dir + p.dir_offsets[seq], h, c);
      per_token = total / static_cast<float>(rec.size(c % p.records.slots));
    }
    p.logits[static_cast<int64_t>(item) * G * p.max_clusters + c] = per_token;
  }
  const int count = __syncthreads_count(non_empty);
  if (threadIdx.x == 0 && count > 0) atomicAdd(&p.zone_tallies[item * 2 + 1], count);
}

// Block (256 pages, item): a clustered candidate's estimated attention, its tokens' cluster totals
// over the clusters' sizes (the totals pass's per-token shares), the cluster ids read 16 bytes at a
// time.
__global__ void __launch_bounds__(kThreads) retro_page_scores_kernel(RetroInferSelectParams p) {
  enter_dependent_grid();
  const int item = blockIdx.y;
  const int heads = p.records.num_kv_heads;
  const int seq = item / heads, h = item % heads;
  const int first = p.first_candidate[seq];
  const int page = first + static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (page >= p.end_candidate[seq]) return;
  float mass = INFINITY;
  if (page < p.clustered_pages[seq]) {
    const int32_t* dir = p.dir + p.dir_offsets[seq];
    const Record rec = record_of(p.records, dir, h, page);
    const float* per_token = p.logits + static_cast<int64_t>(item) * p.group * p.max_clusters;
    const int4* ids = reinterpret_cast<const int4*>(&rec.cluster(0));
    mass = 0.0f;
#pragma unroll 4
    for (int t = 0; t < p.records.page_size / 4; ++t) {
      const int4 c = ids[t];
      const float a = per_token[c.x], b = per_token[c.y], d = per_token[c.z], e = per_token[c.w];
      mass += a;
      mass += b;
      mass += d;
      mass += e;
    }
  }
  p.page_scores[static_cast<int64_t>(item) * p.max_candidates + (page - first)] = mass;
}

// Block (256 pages, item): the clusters of each clustered candidate page not selected get a flag.
__global__ void __launch_bounds__(kThreads) retro_zone_flags_kernel(RetroInferSelectParams p) {
  enter_dependent_grid();
  const int item = blockIdx.y;
  const int heads = p.records.num_kv_heads;
  const int seq = item / heads, h = item % heads;
  const int first = p.first_candidate[seq];
  const int page = first + static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (page >= min(p.end_candidate[seq], p.clustered_pages[seq])) return;
  if (find_sorted(p.selected + p.selected_offsets[item], p.selected_counts[item], page) >= 0) return;
  const Record rec = record_of(p.records, p.dir + p.dir_offsets[seq], h, page);
  uint8_t* flags = p.zone_flags + static_cast<int64_t>(item) * p.max_clusters;
  const int4* ids = reinterpret_cast<const int4*>(&rec.cluster(0));
  for (int t = 0; t < p.records.page_size / 4; ++t) {
    const int4 c = ids[t];
    flags[c.x] = 1;
    flags[c.y] = 1;
    flags[c.z] = 1;
    flags[c.w] = 1;
  }
}

// Block (256 slots, item): zone scores, and the flagged clusters counted.
__global__ void __launch_bounds__(kThreads) retro_zone_scores_kernel(RetroInferSelectParams p) {
  enter_dependent_grid();
  const int item = blockIdx.y;
  const int seq = item / p.records.num_kv_heads;
  const int c = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (static_cast<int>(blockIdx.x) * kThreads >= num_slots(p, seq)) return;  // whole block
  bool flagged = false;
  if (c < num_slots(p, seq)) {
    const int64_t at = static_cast<int64_t>(item) * p.max_clusters + c;
    flagged = p.zone_flags[at] != 0;
    p.zone_scores[at] = flagged ? p.totals[at] : NAN;
  }
  const int count = __syncthreads_count(flagged);
  if (threadIdx.x == 0 && count > 0) atomicAdd(&p.zone_tallies[item * 2], count);
}

// Thread per item: how many clusters the zone takes.
__global__ void retro_zone_count_kernel(RetroInferSelectParams p, int items) {
  enter_dependent_grid();
  const int item = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (item >= items) return;
  const int candidates = p.zone_tallies[item * 2], non_empty = p.zone_tallies[item * 2 + 1];
  p.zone_counts[item] = min(static_cast<int>(ceil(p.estimate_fraction * non_empty)), candidates);
}

// ---------------------------------------------------------------------------------------------
// Estimate

// Candidate pages a rank table covers at most: 8 KB of shared memory, within the default limit, so
// the launch needs no opt-in (32K pages, about 500K tokens at 16-token pages).
constexpr int kMaxRankedPages = 32768;
__host__ __device__ inline int ranked_pages(int max_candidates) { return min(max_candidates, kMaxRankedPages); }
// 32-bit words of the rank table's bits (and as many of its counts) for `max_candidates` pages.
__host__ __device__ inline int rank_words(int max_candidates) {
  return max_candidates > 0 ? (ranked_pages(max_candidates) + 31) / 32 : 1;
}

// Where a page sits among an item's selected pages (ascending), from a table in shared memory:
// a bit per candidate page and, per 32 of them, the selected pages before. A member's lookup is
// two shared loads instead of a binary search over the list in global memory.
struct SelectedRanks {
  uint32_t* bits;
  int32_t* before;
  int first;

  __device__ int rank(int page) const {
    const int off = page - first;
    const uint32_t word = bits[off >> 5], bit = 1u << (off & 31);
    return word & bit ? before[off >> 5] + __popc(word & (bit - 1)) : -1;
  }
};

// Fills the table for candidates [first, first + 32 * words); every thread of the block calls it.
__device__ void build_selected_ranks(const SelectedRanks& t, int words, const int32_t* selected, int k) {
  for (int w = threadIdx.x; w < words; w += blockDim.x) t.bits[w] = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int off = selected[j] - t.first;
    atomicOr(&t.bits[off >> 5], 1u << (off & 31));
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int carry = 0;
    for (int w0 = 0; w0 < words; w0 += 32) {
      const int w = w0 + lane;
      const int count = w < words ? __popc(t.bits[w]) : 0;
      int inclusive = count;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int below = __shfl_up_sync(kFull, inclusive, offset);
        if (lane >= offset) inclusive += below;
      }
      if (w < words) t.before[w] = carry + inclusive - count;
      carry += __shfl_sync(kFull, inclusive, 31);
    }
  }
  __syncthreads();
}

// Subtracts from `sum` (lanes over dims: lane + 32 e) the rows of D bf16 values that the lanes set
// in `rows` point to with `row_at`, in lane order, four rows' loads in flight at a time.
template <int V>
__device__ __forceinline__ void subtract_lane_rows(float (&sum)[V], unsigned rows, unsigned long long row_at) {
  const int lane = threadIdx.x % 32;
  while (rows) {
    float x[4][V];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool has = rows != 0;  // the same in every lane
      const int src = has ? __ffs(rows) - 1 : 0;
      rows &= rows - 1;
      const auto* row = reinterpret_cast<const bf16*>(__shfl_sync(kFull, row_at, src));
#pragma unroll
      for (int e = 0; e < V; ++e) x[u][e] = 0.0f;
      if (has) {
#pragma unroll
        for (int e = 0; e < V; ++e) x[u][e] = __bfloat162float(row[lane + 32 * e]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] -= x[u][e];
  }
}

// Block (split, item): the zone clusters z = split * kWarps + warp (+ splits * kWarps ...), one per
// warp at a time. The lanes take 32 members at once and find where each one's page sits in the
// attention list (selected pages by the block's rank table, or by binary search for an item with
// more candidates than the table holds); the values of the attended ones are subtracted one by one
// (lanes over dims).
template <int D, int G>
__global__ void __launch_bounds__(kThreads) retro_estimate_partial_kernel(RetroInferEstimateParams p) {
  extern __shared__ uint32_t rank_table[];  // [2 * rank_words(max_candidates)]
  enter_dependent_grid();
  constexpr int V = D / 32;
  __shared__ float q[G][D];
  __shared__ float part_m[kWarps][G], part_l[kWarps][G];
  __shared__ float part_acc[kWarps][G][D];
  const int item = blockIdx.y, split = blockIdx.x;
  const int zone_count = p.zone_counts[item];
  if (zone_count <= 0) return;  // whole block: the attention's output stands
  const int heads = p.records.num_kv_heads;
  const int seq = item / heads, h = item % heads;
  const int ps = p.records.page_size;
  const bf16* qh = p.q + static_cast<int64_t>(item) * G * D;
  for (int k = threadIdx.x; k < G * D; k += kThreads) q[k / D][k % D] = __bfloat162float(qh[k]);
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t* dir = p.dir + p.dir_offsets[seq];
  const int first = p.first_candidate[seq], end = p.end_candidate[seq];
  const int32_t* selected = p.selected + p.selected_offsets[item];
  const int k = p.selected_counts[item];
  const int table_words = rank_words(p.max_candidates);
  const SelectedRanks ranks{rank_table, reinterpret_cast<int32_t*>(rank_table + table_words), first};
  const bool by_table = end - first <= ranked_pages(p.max_candidates);
  if (by_table) build_selected_ranks(ranks, (end - first + 31) / 32, selected, k);
  const int32_t* list = p.decode_pages + p.decode_offsets[item];
  const int32_t* fills = p.fill_pages ? p.fill_pages + p.decode_offsets[item] : nullptr;
  const int64_t page_elems = int64_t{2} * ps * D;
  float m[G], l[G], acc[G][V];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) acc[g][e] = 0.0f;
  }
  const int32_t* zone = p.zone + p.zone_offsets[item];
  for (int z = split * kWarps + warp; z < zone_count; z += p.splits * kWarps) {
    const int c = zone[z];
    const Record rec = slot_record(p.records, dir, h, c);
    const int sc = c % p.records.slots;
    const int start = rec.start(sc), size = rec.size(sc);
    float vsum[V], cent[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      vsum[e] = rec.value_sum(sc)[lane + 32 * e];
      cent[e] = __bfloat162float(rec.centroid(sc)[lane + 32 * e]);
    }
    int missing = size;
    for (int i0 = start; i0 < start + size; i0 += 32) {
      const int i = i0 + lane;
      int t = 0, at = -1;  // the member and its page's position in the attention list
      if (i < start + size) {
        t = token_record(p.records, dir, h, i).member(i % ps);
        const int page = t / ps;
        if (page < first) {
          at = page;
        } else if (page >= end) {
          at = first + k + (page - end);
        } else if (const int j = by_table ? ranks.rank(page) : find_sorted(selected, k, page); j >= 0) {
          at = first + j;
        }
      }
      // Each lane finds its attended member's value row at once; the warp reads them in fours.
      unsigned long long row = 0;
      if (at >= 0) {
        const int32_t page = list[at] >= 0 || !fills ? list[at] : fills[at];
        row = reinterpret_cast<unsigned long long>(p.records.kv_pool + page * page_elems + int64_t{ps} * D +
                                                   (t % ps) * D);
      }
      const unsigned attended = __ballot_sync(kFull, at >= 0);
      missing -= __popc(attended);
      subtract_lane_rows(vsum, attended, row);
    }
    if (missing == 0) continue;
    const float log_size = logf(static_cast<float>(missing));
    const float inv_size = 1.0f / static_cast<float>(missing);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) dot = fmaf(q[g][lane + 32 * e], cent[e], dot);
      const float a = warp_sum(dot) * p.scale + log_size;
      const float m_new = fmaxf(m[g], a);
      const float keep = __expf(m[g] - m_new), w = __expf(a - m_new);
      l[g] = l[g] * keep + w;
#pragma unroll
      for (int e = 0; e < V; ++e) acc[g][e] = acc[g][e] * keep + w * vsum[e] * inv_size;
      m[g] = m_new;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) part_m[warp][g] = m[g], part_l[warp][g] = l[g];
#pragma unroll
    for (int e = 0; e < V; ++e) part_acc[warp][g][lane + 32 * e] = acc[g][e];
  }
  __syncthreads();
  // The block's partial per query head: (max, sum) then the D sums, rescaled to that max.
  float* out = p.partials + (static_cast<int64_t>(item) * p.splits + split) * G * (D + 2);
  for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float mz = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mz = fmaxf(mz, part_m[w][g]);
    float lz = 0.0f, az = 0.0f;
    if (mz != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        if (part_m[w][g] == -INFINITY) continue;
        const float s = __expf(part_m[w][g] - mz);
        lz += s * part_l[w][g];
        az += s * part_acc[w][g][d];
      }
    }
    out[g * (D + 2) + 2 + d] = az;
    if (d == 0) out[g * (D + 2)] = mz, out[g * (D + 2) + 1] = lz;
  }
}

// Block per item: the splits' partials merged with the attention's output and log-sum-exp.
template <int D, int G>
__global__ void __launch_bounds__(kThreads) retro_estimate_merge_kernel(RetroInferEstimateParams p) {
  enter_dependent_grid();
  const int item = blockIdx.x;
  if (p.zone_counts[item] <= 0) return;  // whole block
  const float* parts = p.partials + static_cast<int64_t>(item) * p.splits * G * (D + 2);
  for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float mz = -INFINITY;
    for (int s = 0; s < p.splits; ++s) mz = fmaxf(mz, parts[(s * G + g) * (D + 2)]);
    float lz = 0.0f, az = 0.0f;
    if (mz != -INFINITY) {
      for (int s = 0; s < p.splits; ++s) {
        const float* part = parts + (s * G + g) * (D + 2);
        if (part[0] == -INFINITY) continue;
        const float w = __expf(part[0] - mz);
        lz += w * part[1];
        az += w * part[2 + d];
      }
    }
    const int64_t row = static_cast<int64_t>(item) * G + g;
    const float lse = p.lse[row];
    const float top = fmaxf(lse, mz);
    if (top == -INFINITY) continue;
    const float wa = lse == -INFINITY ? 0.0f : __expf(lse - top);
    const float we = mz == -INFINITY ? 0.0f : __expf(mz - top);
    bf16* o = p.out + row * D + d;
    *o = __float2bfloat16((wa * __bfloat162float(*o) + we * az) / (wa + we * lz));
  }
}

template <int D, int G>
void launch_estimate_passes(const RetroInferEstimateParams& p, unsigned items, cudaStream_t stream) {
  const size_t table_bytes = size_t{2} * sizeof(uint32_t) * rank_words(p.max_candidates);
  launch(retro_estimate_partial_kernel<D, G>, dim3(static_cast<unsigned>(p.splits), items), kThreads, table_bytes,
         stream, p);
  launch(retro_estimate_merge_kernel<D, G>, items, kThreads, 0, stream, p);
}

template <int D>
cudaError_t launch_estimate(const RetroInferEstimateParams& p, unsigned items, cudaStream_t stream) {
  with_group(p.group, [&](auto g) { launch_estimate_passes<D, decltype(g)::value>(p, items, stream); });
  return cudaGetLastError();
}

template <int D, int G>
void launch_score_passes(const RetroInferSelectParams& p, dim3 grid, cudaStream_t stream) {
  launch(retro_logits_kernel<D, G>, grid, kThreads, 0, stream, p);
  launch(retro_totals_kernel<G>, grid, kThreads, 0, stream, p);
}

template <int D>
void launch_score(const RetroInferSelectParams& p, dim3 grid, cudaStream_t stream) {
  with_group(p.group, [&](auto g) { launch_score_passes<D, decltype(g)::value>(p, grid, stream); });
}

bool valid_records(const RetroInferRecords& r) {
  return r.kv_pool != nullptr && (reinterpret_cast<uintptr_t>(r.kv_pool) & 15) == 0 && r.num_kv_heads >= 1 && (r.head_dim == 64 || r.head_dim == 128) &&
         r.page_size >= 8 && r.page_size <= 64 && r.page_size % 8 == 0 && r.slots >= 1 &&
         r.records_per_page >= 1 && r.records_per_page <= retroinfer_records_per_page(r.page_size, r.head_dim, r.slots);
}

}  // namespace

size_t retroinfer_cluster_scratch_bytes(int64_t total_pages, int64_t num_jobs, int page_size, int head_dim,
                                        int slots) {
  size_t bytes = 0;
  static_cast<void>(cluster_scratch(nullptr, total_pages, num_jobs, page_size, head_dim, slots, &bytes));
  return bytes;
}

cudaError_t retroinfer_cluster(const RetroInferClusterParams& p, cudaStream_t stream) {
  if (p.num_jobs < 0 || p.num_jobs > 65535 || !valid_records(p.records) || p.cluster_tokens < 1 ||
      p.records.slots < retroinfer_slots_per_page(p.records.page_size, p.cluster_tokens) || p.iterations < 1 ||
      p.total_pages < 0)
    return cudaErrorInvalidValue;
  if (p.num_jobs == 0) return cudaSuccess;
  if (!p.page_ids || !p.page_offsets || !p.first_page || !p.head || !p.dir || !p.dir_offsets || !p.scratch)
    return cudaErrorInvalidValue;
  const ClusterScratch s = cluster_scratch(p.scratch, p.total_pages, p.num_jobs, p.records.page_size,
                                           p.records.head_dim, p.records.slots);
  const auto jobs = static_cast<unsigned>(p.num_jobs);
  const bool wide = p.records.head_dim == 128;
  const auto assign = wide ? retro_assign_kernel<128> : retro_assign_kernel<64>;
  const auto update = wide ? retro_update_kernel<128> : retro_update_kernel<64>;
  const auto shared = static_cast<int>(wide ? assign_shared_bytes<128>() : assign_shared_bytes<64>());
  const cudaError_t e = cudaFuncSetAttribute(assign, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (e != cudaSuccess) return e;
  const dim3 chunks(kLoadChunks, jobs);
  launch(retro_load_kernel, chunks, kThreads, 0, stream, p, s);
  launch(retro_centre_kernel, chunks, kThreads, 0, stream, p, s);
  const dim3 assign_grid(kRetroInferMaxSegmentTokens / kAssignRows, jobs);
  const dim3 cluster_grid((kRetroInferMaxSegmentTokens / p.cluster_tokens + kWarps - 1) / kWarps, jobs);
  for (int it = 0; it < p.iterations; ++it) {
    launch(assign, assign_grid, kThreads, shared, stream, p, s);
    launch(retro_sort_kernel, jobs, kThreads, 0, stream, p, s);
    if (it < p.iterations - 1) launch(update, cluster_grid, kThreads, 0, stream, p, s);
  }
  // Slots per job: pages * slots <= kRetroInferMaxSegmentTokens / page_size * slots.
  const dim3 slot_grid((kRetroInferMaxSegmentTokens / p.records.page_size * p.records.slots + kWarps - 1) / kWarps, jobs);
  launch(wide ? retro_records_kernel<128> : retro_records_kernel<64>, slot_grid, kThreads, 0, stream, p, s);
  launch(retro_members_kernel, chunks, kThreads, 0, stream, p, s);
  return cudaGetLastError();
}

cudaError_t retroinfer_score(const RetroInferSelectParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.records.num_kv_heads;
  if (p.num_seqs < 0 || items > 65535 || !valid_records(p.records) || p.group < 1 || p.group > 8 ||
      p.max_clusters < 0 || p.max_candidates < 0)
    return cudaErrorInvalidValue;
  if (items == 0) return cudaSuccess;
  if (!p.q || !p.dir || !p.dir_offsets || !p.clustered_pages || !p.first_candidate || !p.end_candidate ||
      !p.logits || !p.totals || !p.page_scores || !p.zone_flags || !p.zone_tallies)
    return cudaErrorInvalidValue;
  if (p.max_clusters > 0) {
    const dim3 grid(static_cast<unsigned>((p.max_clusters + kThreads - 1) / kThreads), static_cast<unsigned>(items));
    if (p.records.head_dim == 64)
      launch_score<64>(p, grid, stream);
    else
      launch_score<128>(p, grid, stream);
  }
  if (p.max_candidates > 0) {
    const dim3 grid(static_cast<unsigned>((p.max_candidates + kThreads - 1) / kThreads), static_cast<unsigned>(items));
    launch(retro_page_scores_kernel, grid, kThreads, 0, stream, p);
  }
  return cudaGetLastError();
}

cudaError_t retroinfer_zone(const RetroInferSelectParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.records.num_kv_heads;
  if (p.num_seqs < 0 || items > 65535 || !valid_records(p.records) || p.max_clusters < 0 || p.max_candidates < 0 ||
      !(p.estimate_fraction >= 0.0 && p.estimate_fraction <= 1.0))
    return cudaErrorInvalidValue;
  if (items == 0) return cudaSuccess;
  if (!p.dir || !p.dir_offsets || !p.clustered_pages || !p.first_candidate || !p.end_candidate || !p.totals ||
      !p.selected || !p.selected_offsets || !p.selected_counts || !p.zone_flags || !p.zone_tallies || !p.zone_scores ||
      !p.zone_counts)
    return cudaErrorInvalidValue;
  const auto n = static_cast<unsigned>(items);
  if (p.max_candidates > 0) {
    launch(retro_zone_flags_kernel, dim3((p.max_candidates + kThreads - 1) / kThreads, n), kThreads, 0, stream, p);
  }
  if (p.max_clusters > 0) {
    launch(retro_zone_scores_kernel, dim3((p.max_clusters + kThreads - 1) / kThreads, n), kThreads, 0, stream, p);
  }
  launch(retro_zone_count_kernel, (n + kThreads - 1) / kThreads, kThreads, 0, stream, p, static_cast<int>(items));
  return cudaGetLastError();
}

cudaError_t retroinfer_estimate(const RetroInferEstimateParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.records.num_kv_heads;
  if (p.num_seqs < 0 || items > 65535 || !valid_records(p.records) || p.group < 1 || p.group > 8 || p.splits < 1 ||
      p.splits > 65535 || p.max_candidates < 0 || p.max_candidates > (1 << 20))
    return cudaErrorInvalidValue;
  if (items == 0) return cudaSuccess;
  if (!p.q || !p.dir || !p.dir_offsets || !p.first_candidate || !p.end_candidate || !p.selected ||
      !p.selected_offsets || !p.selected_counts || !p.zone || !p.zone_offsets || !p.zone_counts || !p.decode_pages ||
      !p.decode_offsets || !p.lse || !p.out || !p.partials)
    return cudaErrorInvalidValue;
  const auto n = static_cast<unsigned>(items);
  return p.records.head_dim == 64 ? launch_estimate<64>(p, n, stream) : launch_estimate<128>(p, n, stream);
}

}  // namespace spin::cuda
