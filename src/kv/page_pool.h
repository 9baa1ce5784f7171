#pragma once
// Fixed-capacity pools of physical pages (and of metadata segments): O(1) alloc/free from a
// free list. When a pool cannot satisfy a request it throws PoolExhausted, a typed error the
// scheduler catches to preempt or delay; callers check capacity before mutating anything, so
// nothing is ever left half-updated.
#include <cstdint>
#include <string>
#include <vector>

#include "base/error.h"
#include "kv/page_memory.h"

namespace spin::kv {

class PoolExhausted : public Error {
 public:
  PoolExhausted(std::string pool, uint64_t requested, uint64_t available);
  const std::string& pool() const { return pool_; }
  uint64_t requested() const { return requested_; }
  uint64_t available() const { return available_; }

 private:
  std::string pool_;
  uint64_t requested_;
  uint64_t available_;
};

// Hands out ids 0..capacity-1. Used for device pages, host pages and metadata segments.
class IdPool {
 public:
  IdPool(std::string name, uint32_t capacity);
  uint32_t alloc();  // throws PoolExhausted
  void free(uint32_t id);
  // Throws PoolExhausted unless `count` ids are free; lets multi-step operations check first.
  void require(uint64_t count) const;
  uint32_t capacity() const { return capacity_; }
  uint32_t num_free() const { return static_cast<uint32_t>(free_list_.size()); }
  uint32_t num_used() const { return capacity_ - num_free(); }
  bool is_used(uint32_t id) const { return id < capacity_ && used_[id]; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  uint32_t capacity_;
  std::vector<uint32_t> free_list_;
  std::vector<uint8_t> used_;  // catches double free / foreign ids
};

class PagePool : public IdPool {
 public:
  PagePool(Tier tier, uint32_t capacity_pages, uint64_t page_bytes);
  Tier tier() const { return tier_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t capacity_bytes() const { return uint64_t{capacity()} * page_bytes_; }
  uint64_t used_bytes() const { return uint64_t{num_used()} * page_bytes_; }

 private:
  Tier tier_;
  uint64_t page_bytes_;
};

}  // namespace spin::kv
