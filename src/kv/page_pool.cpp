#include "kv/page_pool.h"

#include <fmt/format.h>

namespace spin::kv {

PoolExhausted::PoolExhausted(std::string pool, uint64_t requested, uint64_t available)
    : Error(fmt::format("{} exhausted: {} needed, {} free", pool, requested, available)),
      pool_(std::move(pool)),
      requested_(requested),
      available_(available) {}

IdPool::IdPool(std::string name, uint32_t capacity)
    : name_(std::move(name)), capacity_(capacity), used_(capacity, 0) {
  SPIN_CHECK(capacity < 0xffffffffu, "{} capacity {} too large", name_, capacity);
  free_list_.reserve(capacity);
  // Lowest ids on top of the stack, so allocation order is deterministic and readable in tests.
  for (uint32_t id = capacity; id-- > 0;) free_list_.push_back(id);
}

uint32_t IdPool::alloc() {
  require(1);
  const uint32_t id = free_list_.back();
  free_list_.pop_back();
  used_[id] = 1;
  return id;
}

void IdPool::free(uint32_t id) {
  SPIN_CHECK(is_used(id), "{}: freeing id {} that is not allocated", name_, id);
  used_[id] = 0;
  free_list_.push_back(id);
}

void IdPool::require(uint64_t count) const {
  if (count > free_list_.size()) throw PoolExhausted(name_, count, free_list_.size());
}

PagePool::PagePool(Tier tier, uint32_t capacity_pages, uint64_t page_bytes)
    : IdPool(tier == Tier::Device ? "device KV page pool" : "host KV page pool", capacity_pages),
      tier_(tier),
      page_bytes_(page_bytes) {}

}  // namespace spin::kv
