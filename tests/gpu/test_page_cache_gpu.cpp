// GPU Retrieve (kernels/cuda/page_cache.h) against a plain CPU model of the whole policy whose
// victims come from kv::BucketedLruPicker, the CPU KV manager's picker. Randomised multi-step
// traces over requests of different slot counts, several layers and KV heads, needed lists with
// locality and stamps spanning many more steps than buckets; after every call the slot tables,
// the output page lists, the counters, the error flag and the whole device pool (every byte) must
// equal the model's exactly, whether Retrieve ran as one launch or as two (plan, then fetch); with
// ShadowKV's rebuild_end, so must the values-only copies and their rebuild lists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "kernels/cuda/page_cache.h"
#include "kernels/cuda/per_device.h"
#include "kv/bucketed_lru.h"

namespace spin {
namespace {

using Rng = std::mt19937_64;
constexpr unsigned char kPoolPoison = 0xA5;  // device pool bytes no page was copied to
constexpr int32_t kOutPoison = -7;           // out_pages entries outside every item's range

struct TraceShape {
  int page_size;
  int head_dim;
  int num_kv_heads;
  int num_layers;
  int buckets;
  std::vector<int> slots;          // per request
  std::vector<int> logical_pages;  // per request; more than its slots
  int steps;
  int max_jump;         // a request's step counter advances by 1..max_jump between calls
  bool overfull_items;  // one item per call asks for more pages than its request has slots
  // Per request, ShadowKV's rebuild_end: misses of logical pages below it fetch only their values
  // and are listed for the key rebuild. Empty: no rebuild lists (every miss fetches whole pages).
  std::vector<int32_t> rebuild_end = {};
};

// What a trace exercised, so a pass cannot come from a trace that never reached a branch.
struct Coverage {
  int hits = 0;
  int empties_used = 0;
  int evictions = 0;
  int wide_buckets = 0;      // eviction with bucket width > 1
  int partial_boundary = 0;  // last bucket only partly taken
  int ordered_boundary = 0;  // two or more victims from the last bucket (their order matters)
  int sorted_boundary = 0;   // more than 4 (page_cache.cu's kFewVictims): ordered by a sort
  int whole_buckets = 0;     // victims from buckets before the last one
  int error_items = 0;
  int values_only = 0;       // misses that fetched their values only
  int whole_misses = 0;      // misses that fetched whole pages
};

// Pinned host memory mapped into the device address space, freed on scope exit.
class MappedHost {
 public:
  explicit MappedHost(size_t bytes) {
    status_ = cudaHostAlloc(&ptr_, bytes, cudaHostAllocMapped);
    if (status_ == cudaSuccess) status_ = cudaHostGetDevicePointer(&device_view_, ptr_, 0);
  }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;
  ~MappedHost() { cudaFreeHost(ptr_); }
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  const void* device_view() const { return device_view_; }
  cudaError_t status() const { return status_; }

 private:
  void* ptr_ = nullptr;
  void* device_view_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

// Reports the first few differences (with `where` describing an index) and their count.
template <typename T>
bool same_or_report(const char* what, const std::vector<T>& expect, const std::vector<T>& got,
                    const std::function<std::string(size_t)>& where) {
  if (expect.size() != got.size()) {
    ADD_FAILURE() << what << ": size " << got.size() << ", expected " << expect.size();
    return false;
  }
  size_t bad = 0;
  for (size_t i = 0; i < expect.size(); ++i) {
    if (expect[i] == got[i]) continue;
    if (bad < 8)
      ADD_FAILURE() << what << " [" << i << "] " << where(i) << ": got " << got[i] << ", expected "
                    << expect[i];
    ++bad;
  }
  if (bad > 0) ADD_FAILURE() << what << ": " << bad << " of " << expect.size() << " differ";
  return bad == 0;
}

// pick appends the whole buckets' victims in candidate order, then the last bucket's in an order
// its nth_element leaves open; page_cache.h fixes those by ascending logical page. Checks that
// layout of pick's answer and sorts the last bucket's part.
void order_last_bucket(const std::vector<kv::LruCandidate>& candidates, uint32_t now,
                       uint32_t buckets, std::vector<uint32_t>& victims, Coverage& cov) {
  uint32_t oldest = now;
  for (const kv::LruCandidate& c : candidates) oldest = std::min(oldest, c.stamp);
  const uint32_t width = std::max<uint32_t>(1, (now - oldest + buckets - 1) / buckets);
  std::map<uint32_t, kv::LruCandidate> by_slot;
  for (const kv::LruCandidate& c : candidates) by_slot[c.slot] = c;
  auto bucket = [&](uint32_t slot) { return (by_slot.at(slot).stamp - oldest) / width; };

  const uint32_t last = bucket(victims.back());
  const auto first_last =
      std::find_if(victims.begin(), victims.end(), [&](uint32_t v) { return bucket(v) == last; });
  for (auto it = victims.begin(); it != first_last; ++it) EXPECT_LT(bucket(*it), last);
  for (auto it = first_last; it != victims.end(); ++it) EXPECT_EQ(bucket(*it), last);
  std::sort(first_last, victims.end(),
            [&](uint32_t a, uint32_t b) { return by_slot.at(a).logical < by_slot.at(b).logical; });

  const auto in_last =
      std::count_if(candidates.begin(), candidates.end(),
                    [&](const kv::LruCandidate& c) { return bucket(c.slot) == last; });
  cov.wide_buckets += width > 1;
  cov.partial_boundary += in_last > victims.end() - first_last;
  cov.ordered_boundary += victims.end() - first_last >= 2;
  cov.sorted_boundary += victims.end() - first_last > 4;
  cov.whole_buckets += first_last != victims.begin();
}

class GpuPageCache : public SeededGpuTest<Rng> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }

