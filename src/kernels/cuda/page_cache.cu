#include "kernels/cuda/page_cache.h"

#include <cooperative_groups.h>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>

#include "kernels/cuda/host_pages.cuh"
#include "kernels/cuda/launch.cuh"

namespace spin::cuda {

namespace {

constexpr int kThreads = 512;
// Slots, needed pages and histogram buckets are held blocked: thread t owns indices
// [t * kPerThread, (t + 1) * kPerThread), so block scans rank them in index order. A request of
// at most kThreads slots (and buckets) runs with one index per thread: its scans and sort are an
// eighth of the full capacity's, which at small batches is most of a layer's Retrieve.
constexpr int kFullPerThread = kMaxCacheSlots / kThreads;
constexpr int kUnroll = 8;  // 16-byte host loads in flight per thread before the first store
constexpr int32_t kNoSlot = INT32_MAX;
static_assert(kFullPerThread * kThreads == kMaxCacheSlots);
static_assert(kMaxLruBuckets <= kMaxCacheSlots);
// Two ranks share one scan (16 bits each), so every count must stay below 2^16.
static_assert(kMaxCacheSlots < (1 << 16));
// The last bucket's victims, when at most kFewVictims and their logical pages below
// 2^(32 - kSlotBits), are found by that many block minimums of (logical page, slot) packed in 32
// bits instead of a radix sort of every slot: the usual case at high hit rates (one or two misses
// per item), where the sort's passes were a fixed share of the plan's time.
constexpr int kFewVictims = 4;
constexpr int kSlotBits = 12;
static_assert(kMaxCacheSlots <= (1 << kSlotBits));

using Scan = cub::BlockScan<uint32_t, kThreads>;
template <int kPerThread>
using SortByLogical = cub::BlockRadixSort<uint32_t, kThreads, kPerThread, int32_t>;

// Phases reuse memory: the residency/victim tables live until the table update, the copy list
// only after it; the needed pages, the histogram and the sort never overlap in time.
template <int kPerThread>
struct Shared {
  static constexpr int kCapacity = kPerThread * kThreads;
  union {
    struct {
      int32_t hit_slot[kCapacity];   // per needed page: the slot holding it, or kNoSlot
      int16_t free_slot[kCapacity];  // the k-th free slot, for the k-th miss
      union {
        int32_t needed[kCapacity];
        uint32_t histogram[kCapacity];
        typename SortByLogical<kPerThread>::TempStorage sort;
      } scratch;
    } select;
    struct {
      int32_t src[kCapacity];  // host page of the k-th miss
      int32_t dst[kCapacity];  // device page it goes to
    } copy;
  };
  typename Scan::TempStorage scan;
  uint32_t oldest;
  uint32_t max_logical;
  uint32_t boundary;
  uint32_t taken;
  uint32_t warp_min[kThreads / 32];  // the few victims' block minimum, per warp
  uint32_t picked;
};

// First index in sorted[0, n) whose value is >= key.
__device__ __forceinline__ int lower_bound(const int32_t* sorted, int n, int32_t key) {
  int lo = 0;
  while (n > 0) {
    const int half = n / 2;
    if (sorted[lo + half] < key) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// An item's place in the params, as every block of it reads them alike.
struct Item {
  int seq, head;
  int32_t cache_begin;
  int slots, count;
  const int32_t* needed;
  int32_t* out;
  int32_t* fill;  // null unless the decode attention fetches the misses
  __device__ Item(const PageCacheParams& p, int item)
      : seq(item / p.num_kv_heads),
        head(item - seq * p.num_kv_heads),
        cache_begin(p.cache_offsets[seq]),
        slots(p.cache_offsets[seq + 1] - cache_begin),
        count(p.needed_counts[item]),
        needed(p.needed + p.needed_offsets[item]),
        out(p.out_pages + p.out_offsets[item]),
        fill(p.fill_pages ? p.fill_pages + p.out_offsets[item] : nullptr) {}
  // Whether the item fits the bounds the block's shared memory allows.
  __device__ bool fits() const { return count >= 0 && count <= slots && slots <= kMaxCacheSlots; }
};

// What an item's bookkeeping leaves for the fetch: copy.src / copy.dst[0, misses) of its shared
// memory, the values-only misses first.
struct MissList {
  int misses;
  int value_misses;
};

// One item (seq, KV head) in one block. Every branch that encloses a __syncthreads or a block
// collective depends only on values all threads read alike (the item's counts) or on block
// totals, so control flow around barriers is uniform.
template <int kPerThread>
__device__ MissList retrieve_item(const PageCacheParams& p, Shared<kPerThread>& sh, int item, const Item& it) {
  const int seq = it.seq, head = it.head, slots = it.slots, count = it.count;
  const int32_t* needed = it.needed;
  int32_t* out = it.out;
  using Sort = SortByLogical<kPerThread>;
  const int tid = threadIdx.x;
  const int heads = p.num_kv_heads;
  const uint32_t now = p.now[seq];
  const int32_t* groups = p.cache_groups + it.cache_begin;
  auto state_index = [&](int32_t group) {
    return (static_cast<int64_t>(group) * p.num_layers + p.layer) * heads + head;
  };

  for (int k = tid; k < count; k += kThreads) {
    sh.select.scratch.needed[k] = needed[k];
    sh.select.hit_slot[k] = kNoSlot;
  }
  if (tid == 0) {
    sh.oldest = now;
    sh.max_logical = 0;
  }
  int32_t page[kPerThread];
  uint32_t stamp[kPerThread];
  int32_t group[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int j = tid * kPerThread + i;
    page[i] = -1;
    stamp[i] = 0;
    group[i] = -1;
    if (j < slots) {
      group[i] = groups[j];
      const int64_t s = state_index(group[i]);
      page[i] = p.slot_page[s];
      stamp[i] = p.slot_stamp[s];
    }
  }
  __syncthreads();

  // Hits. A needed page held by several slots (a corrupt table) counts once, in the lowest slot.
  int found[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int j = tid * kPerThread + i;
    found[i] = -1;
    if (j < slots && page[i] >= 0) {
      const int k = lower_bound(sh.select.scratch.needed, count, page[i]);
      if (k < count && sh.select.scratch.needed[k] == page[i]) {
        found[i] = k;
        atomicMin(&sh.select.hit_slot[k], j);
      }
    }
  }
  __syncthreads();

  uint32_t empty_mask = 0, candidate_mask = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int j = tid * kPerThread + i;
    if (j >= slots) continue;
    if (page[i] < 0) {
      empty_mask |= 1u << i;
    } else if (found[i] >= 0 && sh.select.hit_slot[found[i]] == j) {
      p.slot_stamp[state_index(group[i])] = now;
    } else {
      candidate_mask |= 1u << i;
    }
  }

  // One scan ranks misses in needed order (high half) and empty slots in slot order (low half).
  uint32_t ranks[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int k = tid * kPerThread + i;
    const bool miss = k < count && sh.select.hit_slot[k] == kNoSlot;
    ranks[i] = (static_cast<uint32_t>(miss) << 16) | ((empty_mask >> i) & 1u);
  }
  uint32_t totals = 0;
  Scan(sh.scan).ExclusiveSum(ranks, ranks, totals);
  const int misses = static_cast<int>(totals >> 16);
  const int empties = static_cast<int>(totals & 0xffffu);
  const int hits = count - misses;
  const int victims = misses > empties ? misses - empties : 0;

#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int rank = static_cast<int>(ranks[i] & 0xffffu);
    if (((empty_mask >> i) & 1u) && rank < misses)
      sh.select.free_slot[rank] = static_cast<int16_t>(tid * kPerThread + i);
  }

  if (victims > 0) {
    // BucketedLruPicker::pick over the candidates (occupied, not needed) in slot order.
    const uint32_t buckets = static_cast<uint32_t>(p.buckets);
    uint32_t local_oldest = now;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      if ((candidate_mask >> i) & 1u) local_oldest = min(local_oldest, stamp[i]);
    if (local_oldest < now) atomicMin(&sh.oldest, local_oldest);
    for (int b = tid; b < static_cast<int>(buckets); b += kThreads)
      sh.select.scratch.histogram[b] = 0;
    __syncthreads();

    const uint32_t oldest = sh.oldest;
    const uint32_t span = now - oldest;
    const uint32_t width = max(1u, (span + buckets - 1) / buckets);  // uint32 as in pick
    uint32_t bucket[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      // Stamps < now keep the bucket below `buckets`; the clamp only guards a broken table.
      bucket[i] = min((stamp[i] - oldest) / width, buckets - 1);
      if ((candidate_mask >> i) & 1u) atomicAdd(&sh.select.scratch.histogram[bucket[i]], 1u);
    }
    __syncthreads();

    // The boundary bucket: the first whose inclusive prefix reaches `victims`; all older buckets
    // go whole.
    uint32_t counts[kPerThread], prefix[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int b = tid * kPerThread + i;
      counts[i] = b < static_cast<int>(buckets) ? sh.select.scratch.histogram[b] : 0u;
    }
    Scan(sh.scan).InclusiveSum(counts, prefix);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const uint32_t before = prefix[i] - counts[i];
      if (before < static_cast<uint32_t>(victims) && prefix[i] >= static_cast<uint32_t>(victims)) {
        sh.boundary = tid * kPerThread + i;
        sh.taken = before;
      }
    }
    __syncthreads();

    const uint32_t boundary = sh.boundary;
    const int taken = static_cast<int>(sh.taken);
    uint32_t whole[kPerThread];
    uint32_t local_max = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool candidate = (candidate_mask >> i) & 1u;
      whole[i] = candidate && bucket[i] < boundary;
      if (candidate && bucket[i] == boundary)
        local_max = max(local_max, static_cast<uint32_t>(page[i]));
    }
    if (local_max > 0) atomicMax(&sh.max_logical, local_max);
    Scan(sh.scan).ExclusiveSum(whole, whole);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool candidate = (candidate_mask >> i) & 1u;
      if (candidate && bucket[i] < boundary)
        sh.select.free_slot[empties + static_cast<int>(whole[i])] =
            static_cast<int16_t>(tid * kPerThread + i);
    }
    __syncthreads();

