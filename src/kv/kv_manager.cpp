#include "kv/kv_manager.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "base/checked.h"
#include "base/error.h"

namespace spin::kv {

KvCounters& KvCounters::operator+=(const KvCounters& o) {
  hits += o.hits;
  misses += o.misses;
  h2d_pages += o.h2d_pages;
  h2d_bytes += o.h2d_bytes;
  d2h_pages += o.d2h_pages;
  d2h_bytes += o.d2h_bytes;
  evictions += o.evictions;
  return *this;
}

void LayerSelection::add_head(std::span<const uint32_t> head_pages) {
  pages.insert(pages.end(), head_pages.begin(), head_pages.end());
  offsets.push_back(static_cast<uint32_t>(pages.size()));
}

std::span<const uint32_t> LayerSelection::head(uint32_t h) const {
  return std::span<const uint32_t>(pages).subspan(offsets[h], offsets[h + 1] - offsets[h]);
}

void LayerSelection::clear() {
  offsets.assign(1, 0);
  pages.clear();
}

KvConfig KvManager::with_defaults(KvConfig config) {
  validate(config.layout);
  SPIN_CHECK(config.max_batch > 0 && config.max_context > 0,
             "KV manager needs max_batch and max_context > 0");
  const uint64_t max_pages = config.layout.pages_for_tokens(config.max_context);
  const uint64_t streams = uint64_t{config.max_batch} * config.layout.streams();
  if (config.max_resident_pages == 0) config.max_resident_pages = static_cast<uint32_t>(max_pages);
  SPIN_CHECK(config.max_resident_pages <= max_pages, "max_resident_pages {} exceeds {} pages",
             config.max_resident_pages, max_pages);
  // Each stream wastes at most one partial segment; every logical page holds a device or a host
  // page and every resident slot a device page, so these sizes can never run out first.
  auto enough = [&](uint64_t pages) {
    const uint64_t n = pages / kSegmentEntries + streams + 1;
    SPIN_CHECK(n < 0xffffffffu, "segment pool too large");
    return static_cast<uint32_t>(n);
  };
  if (config.logical_segments == 0)
    config.logical_segments = enough(uint64_t{config.device_pages} + config.host_pages);
  if (config.resident_segments == 0) config.resident_segments = enough(config.device_pages);
  // Stream and arena indices are 32-bit.
  SPIN_CHECK(streams < 0xffffffffu && config.logical_segments <= 0xffffffffu / kSegmentEntries &&
                 config.resident_segments <= 0xffffffffu / kSegmentEntries,
             "KV manager configuration too large ({} streams)", streams);
  return config;
}

KvManager::KvManager(const KvConfig& config, PageMemory& memory)
    : config_(with_defaults(config)),
      memory_(memory),
      device_pool_(Tier::Device, config_.device_pages, config_.layout.page_bytes()),
      host_pool_(Tier::Host, config_.host_pages, config_.layout.page_bytes()),
      request_slots_("request slots", config_.max_batch),
      logical_segments_("logical page-table segment pool", config_.logical_segments),
      resident_segments_("resident page-table segment pool", config_.resident_segments),
      max_pages_(config_.layout.pages_for_tokens(config_.max_context)),
      logical_dir_entries_(segments_for(max_pages_)),
      resident_dir_entries_(segments_for(config_.max_resident_pages)),
      requests_(config_.max_batch),
      streams_(uint64_t{config_.max_batch} * config_.layout.streams()),
      picker_(config_.lru_buckets),
      seen_(max_pages_, 0) {
  SPIN_CHECK(memory.capacity(Tier::Device) >= config_.device_pages &&
                 memory.capacity(Tier::Host) >= config_.host_pages,
             "page memory smaller than the configured pools");
  SPIN_CHECK(memory.layout().page_bytes() == config_.layout.page_bytes(),
             "page memory layout differs from the KV layout");
  const uint64_t streams = streams_.size();
  logical_directory_.assign(checked_mul(streams, logical_dir_entries_, "logical directory"),
                            kNoPage);
  resident_directory_.assign(checked_mul(streams, resident_dir_entries_, "resident directory"),
                             kNoPage);
  logical_arena_.resize(checked_mul(config_.logical_segments, kSegmentEntries, "segment arena"));
  const uint64_t resident_entries =
      checked_mul(config_.resident_segments, kSegmentEntries, "segment arena");
  resident_logical_.resize(resident_entries);
  resident_device_page_.resize(resident_entries);
  resident_stamp_.resize(resident_entries);
}

uint32_t KvManager::stream_index(RequestId request, uint32_t layer, uint32_t head) const {
  SPIN_CHECK(layer < config_.layout.num_layers && head < config_.layout.num_kv_heads,
             "layer {} / KV head {} out of range", layer, head);
  return (request * config_.layout.num_layers + layer) * config_.layout.num_kv_heads + head;
}

KvManager::RequestState& KvManager::state(RequestId request) {
  return const_cast<RequestState&>(std::as_const(*this).state(request));
}

const KvManager::RequestState& KvManager::state(RequestId request) const {
  SPIN_CHECK(request < requests_.size() && requests_[request].active, "unknown KV request {}",
             request);
  return requests_[request];
}

bool KvManager::pinned(uint32_t logical, uint32_t num_pages) const {
  return logical < config_.sink_pages || uint64_t{logical} + 1 + config_.window_pages >= num_pages;
}

uint32_t KvManager::pinned_count(uint32_t num_pages) const {
  const uint32_t window_start = num_pages > config_.window_pages + 1
                                    ? num_pages - 1 - config_.window_pages
                                    : 0;
  const uint32_t sinks = std::min(config_.sink_pages, num_pages);
  return sinks + (num_pages - std::max(window_start, sinks));
}

KvManager::LogicalEntry& KvManager::logical_entry(uint32_t stream, uint32_t logical) {
  return const_cast<LogicalEntry&>(std::as_const(*this).logical_entry(stream, logical));
}

const KvManager::LogicalEntry& KvManager::logical_entry(uint32_t stream, uint32_t logical) const {
  const uint32_t segment =
      logical_directory_[uint64_t{stream} * logical_dir_entries_ + logical / kSegmentEntries];
  return logical_arena_[uint64_t{segment} * kSegmentEntries + logical % kSegmentEntries];
}

uint32_t KvManager::resident_index(uint32_t stream, uint32_t slot) const {
  const uint32_t segment =
      resident_directory_[uint64_t{stream} * resident_dir_entries_ + slot / kSegmentEntries];
  return segment * kSegmentEntries + slot % kSegmentEntries;
}

void KvManager::push_resident(uint32_t stream, uint32_t logical, PageId device_page,
                              uint32_t stamp) {
  StreamState& s = streams_[stream];
  const uint32_t slot = s.resident_count++;
  if (slot % kSegmentEntries == 0) {
    resident_directory_[uint64_t{stream} * resident_dir_entries_ + slot / kSegmentEntries] =
        resident_segments_.alloc();
  }
  const uint32_t i = resident_index(stream, slot);
  resident_logical_[i] = logical;
  resident_device_page_[i] = device_page;
  resident_stamp_[i] = stamp;
  logical_entry(stream, logical).resident_slot = slot;
}

// Swap-remove: the last slot moves into the hole, so slots stay dense and segments free in order.
void KvManager::remove_resident(uint32_t stream, uint32_t slot) {
  StreamState& s = streams_[stream];
  const uint32_t last = --s.resident_count;
  const uint32_t i = resident_index(stream, slot);
  logical_entry(stream, resident_logical_[i]).resident_slot = kNoPage;
  if (slot != last) {
    const uint32_t j = resident_index(stream, last);
    resident_logical_[i] = resident_logical_[j];
    resident_device_page_[i] = resident_device_page_[j];
    resident_stamp_[i] = resident_stamp_[j];
    logical_entry(stream, resident_logical_[i]).resident_slot = slot;
  }
  if (last % kSegmentEntries == 0) {
    uint32_t& dir =
        resident_directory_[uint64_t{stream} * resident_dir_entries_ + last / kSegmentEntries];
    resident_segments_.free(dir);
    dir = kNoPage;
  }
}

uint32_t KvManager::count_candidates(uint32_t stream, uint32_t num_pages, uint32_t now) const {
  uint32_t n = 0;
  for (uint32_t slot = 0; slot < streams_[stream].resident_count; ++slot) {
    const uint32_t i = resident_index(stream, slot);
    n += !pinned(resident_logical_[i], num_pages) && resident_stamp_[i] != now;
  }
  return n;
}

void KvManager::evict(uint32_t stream, uint32_t num_pages, uint32_t now, uint32_t count,
                      KvCounters& c) {
  if (count == 0) return;
  candidates_.clear();
  for (uint32_t slot = 0; slot < streams_[stream].resident_count; ++slot) {
    const uint32_t i = resident_index(stream, slot);
    if (pinned(resident_logical_[i], num_pages) || resident_stamp_[i] == now) continue;
    candidates_.push_back({resident_stamp_[i], resident_logical_[i], slot});
  }
  victims_.clear();
  picker_.pick(candidates_, now, count, victims_);
  // Highest slots first, so a swap-remove never moves a victim that is still pending.
  std::sort(victims_.begin(), victims_.end(), std::greater<>());
  for (uint32_t slot : victims_) {
    device_pool_.free(resident_device_page_[resident_index(stream, slot)]);
    remove_resident(stream, slot);
  }
  c.evictions += count;
}

RequestId KvManager::create_request() {
  const RequestId id = request_slots_.alloc();
  requests_[id] = RequestState{};
  requests_[id].active = true;
  return id;
}

void KvManager::reserve_tokens(RequestId request, uint32_t count) {
  RequestState& r = state(request);
  SPIN_CHECK(!r.suspended, "request {} is suspended", request);
  SPIN_CHECK(uint64_t{r.tokens} + count <= config_.max_context,
             "request {} would hold {} tokens, more than max_context {}", request,
             uint64_t{r.tokens} + count, config_.max_context);
  const uint32_t old_pages = config_.layout.pages_for_tokens(r.tokens);
  const uint32_t new_pages = config_.layout.pages_for_tokens(uint64_t{r.tokens} + count);
  const uint32_t streams = config_.layout.streams();
  const uint64_t added = uint64_t{new_pages - old_pages} * streams;
  if (added > 0) {
    // Check every pool first: the reservation happens whole or not at all.
    device_pool_.require(added);
    if (r.offloaded) host_pool_.require(added);
    logical_segments_.require(
        uint64_t{segments_for(new_pages) - segments_for(old_pages)} * streams);
    if (r.offloaded) {
      const uint32_t first = request * streams;
      uint64_t grow = 0;
      for (uint32_t s = first; s < first + streams; ++s) {
        const uint32_t resident = streams_[s].resident_count;
        SPIN_CHECK(resident + (new_pages - old_pages) <= config_.max_resident_pages,
                   "request {} would keep {} pages of a head resident, max_resident_pages is {}",
                   request, resident + (new_pages - old_pages), config_.max_resident_pages);
        grow += segments_for(resident + new_pages - old_pages) - segments_for(resident);
      }
      resident_segments_.require(grow);
    }
  }
  for (uint32_t st = 0; st < streams && added > 0; ++st) {
    const uint32_t s = request * streams + st;
    for (uint32_t p = old_pages; p < new_pages; ++p) {
      if (p % kSegmentEntries == 0) {
        logical_directory_[uint64_t{s} * logical_dir_entries_ + p / kSegmentEntries] =
            logical_segments_.alloc();
      }
      const PageId device = device_pool_.alloc();
      LogicalEntry& e = logical_entry(s, p);
      e.resident_slot = kNoPage;
      if (r.offloaded) {
        e.page = host_pool_.alloc();
        push_resident(s, p, device, r.local_step);
      } else {
        e.page = device;
      }
    }
    // Pages that slid out of the recent window were read as window by the current step.
    if (r.offloaded) {
      for (uint32_t slot = 0; slot < streams_[s].resident_count; ++slot) {
        const uint32_t i = resident_index(s, slot);
        const uint32_t logical = resident_logical_[i];
        if (pinned(logical, old_pages) && !pinned(logical, new_pages))
          resident_stamp_[i] = r.local_step;
      }
    }
  }
  r.tokens += count;
}

void KvManager::write_tokens(RequestId request, uint32_t layer, uint32_t first_token,
                             uint32_t count, const void* k, const void* v) {
  RequestState& r = state(request);
  SPIN_CHECK(uint64_t{first_token} + count <= r.tokens,
             "writing tokens {}..{} of request {} beyond its {} reserved tokens", first_token,
             uint64_t{first_token} + count, request, r.tokens);
  const KvLayout& L = config_.layout;
  const uint64_t row_stride = uint64_t{L.num_kv_heads} * L.head_dim;
  const uint64_t elem = elem_bytes(L.elem);
  for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
    const uint32_t s = stream_index(request, layer, h);
    uint32_t token = first_token;
    while (token < first_token + count) {
      const uint32_t logical = token / L.page_size;
      const uint32_t slot = token % L.page_size;
      const uint32_t n = std::min(L.page_size - slot, first_token + count - token);
      const uint64_t offset = ((token - first_token) * row_stride + uint64_t{h} * L.head_dim) * elem;
      const auto* kp = static_cast<const std::byte*>(k) + offset;
      const auto* vp = static_cast<const std::byte*>(v) + offset;
      const LogicalEntry& e = logical_entry(s, logical);
      if (!r.offloaded) {
        memory_.write_tokens(Tier::Device, e.page, slot, n, kp, vp, row_stride);
      } else {
        SPIN_CHECK(e.resident_slot != kNoPage,
                   "writing page {} of request {} that is not device-resident", logical, request);
        const PageId device = resident_device_page_[resident_index(s, e.resident_slot)];
        memory_.write_tokens(Tier::Device, device, slot, n, kp, vp, row_stride);
        memory_.write_tokens(Tier::Host, e.page, slot, n, kp, vp, row_stride);
        const uint64_t bytes = 2 * uint64_t{n} * L.token_bytes();
        r.counters.d2h_bytes += bytes;
        global_.d2h_bytes += bytes;
      }
      token += n;
    }
  }
}

