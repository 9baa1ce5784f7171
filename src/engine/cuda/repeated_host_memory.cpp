#include "engine/cuda/repeated_host_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "base/error.h"
#include "kernels/cuda/driver_entry_point.h"

namespace spin {
namespace {

// The driver's functions, or an error naming the one it lacks.
template <typename Fn>
Fn driver_function(const char* name) {
  const auto fn = cuda::driver_entry_point<Fn>(name);
  SPIN_CHECK(fn != nullptr, "the CUDA driver has no {}", name);
  return fn;
}

struct Driver {
  decltype(&cuMemGetAllocationGranularity) granularity = driver_function<decltype(granularity)>(
      "cuMemGetAllocationGranularity");
  decltype(&cuMemCreate) create = driver_function<decltype(create)>("cuMemCreate");
  decltype(&cuMemRelease) release = driver_function<decltype(release)>("cuMemRelease");
  decltype(&cuMemAddressReserve) reserve = driver_function<decltype(reserve)>("cuMemAddressReserve");
  decltype(&cuMemAddressFree) free = driver_function<decltype(free)>("cuMemAddressFree");
  decltype(&cuMemMap) map = driver_function<decltype(map)>("cuMemMap");
  decltype(&cuMemUnmap) unmap = driver_function<decltype(unmap)>("cuMemUnmap");
  decltype(&cuMemSetAccess) set_access = driver_function<decltype(set_access)>("cuMemSetAccess");
};

const Driver& driver() {
  static const Driver d;
  return d;
}

void driver_check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) fail("repeated host memory: {} failed (CUresult {})", what, static_cast<int>(result));
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

RepeatedHostMemory::RepeatedHostMemory(size_t bytes, size_t backing) {
  SPIN_CHECK(bytes > 0 && backing > 0 && backing <= bytes,
             "repeated host memory: backing ({} bytes) must be in (0, {}]", backing, bytes);
  const Driver& d = driver();
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) {
    fail("repeated host memory: no current device: {}", cudaGetErrorString(status));
  }
  // Host memory with no node named where the driver allows it, else the device's nearest node.
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
  size_t granularity = 0;
  if (d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) {
    int node = 0;
    if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device) != cudaSuccess || node < 0) node = 0;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = node;
    driver_check(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 "cuMemGetAllocationGranularity (host memory)");
  }
  backing_ = round_up(backing, granularity);
  size_ = round_up(bytes, backing_);
  try {
    driver_check(d.create(&allocation_, backing_, &prop, 0), "cuMemCreate (pinned host memory)");
    driver_check(d.reserve(&address_, size_, 0, 0, 0), "cuMemAddressReserve");
    for (; mapped_ < size_; mapped_ += backing_) {
      driver_check(d.map(address_ + mapped_, backing_, 0, allocation_, 0), "cuMemMap");
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    driver_check(d.set_access(address_, size_, &access, 1), "cuMemSetAccess");
  } catch (...) {
    release();
    throw;
  }
}

RepeatedHostMemory::~RepeatedHostMemory() { release(); }

void RepeatedHostMemory::release() {
  const Driver& d = driver();
  if (mapped_ > 0) d.unmap(address_, mapped_);
  if (address_ != 0) d.free(address_, size_);
  if (allocation_ != 0) d.release(allocation_);
  mapped_ = 0;
  address_ = 0;
  allocation_ = 0;
}

}  // namespace spin