    // The boundary bucket's candidates by ascending logical page (a slot's page is unique; a
    // corrupt table's repeats go by slot, as the sort keeps them).
    const int rest = victims - taken;
    if (rest <= kFewVictims && sh.max_logical < (1u << (32 - kSlotBits))) {
      uint32_t keys[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const bool in_boundary = ((candidate_mask >> i) & 1u) && bucket[i] == boundary;
        keys[i] = in_boundary ? static_cast<uint32_t>(page[i]) << kSlotBits | static_cast<uint32_t>(tid * kPerThread + i)
                              : UINT32_MAX;
      }
      const int lane = tid % 32, warp = tid / 32;
      for (int q = 0; q < rest; ++q) {
        uint32_t m = UINT32_MAX;
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) m = min(m, keys[i]);
        m = __reduce_min_sync(0xffffffffu, m);
        if (lane == 0) sh.warp_min[warp] = m;
        __syncthreads();
        if (warp == 0) {
          m = __reduce_min_sync(0xffffffffu, lane < kThreads / 32 ? sh.warp_min[lane] : UINT32_MAX);
          if (lane == 0) {
            sh.picked = m;
            sh.select.free_slot[empties + taken + q] = static_cast<int16_t>(m & ((1u << kSlotBits) - 1));
          }
        }
        __syncthreads();
        const uint32_t picked = sh.picked;
#pragma unroll
        for (int i = 0; i < kPerThread; ++i)
          if (keys[i] == picked) keys[i] = UINT32_MAX;
      }
    } else {
      // The rest sort after the boundary's pages because their key, all ones in the sorted bits,
      // exceeds every boundary page.
      const uint32_t end_bit = 32 - __clz(static_cast<int>(sh.max_logical + 1));
      uint32_t keys[kPerThread];
      int32_t values[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const bool in_boundary = ((candidate_mask >> i) & 1u) && bucket[i] == boundary;
        keys[i] = in_boundary ? static_cast<uint32_t>(page[i]) : UINT32_MAX;
        values[i] = tid * kPerThread + i;
      }
      Sort(sh.select.scratch.sort).Sort(keys, values, 0, static_cast<int>(end_bit));
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int q = tid * kPerThread + i;
        if (q < rest) sh.select.free_slot[empties + taken + q] = static_cast<int16_t>(values[i]);
      }
    }
  }
  __syncthreads();

  // Misses whose keys the device rebuilds: ranked apart, their copies (values only) come first.
  // rebuild_end is the block's own (one seq), so the scan runs for every thread or none.
  const int32_t rebuild_end = p.rebuild_end ? p.rebuild_end[seq] : 0;
  uint32_t value_rank[kPerThread] = {};
  uint32_t value_total = 0;
  if (rebuild_end > 0) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int k = tid * kPerThread + i;
      value_rank[i] = k < count && sh.select.hit_slot[k] == kNoSlot && needed[k] < rebuild_end;
    }
    Scan(sh.scan).ExclusiveSum(value_rank, value_rank, value_total);
  }
  const int value_misses = static_cast<int>(value_total);

  // Table update and output: the k-th miss takes the k-th free slot.
  const int32_t* host_groups = p.host_groups + p.host_offsets[seq];
  int copy_rank[kPerThread];
  int32_t copy_src[kPerThread], copy_dst[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int k = tid * kPerThread + i;
    copy_rank[i] = -1;
    copy_src[i] = 0;
    copy_dst[i] = 0;
    if (k >= count) continue;
    const int32_t held = sh.select.hit_slot[k];
    const bool miss = held == kNoSlot;
    const int rank = static_cast<int>(ranks[i] >> 16);
    const int slot = miss ? sh.select.free_slot[rank] : held;
    const int32_t slot_group = groups[slot];
    const int32_t device_page = slot_group * heads + head;
    if (miss) {
      const int32_t logical = needed[k];
      const int64_t s = state_index(slot_group);
      p.slot_page[s] = logical;
      p.slot_stamp[s] = now;
      const bool values_only = logical < rebuild_end;
      copy_rank[i] = values_only ? static_cast<int>(value_rank[i])
                                 : value_misses + rank - static_cast<int>(value_rank[i]);
      copy_src[i] = host_groups[logical] * heads + head;
      copy_dst[i] = device_page;
      if (values_only) {
        p.rebuild_pages[p.needed_offsets[item] + value_rank[i]] = device_page;
        p.rebuild_logical[p.needed_offsets[item] + value_rank[i]] = logical;
      }
    }
    if (it.fill) {  // the attention reads the miss from the host tier and fills its slot
      out[k] = miss ? ~copy_src[i] : device_page;
      it.fill[k] = miss ? device_page : -1;
    } else {
      out[k] = device_page;
    }
  }
  if (tid == 0) {
    atomicAdd(&p.counters[seq * 3 + 0], static_cast<unsigned long long>(hits));
    atomicAdd(&p.counters[seq * 3 + 1], static_cast<unsigned long long>(misses));
    atomicAdd(&p.counters[seq * 3 + 2], static_cast<unsigned long long>(victims));
    if (p.rebuild_end) {
      p.rebuild_counts[item] = value_misses;
      atomicAdd(&p.value_only[seq], static_cast<unsigned long long>(value_misses));
    }
  }
  __syncthreads();  // the copy list overwrites the tables read above
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (copy_rank[i] >= 0) {
      sh.copy.src[copy_rank[i]] = copy_src[i];
      sh.copy.dst[copy_rank[i]] = copy_dst[i];
    }
  }
  __syncthreads();

  return MissList{misses, value_misses};
}