void KvManager::finish_prefill(RequestId request) {
  RequestState& r = state(request);
  SPIN_CHECK(!r.offloaded, "request {} is already offloaded", request);
  const uint32_t pages = config_.layout.pages_for_tokens(r.tokens);
  const uint32_t streams = config_.layout.streams();
  const uint32_t keep = pinned_count(pages);
  SPIN_CHECK(keep <= config_.max_resident_pages,
             "{} always-resident pages exceed max_resident_pages {}", keep,
             config_.max_resident_pages);
  host_pool_.require(uint64_t{pages} * streams);
  resident_segments_.require(uint64_t{segments_for(keep)} * streams);

  copies_.clear();
  for (uint32_t st = 0; st < streams; ++st) {
    const uint32_t s = request * streams + st;
    for (uint32_t p = 0; p < pages; ++p) {
      LogicalEntry& e = logical_entry(s, p);
      const PageId device = e.page;
      e.page = host_pool_.alloc();
      copies_.push_back({device, e.page});
    }
  }
  memory_.copy_pages(Tier::Device, Tier::Host, copies_);
  size_t c = 0;
  for (uint32_t st = 0; st < streams; ++st) {
    const uint32_t s = request * streams + st;
    for (uint32_t p = 0; p < pages; ++p, ++c) {
      if (pinned(p, pages)) {
        push_resident(s, p, copies_[c].src, r.local_step);
      } else {
        device_pool_.free(copies_[c].src);
      }
    }
  }
  const uint64_t moved = copies_.size();
  const uint64_t bytes = moved * config_.layout.page_bytes();
  r.counters.d2h_pages += moved;
  r.counters.d2h_bytes += bytes;
  global_.d2h_pages += moved;
  global_.d2h_bytes += bytes;
  r.offloaded = true;
}

