#pragma once
// A recorded selection trace: for each decode step and each (request, layer, KV head), the set
// of logical pages Select asked for. Sparse eval records it; the replacement oracle replays it.
//
// File format (little endian): "SPINTRC1", u32 page_size, u32 zero, u64 record count, u64 page
// count, then per record {u64 step, u32 request, u32 layer, u32 head, u32 page count}, then all
// pages as u32 in record order.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace spin::kv {

struct TraceRecord {
  uint64_t step = 0;
  uint32_t request = 0;
  uint32_t layer = 0;
  uint32_t head = 0;
  uint32_t first = 0;  // index of the record's first page in SelectionTrace::pages
  uint32_t count = 0;
};

struct SelectionTrace {
  uint32_t page_size = 16;
  std::vector<TraceRecord> records;  // in the order the steps ran
  std::vector<uint32_t> pages;

  void add(uint64_t step, uint32_t request, uint32_t layer, uint32_t head,
           std::span<const uint32_t> selected);
  std::span<const uint32_t> pages_of(const TraceRecord& record) const {
    return std::span<const uint32_t>(pages).subspan(record.first, record.count);
  }
};

void write_trace(const SelectionTrace& trace, const std::string& path);
// Throws spin::Error on a malformed or truncated file.
SelectionTrace read_trace(const std::string& path);

}  // namespace spin::kv