// Zero-copy gather of an item's misses in half pages (K, V): the values-only misses' V halves,
// then both halves of the others. Vector `first` is this thread's, then every `stride`-th, with
// kUnroll loads in flight per thread.
__device__ void fetch_misses(const PageCacheParams& p, const MissList& list, const int32_t* src_pages,
                             const int32_t* dst_pages, int64_t first, int64_t stride) {
  const int64_t vecs_per_half = p.page_size * p.head_dim / 8;
  const int64_t halves = list.value_misses + 2 * static_cast<int64_t>(list.misses - list.value_misses);
  const auto half_of = [&](const int32_t* pages, int64_t u) -> int64_t {
    if (u < list.value_misses) return 2 * static_cast<int64_t>(pages[u]) + 1;
    const int64_t v = u - list.value_misses;
    return 2 * static_cast<int64_t>(pages[list.value_misses + v / 2]) + v % 2;
  };
  copy_host_pages<kUnroll>(
      reinterpret_cast<const uint4*>(p.host_pool), reinterpret_cast<uint4*>(p.device_pool), first,
      halves * vecs_per_half, stride, vecs_per_half, [&](int64_t u) { return half_of(src_pages, u); },
      [&](int64_t u) { return half_of(dst_pages, u); });
}

// An item that does not fit: -1 for its pages and the error flag; nothing fetched or rebuilt.
__device__ void refuse_item(const PageCacheParams& p, const Item& it, int item) {
  for (int k = threadIdx.x; k < it.count; k += kThreads) {
    it.out[k] = -1;
    if (it.fill) it.fill[k] = -1;
  }
  if (threadIdx.x == 0) {
    *p.error = 1;
    if (p.rebuild_end) p.rebuild_counts[item] = 0;
  }
}