void KvManager::set_buffer_pages(RequestId request, uint32_t pages) {
  RequestState& r = state(request);
  r.buffer_pages = pages;
  if (!r.offloaded) return;
  const uint32_t num_pages = config_.layout.pages_for_tokens(r.tokens);
  const uint32_t streams = config_.layout.streams();
  KvCounters delta;
  for (uint32_t s = request * streams; s < (request + 1) * streams; ++s) {
    const uint32_t candidates = count_candidates(s, num_pages, r.local_step);
    if (candidates > pages) evict(s, num_pages, r.local_step, candidates - pages, delta);
  }
  r.counters += delta;
  global_ += delta;
}

void KvManager::retrieve(RequestId request, uint32_t layer, uint64_t step,
                         const LayerSelection& selection, std::vector<PageId>& device_pages) {
  RequestState& r = state(request);
  SPIN_CHECK(!r.suspended, "request {} is suspended", request);
  const KvLayout& L = config_.layout;
  SPIN_CHECK(selection.num_heads() == L.num_kv_heads, "selection has {} heads, layout has {}",
             selection.num_heads(), L.num_kv_heads);
  SPIN_CHECK(!r.stepped || step >= r.last_step, "step {} of request {} is before step {}", step,
             request, r.last_step);
  const uint32_t num_pages = L.pages_for_tokens(r.tokens);
  const bool new_step = !r.stepped || step > r.last_step;
  SPIN_CHECK(!new_step || r.local_step < 0xfffffffeu, "request {} ran out of step stamps",
             request);
  const uint32_t now = new_step ? r.local_step + 1 : r.local_step;

  // Phase 1, read-only: validate, count misses and the evictions each head needs, check pools.
  plans_.assign(L.num_kv_heads, HeadPlan{});
  uint64_t misses = 0, evictions = 0;
  int64_t segment_growth = 0;
  for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
    const uint32_t s = stream_index(request, layer, h);
    if (++seen_mark_ == 0) {  // wrapped: clear old marks
      std::fill(seen_.begin(), seen_.end(), 0);
      seen_mark_ = 1;
    }
    uint32_t unpinned_hits = 0;
    for (uint32_t logical : selection.head(h)) {
      SPIN_CHECK(logical < num_pages, "selected page {} of request {} beyond its {} pages",
                 logical, request, num_pages);
      SPIN_CHECK(seen_[logical] != seen_mark_, "page {} selected twice for head {}", logical, h);
      seen_[logical] = seen_mark_;
      if (!r.offloaded) continue;
      const LogicalEntry& e = logical_entry(s, logical);
      if (e.resident_slot == kNoPage) {
        ++plans_[h].misses;
      } else if (!pinned(logical, num_pages)) {
        ++unpinned_hits;
      }
    }
    if (!r.offloaded) continue;
    const uint32_t resident = streams_[s].resident_count;
    const uint32_t unpinned = resident - pinned_count(num_pages);
    // Upper bound first; the exact count needs a pass only when eviction may be due.
    uint32_t candidates = unpinned - unpinned_hits;
    if (candidates > r.buffer_pages) {
      candidates = count_candidates(s, num_pages, now);
      // Selected hits are not stamped yet; take them out of the count.
      for (uint32_t logical : selection.head(h)) {
        const LogicalEntry& e = logical_entry(s, logical);
        if (e.resident_slot != kNoPage && !pinned(logical, num_pages) &&
            resident_stamp_[resident_index(s, e.resident_slot)] != now)
          --candidates;
      }
    }
    plans_[h].evictions = candidates > r.buffer_pages ? candidates - r.buffer_pages : 0;
    const uint32_t after = resident - plans_[h].evictions + plans_[h].misses;
    if (after > config_.max_resident_pages) {
      throw PoolExhausted("resident table of a KV head", after, config_.max_resident_pages);
    }
    segment_growth += int64_t{segments_for(after)} - int64_t{segments_for(resident)};
    misses += plans_[h].misses;
    evictions += plans_[h].evictions;
  }
  if (misses > evictions) device_pool_.require(misses - evictions);
  if (segment_growth > 0) resident_segments_.require(static_cast<uint64_t>(segment_growth));

  // Phase 2: stamp hits, evict, load misses, update tables.
  r.stepped = true;
  r.last_step = step;
  r.local_step = now;
  KvCounters delta;
  device_pages.resize(selection.pages.size());
  if (!r.offloaded) {
    for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
      const uint32_t s = stream_index(request, layer, h);
      const auto head = selection.head(h);
      for (size_t i = 0; i < head.size(); ++i)
        device_pages[selection.offsets[h] + i] = logical_entry(s, head[i]).page;
    }
    delta.hits = selection.pages.size();
    r.counters += delta;
    global_ += delta;
    return;
  }
  for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
    const uint32_t s = stream_index(request, layer, h);
    for (uint32_t logical : selection.head(h)) {
      const LogicalEntry& e = logical_entry(s, logical);
      if (e.resident_slot != kNoPage) resident_stamp_[resident_index(s, e.resident_slot)] = now;
    }
    evict(s, num_pages, now, plans_[h].evictions, delta);
  }
  copies_.clear();
  for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
    const uint32_t s = stream_index(request, layer, h);
    const auto head = selection.head(h);
    for (size_t i = 0; i < head.size(); ++i) {
      const uint32_t logical = head[i];
      const LogicalEntry& e = logical_entry(s, logical);
      if (e.resident_slot == kNoPage) {
        const PageId device = device_pool_.alloc();
        copies_.push_back({e.page, device});
        push_resident(s, logical, device, now);
        device_pages[selection.offsets[h] + i] = device;
        ++delta.misses;
      } else {
        device_pages[selection.offsets[h] + i] =
            resident_device_page_[resident_index(s, e.resident_slot)];
        ++delta.hits;
      }
    }
  }
  memory_.copy_pages(Tier::Host, Tier::Device, copies_);
  delta.h2d_pages = copies_.size();
  delta.h2d_bytes = copies_.size() * L.page_bytes();
  r.counters += delta;
  global_ += delta;
}

