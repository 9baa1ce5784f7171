#include "model/cuda/cuda_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <unordered_set>

#include "base/half.h"
#include "kernels/cuda/fill.h"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/module_loading.h"
#include "kernels/cuda/nccl_communicator.h"
#include "kernels/cuda/rmsnorm.h"
#include "model/communicator.h"
#include "model/rope.h"

namespace spin {

namespace {

using bf16 = __nv_bfloat16;

// Host fp32 -> device bf16, in pieces so the host staging stays small. The rounding is
// base/half.h's (nearest even), the one the tests apply to the CPU reference's weights.
void upload_bf16(const float* src, size_t n, bf16* dst) {
  constexpr size_t kPiece = size_t{1} << 24;
  std::vector<uint16_t> staging(std::min(n, kPiece));
  for (size_t done = 0; done < n; done += kPiece) {
    const size_t count = std::min(kPiece, n - done);
    const auto count64 = static_cast<int64_t>(count);
#pragma omp parallel for schedule(static) if (count64 > 65536)
    for (int64_t i = 0; i < count64; ++i) staging[i] = f32_to_bf16(src[done + i]);
    cuda_check(cudaMemcpy(dst + done, staging.data(), count * sizeof(uint16_t), cudaMemcpyHostToDevice),
               "weight upload");
  }
}

void upload_bf16(const std::vector<float>& src, bf16* dst) { upload_bf16(src.data(), src.size(), dst); }

// Fills tensors in the order and with the scales of model/dummy_model.cpp's DummyFiller, so the
// device weights are the host dummy weights rounded to bf16 (the GPU test checks exactly that).
// Under tensor parallelism the matrices split over the ranks are filled from a seed of the rank's
// own (shard_seed; the plain seed on rank 0) and the replicated tensors from the common one.
class DeviceDummyFiller {
 public:
  DeviceDummyFiller(uint64_t seed, uint64_t shard_seed, cudaStream_t stream)
      : seed_(seed), shard_seed_(shard_seed), stream_(stream) {}

  void matrix(bf16* dst, int64_t rows, int64_t cols) { fill(dst, rows * cols, 0.0f, scale(cols), seed_); }
  // A slice of a matrix split over the ranks; cols: the whole matrix's input width.
  void shard(bf16* dst, int64_t rows, int64_t cols, int64_t full_cols) {
    fill(dst, rows * cols, 0.0f, scale(full_cols), shard_seed_);
  }
  void norm(bf16* dst, int64_t n) { fill(dst, n, 1.0f, 0.02f, seed_); }

