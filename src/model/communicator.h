#pragma once
// Collective communication between the ranks of a tensor-parallel model. Each rank's forward pass
// holds one Communicator and calls the same collectives in the same order as every other rank.
// The in-process group runs N ranks on N threads of one process (the CPU backend and its tests);
// GPUs use NCCL (kernels/cuda/nccl_communicator.h) on device buffers instead.
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace spin {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Replaces data[0, count) on every rank by its elementwise sum over all ranks. Collective: every
  // rank calls it with the same count. Throws spin::Error when the ranks disagree or the group was
  // aborted.
  virtual void all_reduce_sum(float* data, int64_t count) = 0;
};

// N ranks on N threads of one process. Sums each element in rank order 0, 1, ..., N-1, so every
// rank gets the bit-identical result and a rerun gives the same bits.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int world_size() const { return world_size_; }
  Communicator& communicator(int rank);
  // Wakes every rank waiting in a collective, and fails every later one, with a spin::Error: a
  // rank that failed calls this so the others do not wait for it forever.
  void abort();
  // Makes the group usable again after an abort. Only while no rank is inside a collective.
  void reset();

 private:
  class Member;
  friend class Member;

  // Waits until all ranks arrive; throws once the group is aborted.
  void barrier();
  void reduce(int rank, float* data, int64_t count);

  int world_size_;
  std::vector<std::unique_ptr<Member>> members_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  int waiting_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  // What each rank passed to the current collective.
  std::vector<float*> data_;
  std::vector<int64_t> counts_;
  // Two result buffers used alternately: a rank may start the next collective (and write the
  // other buffer) while slower ranks still copy this one's result out.
  std::vector<float> sums_[2];
  uint64_t calls_ = 0;  // collectives completed by rank 0 (picks the buffer)
};

}  // namespace spin