void KvManager::drop_layer(RequestId request, uint32_t layer) {
  RequestState& r = state(request);
  if (!r.offloaded) return;
  const uint32_t num_pages = config_.layout.pages_for_tokens(r.tokens);
  KvCounters delta;
  for (uint32_t h = 0; h < config_.layout.num_kv_heads; ++h) {
    const uint32_t s = stream_index(request, layer, h);
    // Highest slots first, so a swap-remove never moves a page that is still to be checked.
    for (uint32_t slot = streams_[s].resident_count; slot-- > 0;) {
      const uint32_t i = resident_index(s, slot);
      if (pinned(resident_logical_[i], num_pages)) continue;
      device_pool_.free(resident_device_page_[i]);
      remove_resident(s, slot);
      ++delta.evictions;
    }
  }
  r.counters += delta;
  global_ += delta;
}

void KvManager::release(RequestId request) {
  RequestState& r = state(request);
  const uint32_t pages = config_.layout.pages_for_tokens(r.tokens);
  const uint32_t streams = config_.layout.streams();
  for (uint32_t s = request * streams; s < (request + 1) * streams; ++s) {
    while (streams_[s].resident_count > 0) {
      const uint32_t last = streams_[s].resident_count - 1;
      device_pool_.free(resident_device_page_[resident_index(s, last)]);
      remove_resident(s, last);
    }
    for (uint32_t p = 0; p < pages; ++p) {
      PagePool& pool = r.offloaded ? host_pool_ : device_pool_;
      pool.free(logical_entry(s, p).page);
    }
    for (uint32_t d = 0; d < segments_for(pages); ++d) {
      uint32_t& dir = logical_directory_[uint64_t{s} * logical_dir_entries_ + d];
      logical_segments_.free(dir);
      dir = kNoPage;
    }
  }
  r.active = false;
  request_slots_.free(request);
}