 private:
  static float scale(int64_t cols) { return 1.0f / std::sqrt(static_cast<float>(cols)); }
  void fill(bf16* dst, int64_t n, float center, float stddev, uint64_t seed) {
    const float half_width = stddev * std::sqrt(3.0f);
    cuda_check(cuda::fill_dummy_bf16(dst, n, seed, next_id_++, center, half_width, stream_), "dummy weight fill");
  }
  uint64_t seed_, shard_seed_;
  cudaStream_t stream_;
  uint64_t next_id_ = 0;
};

// Captured decode graphs kept at once (batch sizes x context buckets of one store are far fewer).
constexpr size_t kMaxGraphs = 512;

}  // namespace

int64_t CudaModel::padded_decode_rows(int64_t n) {
  if (n <= 1) return 1;
  if (n <= 2) return 2;
  if (n <= 4) return 4;
  return (n + 7) / 8 * 8;
}

CudaModel::CudaModel(const ModelConfig& config, const CudaModelOptions& options, bool separate_lm_head)
    : config_(config), options_(options), separate_lm_head_(separate_lm_head) {
  config_.validate();
  SPIN_CHECK(options_.max_batch_tokens > 0 && options_.max_sequences > 0,
             "CUDA model: max batch tokens ({}) and sequences ({}) must be positive", options_.max_batch_tokens,
             options_.max_sequences);
  cuda_check(cudaSetDevice(options_.device), "cudaSetDevice");
#ifdef SPIN_WITH_NCCL
  SPIN_CHECK(options_.communicator == nullptr || options_.communicator->device() == options_.device,
             "CUDA model: the communicator is on GPU {}, the model on GPU {}",
             options_.communicator ? options_.communicator->device() : 0, options_.device);
#else
  SPIN_CHECK(options_.communicator == nullptr,
             "CUDA model: tensor parallelism needs NCCL, and this spin was built without it");
#endif
  SPIN_CHECK(options_.communicator == nullptr || options_.gemm_tuning_file.empty(),
             "a GEMM tuning file is for one GPU; it cannot be used with tensor parallelism");
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream creation");
  gemm_.emplace(options_.gemm_tuning_file, options_.gemv_rows);
  q_width_ = config_.n_heads * config_.head_dim;
  kv_width_ = config_.n_kv_heads * config_.head_dim;
  qkv_width_ = q_width_ + 2 * kv_width_;
  allocate_weights();
}

CudaModel::CudaModel(const ModelWeights& weights, const CudaModelOptions& options)
    : CudaModel(weights.config, options, !weights.lm_head.empty()) {
  weights.validate_shapes();
  const int64_t hidden = config_.hidden_size, ffn = config_.intermediate_size;
  upload_bf16(weights.tok_embd.data, tok_embd_.get());
  upload_bf16(weights.out_norm, out_norm_.get());
  if (separate_lm_head_) upload_bf16(weights.lm_head.data, lm_head_.get());
  for (int64_t l = 0; l < config_.n_layers; ++l) {
    const LayerWeights& src = weights.layers[l];
    Layer& dst = layers_[l];
    upload_bf16(src.attn_norm, dst.attn_norm.get());
    upload_bf16(src.wq.data, dst.wqkv.get());
    upload_bf16(src.wk.data, dst.wqkv.get() + q_width_ * hidden);
    upload_bf16(src.wv.data, dst.wqkv.get() + (q_width_ + kv_width_) * hidden);
    upload_bf16(src.wo.data, dst.wo.get());
    if (config_.qk_norm) {
      upload_bf16(src.q_norm, dst.q_norm.get());
      upload_bf16(src.k_norm, dst.k_norm.get());
    }
    upload_bf16(src.ffn_norm, dst.ffn_norm.get());
    upload_bf16(src.w_gate.data, dst.w_gate_up.get());
    upload_bf16(src.w_up.data, dst.w_gate_up.get() + ffn * hidden);
    upload_bf16(src.w_down.data, dst.w_down.get());
  }
  finish_setup();
}

CudaModel::CudaModel(const ModelConfig& config, uint64_t seed, const CudaModelOptions& options)
    : CudaModel(config, options, !config.tie_embeddings) {
  const int64_t hidden = config_.hidden_size, ffn = config_.intermediate_size;
  int rank = 0, world = 1;
#ifdef SPIN_WITH_NCCL
  if (options_.communicator) {
    rank = options_.communicator->rank();
    world = options_.communicator->world_size();
  }
#endif
  // Row-parallel matrices (o, down) keep the scale of the whole matrix's input width.
  const int64_t full_q = q_width_ * world, full_ffn = ffn * world;
  DeviceDummyFiller fill(seed, seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(rank), stream_);
  fill.matrix(tok_embd_.get(), config_.vocab_size, hidden);
  fill.norm(out_norm_.get(), hidden);
  if (separate_lm_head_) fill.matrix(lm_head_.get(), config_.vocab_size, hidden);
  for (Layer& l : layers_) {
    fill.norm(l.attn_norm.get(), hidden);
    fill.shard(l.wqkv.get(), q_width_, hidden, hidden);
    fill.shard(l.wqkv.get() + q_width_ * hidden, kv_width_, hidden, hidden);
    fill.shard(l.wqkv.get() + (q_width_ + kv_width_) * hidden, kv_width_, hidden, hidden);
    fill.shard(l.wo.get(), hidden, q_width_, full_q);
    if (config_.qk_norm) {
      fill.norm(l.q_norm.get(), config_.head_dim);
      fill.norm(l.k_norm.get(), config_.head_dim);
    }
    fill.norm(l.ffn_norm.get(), hidden);
    fill.shard(l.w_gate_up.get(), ffn, hidden, hidden);
    fill.shard(l.w_gate_up.get() + ffn * hidden, ffn, hidden, hidden);
    fill.shard(l.w_down.get(), hidden, ffn, full_ffn);
  }
  cuda_check(cudaStreamSynchronize(stream_), "dummy weight fill");
  finish_setup();
}

CudaModel::~CudaModel() {
  cudaSetDevice(options_.device);  // the thread may be on another GPU (tensor parallelism, tests)
  drop_graphs();
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaModel::allocate_weights() {
  const int64_t hidden = config_.hidden_size, ffn = config_.intermediate_size;
  int64_t elements = 0;
  auto alloc = [&](DeviceBuffer<bf16>& buffer, int64_t n, const char* what) {
    buffer.reserve(static_cast<size_t>(n), what);
    elements += n;
  };
  alloc(tok_embd_, config_.vocab_size * hidden, "token embeddings");
  alloc(out_norm_, hidden, "output norm");
  if (separate_lm_head_) alloc(lm_head_, config_.vocab_size * hidden, "LM head");
  layers_.resize(static_cast<size_t>(config_.n_layers));
  for (Layer& l : layers_) {
    alloc(l.attn_norm, hidden, "attention norm");
    alloc(l.wqkv, qkv_width_ * hidden, "q|k|v projection");
    alloc(l.wo, hidden * q_width_, "output projection");
    if (config_.qk_norm) {
      alloc(l.q_norm, config_.head_dim, "q norm");
      alloc(l.k_norm, config_.head_dim, "k norm");
    }
    alloc(l.ffn_norm, hidden, "MLP norm");
    alloc(l.w_gate_up, 2 * ffn * hidden, "gate|up projection");
    alloc(l.w_down, hidden * ffn, "down projection");
  }
  weight_bytes_ = elements * static_cast<int64_t>(sizeof(bf16));
}

void CudaModel::finish_setup() {
  const RopeTable rope = make_rope_table(config_.rope, config_.head_dim);
  inv_freq_.reserve(rope.inv_freq.size(), "RoPE frequencies");
  cuda_check(cudaMemcpy(inv_freq_.get(), rope.inv_freq.data(), rope.inv_freq.size() * sizeof(float),
                        cudaMemcpyHostToDevice),
             "RoPE frequency upload");
  rope_mscale_ = rope.mscale;
  rope_neox_ = rope.neox;
  reserve_activations(std::max(options_.max_batch_tokens, padded_decode_rows(options_.max_sequences)),
                      padded_decode_rows(options_.max_sequences));
}

AttentionShape CudaModel::attention_shape() const {
  return AttentionShape{config_.n_layers, config_.n_heads, config_.n_kv_heads, config_.head_dim,
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.head_dim)))};
}