  // A needed list with locality: most of the previous list again, new pages mostly near a
  // drifting centre, a few anywhere; sometimes empty, sometimes as many as the slots.
  std::vector<int32_t> draw_needed(const std::vector<int32_t>& previous, int slots, int pages,
                                   int& centre) {
    const int kind = uniform(0, 9);
    const size_t target = kind == 0 ? 0 : kind == 1 ? slots : uniform(1, slots);
    std::set<int32_t> chosen;
    for (int32_t page : previous)
      if (chosen.size() < target && chance(0.7)) chosen.insert(page);
    centre = std::clamp(centre + uniform(-slots / 4 - 1, slots / 4 + 1), 0, pages - 1);
    while (chosen.size() < target) {
      chosen.insert(chance(0.75) ? std::clamp(centre + uniform(-slots, slots), 0, pages - 1)
                                 : uniform(0, pages - 1));
    }
    return {chosen.begin(), chosen.end()};
  }

  std::vector<int32_t> draw_overfull(int slots, int pages) {
    const size_t target = uniform(slots + 1, std::min(slots + 3, pages));
    std::set<int32_t> chosen;
    while (chosen.size() < target) chosen.insert(uniform(0, pages - 1));
    return {chosen.begin(), chosen.end()};
  }

  void run_trace(const TraceShape& s, Coverage& cov);
};

void GpuPageCache::run_trace(const TraceShape& s, Coverage& cov) {
  const int seqs = static_cast<int>(s.slots.size());
  const int heads = s.num_kv_heads;
  const int layers = s.num_layers;
  const int items = seqs * heads;
  const size_t page_bytes = size_t{4} * s.page_size * s.head_dim;  // K and V rows, bf16

  // Each request's slots get distinct device groups in shuffled order; a few groups belong to no
  // request, so a stray write shows in the pool check.
  std::vector<int32_t> cache_offsets(seqs + 1, 0), host_offsets(seqs, 0);
  for (int r = 0; r < seqs; ++r) cache_offsets[r + 1] = cache_offsets[r] + s.slots[r];
  const int device_groups = cache_offsets[seqs] + 3;
  std::vector<int32_t> cache_groups(device_groups);
  std::iota(cache_groups.begin(), cache_groups.end(), 0);
  std::shuffle(cache_groups.begin(), cache_groups.end(), rng_);
  cache_groups.resize(cache_offsets[seqs]);
  std::vector<std::string> owner(device_groups, "no request");
  for (int r = 0; r < seqs; ++r)
    for (int j = 0; j < s.slots[r]; ++j)
      owner[cache_groups[cache_offsets[r] + j]] =
          "seq " + std::to_string(r) + " slot " + std::to_string(j);

  // Logical page p of request r lives in host group host_groups[host_offsets[r] + p], shuffled.
  int host_group_count = 0;
  for (int r = 0; r < seqs; ++r) {
    host_offsets[r] = host_group_count;
    host_group_count += s.logical_pages[r];
  }
  std::vector<int32_t> host_groups(host_group_count);
  std::iota(host_groups.begin(), host_groups.end(), 0);
  std::shuffle(host_groups.begin(), host_groups.end(), rng_);

  const size_t host_layer_pages = size_t(host_group_count) * heads;
  const size_t device_layer_pages = size_t(device_groups) * heads;
  MappedHost host(host_layer_pages * layers * page_bytes);
  CUDA_OK(host.status());
  for (size_t at = 0; at < host_layer_pages * layers * page_bytes; at += sizeof(uint64_t)) {
    const uint64_t word = rng_();  // page bytes are a multiple of 16
    std::memcpy(host.get() + at, &word, sizeof word);
  }
  const size_t pool_bytes = device_layer_pages * layers * page_bytes;
  DeviceArray<unsigned char> device_pool(pool_bytes);
  CUDA_OK(device_pool.status());
  CUDA_OK(cudaMemset(device_pool.get(), kPoolPoison, pool_bytes));
  std::vector<unsigned char> expect_pool(pool_bytes, kPoolPoison);

  const size_t state_size = size_t(device_groups) * layers * heads;
  auto state_index = [&](int32_t group, int layer, int head) {
    return (size_t(group) * layers + layer) * heads + head;
  };
  auto describe_state = [&](size_t i) {
    const size_t group = i / (size_t(layers) * heads);
    return owner[group] + " layer " + std::to_string(i / heads % layers) + " head " +
           std::to_string(i % heads);
  };
  std::vector<int32_t> ref_page(state_size, -1);
  std::vector<uint32_t> ref_stamp(state_size, 0);
  std::vector<unsigned long long> ref_counters(seqs * 3, 0);
  const bool rebuilds = !s.rebuild_end.empty();
  std::vector<unsigned long long> ref_value_only(seqs, 0);
  DeviceArray<int32_t> d_rebuild_end(rebuilds ? s.rebuild_end : std::vector<int32_t>(1, 0));
  DeviceArray<unsigned long long> d_value_only(ref_value_only);
  CUDA_OK(d_rebuild_end.status());
  CUDA_OK(d_value_only.status());
  DeviceArray<int32_t> d_slot_page(ref_page);
  DeviceArray<uint32_t> d_slot_stamp(ref_stamp);
  DeviceArray<unsigned long long> d_counters(ref_counters);
  DeviceArray<int32_t> d_cache_groups(cache_groups), d_cache_offsets(cache_offsets);
  DeviceArray<int32_t> d_host_groups(host_groups), d_host_offsets(host_offsets);
  DeviceArray<int> d_error(1);
  for (auto status : {d_slot_page.status(), d_slot_stamp.status(), d_counters.status(),
                      d_cache_groups.status(), d_cache_offsets.status(), d_host_groups.status(),
                      d_host_offsets.status(), d_error.status()})
    CUDA_OK(status);

  kv::BucketedLruPicker picker(static_cast<uint32_t>(s.buckets));
  std::vector<uint32_t> now(seqs);
  for (uint32_t& n : now) n = static_cast<uint32_t>(uniform(1, 5));
  std::vector<std::vector<int32_t>> previous(size_t(layers) * items);
  std::vector<int> centres(size_t(layers) * items);
  for (int l = 0; l < layers; ++l)
    for (int i = 0; i < items; ++i)
      centres[size_t(l) * items + i] = uniform(0, s.logical_pages[i / heads] - 1);

  // The model of one item: hits, free slots (empties, then pick's victims), misses in order.
  // Its values-only misses go, in needed order, to rebuild (device page, logical page). With
  // `fill` (the attention fetches): a miss's out is ~(host page) and its fill the device page.
  auto reference_item = [&](int seq, int head, int layer, const std::vector<int32_t>& list, int32_t* out,
                            int32_t* fill, int& error, std::vector<std::pair<int32_t, int32_t>>& rebuild) {
    const int slots = s.slots[seq];
    const int32_t* groups = cache_groups.data() + cache_offsets[seq];
    if (fill) std::fill(fill, fill + list.size(), -1);
    if (list.size() > size_t(slots) || slots > cuda::kMaxCacheSlots) {
      std::fill(out, out + list.size(), -1);
      error = 1;
      ++cov.error_items;
      return;
    }
    auto slot_state = [&](int j) { return state_index(groups[j], layer, head); };
    std::map<int32_t, int> slot_holding;
    for (int j = 0; j < slots; ++j)
      if (ref_page[slot_state(j)] >= 0) slot_holding[ref_page[slot_state(j)]] = j;

    std::vector<bool> needed_slot(slots, false);
    std::vector<size_t> missed;
    for (size_t k = 0; k < list.size(); ++k) {
      const auto held = slot_holding.find(list[k]);
      if (held == slot_holding.end()) {
        missed.push_back(k);
        continue;
      }
      needed_slot[held->second] = true;
      ref_stamp[slot_state(held->second)] = now[seq];
      out[k] = groups[held->second] * heads + head;
    }
    std::vector<uint32_t> free_slots;
    for (int j = 0; j < slots; ++j)
      if (ref_page[slot_state(j)] < 0 && free_slots.size() < missed.size()) free_slots.push_back(j);
    cov.empties_used += static_cast<int>(free_slots.size());
    size_t evictions = 0;
    if (missed.size() > free_slots.size()) {
      std::vector<kv::LruCandidate> candidates;
      for (int j = 0; j < slots; ++j) {
        const int32_t page = ref_page[slot_state(j)];
        if (page >= 0 && !needed_slot[j])
          candidates.push_back(
              {ref_stamp[slot_state(j)], static_cast<uint32_t>(page), static_cast<uint32_t>(j)});
      }
      std::vector<uint32_t> victims;
      picker.pick(candidates, now[seq], static_cast<uint32_t>(missed.size() - free_slots.size()),
                  victims);
      order_last_bucket(candidates, now[seq], static_cast<uint32_t>(s.buckets), victims, cov);
      evictions = victims.size();
      free_slots.insert(free_slots.end(), victims.begin(), victims.end());
    }
    for (size_t r = 0; r < missed.size(); ++r) {
      const size_t k = missed[r];
      const int j = static_cast<int>(free_slots[r]);
      ref_page[slot_state(j)] = list[k];
      ref_stamp[slot_state(j)] = now[seq];
      const size_t device_page = size_t(groups[j]) * heads + head;
      const size_t host_page = size_t(host_groups[host_offsets[seq] + list[k]]) * heads + head;
      out[k] = fill ? ~static_cast<int32_t>(host_page) : static_cast<int32_t>(device_page);
      if (fill) fill[k] = static_cast<int32_t>(device_page);
      // A values-only miss copies the page's second half (V) and keeps the slot's old keys.
      const bool values_only = rebuilds && list[k] < s.rebuild_end[seq];
      const size_t skip = values_only ? page_bytes / 2 : 0;
      std::memcpy(expect_pool.data() + (layer * device_layer_pages + device_page) * page_bytes + skip,
                  host.get() + (layer * host_layer_pages + host_page) * page_bytes + skip, page_bytes - skip);
      if (values_only) rebuild.emplace_back(static_cast<int32_t>(device_page), list[k]);
      ++(values_only ? cov.values_only : cov.whole_misses);
    }
    ref_value_only[seq] += rebuild.size();
    ref_counters[seq * 3 + 0] += list.size() - missed.size();
    ref_counters[seq * 3 + 1] += missed.size();
    ref_counters[seq * 3 + 2] += evictions;
    cov.hits += static_cast<int>(list.size() - missed.size());
    cov.evictions += static_cast<int>(evictions);
  };

  for (int step = 0; step < s.steps; ++step) {
    for (uint32_t& n : now) n += static_cast<uint32_t>(uniform(1, s.max_jump));
    DeviceArray<uint32_t> d_now(now);
    CUDA_OK(d_now.status());
    for (int layer = 0; layer < layers; ++layer) {
      SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(layer) + " seed " +
                   std::to_string(seed_));
      const int overfull = s.overfull_items ? uniform(0, items - 1) : -1;
      std::vector<std::vector<int32_t>> lists(items);
      for (int i = 0; i < items; ++i) {
        const int seq = i / heads;
        const size_t at = size_t(layer) * items + i;
        lists[i] = i == overfull
                       ? draw_overfull(s.slots[seq], s.logical_pages[seq])
                       : draw_needed(previous[at], s.slots[seq], s.logical_pages[seq], centres[at]);
        previous[at] = lists[i];
      }
      // Needed lists packed last item first; output ranges in item order with gaps.
      std::vector<int32_t> needed, needed_offsets(items), needed_counts(items), out_offsets(items);
      for (int i = items - 1; i >= 0; --i) {
        needed_offsets[i] = static_cast<int32_t>(needed.size());
        needed_counts[i] = static_cast<int32_t>(lists[i].size());
        needed.insert(needed.end(), lists[i].begin(), lists[i].end());
      }
      int32_t out_size = 0;
      for (int i = 0; i < items; ++i) {
        out_offsets[i] = out_size + uniform(0, 2);
        out_size = out_offsets[i] + needed_counts[i];
      }
      std::vector<int32_t> expect_out(out_size, kOutPoison);
      DeviceArray<int32_t> d_needed(needed), d_needed_offsets(needed_offsets),
          d_needed_counts(needed_counts), d_out_offsets(out_offsets), d_out(expect_out);
      for (auto status : {d_needed.status(), d_needed_offsets.status(), d_needed_counts.status(),
                          d_out_offsets.status(), d_out.status()})
        CUDA_OK(status);
      CUDA_OK(cudaMemset(d_error.get(), 0, sizeof(int)));

      DeviceArray<int32_t> d_rebuild_pages(std::max<size_t>(needed.size(), 1)),
          d_rebuild_logical(std::max<size_t>(needed.size(), 1)), d_rebuild_counts(items);
      cuda::PageCacheParams p;
      p.num_seqs = seqs;
      p.num_kv_heads = heads;
      p.num_layers = layers;
      p.layer = layer;
      p.head_dim = s.head_dim;
      p.page_size = s.page_size;
      p.buckets = s.buckets;
      p.needed = d_needed.get();
      p.needed_offsets = d_needed_offsets.get();
      p.needed_counts = d_needed_counts.get();
      p.cache_groups = d_cache_groups.get();
      p.cache_offsets = d_cache_offsets.get();
      p.host_groups = d_host_groups.get();
      p.host_offsets = d_host_offsets.get();
      p.now = d_now.get();
      p.slot_page = d_slot_page.get();
      p.slot_stamp = d_slot_stamp.get();
      p.host_pool = reinterpret_cast<const __nv_bfloat16*>(
          static_cast<const unsigned char*>(host.device_view()) +
          layer * host_layer_pages * page_bytes);
      p.device_pool = reinterpret_cast<__nv_bfloat16*>(device_pool.get() +
                                                       layer * device_layer_pages * page_bytes);
      p.out_pages = d_out.get();
      p.out_offsets = d_out_offsets.get();
      p.counters = d_counters.get();
      p.error = d_error.get();
      if (rebuilds) {
        p.rebuild_end = d_rebuild_end.get();
        p.rebuild_pages = d_rebuild_pages.get();
        p.rebuild_logical = d_rebuild_logical.get();
        p.rebuild_counts = d_rebuild_counts.get();
        p.value_only = d_value_only.get();
      }
      // Every fetch split: the launch's choice, one block per item, 2, 4 and 8 blocks (clusters of
      // them in one launch, sm_90), each in one launch and in two (plan, then fetch); and the plan
      // alone, leaving the fetch to the attention (not with values-only misses), whose fill list
      // this test carries out with cudaMemcpy.
      constexpr int kBlocksPerItem[] = {0, 1, 2, 4, 8};
      const int call = step * layers + layer;
      const bool fill_mode = call / 5 % 3 == 2 && !rebuilds;
      const bool two_launches = call / 5 % 3 != 0 && !fill_mode;
      p.blocks_per_item = kBlocksPerItem[call % 5];
      if (p.blocks_per_item > 1 && !two_launches && !cuda::sm90_or_newer()) p.blocks_per_item = 1;
      SCOPED_TRACE("blocks per item " + std::to_string(p.blocks_per_item) +
                   (fill_mode ? ", plan for the attention's fetch" : two_launches ? ", plan then fetch" : ", one launch"));
      std::vector<int32_t> expect_fill(fill_mode ? out_size : 0, kOutPoison);
      DeviceArray<int32_t> d_fill(expect_fill);
      CUDA_OK(d_fill.status());
      // The two-launch form's lists; its counts poisoned with a large count, so a plan that left one
      // unwritten would fetch garbage.
      const size_t copy_entries = two_launches ? std::max<size_t>(needed.size(), 1) : 0;
      DeviceArray<int32_t> d_copy_src(copy_entries), d_copy_dst(copy_entries),
          d_copy_counts(std::vector<int32_t>(two_launches ? 2 * items : 0, 1 << 20));
      for (auto status : {d_copy_src.status(), d_copy_dst.status(), d_copy_counts.status(),
                          d_rebuild_pages.status(), d_rebuild_logical.status(), d_rebuild_counts.status()})
        CUDA_OK(status);
      if (fill_mode) {
        p.fill_pages = d_fill.get();
        CUDA_OK(cuda::plan_cached_pages(p, nullptr));
      } else if (two_launches) {
        p.copy_src = d_copy_src.get();
        p.copy_dst = d_copy_dst.get();
        p.copy_counts = d_copy_counts.get();
        CUDA_OK(cuda::plan_cached_pages(p, nullptr));
        CUDA_OK(cuda::fetch_planned_pages(p, nullptr));
      } else {
        CUDA_OK(cuda::retrieve_cached_pages(p, nullptr));
      }
      CUDA_OK(cudaDeviceSynchronize());

      int expect_error = 0;
      std::vector<std::vector<std::pair<int32_t, int32_t>>> expect_rebuild(items);
      for (int i = 0; i < items; ++i)
        reference_item(i / heads, i % heads, layer, lists[i], expect_out.data() + out_offsets[i],
                       fill_mode ? expect_fill.data() + out_offsets[i] : nullptr, expect_error, expect_rebuild[i]);
      bool same = true;
      if (fill_mode) {  // the attention's part: each listed miss's host page into its fill page
        const std::vector<int32_t> got_fill = d_fill.download(), got_out = d_out.download();
        same &= same_or_report("fill_pages", expect_fill, got_fill, [](size_t at) { return "entry " + std::to_string(at); });
        for (int i = 0; i < items && same; ++i) {
          for (int k = out_offsets[i]; k < out_offsets[i] + needed_counts[i]; ++k) {
            if (got_fill[k] < 0) continue;
            CUDA_OK(cudaMemcpy(device_pool.get() + (layer * device_layer_pages + got_fill[k]) * page_bytes,
                               host.get() + (layer * host_layer_pages + ~got_out[k]) * page_bytes, page_bytes,
                               cudaMemcpyHostToDevice));
          }
        }
      }

      const std::vector<int> got_error = d_error.download();
      EXPECT_EQ(got_error[0], expect_error) << "error flag";
      auto describe_out = [&](size_t at) {
        for (int i = 0; i < items; ++i)
          if (at >= size_t(out_offsets[i]) && at < size_t(out_offsets[i] + needed_counts[i]))
            return "item " + std::to_string(i) + " needed #" + std::to_string(at - out_offsets[i]) +
                   " (logical " + std::to_string(lists[i][at - out_offsets[i]]) + ")";
        return std::string("gap");
      };
      same &= got_error[0] == expect_error;
      same &= same_or_report("out_pages", expect_out, d_out.download(), describe_out);
      same &= same_or_report("counters", ref_counters, d_counters.download(), [](size_t i) {
        return "seq " + std::to_string(i / 3) +
               (i % 3 == 0   ? " hits"
                : i % 3 == 1 ? " misses"
                             : " evictions");
      });
      if (rebuilds) {
        std::vector<int32_t> expect_counts(items), got_counts = d_rebuild_counts.download();
        for (int i = 0; i < items; ++i) expect_counts[i] = static_cast<int32_t>(expect_rebuild[i].size());
        same &= same_or_report("rebuild_counts", expect_counts, got_counts,
                               [](size_t i) { return "item " + std::to_string(i); });
        const std::vector<int32_t> got_pages = d_rebuild_pages.download(), got_logical = d_rebuild_logical.download();
        for (int i = 0; i < items && same; ++i) {
          for (size_t j = 0; j < expect_rebuild[i].size(); ++j) {
            const size_t at = needed_offsets[i] + j;
            EXPECT_EQ(got_pages[at], expect_rebuild[i][j].first) << "item " << i << " rebuild page #" << j;
            EXPECT_EQ(got_logical[at], expect_rebuild[i][j].second) << "item " << i << " rebuild logical #" << j;
            same &= got_pages[at] == expect_rebuild[i][j].first && got_logical[at] == expect_rebuild[i][j].second;
          }
        }
        same &= same_or_report("value_only", ref_value_only, d_value_only.download(),
                               [](size_t i) { return "seq " + std::to_string(i); });
      }
      same &= same_or_report("slot_page", ref_page, d_slot_page.download(), describe_state);
      same &= same_or_report("slot_stamp", ref_stamp, d_slot_stamp.download(), describe_state);
      const std::vector<unsigned char> got_pool = device_pool.download();
      size_t bad_pages = 0;
      for (size_t page = 0; page < device_layer_pages * layers; ++page) {
        const size_t at = page * page_bytes;
        if (std::memcmp(got_pool.data() + at, expect_pool.data() + at, page_bytes) == 0) continue;
        if (bad_pages < 8) {
          const size_t in_layer = page % device_layer_pages;
          ADD_FAILURE() << "device pool page " << in_layer << " of layer "
                        << page / device_layer_pages << " (" << owner[in_layer / heads] << " head "
                        << in_layer % heads << ") differs from the host tier page its slot holds";
        }
        ++bad_pages;
      }
      EXPECT_EQ(bad_pages, 0u) << "device pool pages that differ";
      same &= bad_pages == 0;
      ASSERT_TRUE(same) << "stopping the trace at the first call that differs";
    }
  }
}

