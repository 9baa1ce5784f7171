#include "model/communicator.h"

#include <algorithm>
#include <cstring>

#include "base/error.h"

namespace spin {

class InProcessGroup::Member final : public Communicator {
 public:
  Member(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_.world_size_; }
  void all_reduce_sum(float* data, int64_t count) override { group_.reduce(rank_, data, count); }

  uint64_t calls = 0;  // collectives this rank entered (the same on every rank between resets)

 private:
  InProcessGroup& group_;
  int rank_;
};

InProcessGroup::InProcessGroup(int world_size)
    : world_size_(world_size), data_(std::max(world_size, 0)), counts_(std::max(world_size, 0)) {
  SPIN_CHECK(world_size >= 1, "tensor parallel: the world size must be >= 1, got {}", world_size);
  for (int r = 0; r < world_size; ++r) members_.push_back(std::make_unique<Member>(*this, r));
}

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::communicator(int rank) {
  SPIN_CHECK(rank >= 0 && rank < world_size_, "tensor parallel: rank {} outside 0..{}", rank,
             world_size_ - 1);
  return *members_[rank];
}

void InProcessGroup::abort() {
  {
    std::lock_guard lock(mutex_);
    aborted_ = true;
  }
  arrived_.notify_all();
}

void InProcessGroup::reset() {
  std::lock_guard lock(mutex_);
  aborted_ = false;
  waiting_ = 0;
  for (auto& m : members_) m->calls = 0;
}

void InProcessGroup::barrier() {
  std::unique_lock lock(mutex_);
  SPIN_CHECK(!aborted_, "tensor parallel: another rank failed");
  const uint64_t generation = generation_;
  if (++waiting_ == world_size_) {
    waiting_ = 0;
    ++generation_;
    lock.unlock();
    arrived_.notify_all();
    return;
  }
  arrived_.wait(lock, [&] { return generation_ != generation || aborted_; });
  SPIN_CHECK(generation_ != generation, "tensor parallel: another rank failed");
}

void InProcessGroup::reduce(int rank, float* data, int64_t count) {
  SPIN_CHECK(count >= 0, "all-reduce: negative count {}", count);
  if (world_size_ == 1) return;
  Member& me = *members_[rank];
  std::vector<float>& sums = sums_[me.calls % 2];
  ++me.calls;
  data_[rank] = data;
  counts_[rank] = count;
  // Rank 0 sizes this call's buffer; nobody touches it until the barrier (see sums_).
  if (rank == 0) sums.resize(static_cast<size_t>(count));
  barrier();
  for (int r = 0; r < world_size_; ++r) {
    SPIN_CHECK(counts_[r] == count, "all-reduce: rank {} passed {} values but rank {} passed {}", r,
               counts_[r], rank, count);
  }
  // Each rank sums its own slice of the elements, always in rank order.
  const int64_t begin = count * rank / world_size_;
  const int64_t end = count * (rank + 1) / world_size_;
  for (int64_t i = begin; i < end; ++i) {
    float s = data_[0][i];
    for (int r = 1; r < world_size_; ++r) s += data_[r][i];
    sums[i] = s;
  }
  barrier();
  if (count > 0) std::memcpy(data, sums.data(), sizeof(float) * static_cast<size_t>(count));
}

}  // namespace spin
