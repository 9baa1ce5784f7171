#include "model/tensor_parallel.h"

#include <algorithm>
#include <utility>

#include <spdlog/spdlog.h>

#include "base/error.h"
#include "kernels/cpu/ops.h"
#include "model/communicator.h"
#include "model/transformer.h"

namespace spin {

namespace {

// Rows [begin, begin + count) of m.
Matrix slice_rows(const Matrix& m, int64_t begin, int64_t count) {
  Matrix out;
  out.rows = count;
  out.cols = m.cols;
  out.data.assign(m.data.begin() + begin * m.cols, m.data.begin() + (begin + count) * m.cols);
  return out;
}

// Columns [begin, begin + count) of m.
Matrix slice_cols(const Matrix& m, int64_t begin, int64_t count) {
  Matrix out;
  out.rows = m.rows;
  out.cols = count;
  out.data.resize(static_cast<size_t>(m.rows * count));
  for (int64_t r = 0; r < m.rows; ++r) {
    const float* src = &m.data[r * m.cols + begin];
    std::copy(src, src + count, &out.data[r * count]);
  }
  return out;
}

}  // namespace

void check_tensor_parallel(const ModelConfig& c, int world) {
  SPIN_CHECK(world >= 1, "--tensor-parallel-size must be >= 1, got {}", world);
  SPIN_CHECK(c.n_kv_heads % world == 0,
             "--tensor-parallel-size {} does not divide the model's {} KV heads (each rank owns "
             "whole KV heads)",
             world, c.n_kv_heads);
  SPIN_CHECK(c.n_heads % world == 0,
             "--tensor-parallel-size {} does not divide the model's {} attention heads", world,
             c.n_heads);
  SPIN_CHECK(c.intermediate_size % world == 0,
             "--tensor-parallel-size {} does not divide the model's intermediate size {}", world,
             c.intermediate_size);
}

ModelConfig shard_config(const ModelConfig& config, int world) {
  check_tensor_parallel(config, world);
  ModelConfig c = config;
  c.n_heads /= world;
  c.n_kv_heads /= world;
  c.intermediate_size /= world;
  return c;
}

ModelWeights shard_weights(const ModelWeights& weights, int rank, int world) {
  weights.validate_shapes();
  const ModelConfig& full = weights.config;
  ModelWeights w;
  w.config = shard_config(full, world);
  SPIN_CHECK(rank >= 0 && rank < world, "tensor parallel: rank {} outside 0..{}", rank, world - 1);
  const ModelConfig& c = w.config;
  const int64_t q_rows = c.n_heads * c.head_dim;
  const int64_t kv_rows = c.n_kv_heads * c.head_dim;
  const int64_t ffn = c.intermediate_size;

  w.tok_embd = weights.tok_embd;
  w.out_norm = weights.out_norm;
  w.lm_head = weights.lm_head;
  w.layers.reserve(weights.layers.size());
  for (const LayerWeights& L : weights.layers) {
    LayerWeights s;
    s.attn_norm = L.attn_norm;
    s.wq = slice_rows(L.wq, rank * q_rows, q_rows);
    s.wk = slice_rows(L.wk, rank * kv_rows, kv_rows);
    s.wv = slice_rows(L.wv, rank * kv_rows, kv_rows);
    s.wo = slice_cols(L.wo, rank * q_rows, q_rows);
    s.q_norm = L.q_norm;
    s.k_norm = L.k_norm;
    s.ffn_norm = L.ffn_norm;
    s.w_gate = slice_rows(L.w_gate, rank * ffn, ffn);
    s.w_up = slice_rows(L.w_up, rank * ffn, ffn);
    s.w_down = slice_cols(L.w_down, rank * ffn, ffn);
    w.layers.push_back(std::move(s));
  }
  return w;
}

TensorParallelKv::TensorParallelKv(std::vector<std::unique_ptr<SequenceKv>> ranks)
    : ranks_(std::move(ranks)) {
  SPIN_CHECK(!ranks_.empty(), "tensor parallel: a sequence's KV needs at least one rank");
  for (const auto& r : ranks_) SPIN_CHECK(r != nullptr, "tensor parallel: a rank's KV is missing");
}

RankThreads::RankThreads(int world) {
  SPIN_CHECK(world >= 1, "tensor parallel: the world size must be >= 1, got {}", world);
  for (int r = 0; r < world; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void RankThreads::run(const std::function<void(int)>& task, const std::function<void()>& on_failure) {
  std::unique_lock lock(mutex_);
  task_ = &task;
  on_failure_ = &on_failure;
  first_error_ = nullptr;
  pending_ = world_size();
  ++job_;
  start_.notify_all();
  done_.wait(lock, [&] { return pending_ == 0; });
  task_ = nullptr;
  on_failure_ = nullptr;
  if (first_error_) std::rethrow_exception(std::exchange(first_error_, nullptr));
}

void RankThreads::loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* task = nullptr;
    const std::function<void()>* on_failure = nullptr;
    {
      std::unique_lock lock(mutex_);
      start_.wait(lock, [&] { return stopping_ || job_ != seen; });
      if (stopping_) return;
      seen = job_;
      task = task_;
      on_failure = on_failure_;
    }
    std::exception_ptr error;
    try {
      (*task)(rank);
    } catch (const std::exception& e) {
      // Said at once: the other ranks may be stuck where this failure cannot reach them.
      spdlog::error("tensor parallel: rank {} failed: {}", rank, e.what());
      error = std::current_exception();
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      bool first = false;
      {
        std::lock_guard lock(mutex_);
        first = !first_error_;
        if (first) first_error_ = error;
      }
      // The others may wait in a collective for this rank: fail them too.
      if (first && *on_failure) (*on_failure)();
    }
    std::lock_guard lock(mutex_);
    if (--pending_ == 0) done_.notify_all();
  }
}

TensorParallelModel::TensorParallelModel(const ModelConfig& config, int world, const RankSetup& setup,
                                         RankLinks links)
    : config_(config), links_(std::move(links)), threads_((check_tensor_parallel(config, world), world)) {
  ranks_.resize(static_cast<size_t>(world));
  try {
    threads_.run([&](int r) { ranks_[r] = setup(r); }, links_.abort);
    for (int r = 0; r < world; ++r) {
      SPIN_CHECK(ranks_[r] != nullptr, "tensor parallel: rank {} made no model", r);
      const AttentionShape s = ranks_[r]->attention_shape();
      SPIN_CHECK(s.n_heads * world == config.n_heads && s.n_kv_heads * world == config.n_kv_heads,
                 "tensor parallel: rank {} has {} query and {} KV heads, expected {} and {}", r, s.n_heads,
                 s.n_kv_heads, config.n_heads / world, config.n_kv_heads / world);
    }
  } catch (...) {
    destroy_ranks();
    throw;
  }
  rank_chunks_.resize(static_cast<size_t>(world));
  rank_logits_.resize(static_cast<size_t>(world));
  rank_tokens_.resize(static_cast<size_t>(world));
}

TensorParallelModel::~TensorParallelModel() { destroy_ranks(); }

void TensorParallelModel::destroy_ranks() {
  threads_.run([&](int r) { ranks_[r].reset(); }, links_.abort);
}

AttentionShape TensorParallelModel::attention_shape() const {
  AttentionShape s = rank_attention_shape();
  s.n_heads = config_.n_heads;
  s.n_kv_heads = config_.n_kv_heads;
  return s;
}

void TensorParallelModel::split_chunks(std::span<const SequenceChunk> chunks) {
  const int world = world_size();
  for (auto& rc : rank_chunks_) rc.clear();
  for (const SequenceChunk& chunk : chunks) {
    auto* kv = dynamic_cast<TensorParallelKv*>(chunk.attention);
    SPIN_CHECK(kv != nullptr,
               "forward: the tensor-parallel model needs KV made by its own attention factory "
               "(engine/tensor_parallel_factory.h)");
    SPIN_CHECK(kv->world_size() == world, "forward: KV of {} ranks given to a model of {} ranks",
               kv->world_size(), world);
    for (int r = 0; r < world; ++r) {
      rank_chunks_[r].push_back(SequenceChunk{chunk.tokens, chunk.pos0, &kv->rank(r)});
    }
  }
}

void TensorParallelModel::forward(std::span<const SequenceChunk> chunks, bool all_logits,
                                  std::vector<float>& logits) {
  split_chunks(chunks);
  if (links_.reset) links_.reset();
  threads_.run([&](int r) { ranks_[r]->forward(rank_chunks_[r], all_logits, rank_logits_[r]); }, links_.abort);
  logits.swap(rank_logits_[0]);
}

void TensorParallelModel::forward_sampled(std::span<const SequenceChunk> chunks,
                                          std::span<const DeviceSampling> sampling, int64_t vocab,
                                          std::span<const int64_t> logit_rows, std::vector<float>& logits,
                                          std::vector<int32_t>& tokens) {
  split_chunks(chunks);
  if (links_.reset) links_.reset();
  threads_.run(
      [&](int r) {
        ranks_[r]->forward_sampled(rank_chunks_[r], sampling, vocab,
                                   r == 0 ? logit_rows : std::span<const int64_t>(), rank_logits_[r], rank_tokens_[r]);
      },
      links_.abort);
  tokens.swap(rank_tokens_[0]);
  if (!logit_rows.empty()) logits.swap(rank_logits_[0]);
}

namespace {

// One CPU rank: its shard and a Transformer over it, joined to the group.
class CpuRank final : public ForwardModel {
 public:
  CpuRank(ModelWeights shard, std::shared_ptr<InProcessGroup> group, int rank, int threads)
      : shard_(std::move(shard)), group_(std::move(group)), threads_(threads),
        transformer_(shard_, &group_->communicator(rank)) {}

