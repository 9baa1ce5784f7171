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

#include "model/forward_model.h"
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

// One persistent thread per rank. run(task) runs task(r) on thread r for every rank at once and
// returns when all are done. A rank that throws calls on_failure (which must wake ranks waiting
// for it in a collective); the first exception is rethrown, not the others' echoes of it.
class RankThreads {
 public:
  explicit RankThreads(int world);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int world_size() const { return static_cast<int>(threads_.size()); }
  void run(const std::function<void(int rank)>& task, const std::function<void()>& on_failure);

 private:
  void loop(int rank);

  std::mutex mutex_;
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(int)>* task_ = nullptr;
  const std::function<void()>* on_failure_ = nullptr;
  uint64_t job_ = 0;  // tasks started
  int pending_ = 0;   // ranks still running the current task
  bool stopping_ = false;
  std::exception_ptr first_error_;
  std::vector<std::thread> threads_;
};

// What joins the ranks' collectives (an in-process group, NCCL communicators).
struct RankLinks {
  std::function<void()> abort;  // after a rank failed: wake the ranks waiting in a collective
  std::function<void()> reset;  // before each forward: usable again after an abort (or throw)
};

// N rank models, one per rank thread, each over its shard and joined to the others through
// RankLinks' collectives. forward() hands every rank its KV handles and runs all ranks at once;
// the logits are rank 0's (each rank computes the same ones from the replicated LM head).
class TensorParallelModel final : public ForwardModel {
 public:
  // Makes rank r's model on rank r's own thread, all ranks at once (NCCL communicators must be
  // created that way, and a GPU rank keeps its device current on its thread).
  using RankSetup = std::function<std::unique_ptr<ForwardModel>(int rank)>;

  // config: the whole model's. Throws spin::Error if world cannot split it or a rank's setup
  // fails (the ranks made so far are destroyed on their threads).
  TensorParallelModel(const ModelConfig& config, int world, const RankSetup& setup, RankLinks links);
  // Destroys each rank's model on its own thread, all at once (NCCL teardown is collective).
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

  // chunks' attention must be TensorParallelKv of this world size.
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override;
  // Every rank computes the same logits (replicated LM head) and draws the same tokens with the
  // same rule; rank 0's come back, and only rank 0 downloads the logit rows asked for.
  bool samples_on_device() const override { return ranks_.front()->samples_on_device(); }
  void forward_sampled(std::span<const SequenceChunk> chunks, std::span<const DeviceSampling> sampling, int64_t vocab,
                       std::span<const int64_t> logit_rows, std::vector<float>& logits,
                       std::vector<int32_t>& tokens) override;
  // Rank 0's: every rank runs the same steps.
  std::optional<ForwardStats> forward_stats() const override { return ranks_.front()->forward_stats(); }

 private:
  void destroy_ranks();
  // Splits the chunks' KV handles into each rank's chunks (rank_chunks_).
  void split_chunks(std::span<const SequenceChunk> chunks);

  ModelConfig config_;
  RankLinks links_;
  RankThreads threads_;
  std::vector<std::unique_ptr<ForwardModel>> ranks_;
  // The current forward's work.
  std::vector<std::vector<SequenceChunk>> rank_chunks_;
  std::vector<std::vector<float>> rank_logits_;
  std::vector<std::vector<int32_t>> rank_tokens_;
};

// The CPU model over `world` ranks: Transformers over the shards of `weights` (copied; the caller
// may free weights afterwards), joined by an in-process all-reduce, each rank running its kernels
// on threads / world OpenMP threads (threads: 0 = the calling thread's OpenMP default).
std::unique_ptr<TensorParallelModel> make_cpu_tensor_parallel_model(const ModelWeights& weights, int world,
                                                                    int threads = 0);

}  // namespace spin