void CudaModel::reserve_activations(int64_t rows, int64_t logit_rows) {
  if (rows <= row_capacity_ && logit_rows <= logit_row_capacity_) return;
  // Grow with headroom so a slowly rising step size does not reallocate (and drop graphs) often;
  // buffers already large enough stay where they are.
  rows = rows > row_capacity_ ? std::max(rows, row_capacity_ + row_capacity_ / 2) : row_capacity_;
  logit_rows = logit_rows > logit_row_capacity_ ? std::max(logit_rows, logit_row_capacity_ + logit_row_capacity_ / 2)
                                                : logit_row_capacity_;
  const auto r = static_cast<size_t>(rows);
  const auto hidden = static_cast<size_t>(config_.hidden_size);
  const auto ffn = static_cast<size_t>(config_.intermediate_size);
  x_.reserve(r * hidden, "residual activations");
  h_.reserve(r * hidden, "normalised activations");
  qkv_.reserve(r * static_cast<size_t>(qkv_width_), "q|k|v activations");
  attn_.reserve(r * static_cast<size_t>(q_width_), "attention output");
  proj_.reserve(r * hidden, "projection output");
  gate_up_.reserve(r * 2 * ffn, "gate|up activations");
  act_.reserve(r * ffn, "MLP activations");
  logit_inputs_.reserve(static_cast<size_t>(logit_rows) * hidden, "LM head inputs");
  logits_.reserve(static_cast<size_t>(logit_rows) * static_cast<size_t>(config_.vocab_size), "logits");
  step_inputs_.reserve(2 * r + static_cast<size_t>(logit_rows), "step inputs");
  step_inputs_host_.reserve(2 * r + static_cast<size_t>(logit_rows));
  row_capacity_ = rows;
  logit_row_capacity_ = logit_rows;
  buffers_epoch_ = new_buffers_epoch();
  drop_graphs();
}