  const ModelConfig& config() const override { return transformer_.config(); }
  AttentionShape attention_shape() const override { return transformer_.attention_shape(); }

  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override {
    {
      // OpenBLAS (OpenMP build) keeps ONE process-wide thread count and resizes its buffers
      // whenever a caller's OpenMP thread count differs from it; every rank sets the same count
      // here, one at a time, so no two ranks resize at once during their GEMMs.
      static std::mutex threads_mutex;
      std::lock_guard lock(threads_mutex);
      cpu::set_num_threads(threads_);
    }
    transformer_.forward(chunks, all_logits, logits);
  }

 private:
  ModelWeights shard_;
  std::shared_ptr<InProcessGroup> group_;
  int threads_;
  Transformer transformer_;
};

}  // namespace

std::unique_ptr<TensorParallelModel> make_cpu_tensor_parallel_model(const ModelWeights& weights, int world,
                                                                    int threads) {
  check_tensor_parallel(weights.config, world);
  SPIN_CHECK(threads >= 0, "tensor parallel: thread count must be >= 0, got {}", threads);
  const int per_rank = std::max(1, (threads > 0 ? threads : cpu::num_threads()) / world);
  auto group = std::make_shared<InProcessGroup>(world);
  RankLinks links{.abort = [group] { group->abort(); }, .reset = [group] { group->reset(); }};
  return std::make_unique<TensorParallelModel>(
      weights.config, world,
      [&](int r) { return std::make_unique<CpuRank>(shard_weights(weights, r, world), group, r, per_rank); },
      std::move(links));
}

}  // namespace spin
