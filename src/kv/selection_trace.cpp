#include "kv/selection_trace.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>

#include "base/checked.h"
#include "base/error.h"

namespace spin::kv {

static_assert(std::endian::native == std::endian::little, "trace I/O assumes little endian");

namespace {

constexpr char kMagic[8] = {'S', 'P', 'I', 'N', 'T', 'R', 'C', '1'};
constexpr uint64_t kHeaderBytes = 32;
constexpr uint64_t kRecordBytes = 24;

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
T get(const std::string& in, uint64_t& offset) {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof(T));
  offset += sizeof(T);
  return value;
}

}  // namespace

void SelectionTrace::add(uint64_t step, uint32_t request, uint32_t layer, uint32_t head,
                         std::span<const uint32_t> selected) {
  SPIN_CHECK(pages.size() + selected.size() < 0xffffffffu, "selection trace too large");
  records.push_back({step, request, layer, head, static_cast<uint32_t>(pages.size()),
                     static_cast<uint32_t>(selected.size())});
  pages.insert(pages.end(), selected.begin(), selected.end());
}

void write_trace(const SelectionTrace& trace, const std::string& path) {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, trace.page_size);
  put<uint32_t>(out, 0);
  put<uint64_t>(out, trace.records.size());
  put<uint64_t>(out, trace.pages.size());
  for (const TraceRecord& r : trace.records) {
    put<uint64_t>(out, r.step);
    put<uint32_t>(out, r.request);
    put<uint32_t>(out, r.layer);
    put<uint32_t>(out, r.head);
    put<uint32_t>(out, r.count);
  }
  out.append(reinterpret_cast<const char*>(trace.pages.data()),
             trace.pages.size() * sizeof(uint32_t));
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  SPIN_CHECK(file.good(), "cannot create selection trace {}", path);
  file.write(out.data(), static_cast<std::streamsize>(out.size()));
  SPIN_CHECK(file.good(), "failed writing selection trace {}", path);
}

SelectionTrace read_trace(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  SPIN_CHECK(file.good(), "cannot open selection trace {}", path);
  const std::string in((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  SPIN_CHECK(in.size() >= kHeaderBytes && std::memcmp(in.data(), kMagic, sizeof(kMagic)) == 0,
             "{} is not a spin selection trace (bad magic or truncated header)", path);
  uint64_t offset = sizeof(kMagic);
  SelectionTrace trace;
  trace.page_size = get<uint32_t>(in, offset);
  get<uint32_t>(in, offset);
  const uint64_t num_records = get<uint64_t>(in, offset);
  const uint64_t num_pages = get<uint64_t>(in, offset);
  const uint64_t expected =
      checked_add(checked_add(kHeaderBytes, checked_mul(num_records, kRecordBytes, "trace records"),
                              "trace size"),
                  checked_mul(num_pages, sizeof(uint32_t), "trace pages"), "trace size");
  SPIN_CHECK(expected == in.size(), "selection trace {} is {} bytes, its header implies {}", path,
             in.size(), expected);
  SPIN_CHECK(num_pages < 0xffffffffu, "selection trace {} has too many pages", path);
  trace.records.reserve(num_records);
  uint64_t first = 0;
  for (uint64_t i = 0; i < num_records; ++i) {
    TraceRecord r;
    r.step = get<uint64_t>(in, offset);
    r.request = get<uint32_t>(in, offset);
    r.layer = get<uint32_t>(in, offset);
    r.head = get<uint32_t>(in, offset);
    r.count = get<uint32_t>(in, offset);
    r.first = static_cast<uint32_t>(first);
    first += r.count;
    SPIN_CHECK(first <= num_pages, "selection trace {}: record {} runs past the page list", path,
               i);
    trace.records.push_back(r);
  }
  SPIN_CHECK(first == num_pages, "selection trace {}: records name {} pages, file holds {}", path,
             first, num_pages);
  trace.pages.resize(num_pages);
  std::memcpy(trace.pages.data(), in.data() + offset, num_pages * sizeof(uint32_t));
  return trace;
}

}  // namespace spin::kv