void CudaModel::drop_graphs() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  warmed_up_.clear();
}

void CudaModel::forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) {
  const int64_t out_rows = enqueue_step(chunks, all_logits);
  try {
    enqueue_logits_download(out_rows, logits);
    wait_for_step();
  } catch (...) {
    cudaStreamSynchronize(stream_);
    throw;
  }
}

void CudaModel::forward_sampled(std::span<const SequenceChunk> chunks, std::span<const DeviceSampling> sampling,
                                int64_t vocab, std::span<const int64_t> logit_rows, std::vector<float>& logits,
                                std::vector<int32_t>& tokens) {
  SPIN_CHECK(sampling.size() == chunks.size(), "forward_sampled: {} sampling rows for {} chunks", sampling.size(),
             chunks.size());
  SPIN_CHECK(vocab > 0 && vocab <= config_.vocab_size, "forward_sampled: {} sampleable logits of {}", vocab,
             config_.vocab_size);
  const int64_t rows = enqueue_step(chunks, false);
  try {
    const auto n = static_cast<size_t>(rows);
    sampling_rows_.reserve(n, "sampling parameters");
    sampling_rows_host_.reserve(n);
    sampled_.reserve(n, "sampled tokens");
    sampled_host_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const DeviceSampling& d = sampling[i];
      sampling_rows_host_[i] = cuda::SamplingRow{.temperature = d.temperature,
                                                 .top_k = d.top_k,
                                                 .top_p = d.top_p,
                                                 .min_p = d.min_p,
                                                 .seed = d.seed,
                                                 .step = d.step};
    }
    cuda_check(cudaMemcpyAsync(sampling_rows_.get(), sampling_rows_host_.get(), n * sizeof(cuda::SamplingRow),
                               cudaMemcpyHostToDevice, stream_),
               "sampling parameters upload");
    cuda_check(cuda::sample_tokens(logits_.get(), rows, vocab, config_.vocab_size, sampling_rows_.get(), sampled_.get(),
                                   nullptr, 0, stream_),
               "token sampling");
    cuda_check(cudaMemcpyAsync(sampled_host_.get(), sampled_.get(), n * sizeof(int32_t), cudaMemcpyDeviceToHost,
                               stream_),
               "sampled tokens download");
    if (!logit_rows.empty()) enqueue_logit_rows_download(rows, logit_rows, logits);
    wait_for_step();
    tokens.assign(sampled_host_.get(), sampled_host_.get() + n);
  } catch (...) {
    cudaStreamSynchronize(stream_);
    throw;
  }
}