void KvManager::suspend(RequestId request) {
  RequestState& r = state(request);
  SPIN_CHECK(r.offloaded && !r.suspended, "request {} cannot be suspended (offloaded: {}, suspended: {})",
             request, r.offloaded, r.suspended);
  const uint32_t streams = config_.layout.streams();
  for (uint32_t s = request * streams; s < (request + 1) * streams; ++s) {
    while (streams_[s].resident_count > 0) {
      const uint32_t last = streams_[s].resident_count - 1;
      device_pool_.free(resident_device_page_[resident_index(s, last)]);
      remove_resident(s, last);
    }
  }
  r.suspended = true;
}

void KvManager::resume(RequestId request) {
  RequestState& r = state(request);
  SPIN_CHECK(r.suspended, "request {} is not suspended", request);
  const uint32_t pages = config_.layout.pages_for_tokens(r.tokens);
  const uint32_t streams = config_.layout.streams();
  const uint32_t keep = pinned_count(pages);
  device_pool_.require(uint64_t{keep} * streams);
  resident_segments_.require(uint64_t{segments_for(keep)} * streams);
  copies_.clear();
  for (uint32_t s = request * streams; s < (request + 1) * streams; ++s) {
    for (uint32_t p = 0; p < pages; ++p) {
      if (!pinned(p, pages)) continue;
      const PageId device = device_pool_.alloc();
      copies_.push_back({logical_entry(s, p).page, device});
      push_resident(s, p, device, r.local_step);
    }
  }
  memory_.copy_pages(Tier::Host, Tier::Device, copies_);
  KvCounters delta;
  delta.misses = copies_.size();
  delta.h2d_pages = copies_.size();
  delta.h2d_bytes = copies_.size() * config_.layout.page_bytes();
  r.counters += delta;
  global_ += delta;
  r.suspended = false;
}