// A fitting item's bookkeeping runs in the smaller shared layout when its slots and buckets
// allow (every block of the item agrees on which); the copy list is then that layout's.
struct ItemPlan {
  bool small;
  MissList list;
  const int32_t* src;  // the copy list, in the block's shared memory
  const int32_t* dst;
};
__device__ ItemPlan item_layout(const PageCacheParams& p, Shared<kFullPerThread>& full, const Item& it) {
  static_assert(sizeof(Shared<1>) <= sizeof(Shared<kFullPerThread>) &&
                alignof(Shared<1>) <= alignof(Shared<kFullPerThread>));
  auto& small = reinterpret_cast<Shared<1>&>(full);
  if (it.slots <= kThreads && p.buckets <= kThreads) return {true, {0, 0}, small.copy.src, small.copy.dst};
  return {false, {0, 0}, full.copy.src, full.copy.dst};
}

// Rank 0's part: the item's tables, pages and copy list (in `layout`'s shared memory).
__device__ MissList plan_item(const PageCacheParams& p, Shared<kFullPerThread>& full, const Item& it, int item,
                              const ItemPlan& layout) {
  return layout.small ? retrieve_item<1>(p, reinterpret_cast<Shared<1>&>(full), item, it)
                      : retrieve_item<kFullPerThread>(p, full, item, it);
}