void CudaModel::wait_for_step() {
  const auto start = std::chrono::steady_clock::now();
  cuda_check(cudaStreamSynchronize(stream_), "forward pass");
  stats_.device_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CudaModel::enqueue_logits_download(int64_t rows, std::vector<float>& logits) {
  logits.resize(static_cast<size_t>(rows * config_.vocab_size));
  cuda_check(cudaMemcpyAsync(logits.data(), logits_.get(), logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                             stream_),
             "logits download");
}

void CudaModel::enqueue_logit_rows_download(int64_t rows, std::span<const int64_t> wanted, std::vector<float>& logits) {
  const int64_t vocab = config_.vocab_size;
  logits.resize(static_cast<size_t>(rows * vocab));
  // One copy per run of consecutive rows: a batch where every row wants its logits moves them in one.
  for (size_t i = 0; i < wanted.size();) {
    size_t end = i + 1;
    while (end < wanted.size() && wanted[end] == wanted[end - 1] + 1) ++end;
    const int64_t first = wanted[i], n = wanted[end - 1] - first + 1;
    SPIN_CHECK(first >= 0 && first + n <= rows && (i == 0 || first > wanted[i - 1]),
               "logit rows must ascend within the step's {} rows (rows {}..{})", rows, first, first + n - 1);
    cuda_check(cudaMemcpyAsync(logits.data() + first * vocab, logits_.get() + first * vocab,
                               static_cast<size_t>(n * vocab) * sizeof(float), cudaMemcpyDeviceToHost, stream_),
               "logit rows download");
    i = end;
  }
}

int64_t CudaModel::enqueue_step(std::span<const SequenceChunk> chunks, bool all_logits) {
  SPIN_CHECK(!chunks.empty(), "forward: no chunks");
  cuda_check(cudaSetDevice(options_.device), "cudaSetDevice");

  // Every chunk's KV must live in one device store; the store checks that the handles are its own.
  DeviceAttention* attention = nullptr;
  int64_t n_tokens = 0;
  for (const SequenceChunk& chunk : chunks) {
    SPIN_CHECK(!chunk.tokens.empty() && chunk.attention != nullptr, "forward: empty chunk");
    auto* kv = dynamic_cast<DeviceSequenceKv*>(chunk.attention);
    SPIN_CHECK(kv != nullptr,
               "forward: the CUDA model needs KV made by the CUDA attention factory (this KV is host-side)");
    if (attention == nullptr) attention = &kv->store();
    SPIN_CHECK(&kv->store() == attention, "forward: the chunks' KV belongs to different device stores");
    for (int32_t id : chunk.tokens) {
      SPIN_CHECK(id >= 0 && id < config_.vocab_size, "token id {} outside the vocabulary (0..{})", id,
                 config_.vocab_size - 1);
    }
    n_tokens += static_cast<int64_t>(chunk.tokens.size());
  }

  // Single-token chunks first: the attention store runs them as one contiguous decode batch.
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_partition(order.begin(), order.end(), [&](size_t i) { return chunks[i].tokens.size() == 1; });
  std::vector<SequenceChunk> ordered;
  ordered.reserve(chunks.size());
  for (size_t i : order) ordered.push_back(chunks[i]);
  const bool decode_only = static_cast<int64_t>(chunks.size()) == n_tokens;
  const int64_t rows = decode_only ? padded_decode_rows(n_tokens) : n_tokens;
  const int64_t out_rows = all_logits ? n_tokens : static_cast<int64_t>(chunks.size());
  // A decode step computes logits for every padded row, so its shape depends on `rows` alone.
  const int64_t logit_rows = decode_only ? rows : out_rows;
  reserve_activations(rows, logit_rows);

  // Inputs in the reordered row order; logit rows in the caller's chunk order.
  int32_t* host = step_inputs_host_.get();
  int32_t* host_positions = host + rows;
  int32_t* host_logit_rows = host + 2 * rows;
  std::vector<int64_t> first_row(chunks.size());
  {
    int64_t row = 0;
    for (size_t i : order) {
      first_row[i] = row;
      const SequenceChunk& c = chunks[i];
      for (size_t t = 0; t < c.tokens.size(); ++t, ++row) {
        host[row] = c.tokens[t];
        host_positions[row] = static_cast<int32_t>(c.pos0 + static_cast<int64_t>(t));
      }
    }
    for (; row < rows; ++row) host[row] = host_positions[row] = 0;  // padding rows
  }
  {
    int64_t r = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const auto n = static_cast<int64_t>(chunks[i].tokens.size());
      if (all_logits) {
        for (int64_t t = 0; t < n; ++t) host_logit_rows[r++] = static_cast<int32_t>(first_row[i] + t);
      } else {
        host_logit_rows[r++] = static_cast<int32_t>(first_row[i] + n - 1);
      }
    }
    for (; r < logit_rows; ++r) host_logit_rows[r] = 0;
  }

  // The store allocates pages first: if the pool is short nothing has been enqueued yet.
  const DeviceStepLayout layout = attention->begin_step(ordered, rows, stream_);
  try {
    int32_t* device = step_inputs_.get();
    ids_ = device;
    positions_ = device + rows;
    logit_rows_ = device + 2 * rows;
    cuda_check(cudaMemcpyAsync(device, host, static_cast<size_t>(2 * rows + logit_rows) * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_),
               "step input upload");
    if (options_.ranks_ready) options_.ranks_ready();
    if (options_.cuda_graphs && decode_only && rows <= options_.max_graph_batch) {
      const GraphKey key{rows, attention, layout.context_bucket, layout.buffers_epoch, layout.kernel_set,
                         buffers_epoch_};
      run_graph(key, *attention, rows, logit_rows);
    } else {
      enqueue_forward(*attention, rows, logit_rows);
      ++stats_.eager_steps;
    }
  } catch (...) {
    // Pinned inputs are rewritten next step: let whatever was enqueued finish first.
    cudaStreamSynchronize(stream_);
    throw;
  }
  return out_rows;
}