TEST_F(GpuPageCache, TraceMatchesCpuPolicyAtDefaultPageShape) {
  // Few buckets and long step jumps, so most evictions see buckets wider than one step.
  const TraceShape shape{16, 128, 2, 2, 4, {1, 7, 64, 300}, {5, 12, 150, 600}, 20, 6, false};
  Coverage cov;
  run_trace(shape, cov);
  if (HasFatalFailure()) return;
  EXPECT_GT(cov.hits, 0);
  EXPECT_GT(cov.empties_used, 0);
  EXPECT_GT(cov.evictions, 0);
  EXPECT_GT(cov.wide_buckets, 0);
  EXPECT_GT(cov.partial_boundary, 0);
  EXPECT_GT(cov.ordered_boundary, 0);
  EXPECT_GT(cov.sorted_boundary, 0);
  EXPECT_GT(cov.whole_buckets, 0);
  EXPECT_EQ(cov.error_items, 0);
}

TEST_F(GpuPageCache, TraceMatchesCpuPolicyAtMostSlots) {
  // A request with kMaxCacheSlots slots (every thread holds its full share), one with a single
  // slot, one just past a thread's share; the default 64 buckets with jumps up to 40 steps.
  const TraceShape shape{8,  64, 2,    1, 64, {cuda::kMaxCacheSlots, 1, 513}, {5000, 3, 700},
                         10, 40, false};
  Coverage cov;
  run_trace(shape, cov);
  if (HasFatalFailure()) return;
  EXPECT_GT(cov.hits, 0);
  EXPECT_GT(cov.evictions, 0);
  EXPECT_GT(cov.wide_buckets, 0);
  EXPECT_GT(cov.ordered_boundary, 0);
}