bool KvManager::suspended(RequestId request) const { return state(request).suspended; }

PageLocation KvManager::lookup(RequestId request, uint32_t layer, uint32_t head,
                               uint32_t logical) const {
  const RequestState& r = state(request);
  SPIN_CHECK(logical < config_.layout.pages_for_tokens(r.tokens),
             "page {} of request {} is beyond its tokens", logical, request);
  const uint32_t s = stream_index(request, layer, head);
  const LogicalEntry& e = logical_entry(s, logical);
  if (!r.offloaded) return {e.page, kNoPage};
  PageLocation loc{kNoPage, e.page};
  if (e.resident_slot != kNoPage) loc.device = resident_device_page_[resident_index(s, e.resident_slot)];
  return loc;
}

bool KvManager::is_always_resident(RequestId request, uint32_t logical) const {
  return pinned(logical, config_.layout.pages_for_tokens(state(request).tokens));
}

uint32_t KvManager::num_tokens(RequestId request) const { return state(request).tokens; }

uint32_t KvManager::num_pages(RequestId request) const {
  return config_.layout.pages_for_tokens(state(request).tokens);
}

bool KvManager::offloaded(RequestId request) const { return state(request).offloaded; }

uint32_t KvManager::buffer_pages(RequestId request) const { return state(request).buffer_pages; }