// One cluster of `ranks` blocks per item (1 without clusters). Rank 0 keeps the item's tables
// and lists its misses; then every rank fetches a share of them, its own copy of the list in its
// shared memory. One block per item would leave most SMs idle at small batches, and one SM's
// host reads run well below the link's rate. Two blocks per SM (64 registers) keep more host reads
// in flight than one.
__global__ void __launch_bounds__(kThreads, 2) retrieve_cached_pages_kernel(const PageCacheParams p, int ranks) {
  enter_dependent_grid();
  __shared__ Shared<kFullPerThread> full;
  const int tid = threadIdx.x;
  const int item = blockIdx.x / ranks;
  const int rank = blockIdx.x - item * ranks;
  const Item it(p, item);
  // The same for every rank of the item, so a cluster returns whole, before any cluster barrier.
  if (!it.fits()) {
    if (rank == 0) refuse_item(p, it, item);
    return;
  }
  ItemPlan plan = item_layout(p, full, it);
  if (rank == 0) plan.list = plan_item(p, full, it, item, plan);
#if __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  if (ranks > 1) {
    __shared__ MissList published;
    if (rank == 0 && tid == 0) published = plan.list;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // rank 0's list is complete
    if (rank > 0) {
      plan.list = *cluster.map_shared_rank(&published, 0);
      const int32_t* remote_src = cluster.map_shared_rank(plan.src, 0);
      const int32_t* remote_dst = cluster.map_shared_rank(plan.dst, 0);
      for (int k = tid; k < plan.list.misses; k += kThreads) {
        full.copy.src[k] = remote_src[k];
        full.copy.dst[k] = remote_dst[k];
      }
      plan.src = full.copy.src;
      plan.dst = full.copy.dst;
      __syncthreads();
    }
    cluster.barrier_arrive();  // rank 0's shared memory is no longer read
  }
