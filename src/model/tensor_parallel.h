#pragma once
// Tensor parallelism (Megatron-style) for Llama-family decoders. Rank r of N owns a contiguous
// block of attention heads with their KV heads, and a contiguous slice of the MLP's intermediate
// dimension:
//   q/k/v projections: the rows of the rank's heads (column-parallel); Qwen3 q/k norms replicated;
//   o projection: the columns of the rank's heads (row-parallel: partial sums over the ranks);
//   gate/up: the rows of the rank's slice; down: its columns (row-parallel);
//   norms, embeddings and the LM head: replicated.
// Each layer then needs two all-reduces (after the O and the down projections) and nothing else;
// attention and the KV it reads stay on the rank that owns the heads.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "model/communicator.h"
#include "model/forward_model.h"
#include "model/transformer.h"
#include "model/weights.h"

namespace spin {

// Throws spin::Error naming the numbers unless `world` ranks can split this model: world >= 1 and
// world divides the KV heads (hence the query heads) and the intermediate size.
void check_tensor_parallel(const ModelConfig& config, int world);
// One rank's config: n_heads, n_kv_heads and intermediate_size divided by world.
ModelConfig shard_config(const ModelConfig& config, int world);
// Rank `rank`'s weights (see the top of this file); their config is shard_config's.
ModelWeights shard_weights(const ModelWeights& weights, int rank, int world);

// One sequence's KV in a tensor-parallel model: one handle per rank, each holding only that
// rank's KV heads (in its own store). Made by the factory that goes with the model
// (engine/tensor_parallel_factory.h).
class TensorParallelKv final : public SequenceKv {
 public:
  explicit TensorParallelKv(std::vector<std::unique_ptr<SequenceKv>> ranks);
  int64_t length() const override { return ranks_.front()->length(); }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  SequenceKv& rank(int r) { return *ranks_[r]; }

 private:
  std::vector<std::unique_ptr<SequenceKv>> ranks_;
};

// N CPU Transformers over the ranks' shards, joined by an in-process all-reduce. Each forward runs
// every rank on its own persistent thread with threads / N OpenMP threads; the logits are rank 0's
// (every rank computes the same ones from the replicated LM head).
class TensorParallelModel final : public ForwardModel {
 public:
  // Copies the shards out of `weights` (which the caller may free afterwards). threads: CPU
  // threads all ranks share; 0 = the calling thread's OpenMP default.
  TensorParallelModel(const ModelWeights& weights, int world, int threads = 0);
  ~TensorParallelModel() override;
  TensorParallelModel(const TensorParallelModel&) = delete;
  TensorParallelModel& operator=(const TensorParallelModel&) = delete;

  // The whole model's config and attention shape (all heads): what the engine sizes budgets by.
  const ModelConfig& config() const override { return config_; }
  AttentionShape attention_shape() const override;
  // One rank's attention shape (n_heads / N query and n_kv_heads / N KV heads): what each rank's
  // attention factory is built for.
  AttentionShape rank_attention_shape() const { return ranks_.front()->attention_shape(); }
  int world_size() const { return static_cast<int>(ranks_.size()); }
  int threads_per_rank() const { return threads_per_rank_; }

  // chunks' attention must be TensorParallelKv of this world size.
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override;

 private:
  void worker(int rank);
  void run_rank(int rank);

  ModelConfig config_;
  std::vector<ModelWeights> shards_;
  InProcessGroup group_;
  std::vector<std::unique_ptr<Transformer>> ranks_;
  int threads_per_rank_ = 1;

  // The current forward's work, read by the workers.
  std::vector<std::vector<SequenceChunk>> rank_chunks_;
  std::vector<std::vector<float>> rank_logits_;
  bool all_logits_ = false;

  std::mutex mutex_;
  std::condition_variable start_;
  std::condition_variable done_;
  uint64_t job_ = 0;     // forwards started
  int pending_ = 0;      // ranks still running the current forward
  bool stopping_ = false;
  std::exception_ptr first_error_;  // the failure that aborted the group, not its echoes
  std::mutex threads_mutex_;        // serialises the ranks' thread-count setting (see run_rank)
  std::vector<std::thread> workers_;
};

}  // namespace spin
