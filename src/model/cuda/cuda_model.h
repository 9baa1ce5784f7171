#pragma once
// The Llama-family forward pass on one GPU: bf16 weights and activations, fp32 math inside every
// kernel and GEMM (cuBLASLt), attention through a DeviceAttention store (model/device_attention.h).
// It runs the same batches as the CPU Transformer (several sequences' chunks in one step) and
// returns fp32 logits on the host, so the Engine schedules and samples it unchanged.
//
// Decode steps (every chunk one token) run at a padded batch size (1, 2, 4, then multiples of 8),
// with or without CUDA graphs, so both modes compute exactly the same thing; with graphs on, a
// step whose shape was seen before replays the graph captured for it (the second time a shape
// comes: the first runs eagerly and warms up cuBLASLt and the kernels).
//
// Tensor parallelism (model/tensor_parallel.h): a CudaModel built over one rank's shard with that
// rank's NCCL communicator sums the partial outputs of the O and down projections over the ranks
// (bf16 all-reduce on the model's stream, as vLLM does) before each residual add. The all-reduces
// are captured into the decode graphs like every other kernel; every rank runs the same steps, so
// the ranks' collectives match whether a step replays a graph or runs eagerly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <tuple>
#include <vector>

#include "kernels/cuda/sampling.h"
#include "model/cuda/device_buffer.h"
#include "model/cuda/gemm.h"
#include "model/device_attention.h"
#include "model/forward_model.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"

namespace spin {

namespace cuda {
class NcclCommunicator;
}

struct CudaModelOptions {
  int device = 0;
  bool cuda_graphs = true;
  // Activation rows allocated up front (the engine's --max-num-batched-tokens); a larger step
  // grows them, which also drops the captured graphs.
  int64_t max_batch_tokens = 2048;
  // Sequences per step (the engine's --max-num-seqs): logit rows allocated up front (all-logits
  // steps of more rows grow them).
  int64_t max_sequences = 256;
  // Largest padded decode batch run as a graph; larger ones run eagerly.
  int64_t max_graph_batch = 512;
  // Tensor parallelism: this rank's communicator (on `device`; not owned), with which the model
  // sums its row-parallel products over the ranks. Null: one GPU, no collectives.
  cuda::NcclCommunicator* communicator = nullptr;
  // Tensor parallelism: a host barrier over the ranks, called after the step's allocations and
  // before its first collective. cudaMalloc/cudaFree (and pinned host allocations) synchronise
  // with the peer GPUs, so a rank still allocating while another waits inside an all-reduce for
  // it would deadlock. Throws when the group was aborted by a failing rank.
  std::function<void()> ranks_ready;
  // Measured cuBLASLt choices for decode-sized products, read and extended here (gemm.h). Empty:
  // the heuristic's picks. One GPU only: tuning allocates mid-step, which ranks_ready forbids.
  std::filesystem::path gemm_tuning_file;
  // Products of at most this many rows (a small decode batch's, a few logit rows) run on
  // kernels/cuda/gemv.h's kernel, every larger one on cuBLASLt; 0: all on cuBLASLt (gemm.h).
  int64_t gemv_rows = GemmRunner::kDefaultGemvRows;
};

class CudaModel final : public ForwardModel {
 public:
  // Copies the weights to the device as bf16 (round to nearest even), fusing wq|wk|wv and
  // w_gate|w_up into one matrix each. The host weights may be freed afterwards.
  CudaModel(const ModelWeights& weights, const CudaModelOptions& options);
  // Random weights made on the device: equal to make_dummy_weights(config, seed) rounded to bf16,
  // without any host copy. With a communicator, config is the rank's shard (shard_config) and the
  // replicated tensors (embeddings, norms, LM head) are the same on every rank while each rank's
  // slices of the split matrices come from its own seed: a valid sharded model, but not the shard
  // of the unsplit dummy model.
  CudaModel(const ModelConfig& config, uint64_t seed, const CudaModelOptions& options);
  ~CudaModel() override;
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const override { return config_; }
  AttentionShape attention_shape() const override;
  // chunks' attention must be DeviceSequenceKv of one store (spin::Error otherwise).
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override;
  // Draws the next tokens on the GPU (kernels/cuda/sampling.h): a step downloads token ids, and
  // only the logit rows asked for.
  bool samples_on_device() const override { return true; }
  void forward_sampled(std::span<const SequenceChunk> chunks, std::span<const DeviceSampling> sampling, int64_t vocab,
                       std::span<const int64_t> logit_rows, std::vector<float>& logits,
                       std::vector<int32_t>& tokens) override;

  std::optional<ForwardStats> forward_stats() const override { return stats_; }
  // Benchmarks: turns CUDA graphs off or back on for the steps that follow (a step that records
  // events or copies inside its attention must run eagerly).
  void set_cuda_graphs(bool on) { options_.cuda_graphs = on; }
  // Device bytes of the weights (what a decode step reads besides the KV).
  int64_t weight_bytes() const { return weight_bytes_; }
  // The decode batch a step of n single-token chunks runs at.
  static int64_t padded_decode_rows(int64_t n);

