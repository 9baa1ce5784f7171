#pragma once
// Which hardware runs the model (`--device cpu|cuda|auto`): turns --model into the ForwardModel
// the Engine steps and the AttentionFactory its requests' KV comes from. The CPU backend is the
// fp32 Transformer on the paged two-tier store (every sparse algorithm); the CUDA backend is the
// bf16 CudaModel on a device KV pool (dense attention for now). Shared by the subcommands that run
// a model, so each gets the same flags and the same choice.
#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "engine/attention_factory.h"
#include "engine/engine.h"
#include "engine/paged_attention_factory.h"
#include "model/forward_model.h"
#include "model/loader.h"

namespace spin::cli {

struct BackendOptions {
  std::string device = "auto";          // cpu | cuda | auto
  double gpu_memory_utilization = 0.9;  // CUDA: share of GPU memory for weights, activations and KV
  bool cuda_graphs = true;              // CUDA: replay decode steps as CUDA graphs
  std::string gemm_tuning_file;         // CUDA, one GPU: measured cuBLASLt choices (model/gemm_tuning.h)
  // CUDA: products of at most this many rows run kernels/cuda/gemv.h's kernel (0: all cuBLASLt, one
  // product path for every batch size); unset: CudaModelOptions' default.
  std::optional<int64_t> gemv_rows;
  // --tensor-parallel-size: ranks each layer is split over (model/tensor_parallel.h); CPU: threads
  // of this process, CUDA: GPUs 0..N-1, one rank each, joined by NCCL.
  int tensor_parallel_size = 1;
  PagedStoreConfig kv;                  // page size and pool sizes (0 pages: from memory)
  std::string seer_gate;                // --seer-gate: Seer's trained gate (safetensors); empty: training-free
  // The server's default attention is sparse: the CPU store is sized for it, and `auto` stays on
  // the CPU (sparse algorithms do not run on the GPU yet).
  bool sparse_default = false;
};

struct Backend {
  std::string device;                  // "cpu" or "cuda"
  std::unique_ptr<LoadedModel> model;  // name, tokenizer, config; host weights only on the CPU
  std::unique_ptr<ForwardModel> forward;
  std::unique_ptr<AttentionFactory> attention;
  std::string description;             // one log line: device, KV store, sizes
};

// "auto" becomes "cuda" when spin was built with CUDA and a GPU is present (and the default
// attention is dense), else "cpu". Throws spin::Error for an unknown device, or "cuda" where it
// cannot run.
std::string resolve_device(const std::string& device, bool sparse_default);

// engine: the engine's flags (max_model_len 0 = the model's context); they size the KV stores
// and the GPU's activation buffers. Throws spin::Error when --tensor-parallel-size does not split
// the model's KV heads, query heads and intermediate size, or exceeds the visible GPUs.
Backend make_backend(LoadOptions load, const BackendOptions& options, const EngineConfig& engine);

// The flags that name the model and how to read it: -m/--model, --load-format, --rope-scaling.
void add_model_options(CLI::App& cmd, LoadOptions& load);

}  // namespace spin::cli