TEST_F(GpuPageCache, TraceMatchesCpuPolicyAtTheSmallPathsEdges) {
  // Requests of up to 512 slots and buckets run with one slot per thread: 512 slots (the most it
  // takes) beside 511 and 2, with many evictions.
  const TraceShape small{8, 64, 2, 2, 64, {512, 511, 2}, {900, 700, 9}, 12, 30, false};
  Coverage cov;
  run_trace(small, cov);
  if (HasFatalFailure()) return;
  EXPECT_GT(cov.evictions, 0);
  EXPECT_GT(cov.ordered_boundary, 0);
  // Exactly 512 buckets still take the small path, and 513 slots the full one, in the same calls;
  // more than 512 buckets send small requests down the full path, with the same results.
  const TraceShape edge_buckets{8, 64, 2, 1, 512, {512, 513, 3}, {800, 900, 8}, 12, 700, false};
  const TraceShape many_buckets{8, 64, 2, 1, 700, {300, 40}, {500, 90}, 12, 900, false};
  for (const TraceShape& shape : {edge_buckets, many_buckets}) {
    Coverage wide;
    run_trace(shape, wide);
    if (HasFatalFailure()) return;
    EXPECT_GT(wide.evictions, 0);
    EXPECT_GT(wide.wide_buckets, 0);
  }
}

