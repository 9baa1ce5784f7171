#pragma once
// NCCL all-reduce between the GPUs of a tensor-parallel model (one rank per GPU, one thread per
// rank, one process). The GPU counterpart of model/communicator.h's in-process group: each rank's
// forward sums the partial outputs of its O and down projections in place, on its own stream.
// Built only when CMake finds NCCL (SPIN_WITH_NCCL).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>

struct ncclComm;  // nccl.h's ncclComm_t is ncclComm*; kept out of this header

namespace spin::cuda {

// What every rank's communicator is created from: made once, then handed to each rank's thread.
struct NcclId {
  std::array<char, 128> bytes{};  // an ncclUniqueId
};

// The NCCL settings spin runs with, each applied only when the environment leaves it unset:
//  - NCCL_NVLS_ENABLE=0: NVLink multicast off; on the shared multi-GPU machines a program using it
//    can take the host's GPUs out of service (see the device notes, KINDS.md).
//  - NCCL_RUNTIME_CONNECT=0: every connection is made inside ncclCommInitRank, while the GPUs are
//    idle. By default NCCL connects at a communicator's first collective of each kind, with
//    allocations that wait for the whole GPU; with one thread per GPU in one process, a rank
//    connecting mid-step can wait behind another rank's all-reduce kernel, which waits for it.
// make_nccl_id calls it, so it runs before NCCL reads its settings. Not thread-safe (setenv):
// call before starting the rank threads.
void set_nccl_environment();

// A fresh id (ncclGetUniqueId) after set_nccl_environment(). Throws spin::Error on failure.
NcclId make_nccl_id();

class NcclCommunicator {
 public:
  // Rank `rank` of `world_size` on GPU `device` (made current on the calling thread). Collective:
  // every rank's thread calls it at the same time with the same id, and it returns when all have
  // joined. Throws spin::Error naming the NCCL error.
  NcclCommunicator(const NcclId& id, int rank, int world_size, int device);
  // Collective too (NCCL tears down per node): every rank destroys its communicator at the same
  // time, each from its own thread.
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Aborts every operation of this communicator still pending (its kernels return) and makes it
  // unusable: after a rank failed mid-step, the ranks waiting for it in a collective would
  // otherwise wait forever. Any thread may call it, once the failure is known.
  void abort();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }

  // Replaces data[0, count) (device memory of this rank's GPU) by its elementwise sum over the
  // ranks, enqueued on `stream`. Collective: every rank calls it with the same count, in the same
  // order relative to its other collectives. Throws spin::Error naming the NCCL error.
  void all_reduce_sum(float* data, size_t count, cudaStream_t stream);
  void all_reduce_sum(__nv_bfloat16* data, size_t count, cudaStream_t stream);

 private:
  void all_reduce(void* data, size_t count, int nccl_type, cudaStream_t stream);

  std::atomic<ncclComm*> comm_{nullptr};
  int rank_ = 0;
  int world_size_ = 1;
  int device_ = 0;
};

}  // namespace spin::cuda
