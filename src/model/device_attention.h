#pragma once
// The seam between the GPU forward pass and a KV store in device memory (the GPU counterpart of
// SequenceAttention). The CPU model hands attention one sequence and one layer at a time; on the
// GPU that would cost a launch per sequence per layer and could not be captured in a CUDA graph,
// so the store sees the whole step once (begin_step: allocate pages, build every table the step
// needs for ALL layers, upload them in one copy) and then one call per layer that only launches
// kernels on buffers whose addresses stay fixed.
//
// Only the CUDA backend includes this header (it needs the CUDA runtime).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "kernels/cuda/model_ops.h"
#include "model/forward_model.h"

namespace spin {

// What the kernels of a step bake in besides the batch rows: a CUDA graph captured for one step
// may be replayed for another only when both have the same rows and an equal layout.
struct DeviceStepLayout {
  int64_t context_bucket = 0;  // upper bound of the keys one query attends to (sizes split-K grids)
  uint64_t buffers_epoch = 0;  // changes whenever a device buffer the kernels use was reallocated
  // Which of the store's optional kernels the step launches (a bit set the store defines): a
  // graph captured for one set must not replay a step that needs another.
  uint32_t kernel_set = 0;
  bool operator==(const DeviceStepLayout&) const = default;
};

class DeviceAttention {
 public:
  virtual ~DeviceAttention() = default;

  // Once per forward, before the first layer. chunks: every chunk's KV belongs to this store, and
  // single-token chunks come first (their rows go to the decode kernel as one contiguous block).
  // rows >= the chunks' tokens: rows past them are padding (a decode batch rounded up to a size
  // that has a CUDA graph); their K/V go to a scratch page and their output is zero.
  // Throws kv::PoolExhausted when the pages for the new tokens are not free (nothing changed then),
  // spin::Error for chunks the store cannot run.
  virtual DeviceStepLayout begin_step(std::span<const SequenceChunk> chunks, int64_t rows,
                                      cudaStream_t stream) = 0;

  // Finishes q and k of `layer` (qk: the projection's rows qk.qkv, q, k, v heads laid out as in
  // kernels/cuda/model_ops.h, and the layer's norm and RoPE; qk.n_tokens = the step's rows), stores
  // the step's K/V in the same launch, and writes causal attention for every row to out:
  // [rows][n_heads * head_dim]. q and k are left in qk.qkv after norm and RoPE. The store's page
  // fields of qk are its own. Only enqueues work on `stream` (graph-safe).
  virtual void forward(int64_t layer, const cuda::QkRopeParams& qk, __nv_bfloat16* out, cudaStream_t stream) = 0;
};

// A sequence's KV in a device store; the forward pass finds the store through it.
class DeviceSequenceKv : public SequenceKv {
 public:
  virtual DeviceAttention& store() = 0;
};

}  // namespace spin
