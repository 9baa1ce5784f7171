#pragma once
// Host memory that the device sees as `bytes` of address space over `backing` bytes of pinned
// memory, mapped again and again (CUDA virtual memory management). Benchmarks use it to time a
// host tier larger than the machine's RAM: a page read from any copy crosses the link like one
// from a tier of its own, but the copies share their contents, so it is never for serving. The
// driver pins the backing once; registering the same bytes many times counts each time (and
// fails past the RAM).
#include <cstddef>
#include <cstdint>

namespace spin {

class RepeatedHostMemory {
 public:
  // For the current device; bytes > 0 and backing in (0, bytes]. The backing is rounded up to
  // the allocation granularity, bytes up to whole copies. Only the device may read and write it.
  // Throws spin::Error with the reason when the driver cannot make it.
  RepeatedHostMemory(size_t bytes, size_t backing);
  ~RepeatedHostMemory();
  RepeatedHostMemory(const RepeatedHostMemory&) = delete;
  RepeatedHostMemory& operator=(const RepeatedHostMemory&) = delete;

  void* data() const { return reinterpret_cast<void*>(address_); }
  size_t size() const { return size_; }
  size_t backing() const { return backing_; }

 private:
  void release();

  unsigned long long address_ = 0;  // CUdeviceptr
  size_t size_ = 0;
  size_t backing_ = 0;
  unsigned long long allocation_ = 0;  // CUmemGenericAllocationHandle
  size_t mapped_ = 0;  // bytes of address_ mapped so far (what the destructor unmaps)
};

}  // namespace spin