void CudaModel::run_graph(const GraphKey& key, DeviceAttention& attention, int64_t rows, int64_t logit_rows) {
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    cuda_check(cudaGraphLaunch(it->second, stream_), "CUDA graph launch");
    ++stats_.graph_replays;
    return;
  }
  // First sight of this shape: run it eagerly, which also makes cuBLASLt choose its algorithms and
  // the kernels set their attributes, none of which may happen while capturing.
  if (warmed_up_.insert(key).second) {
    enqueue_forward(attention, rows, logit_rows);
    ++stats_.eager_steps;
    return;
  }
  // Graphs captured under another layout of this store point at buffers that have moved.
  for (auto it = graphs_.begin(); it != graphs_.end();) {
    const bool stale = std::get<1>(it->first) == &attention && std::get<3>(it->first) != std::get<3>(key);
    if (stale) {
      cudaGraphExecDestroy(it->second);
      it = graphs_.erase(it);
    } else {
      ++it;
    }
  }
  if (graphs_.size() >= kMaxGraphs) drop_graphs();  // e.g. graphs of stores that are gone
  cudaGraph_t graph = nullptr;
  cuda_check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "CUDA graph capture");
  try {
    enqueue_forward(attention, rows, logit_rows);
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  cuda_check(cudaStreamEndCapture(stream_, &graph), "CUDA graph capture");
  cudaGraphExec_t exec = nullptr;
  // Node priorities are those of the streams captured (the KV store's Retrieve stream is the
  // device's highest), so a replay schedules a fetch's blocks ahead of work that waits on it less.
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
  cudaGraphDestroy(graph);
  cuda_check(instantiated, "CUDA graph instantiation");
  graphs_.emplace(key, exec);
  ++stats_.graphs_captured;
  cuda_check(cudaGraphLaunch(exec, stream_), "CUDA graph launch");
  ++stats_.graph_replays;
}

void CudaModel::sum_over_ranks(bf16* data, int64_t count, cudaStream_t stream) {
#ifdef SPIN_WITH_NCCL
  if (options_.communicator) options_.communicator->all_reduce_sum(data, static_cast<size_t>(count), stream);
#else
  (void)data, (void)count, (void)stream;
#endif
}

