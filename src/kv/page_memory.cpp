#include "kv/page_memory.h"

#include <cstring>

#include "base/checked.h"
#include "base/error.h"

namespace spin::kv {

void validate(const KvLayout& layout) {
  SPIN_CHECK(layout.num_layers > 0 && layout.num_kv_heads > 0 && layout.head_dim > 0,
             "KV layout needs layers, KV heads and head_dim > 0 (got {}, {}, {})",
             layout.num_layers, layout.num_kv_heads, layout.head_dim);
  SPIN_CHECK(layout.page_size >= 8 && layout.page_size <= 64,
             "KV page size must be 8..64 tokens, got {}", layout.page_size);
}

HostPageMemory::HostPageMemory(const KvLayout& layout, uint32_t device_pages, uint32_t host_pages)
    : layout_(layout), device_pages_(device_pages), host_pages_(host_pages) {
  validate(layout);
  device_.resize(checked_mul(device_pages, layout.page_bytes(), "device KV pool bytes"));
  host_.resize(checked_mul(host_pages, layout.page_bytes(), "host KV pool bytes"));
}

uint32_t HostPageMemory::capacity(Tier tier) const {
  return tier == Tier::Device ? device_pages_ : host_pages_;
}

std::byte* HostPageMemory::page_ptr(Tier tier, PageId page) {
  return const_cast<std::byte*>(page_data(tier, page));
}

const std::byte* HostPageMemory::page_data(Tier tier, PageId page) const {
  SPIN_CHECK(page < capacity(tier), "page {} outside the {} pool of {} pages", page,
             tier == Tier::Device ? "device" : "host", capacity(tier));
  const auto& bytes = tier == Tier::Device ? device_ : host_;
  return bytes.data() + uint64_t{page} * layout_.page_bytes();
}

void HostPageMemory::write_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count,
                                  const void* k, const void* v, uint64_t row_stride) {
  SPIN_CHECK(first_slot + count <= layout_.page_size, "token slots {}+{} exceed page size {}",
             first_slot, count, layout_.page_size);
  std::byte* base = page_ptr(tier, page);
  const uint64_t row = layout_.token_bytes();
  const uint64_t stride = row_stride * elem_bytes(layout_.elem);
  std::byte* k_dst = base + first_slot * row;
  std::byte* v_dst = base + layout_.page_size * row + first_slot * row;
  for (uint32_t t = 0; t < count; ++t) {
    std::memcpy(k_dst + t * row, static_cast<const std::byte*>(k) + t * stride, row);
    std::memcpy(v_dst + t * row, static_cast<const std::byte*>(v) + t * stride, row);
  }
}

void HostPageMemory::read_tokens(Tier tier, PageId page, uint32_t first_slot, uint32_t count,
                                 void* k, void* v) const {
  SPIN_CHECK(first_slot + count <= layout_.page_size, "token slots {}+{} exceed page size {}",
             first_slot, count, layout_.page_size);
  const std::byte* base = page_data(tier, page);
  const uint64_t row = layout_.token_bytes();
  std::memcpy(k, base + first_slot * row, count * row);
  std::memcpy(v, base + (layout_.page_size + first_slot) * row, count * row);
}

void HostPageMemory::copy_pages(Tier from, Tier to, std::span<const PageCopy> copies) {
  const uint64_t bytes = layout_.page_bytes();
  for (const PageCopy& c : copies) std::memcpy(page_ptr(to, c.dst), page_data(from, c.src), bytes);
}

}  // namespace spin::kv
