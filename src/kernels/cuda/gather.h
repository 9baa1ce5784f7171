#pragma once
// Retrieve gather: copies pages from pinned host memory straight into device page slots with a
// kernel (zero-copy reads over the host link), so many small scattered pages move in one launch
// instead of one DMA per page.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

// Copies page src_ids[i] of host_pool to slot dst_ids[i] of device_pool for i < num_pages.
// host_pool is the DEVICE pointer of mapped pinned memory (cudaHostAlloc with
// cudaHostAllocMapped, then cudaHostGetDevicePointer; or cudaHostRegister'ed memory; with
// unified addressing the host pointer itself works). Both pools and page_bytes must be 16-byte
// aligned; ids are trusted to lie inside the pools. max_blocks bounds the thread blocks, and so
// the SMs the copy occupies (one block per SM at most 1024 threads), leaving the rest to compute.
// Returns cudaErrorInvalidValue on bad arguments, else the launch status.
cudaError_t gather_pages(const void* host_pool, void* device_pool, const int32_t* src_ids,
                         const int32_t* dst_ids, int num_pages, size_t page_bytes, int max_blocks,
                         cudaStream_t stream);

}  // namespace spin::cuda