void CudaModel::enqueue_forward(DeviceAttention& attention, int64_t rows, int64_t logit_rows) {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size, ffn = c.intermediate_size;
  cudaStream_t s = stream_;
  cuda_check(cuda::embedding_bf16(ids_, rows, tok_embd_.get(), hidden, x_.get(), s), "embedding");
  // Each block's norm is fused with the residual add before it: the first layer's input norm has
  // no residual to add; every later norm adds the previous product's output to x_ first.
  cuda_check(cuda::rmsnorm_residual_bf16(x_.get(), nullptr, layers_[0].attn_norm.get(), h_.get(), rows, hidden,
                                         c.rms_eps, s),
             "attention norm");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    gemm_->matmul_nt(h_.get(), L.wqkv.get(), qkv_.get(), rows, qkv_width_, hidden, s);
    cuda::QkRopeParams rope;
    rope.qkv = qkv_.get();
    rope.row_stride = qkv_width_;
    rope.positions = positions_;
    rope.n_tokens = rows;
    rope.n_heads = static_cast<int>(c.n_heads);
    rope.n_kv_heads = static_cast<int>(c.n_kv_heads);
    rope.head_dim = static_cast<int>(c.head_dim);
    rope.q_norm = c.qk_norm ? L.q_norm.get() : nullptr;
    rope.k_norm = c.qk_norm ? L.k_norm.get() : nullptr;
    rope.norm_eps = c.rms_eps;
    rope.inv_freq = inv_freq_.get();
    rope.mscale = rope_mscale_;
    rope.neox = rope_neox_;
    attention.forward(l, rope, attn_.get(), s);
    gemm_->matmul_nt(attn_.get(), L.wo.get(), proj_.get(), rows, hidden, q_width_, s);
    sum_over_ranks(proj_.get(), rows * hidden, s);
    cuda_check(cuda::rmsnorm_residual_bf16(proj_.get(), x_.get(), L.ffn_norm.get(), h_.get(), rows, hidden,
                                           c.rms_eps, s),
               "MLP norm");
    gemm_->matmul_nt(h_.get(), L.w_gate_up.get(), gate_up_.get(), rows, 2 * ffn, hidden, s);
    cuda_check(cuda::silu_mul_bf16(gate_up_.get(), rows, ffn, act_.get(), s), "SiLU");
    gemm_->matmul_nt(act_.get(), L.w_down.get(), proj_.get(), rows, hidden, ffn, s);
    sum_over_ranks(proj_.get(), rows * hidden, s);
    const bf16* next_norm = l + 1 < c.n_layers ? layers_[static_cast<size_t>(l + 1)].attn_norm.get() : out_norm_.get();
    cuda_check(cuda::rmsnorm_residual_bf16(proj_.get(), x_.get(), next_norm, h_.get(), rows, hidden, c.rms_eps, s),
               l + 1 < c.n_layers ? "attention norm" : "output norm");
  }
  cuda_check(cuda::gather_rows_bf16(h_.get(), logit_rows_, logit_rows, hidden, logit_inputs_.get(), s),
             "logit row gather");
  const bf16* output = separate_lm_head_ ? lm_head_.get() : tok_embd_.get();
  gemm_->matmul_nt(logit_inputs_.get(), output, logits_.get(), logit_rows, c.vocab_size, hidden, s);
}

namespace {

#ifdef SPIN_WITH_NCCL
// One GPU rank: its communicator and its model over the rank's shard. The model goes first (its
// stream and graphs hold the communicator's work); the communicator's teardown is collective, so
// TensorParallelModel destroys every rank at once, each on its own thread.
class CudaRank final : public ForwardModel {
 public:
  // `registered` is this rank's entry in the list the failure path aborts; cleared before the
  // communicator goes.
  CudaRank(std::unique_ptr<cuda::NcclCommunicator> communicator, std::unique_ptr<CudaModel> model,
           cuda::NcclCommunicator** registered)
      : communicator_(std::move(communicator)), model_(std::move(model)), registered_(registered) {}
  ~CudaRank() override {
    model_.reset();
    *registered_ = nullptr;
  }

