#pragma once
// Owned device and pinned host memory, and the error check every CUDA call of the GPU backend
// goes through (a failed call becomes a spin::Error naming what was being done).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "base/error.h"

namespace spin {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail("CUDA error in {}: {} ({})", what, cudaGetErrorString(status), static_cast<int>(status));
}

// A number never handed out before in this process: tags the buffers a captured CUDA graph
// points into, so a graph is never replayed after one of them moved (or on another store).
inline uint64_t new_buffers_epoch() {
  static std::atomic<uint64_t> last{0};
  return ++last;
}

// Device memory for `size` elements of T. reserve() reallocates without keeping the contents
// (callers refill it every step), so a grown buffer has a new address.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t size, const char* what = "device buffer") { reserve(size, what); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes room for at least `size` elements; returns true when the address changed.
  bool reserve(size_t size, const char* what = "device buffer") {
    if (size <= size_ && ptr_ != nullptr) return false;
    release();
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(size, 1) * sizeof(T);
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status != cudaSuccess) {
      cudaGetLastError();  // reset the last-error state so a later check is not blamed for it
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      fail("cannot allocate {:.2f} GB of GPU memory for the {} ({:.2f} GB free of {:.2f} GB): {}", bytes / 1e9, what,
           free_bytes / 1e9, total_bytes / 1e9, cudaGetErrorString(status));
    }
    ptr_ = static_cast<T*>(p);
    size_ = size;
    return true;
  }

  T* get() const { return ptr_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  void release() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory (asynchronous copies need it), same growth rule as DeviceBuffer.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void reserve(size_t size) {
    if (size <= size_ && ptr_ != nullptr) return;
    if (ptr_) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    void* p = nullptr;
    cuda_check(cudaMallocHost(&p, std::max<size_t>(size, 1) * sizeof(T)), "pinned host allocation");
    ptr_ = static_cast<T*>(p);
    size_ = size;
  }
  T* get() const { return ptr_; }
  T& operator[](size_t i) const { return ptr_[i]; }
  size_t size() const { return size_; }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace spin