#endif
  fetch_misses(p, plan.list, plan.src, plan.dst, static_cast<int64_t>(rank) * kThreads + tid,
               static_cast<int64_t>(ranks) * kThreads);
#if __CUDA_ARCH__ >= 900
  if (ranks > 1) cg::this_cluster().barrier_wait();  // no rank exits while another reads its memory
#endif
}

// Rank 0's part alone, one block per item: the copy list goes to global memory (or, with
// fill_pages, the misses' host pages to out_pages for the attention to fetch).
__global__ void __launch_bounds__(kThreads, 2) plan_cached_pages_kernel(const PageCacheParams p) {
  enter_dependent_grid();
  __shared__ Shared<kFullPerThread> full;
  const int item = blockIdx.x;
  const Item it(p, item);
  if (!it.fits()) {
    refuse_item(p, it, item);
    if (threadIdx.x == 0 && !it.fill) p.copy_counts[2 * item] = p.copy_counts[2 * item + 1] = 0;  // no fetch
    return;
  }
  ItemPlan plan = item_layout(p, full, it);
  plan.list = plan_item(p, full, it, item, plan);
  if (it.fill) return;
  int32_t* counts = p.copy_counts + 2 * static_cast<int64_t>(item);
  const int64_t at = p.needed_offsets[item];
  for (int k = threadIdx.x; k < plan.list.misses; k += kThreads) {
    p.copy_src[at + k] = plan.src[k];
    p.copy_dst[at + k] = plan.dst[k];
  }
  if (threadIdx.x == 0) {
    counts[0] = plan.list.misses;
    counts[1] = plan.list.value_misses;
  }
}

// The planned copies, `ranks` blocks per item, each a share.
__global__ void __launch_bounds__(kThreads, 2) fetch_planned_pages_kernel(const PageCacheParams p, int ranks) {
  enter_dependent_grid();
  const int item = blockIdx.x / ranks;
  const int rank = blockIdx.x - item * ranks;
  const int32_t* counts = p.copy_counts + 2 * static_cast<int64_t>(item);
  const MissList list{counts[0], counts[1]};
  const int64_t at = p.needed_offsets[item];
  fetch_misses(p, list, p.copy_src + at, p.copy_dst + at, static_cast<int64_t>(rank) * kThreads + threadIdx.x,
               static_cast<int64_t>(ranks) * kThreads);
}

// Retrieve's launches: the one-launch kernel (its blocks of an item share rank 0's shared memory,
// in a cluster), or the plan and the fetch of the two-launch form.
enum class RetrieveLaunch { whole, plan, fetch };