std::vector<uint32_t> KvManager::resident_pages(RequestId request, uint32_t layer,
                                                uint32_t head) const {
  state(request);
  const uint32_t s = stream_index(request, layer, head);
  std::vector<uint32_t> out;
  for (uint32_t slot = 0; slot < streams_[s].resident_count; ++slot)
    out.push_back(resident_logical_[resident_index(s, slot)]);
  return out;
}

const KvCounters& KvManager::counters(RequestId request) const { return state(request).counters; }

uint32_t KvManager::num_active_requests() const { return request_slots_.num_used(); }

MetadataBytes KvManager::two_level_metadata_bytes(const KvConfig& raw,
                                                  uint64_t resident_segments_in_use,
                                                  uint64_t logical_segments_in_use) {
  const KvConfig config = with_defaults(raw);
  const uint64_t streams = uint64_t{config.max_batch} * config.layout.streams();
  const uint64_t max_pages = config.layout.pages_for_tokens(config.max_context);
  MetadataBytes m;
  m.device_directories =
      streams * (segments_for(config.max_resident_pages) * sizeof(uint32_t) + sizeof(StreamState));
  m.device_segments =
      resident_segments_in_use * kSegmentEntries * (2 * sizeof(uint32_t) + sizeof(PageId));
  m.host_directories = streams * segments_for(static_cast<uint32_t>(max_pages)) * sizeof(uint32_t) +
                       uint64_t{config.max_batch} * sizeof(RequestState);
  m.host_segments = logical_segments_in_use * kSegmentEntries * sizeof(LogicalEntry);
  if (!config.tier_split) {
    const uint64_t logical_dirs = streams * segments_for(static_cast<uint32_t>(max_pages)) * sizeof(uint32_t);
    m.device_directories += logical_dirs;
    m.host_directories -= logical_dirs;
    m.device_segments += m.host_segments;
    m.host_segments = 0;
  }
  return m;
}

MetadataBytes KvManager::metadata_bytes() const {
  return two_level_metadata_bytes(config_, resident_segments_.num_used(),
                                  logical_segments_.num_used());
}

FlatMetadataBytes KvManager::flat_metadata_bytes(const KvConfig& raw) {
  const KvConfig config = with_defaults(raw);
  const uint64_t entries = uint64_t{config.max_batch} *
                           config.layout.pages_for_tokens(config.max_context) *
                           config.layout.streams();
  FlatMetadataBytes f;
  f.device_page_table = entries * (sizeof(PageId) + sizeof(uint32_t));
  f.host_page_table = entries * sizeof(PageId);
  return f;
}

}  // namespace spin::kv