TEST_F(GpuPageCache, TraceMatchesCpuPolicyWithValuesOnlyMisses) {
  // ShadowKV's case: below a request's rebuild_end a miss fetches only the page's values (the slot
  // keeps its old keys until the rebuild) and is listed for the key rebuild in needed order; one
  // request rebuilds none of its pages, one all of them. Overfull items list nothing.
  const TraceShape shape{8, 128, 2, 2, 16, {40, 64, 9, 200}, {90, 150, 20, 400}, 12, 8, true, {0, 150, 12, 250}};
  Coverage cov;
  run_trace(shape, cov);
  if (HasFatalFailure()) return;
  EXPECT_GT(cov.values_only, 0);
  EXPECT_GT(cov.whole_misses, 0);
  EXPECT_GT(cov.evictions, 0);
  EXPECT_GT(cov.error_items, 0);
}

TEST_F(GpuPageCache, OverfullItemSetsErrorAndOthersProceed) {
  // One item per call needs more pages than its request has slots; the request with
  // kMaxCacheSlots + 1 slots is an error item in every call. Their slots stay as they were.
  const TraceShape shape{
      8, 32, 2, 2, 8, {3, 40, cuda::kMaxCacheSlots + 1, 200}, {8, 60, 4200, 260}, 6, 5, true};
  Coverage cov;
  run_trace(shape, cov);
  if (HasFatalFailure()) return;
  EXPECT_GT(cov.error_items, 0);
  EXPECT_GT(cov.evictions, 0);
}