// Blocks per item: enough for about kFetchBlocks blocks in all (the link's rate needs about 8 SMs,
// and items' misses differ), at most 8 (a portable cluster). The one-launch kernel needs sm_90's
// clusters for more than one.
constexpr int64_t kFetchBlocks = 32;
int blocks_per_item(const PageCacheParams& p, int64_t items, RetrieveLaunch launch) {
  if (p.blocks_per_item > 0) return p.blocks_per_item;
  if (launch == RetrieveLaunch::whole && !sm90_or_newer()) return 1;
  int ranks = 1;
  while (ranks < 8 && items * ranks * 2 <= kFetchBlocks) ranks *= 2;
  return ranks;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The checks of a Retrieve launch; `items` gets its item count.
cudaError_t check_params(const PageCacheParams& p, RetrieveLaunch launch, int64_t& items) {
  // Page size and head_dim up to 1024 keep the copies' vector counts small; half pages are whole
  // 16-byte vectors.
  if (p.num_seqs < 0 || p.num_kv_heads < 1 || p.num_layers < 1 || p.layer < 0 ||
      p.layer >= p.num_layers || p.head_dim < 1 || p.head_dim > 1024 || p.page_size < 1 ||
      p.page_size > 1024 || (p.page_size * p.head_dim) % 8 != 0 || p.buckets < 1 ||
      p.buckets > kMaxLruBuckets || p.blocks_per_item < 0 || p.blocks_per_item > 8 ||
      (p.blocks_per_item & (p.blocks_per_item - 1)) != 0 ||
      (launch == RetrieveLaunch::whole && p.blocks_per_item > 1 && !sm90_or_newer()))  // clusters
    return cudaErrorInvalidValue;
  items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  if (items > INT_MAX) return cudaErrorInvalidValue;
  if (items == 0) return cudaSuccess;
  if (!p.needed || !p.needed_offsets || !p.needed_counts || !p.cache_groups || !p.cache_offsets ||
      !p.host_groups || !p.host_offsets || !p.now || !p.slot_page || !p.slot_stamp ||
      !p.host_pool || !p.device_pool || !p.out_pages || !p.out_offsets || !p.counters || !p.error ||
      !aligned16(p.host_pool) || !aligned16(p.device_pool) ||
      (p.rebuild_end && (!p.rebuild_pages || !p.rebuild_logical || !p.rebuild_counts || !p.value_only)) ||
      (p.fill_pages && (launch != RetrieveLaunch::plan || p.rebuild_end)) ||
      (launch != RetrieveLaunch::whole && !p.fill_pages && (!p.copy_src || !p.copy_dst || !p.copy_counts)))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t retrieve_cached_pages(const PageCacheParams& p, cudaStream_t stream) {
  int64_t items = 0;
  if (const cudaError_t e = check_params(p, RetrieveLaunch::whole, items); e != cudaSuccess || items == 0) return e;
  const int ranks = blocks_per_item(p, items, RetrieveLaunch::whole);
  if (items * ranks > INT_MAX) return cudaErrorInvalidValue;
  return launch_in_clusters(retrieve_cached_pages_kernel, static_cast<unsigned>(items * ranks), kThreads, 0,
                            static_cast<unsigned>(ranks), stream, p, ranks);
}

cudaError_t plan_cached_pages(const PageCacheParams& p, cudaStream_t stream) {
  int64_t items = 0;
  if (const cudaError_t e = check_params(p, RetrieveLaunch::plan, items); e != cudaSuccess || items == 0) return e;
  return launch(plan_cached_pages_kernel, static_cast<unsigned>(items), kThreads, 0, stream, p);
}

cudaError_t fetch_planned_pages(const PageCacheParams& p, cudaStream_t stream) {
  int64_t items = 0;
  if (const cudaError_t e = check_params(p, RetrieveLaunch::fetch, items); e != cudaSuccess || items == 0) return e;
  // The blocks of an item share nothing but its list in global memory: no clusters needed.
  const int ranks = blocks_per_item(p, items, RetrieveLaunch::fetch);
  if (items * ranks > INT_MAX) return cudaErrorInvalidValue;
  return launch(fetch_planned_pages_kernel, static_cast<unsigned>(items * ranks), kThreads, 0, stream, p, ranks);
}

}  // namespace spin::cuda
