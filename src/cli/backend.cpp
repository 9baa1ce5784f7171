#include "cli/backend.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "base/memory.h"
#include "engine/tensor_parallel_factory.h"
#include "model/tensor_parallel.h"
#include "model/transformer.h"
#ifdef SPIN_WITH_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/cuda_paged_attention.h"
#include "kernels/cuda/module_loading.h"
#include "model/cuda/cuda_model.h"

static_assert(spin::GemmRunner::kDefaultGemvRows == 2, "serve.cpp's help for --gemv-rows states the default");
#endif

namespace spin::cli {

namespace {

// Pool sizes left at 0 get defaults from memory: a sparse server sizes the device tier for every
// running request's full context (prefill is dense on the device) and the host tier for all of
// them; a dense server keeps a small store for requests that ask for sparse attention.
PagedStoreConfig cpu_paged_store(PagedStoreConfig kv, const AttentionShape& shape, const EngineConfig& engine,
                                 bool sparse_default) {
  kv.max_batch = engine.max_num_seqs;
  kv.max_context = engine.max_model_len;
  const auto per_token = static_cast<double>(kv_bytes_per_token(shape));
  const auto memory = static_cast<double>(usable_memory_bytes());
  const int64_t streams = shape.n_layers * shape.n_kv_heads;
  auto pages_for = [&](double tokens, double memory_share) {
    const double capped = std::max(1.0, std::min(tokens, memory * memory_share / per_token));
    return streams * static_cast<int64_t>(std::ceil(capped / kv.page_size));
  };
  const double context = static_cast<double>(engine.max_model_len);
  if (kv.device_pages == 0) {
    kv.device_pages = sparse_default ? pages_for(engine.max_num_seqs * context, 0.15) : pages_for(2 * context, 0.03);
  }
  if (kv.host_pages == 0) {
    kv.host_pages = sparse_default ? pages_for(engine.max_num_seqs * context, 0.25) : pages_for(4 * context, 0.06);
  }
  return kv;
}

int cuda_device_count() {
#ifdef SPIN_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for `auto`
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

using SeerGatePtr = std::shared_ptr<const sparse::SeerGate>;

// --seer-gate, read for the model's whole attention shape; null without the flag.
SeerGatePtr seer_gate(const BackendOptions& options, const ModelConfig& config) {
  if (options.seer_gate.empty()) return nullptr;
  const AttentionShape shape{.n_layers = config.n_layers, .n_heads = config.n_heads, .n_kv_heads = config.n_kv_heads,
                             .head_dim = config.head_dim};
  return sparse::load_seer_gate(options.seer_gate, shape);
}

Backend make_cpu_backend(Backend b, const BackendOptions& options, const EngineConfig& engine, const SeerGatePtr& gate) {
  const int world = options.tensor_parallel_size;
  if (world > 1) {
    // Sized for the whole model, then split: each rank's store holds its KV heads' pages.
    PagedStoreConfig kv;
    TensorParallel tp = make_tensor_parallel(
        b.model->weights, world,
        [&](int rank, const AttentionShape& rank_shape) {
          AttentionShape full = rank_shape;
          full.n_heads *= world;
          full.n_kv_heads *= world;
          kv = cpu_paged_store(options.kv, full, engine, options.sparse_default);
          kv.device_pages = std::max<int64_t>(1, kv.device_pages / world);
          kv.host_pages = std::max<int64_t>(1, kv.host_pages / world);
          const auto heads = static_cast<uint32_t>(rank_shape.n_kv_heads);
          kv.seer_gate = sparse::seer_gate_heads(gate, static_cast<uint32_t>(rank) * heads, heads);
          return make_paged_attention_factory(rank_shape, kv);
        },
        engine.threads);
    b.attention = std::move(tp.factory);
    b.forward = std::move(tp.model);
    b.description = fmt::format(
        "device cpu (fp32), tensor parallel over {} ranks; paged KV store per rank: {} device pages, {} host pages "
        "of {} tokens, buffer {}x",
        world, kv.device_pages, kv.host_pages, kv.page_size, kv.buffer_factor);
    return b;
  }
  auto transformer = std::make_unique<Transformer>(b.model->weights);
  PagedStoreConfig kv = cpu_paged_store(options.kv, transformer->attention_shape(), engine, options.sparse_default);
  kv.seer_gate = gate;
  b.attention = make_paged_attention_factory(transformer->attention_shape(), kv);
  b.forward = std::move(transformer);
  b.description = fmt::format("device cpu (fp32); paged KV store: {} device pages, {} host pages of {} tokens, buffer {}x",
                              kv.device_pages, kv.host_pages, kv.page_size, kv.buffer_factor);
  return b;
}

#ifdef SPIN_WITH_CUDA
// The device KV store's settings from the flags, per GPU when `world` GPUs share the pools.
CudaPagedKvConfig cuda_kv_config(const BackendOptions& options, const EngineConfig& engine, const ModelConfig& config,
                                 int world, const SeerGatePtr& gate) {
  CudaPagedKvConfig kv;
  kv.page_size = options.kv.page_size;
  kv.device_pages = options.kv.device_pages > 0 ? std::max<int64_t>(1, options.kv.device_pages / world) : 0;
  kv.host_pages = options.kv.host_pages > 0 ? std::max<int64_t>(1, options.kv.host_pages / world) : 0;
  kv.buffer_factor = options.kv.buffer_factor;
  kv.gpu_memory_utilization = options.gpu_memory_utilization;
  kv.max_batch = engine.max_num_seqs;
  kv.max_context = engine.max_model_len;
  kv.rope = make_rope_table(config.rope, config.head_dim);
  kv.seer_gate = gate;
  return kv;
}

// --tensor-parallel-size N > 1 on GPUs 0..N-1: a CudaModel per rank over its shard, NCCL between
// them, and a device KV store per rank for its KV heads (equal pools on every GPU).
Backend make_cuda_tensor_parallel_backend(Backend b, const LoadOptions& load, const BackendOptions& options,
                                          const EngineConfig& engine, const CudaModelOptions& model_options,
                                          const SeerGatePtr& gate) {
  const int world = options.tensor_parallel_size;
  const ModelConfig config = b.model->weights.config;
  CudaTensorParallel tp = make_cuda_tensor_parallel_model(load.load_format == "dummy" ? nullptr : &b.model->weights,
                                                          config, load.seed, world, model_options);
  // The devices hold the weights now; keep only the config on the host.
  ModelWeights config_only;
  config_only.config = config;
  b.model->weights = std::move(config_only);
  const CudaPagedKvConfig kv = cuda_kv_config(options, engine, config, world, gate);
  std::vector<std::unique_ptr<CudaPagedAttentionFactory>> rank_factories =
      make_cuda_rank_factories(tp.model->rank_attention_shape(), kv, world);
  const int64_t rank_pages = rank_factories.front()->capacity().device_pages;
  const int64_t page_size = rank_factories.front()->page_size();
  const double pool_bytes = static_cast<double>(rank_factories.front()->pool_bytes());
  std::vector<std::unique_ptr<AttentionFactory>> factories;
  for (auto& f : rank_factories) factories.push_back(std::move(f));
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  b.description = fmt::format(
      "device cuda ({} x {}, tensor parallel, bf16, CUDA graphs {}); weights {:.1f} GB per GPU; KV pool {:.1f} GB "
      "per GPU: {} pages of {} tokens each ({} tokens per sequence at most); host tier {} pages per GPU, buffer {}x",
      world, prop.name, options.cuda_graphs ? "on" : "off", tp.ranks.front()->weight_bytes() / 1e9,
      pool_bytes / 1e9, rank_pages, page_size,
      rank_pages / (config.n_layers * (config.n_kv_heads / world)) * page_size, kv.host_pages, kv.buffer_factor);
  b.attention = make_tensor_parallel_attention_factory(std::move(factories));
  b.forward = std::move(tp.model);
  return b;
}

Backend make_cuda_backend(Backend b, const LoadOptions& load, const BackendOptions& options,
                          const EngineConfig& engine, const SeerGatePtr& gate) {
  CudaModelOptions model_options;
  model_options.cuda_graphs = options.cuda_graphs;
  model_options.gemm_tuning_file = options.gemm_tuning_file;
  if (options.gemv_rows) model_options.gemv_rows = *options.gemv_rows;
  model_options.max_batch_tokens = engine.max_num_batched_tokens;
  model_options.max_sequences = engine.max_num_seqs;
  if (options.tensor_parallel_size > 1) {
    return make_cuda_tensor_parallel_backend(std::move(b), load, options, engine, model_options, gate);
  }
  std::unique_ptr<CudaModel> model;
  if (load.load_format == "dummy") {
    model = std::make_unique<CudaModel>(b.model->weights.config, load.seed, model_options);
  } else {
    model = std::make_unique<CudaModel>(b.model->weights, model_options);
    // The device holds the weights now; keep only the config on the host.
    ModelWeights config_only;
    config_only.config = b.model->weights.config;
    b.model->weights = std::move(config_only);
  }
  // The pool is sized after the weights and activations are allocated: it takes what is left.
  const CudaPagedKvConfig kv = cuda_kv_config(options, engine, model->config(), 1, gate);
  auto factory = std::make_unique<CudaPagedAttentionFactory>(model->attention_shape(), kv);
  const KvDemand capacity = factory->capacity();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  b.description = fmt::format(
      "device cuda ({}, bf16, CUDA graphs {}); weights {:.1f} GB; KV pool {:.1f} GB: {} pages of {} tokens "
      "({} tokens per sequence at most); host tier {} pages, buffer {}x",
      prop.name, options.cuda_graphs ? "on" : "off", model->weight_bytes() / 1e9, factory->pool_bytes() / 1e9,
      capacity.device_pages, factory->page_size(),
      capacity.device_pages / (model->config().n_layers * model->config().n_kv_heads) * factory->page_size(),
      kv.host_pages, kv.buffer_factor);
  b.forward = std::move(model);
  b.attention = std::move(factory);
  return b;
}
#endif

}  // namespace

std::string resolve_device(const std::string& device, bool sparse_default) {
  if (device == "cpu") return "cpu";
  if (device == "auto") return !sparse_default && cuda_device_count() > 0 ? "cuda" : "cpu";
  SPIN_CHECK(device == "cuda", "unknown --device '{}' (expected cpu, cuda or auto)", device);
#ifndef SPIN_WITH_CUDA
  fail("--device cuda: this spin was built without CUDA (configure with -DSPIN_CUDA=ON on a machine with nvcc)");
#endif
  SPIN_CHECK(cuda_device_count() > 0, "--device cuda: no CUDA GPU is visible to this process");
  return "cuda";
}

Backend make_backend(LoadOptions load, const BackendOptions& options, const EngineConfig& engine_flags) {
#ifdef SPIN_WITH_CUDA
  // Before the first CUDA call, which fixes the mode (kernels/cuda/module_loading.h).
  if (options.tensor_parallel_size > 1) cuda::request_eager_module_loading();
#endif
  Backend b;
  b.device = resolve_device(options.device, options.sparse_default);
  // A dummy model on the GPU is filled there: no host copy of its weights at all.
  load.dummy_weights_on_host = b.device == "cpu";
  // Before loading: a large model takes a while to read.
  SPIN_CHECK(options.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1, got {}",
             options.tensor_parallel_size);
  if (b.device == "cuda") {
    const int gpus = cuda_device_count();
    SPIN_CHECK(options.tensor_parallel_size <= gpus,
               "--tensor-parallel-size {} needs {} GPUs (one per rank); {} visible to this process",
               options.tensor_parallel_size, options.tensor_parallel_size, gpus);
  }
  SPIN_CHECK(options.gemm_tuning_file.empty() || (b.device == "cuda" && options.tensor_parallel_size == 1),
             "--gemm-tuning tunes the products of one GPU: it needs --device cuda and no tensor parallelism");
  SPIN_CHECK(!options.gemv_rows || b.device == "cuda",
             "--gemv-rows chooses a GPU's product kernel: it needs --device cuda");
#ifdef SPIN_WITH_CUDA
  if (options.gemv_rows) GemmRunner::check_gemv_rows(*options.gemv_rows);
#endif
  b.model = std::make_unique<LoadedModel>(load_model(load));
  check_tensor_parallel(b.model->weights.config, options.tensor_parallel_size);
  EngineConfig engine = engine_flags;
  if (engine.max_model_len == 0) engine.max_model_len = b.model->weights.config.max_position;
  // Before the weights go to a GPU: a bad gate file fails fast.
  const SeerGatePtr gate = seer_gate(options, b.model->weights.config);
#ifdef SPIN_WITH_CUDA
  if (b.device == "cuda") return make_cuda_backend(std::move(b), load, options, engine, gate);
#endif
  return make_cpu_backend(std::move(b), options, engine, gate);
}

void add_model_options(CLI::App& cmd, LoadOptions& load) {
  cmd.add_option("-m,--model", load.model, ".gguf file, HF directory, or preset name")->required();
  cmd.add_option("--load-format", load.load_format, "auto | gguf | safetensors | dummy")
      ->check(CLI::IsMember({"auto", "gguf", "safetensors", "dummy"}));
  cmd.add_option("--rope-scaling", load.rope_scaling,
                 "JSON rope_scaling replacing the model's, e.g. '{\"rope_type\":\"yarn\",\"factor\":4.0,"
                 "\"original_max_position_embeddings\":32768}' (YaRN extends the context to original x factor)");
}

}  // namespace spin::cli
