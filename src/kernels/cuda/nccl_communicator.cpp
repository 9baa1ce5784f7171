#include "kernels/cuda/nccl_communicator.h"

#include <nccl.h>

#include <cstdlib>
#include <cstring>

#include "base/error.h"

namespace spin::cuda {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "NcclId must hold an ncclUniqueId");

namespace {

void check_nccl(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  const char* detail = ncclGetLastError(nullptr);
  fail("NCCL: {} failed: {}{}{}", what, ncclGetErrorString(result), detail && *detail ? ": " : "",
       detail ? detail : "");
}

}  // namespace

void set_nccl_environment() {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
}

NcclId make_nccl_id() {
  set_nccl_environment();
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  NcclId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(const NcclId& id, int rank, int world_size, int device)
    : rank_(rank), world_size_(world_size), device_(device) {
  SPIN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
             "NCCL: rank {} outside 0..{} (world size {})", rank, world_size - 1, world_size);
  int devices = 0;
  const cudaError_t count = cudaGetDeviceCount(&devices);
  SPIN_CHECK(count == cudaSuccess, "NCCL: cannot count the GPUs: {}", cudaGetErrorString(count));
  SPIN_CHECK(device >= 0 && device < devices, "NCCL: rank {} asks for GPU {} but {} GPU(s) are visible",
             rank, device, devices);
  const cudaError_t set = cudaSetDevice(device);
  SPIN_CHECK(set == cudaSuccess, "NCCL: cannot use GPU {}: {}", device, cudaGetErrorString(set));
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), sizeof(nccl_id));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, world_size, nccl_id, rank), "ncclCommInitRank");
  comm_ = comm;
}

void NcclCommunicator::abort() {
  ncclComm_t comm = comm_.exchange(nullptr);
  if (comm == nullptr) return;
  cudaSetDevice(device_);
  ncclCommAbort(comm);
}

NcclCommunicator::~NcclCommunicator() {
  ncclComm_t comm = comm_.exchange(nullptr);
  if (comm == nullptr) return;  // never made, or aborted
  cudaSetDevice(device_);
  // Flushes this rank's pending collectives before freeing; errors cannot be reported here.
  ncclCommFinalize(comm);
  ncclCommDestroy(comm);
}

void NcclCommunicator::all_reduce(void* data, size_t count, int nccl_type, cudaStream_t stream) {
  SPIN_CHECK(data != nullptr || count == 0, "NCCL all-reduce: null buffer of {} values", count);
  ncclComm_t comm = comm_.load();
  SPIN_CHECK(comm != nullptr, "NCCL all-reduce on rank {}: the communicator was aborted after a rank failed", rank_);
  check_nccl(ncclAllReduce(data, data, count, static_cast<ncclDataType_t>(nccl_type), ncclSum, comm, stream),
             "ncclAllReduce");
}

void NcclCommunicator::all_reduce_sum(float* data, size_t count, cudaStream_t stream) {
  all_reduce(data, count, ncclFloat32, stream);
}

void NcclCommunicator::all_reduce_sum(__nv_bfloat16* data, size_t count, cudaStream_t stream) {
  all_reduce(data, count, ncclBfloat16, stream);
}

}  // namespace spin::cuda