TEST_F(GpuPageCache, RejectsBadParams) {
  DeviceArray<int32_t> ints(64);
  DeviceArray<uint32_t> stamps(64);
  DeviceArray<unsigned long long> counters(64);
  DeviceArray<int> error(1);
  DeviceArray<__nv_bfloat16> pool(4096);
  CUDA_OK(ints.status());
  CUDA_OK(pool.status());
  cuda::PageCacheParams valid;
  valid.num_seqs = 1;
  valid.num_kv_heads = 1;
  valid.num_layers = 1;
  valid.needed = valid.needed_offsets = valid.needed_counts = ints.get();
  valid.cache_groups = valid.cache_offsets = valid.host_groups = valid.host_offsets = ints.get();
  valid.out_offsets = ints.get();
  valid.out_pages = ints.get();
  valid.slot_page = ints.get();
  valid.now = stamps.get();
  valid.slot_stamp = stamps.get();
  valid.counters = counters.get();
  valid.error = error.get();
  valid.host_pool = pool.get();
  valid.device_pool = pool.get();
  valid.copy_src = valid.copy_dst = valid.copy_counts = ints.get();

  const std::vector<std::pair<const char*, std::function<void(cuda::PageCacheParams&)>>> breaks = {
      {"negative num_seqs", [](auto& p) { p.num_seqs = -1; }},
      {"no KV heads", [](auto& p) { p.num_kv_heads = 0; }},
      {"no layers", [](auto& p) { p.num_layers = 0; }},
      {"layer past the last", [](auto& p) { p.layer = 1; }},
      {"negative layer", [](auto& p) { p.layer = -1; }},
      {"head_dim 0", [](auto& p) { p.head_dim = 0; }},
      {"page_size 0", [](auto& p) { p.page_size = 0; }},
      {"page bytes not a multiple of 16",
       [](auto& p) {
         p.page_size = 1;
         p.head_dim = 2;
       }},
      {"page_size too large", [](auto& p) { p.page_size = 2048; }},
      {"zero buckets", [](auto& p) { p.buckets = 0; }},
      {"too many buckets", [](auto& p) { p.buckets = cuda::kMaxLruBuckets + 1; }},
      {"null needed", [](auto& p) { p.needed = nullptr; }},
      {"null needed_counts", [](auto& p) { p.needed_counts = nullptr; }},
      {"null cache_groups", [](auto& p) { p.cache_groups = nullptr; }},
      {"null host_offsets", [](auto& p) { p.host_offsets = nullptr; }},
      {"null now", [](auto& p) { p.now = nullptr; }},
      {"null slot_stamp", [](auto& p) { p.slot_stamp = nullptr; }},
      {"null host pool", [](auto& p) { p.host_pool = nullptr; }},
      {"null out_pages", [](auto& p) { p.out_pages = nullptr; }},
      {"null counters", [](auto& p) { p.counters = nullptr; }},
      {"null error", [](auto& p) { p.error = nullptr; }},
      {"host pool misaligned", [](auto& p) { p.host_pool += 1; }},
      {"device pool misaligned", [](auto& p) { p.device_pool += 4; }},
      {"3 blocks per item", [](auto& p) { p.blocks_per_item = 3; }},
      {"16 blocks per item", [](auto& p) { p.blocks_per_item = 16; }},
      {"negative blocks per item", [](auto& p) { p.blocks_per_item = -1; }},
  };
  for (const auto& [name, mutate] : breaks) {
    cuda::PageCacheParams p = valid;
    mutate(p);
    EXPECT_EQ(cuda::retrieve_cached_pages(p, nullptr), cudaErrorInvalidValue) << name;
    EXPECT_EQ(cuda::plan_cached_pages(p, nullptr), cudaErrorInvalidValue) << name << " (plan)";
    EXPECT_EQ(cuda::fetch_planned_pages(p, nullptr), cudaErrorInvalidValue) << name << " (fetch)";
  }
  const std::vector<std::pair<const char*, std::function<void(cuda::PageCacheParams&)>>> two_launch_breaks = {
      {"null copy_src", [](auto& p) { p.copy_src = nullptr; }},
      {"null copy_dst", [](auto& p) { p.copy_dst = nullptr; }},
      {"null copy_counts", [](auto& p) { p.copy_counts = nullptr; }},
  };
  for (const auto& [name, mutate] : two_launch_breaks) {
    cuda::PageCacheParams p = valid;
    mutate(p);
    EXPECT_EQ(cuda::plan_cached_pages(p, nullptr), cudaErrorInvalidValue) << name << " (plan)";
    EXPECT_EQ(cuda::fetch_planned_pages(p, nullptr), cudaErrorInvalidValue) << name << " (fetch)";
  }
  // The attention's fetch (fill_pages) is the plan's alone, and not with values-only misses.
  cuda::PageCacheParams fill = valid;
  fill.fill_pages = ints.get();
  EXPECT_EQ(cuda::retrieve_cached_pages(fill, nullptr), cudaErrorInvalidValue) << "fill_pages in one launch";
  EXPECT_EQ(cuda::fetch_planned_pages(fill, nullptr), cudaErrorInvalidValue) << "fill_pages in the fetch";
  fill.rebuild_end = fill.rebuild_pages = fill.rebuild_logical = fill.rebuild_counts = ints.get();
  fill.value_only = counters.get();
  EXPECT_EQ(cuda::plan_cached_pages(fill, nullptr), cudaErrorInvalidValue) << "fill_pages with a key rebuild";
  cuda::PageCacheParams empty = valid;
  empty.num_seqs = 0;
  empty.needed = nullptr;
  EXPECT_EQ(cuda::retrieve_cached_pages(empty, nullptr), cudaSuccess)
      << "no requests: nothing to do";
  EXPECT_EQ(cuda::plan_cached_pages(empty, nullptr), cudaSuccess) << "no requests: nothing to plan";
  EXPECT_EQ(cuda::fetch_planned_pages(empty, nullptr), cudaSuccess) << "no requests: nothing to fetch";
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace spin
