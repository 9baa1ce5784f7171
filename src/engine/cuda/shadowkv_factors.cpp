#include "engine/cuda/shadowkv_factors.h"

#include <algorithm>

#include "base/error.h"

namespace spin {

namespace {

// Tokens turned back and multiplied at once: 32 MB of fp32 keys for a 1024-wide layer.
constexpr int64_t kChunkTokens = 8192;

void blas_check(cublasStatus_t status, const char* what) {
  SPIN_CHECK(status == CUBLAS_STATUS_SUCCESS, "{}: cuBLAS error {}", what, static_cast<int>(status));
}

void solver_check(cusolverStatus_t status, const char* what) {
  SPIN_CHECK(status == CUSOLVER_STATUS_SUCCESS, "{}: cuSOLVER error {}", what, static_cast<int>(status));
}

}  // namespace

ShadowKvFactorizer::ShadowKvFactorizer(int device) : device_(device) {
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  blas_check(cublasCreate(&blas_), "cuBLAS handle");
  blas_check(cublasSetMathMode(blas_, CUBLAS_TF32_TENSOR_OP_MATH), "cuBLAS TF32 math");
  solver_check(cusolverDnCreate(&solver_), "cuSOLVER handle");
  solver_check(cusolverDnCreateParams(&params_), "cuSOLVER parameters");
}

ShadowKvFactorizer::~ShadowKvFactorizer() {
  cudaSetDevice(device_);
  if (params_) cusolverDnDestroyParams(params_);
  if (solver_) cusolverDnDestroy(solver_);
  if (blas_) cublasDestroy(blas_);
}

void ShadowKvFactorizer::factorize(std::span<const Layer> layers, cudaStream_t stream) {
  if (layers.empty()) return;
  const cuda::ShadowKvUnrotateParams& shape = layers.front().keys;
  SPIN_CHECK(shape.first_page == 0 && shape.num_pages > 0, "shadowkv: the factorisation takes a whole prompt");
  const int width = shape.num_kv_heads * shape.head_dim;
  const int rank = layers.front().store.rank;
  SPIN_CHECK(rank >= 1 && rank <= width, "shadowkv: rank {} outside 1..{}", rank, width);
  const auto n = static_cast<int64_t>(layers.size());
  const size_t matrix = static_cast<size_t>(width) * width;
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  blas_check(cublasSetStream(blas_, stream), "cuBLAS stream");
  solver_check(cusolverDnSetStream(solver_, stream), "cuSOLVER stream");
  const int64_t chunk_pages = std::max<int64_t>(1, kChunkTokens / shape.page_size);
  const int64_t chunk_tokens = chunk_pages * shape.page_size;
  keys_.reserve(static_cast<size_t>(chunk_tokens * width), "shadowkv keys");
  gram_.reserve(matrix * static_cast<size_t>(n), "shadowkv Gram matrices");
  coeffs_.reserve(static_cast<size_t>(shape.num_pages) * shape.page_size * rank, "shadowkv coefficients");
  values_.reserve(static_cast<size_t>(width * n), "shadowkv eigenvalues");
  info_.reserve(static_cast<size_t>(n), "cuSOLVER status");

  // Layer l's keys of pages [first, first + count) into keys_ (column-major width x tokens).
  const auto unrotate = [&](const Layer& layer, int64_t first, int64_t count) {
    cuda::ShadowKvUnrotateParams chunk = layer.keys;
    chunk.pages = layer.keys.pages + first * layer.keys.num_kv_heads;
    chunk.first_page = static_cast<int>(first);
    chunk.num_pages = static_cast<int>(count);
    chunk.keys = keys_.get();
    cuda_check(cuda::shadowkv_unrotate_keys(chunk, stream), "shadowkv key unrotation");
  };
  const int64_t pages = shape.num_pages;
  const float one = 1.0f, zero = 0.0f;
  for (int64_t l = 0; l < n; ++l) {  // KᵀK
    for (int64_t first = 0; first < pages; first += chunk_pages) {
      const int64_t count = std::min<int64_t>(chunk_pages, pages - first);
      unrotate(layers[static_cast<size_t>(l)], first, count);
      blas_check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, width, width, static_cast<int>(count * shape.page_size),
                             &one, keys_.get(), width, keys_.get(), width, first == 0 ? &zero : &one,
                             gram_.get() + matrix * static_cast<size_t>(l), width),
                 "shadowkv Gram matrix");
    }
  }
  // Every eigenpair of every layer, ascending: the last `rank` columns are the basis.
  size_t device_bytes = 0, host_bytes = 0;
  solver_check(cusolverDnXsyevBatched_bufferSize(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER,
                                                 width, CUDA_R_32F, gram_.get(), width, CUDA_R_32F, values_.get(),
                                                 CUDA_R_32F, &device_bytes, &host_bytes, n),
               "shadowkv eigensolver workspace");
  work_.reserve(std::max<size_t>(device_bytes, 1), "shadowkv eigensolver workspace");
  host_work_.resize(std::max<size_t>(host_bytes, 1));
  solver_check(cusolverDnXsyevBatched(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, width,
                                     CUDA_R_32F, gram_.get(), width, CUDA_R_32F, values_.get(), CUDA_R_32F,
                                     work_.get(), device_bytes, host_work_.data(), host_bytes, info_.get(), n),
               "shadowkv eigensolver");
  std::vector<int> info(static_cast<size_t>(n));
  cuda_check(cudaMemcpyAsync(info.data(), info_.get(), info.size() * sizeof(int), cudaMemcpyDeviceToHost, stream),
             "cuSOLVER status");
  cuda_check(cudaStreamSynchronize(stream), "shadowkv eigensolver");
  for (int64_t l = 0; l < n; ++l) {
    SPIN_CHECK(info[static_cast<size_t>(l)] == 0, "shadowkv: the key eigensolver failed on layer {} (info {})", l,
               info[static_cast<size_t>(l)]);
  }
  // A = K·B per chunk (column-major rank x tokens, i.e. row-major [token][rank]), the keys turned
  // back a second time (keeping them would take tokens x width floats per layer). A layer's pages
  // are all read before its factors are stored: the factor groups may be the prompt's own, freed.
  for (int64_t l = 0; l < n; ++l) {
    const Layer& layer = layers[static_cast<size_t>(l)];
    const float* basis = gram_.get() + matrix * static_cast<size_t>(l) + static_cast<size_t>(width - rank) * width;
    for (int64_t first = 0; first < pages; first += chunk_pages) {
      const int64_t count = std::min<int64_t>(chunk_pages, pages - first);
      unrotate(layer, first, count);
      blas_check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rank, static_cast<int>(count * shape.page_size), width,
                             &one, basis, width, keys_.get(), width, &zero,
                             coeffs_.get() + first * shape.page_size * rank, rank),
                 "shadowkv coefficients");
    }
    cuda::ShadowKvStoreParams store = layer.store;
    store.basis = basis;
    store.ld_basis = width;
    store.num_pages = static_cast<int>(pages);
    store.coeffs = coeffs_.get();
    cuda_check(cuda::shadowkv_store_factors(store, stream), "shadowkv factor store");
  }
}

}  // namespace spin