 private:
  struct Layer {
    DeviceBuffer<__nv_bfloat16> attn_norm, wqkv, wo, q_norm, k_norm, ffn_norm, w_gate_up, w_down;
  };
  // A captured decode step: batch rows, the attention store, its layout (context bucket, buffers,
  // kernel set), this model's buffers.
  using GraphKey = std::tuple<int64_t, const DeviceAttention*, int64_t, uint64_t, uint32_t, uint64_t>;

  CudaModel(const ModelConfig& config, const CudaModelOptions& options, bool separate_lm_head);
  void allocate_weights();
  void finish_setup();
  void reserve_activations(int64_t rows, int64_t logit_rows);
  // Enqueues one step's forward (its graph or its kernels) and returns its logit rows (one per
  // chunk, or per token when all_logits), in chunk order in logits_.
  int64_t enqueue_step(std::span<const SequenceChunk> chunks, bool all_logits);
  // Enqueues the copy of the first `rows` logit rows into `logits`.
  void enqueue_logits_download(int64_t rows, std::vector<float>& logits);
  // Enqueues the copy of the `wanted` rows (ascending) of the step's `rows` into their places in
  // `logits` (sized rows x vocab; the other rows are not written).
  void enqueue_logit_rows_download(int64_t rows, std::span<const int64_t> wanted, std::vector<float>& logits);
  // Blocks until the stream's work is done, counting the wait in stats_.
  void wait_for_step();
  // Enqueues the whole forward for `rows` rows whose inputs were uploaded: embeddings, layers,
  // final norm, the gather of `logit_rows` rows and the LM head.
  void enqueue_forward(DeviceAttention& attention, int64_t rows, int64_t logit_rows);
  void run_graph(const GraphKey& key, DeviceAttention& attention, int64_t rows, int64_t logit_rows);
  void drop_graphs();
  // Tensor parallelism: data[0, count) summed over the ranks, in place (nothing on one GPU).
  void sum_over_ranks(__nv_bfloat16* data, int64_t count, cudaStream_t stream);

  ModelConfig config_;
  CudaModelOptions options_;
  int64_t q_width_ = 0, kv_width_ = 0, qkv_width_ = 0;
  int64_t weight_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  std::optional<GemmRunner> gemm_;  // made after the device is selected (it allocates)

  bool separate_lm_head_ = true;  // false: the LM head is the embedding table (tied)
  DeviceBuffer<__nv_bfloat16> tok_embd_, lm_head_, out_norm_;
  std::vector<Layer> layers_;
  DeviceBuffer<float> inv_freq_;
  float rope_mscale_ = 1.0f;
  bool rope_neox_ = true;

  // Activations, [rows][width]; x_ is the residual stream, h_ the normalised input of the next
  // product, proj_ the output of the products that feed the residual.
  int64_t row_capacity_ = 0, logit_row_capacity_ = 0;
  DeviceBuffer<__nv_bfloat16> x_, h_, qkv_, attn_, proj_, gate_up_, act_, logit_inputs_;
  DeviceBuffer<float> logits_;
  // Device sampling: per-row parameters and drawn tokens, and their pinned host copies.
  DeviceBuffer<cuda::SamplingRow> sampling_rows_;
  PinnedBuffer<cuda::SamplingRow> sampling_rows_host_;
  DeviceBuffer<int32_t> sampled_;
  PinnedBuffer<int32_t> sampled_host_;
  // Per-step inputs, one upload: token ids [rows], positions [rows], logit row indices.
  DeviceBuffer<int32_t> step_inputs_;
  PinnedBuffer<int32_t> step_inputs_host_;
  const int32_t* ids_ = nullptr;
  const int32_t* positions_ = nullptr;
  const int32_t* logit_rows_ = nullptr;
  uint64_t buffers_epoch_ = 0;  // changes whenever an activation buffer moves

  std::map<GraphKey, cudaGraphExec_t> graphs_;
  std::set<GraphKey> warmed_up_;
  ForwardStats stats_;
};

// A tensor-parallel model on GPUs 0..world-1: one CudaModel per rank on GPU `rank`, each with its
// own NCCL communicator (made and destroyed on the rank's thread), joined by TensorParallelModel.
struct CudaTensorParallel {
  std::unique_ptr<TensorParallelModel> model;
  std::vector<CudaModel*> ranks;  // rank r's model (owned by `model`): weight bytes, statistics
};

// weights: host weights, split with shard_weights (the caller may free them afterwards); null:
// dummy weights made on each GPU from `seed` for the rank's shard of `config` (no host copy; see
// the dummy constructor). options.device and options.communicator are set per rank. Throws
// spin::Error when world does not split the model, fewer than world GPUs are visible, spin was
// built without NCCL, or a rank's setup fails.
CudaTensorParallel make_cuda_tensor_parallel_model(const ModelWeights* weights, const ModelConfig& config,
                                                   uint64_t seed, int world, const CudaModelOptions& options);

}  // namespace spin
