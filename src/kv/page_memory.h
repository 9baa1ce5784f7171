#pragma once
// The memory backend of the two tiers: storage for physical pages and the movement of page
// data. Policy code (KvManager) only talks to this interface, so the CUDA backend swaps in device
// memory + pinned host memory and a gather kernel while running the same residency logic.
#include <cstdint>
#include <span>
#include <vector>

#include "kv/layout.h"

namespace spin::kv {

enum class Tier : uint8_t { Device, Host };

using PageId = uint32_t;
inline constexpr PageId kNoPage = 0xffffffffu;

struct PageCopy {
  PageId src;
  PageId dst;
};

class PageMemory {
 public:
  virtual ~PageMemory() = default;
  virtual const KvLayout& layout() const = 0;
  virtual uint32_t capacity(Tier tier) const = 0;
  // Writes `count` tokens into slots [first_slot, first_slot + count) of one page. `k` and `v`
  // hold `count` rows of head_dim elements, consecutive rows `row_stride` elements apart.
  virtual void write_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count,
                            const void* k, const void* v, uint64_t row_stride) = 0;
  // Reads tokens back into dense [count][head_dim] buffers (tests, CPU attention).
  virtual void read_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count, void* k,
                           void* v) const = 0;
  // Copies whole pages between tiers as one batch (one gather kernel on CUDA).
  virtual void copy_pages(Tier from, Tier to, std::span<const PageCopy> copies) = 0;
};

// Both tiers in ordinary host memory; page moves are memcpy.
class HostPageMemory final : public PageMemory {
 public:
  HostPageMemory(const KvLayout& layout, uint32_t device_pages, uint32_t host_pages);
  const KvLayout& layout() const override { return layout_; }
  uint32_t capacity(Tier tier) const override;
  void write_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count, const void* k,
                    const void* v, uint64_t row_stride) override;
  void read_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count, void* k,
                   void* v) const override;
  void copy_pages(Tier from, Tier to, std::span<const PageCopy> copies) override;
  // Direct access for CPU kernels: the page's K rows, then its V rows.
  const std::byte* page_data(Tier tier, PageId page) const;

 private:
  std::byte* page_ptr(Tier tier, PageId page);
  KvLayout layout_;
  uint32_t device_pages_;
  uint32_t host_pages_;
  std::vector<std::byte> device_;
  std::vector<std::byte> host_;
};

}  // namespace spin::kv