  const ModelConfig& config() const override { return model_->config(); }
  AttentionShape attention_shape() const override { return model_->attention_shape(); }
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override {
    model_->forward(chunks, all_logits, logits);
  }

 private:
  std::unique_ptr<cuda::NcclCommunicator> communicator_;
  std::unique_ptr<CudaModel> model_;
  cuda::NcclCommunicator** registered_;
};
#endif

}  // namespace

CudaTensorParallel make_cuda_tensor_parallel_model(const ModelWeights* weights, const ModelConfig& config,
                                                   uint64_t seed, int world, const CudaModelOptions& options) {
  check_tensor_parallel(config, world);
  int devices = 0;
  const cudaError_t counted = cudaGetDeviceCount(&devices);
  if (counted != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  SPIN_CHECK(world <= devices, "--tensor-parallel-size {} needs {} GPUs (one per rank); {} visible to this process",
             world, world, devices);
#ifndef SPIN_WITH_NCCL
  (void)weights, (void)seed, (void)options;
  fail("--tensor-parallel-size {} on the GPU needs NCCL, and this spin was built without it (configure with nccl.h "
       "and libnccl visible, or NCCL_ROOT=<install>)",
       world);
#else
  SPIN_CHECK(cuda::module_loading_is_eager(),
             "--tensor-parallel-size {} needs CUDA kernels loaded eagerly (a rank's first launch of a kernel "
             "can otherwise wait behind another rank's all-reduce forever); run with CUDA_MODULE_LOADING=EAGER",
             world);
  const cuda::NcclId id = cuda::make_nccl_id();
  CudaTensorParallel out;
  out.ranks.resize(static_cast<size_t>(world));
  // A rank that fails while the others wait inside NCCL cannot wake them (the communicators have
  // no abort here); the collectives of every rank are enqueued from identical steps, so a failure
  // that happens on one rank alone is a device fault, after which the process must be restarted.
  // The ranks' step barrier (CudaModelOptions::ranks_ready); a failing rank aborts it so the
  // others do not wait for it.
  auto group = std::make_shared<InProcessGroup>(world);
  // A rank that fails after the others enqueued a collective leaves them waiting on their GPUs:
  // aborting every communicator makes those collectives return, and the step fails everywhere.
  auto communicators = std::make_shared<std::vector<cuda::NcclCommunicator*>>(static_cast<size_t>(world), nullptr);
  RankLinks links{.abort =
                      [group, communicators] {
                        group->abort();
                        for (cuda::NcclCommunicator* c : *communicators) {
                          if (c != nullptr) c->abort();
                        }
                      },
                  .reset = [group] { group->reset(); }};
  out.model = std::make_unique<TensorParallelModel>(
      config, world,
      [&](int r) -> std::unique_ptr<ForwardModel> {
        cuda_check(cudaSetDevice(r), "cudaSetDevice");
        auto communicator = std::make_unique<cuda::NcclCommunicator>(id, r, world, r);
        (*communicators)[static_cast<size_t>(r)] = communicator.get();
        CudaModelOptions rank_options = options;
        rank_options.device = r;
        rank_options.communicator = communicator.get();
        rank_options.ranks_ready = [group, r] {
          float arrived = 0.0f;
          group->communicator(r).all_reduce_sum(&arrived, 1);
        };
        auto model = weights ? std::make_unique<CudaModel>(shard_weights(*weights, r, world), rank_options)
                             : std::make_unique<CudaModel>(shard_config(config, world), seed, rank_options);
        out.ranks[static_cast<size_t>(r)] = model.get();
        return std::make_unique<CudaRank>(std::move(communicator), std::move(model),
                                          &(*communicators)[static_cast<size_t>(r)]);
      },
      std::move(links));
  return out;
#endif
}

}  // namespace spin
