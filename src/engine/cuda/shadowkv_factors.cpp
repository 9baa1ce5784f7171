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
  solver_check(cusolverDnCreate(&solver_), "cuSOLVER handle");
  info_.reserve(1, "cuSOLVER status");
}

ShadowKvFactorizer::~ShadowKvFactorizer() {
  cudaSetDevice(device_);
  if (solver_) cusolverDnDestroy(solver_);
  if (blas_) cublasDestroy(blas_);
}

void ShadowKvFactorizer::factorize(const cuda::ShadowKvUnrotateParams& keys, cuda::ShadowKvStoreParams store,
                                   cudaStream_t stream) {
  SPIN_CHECK(keys.first_page == 0 && keys.num_pages > 0, "shadowkv: the factorisation takes a whole prompt");
  const int width = keys.num_kv_heads * keys.head_dim;
  const int rank = store.rank;
  SPIN_CHECK(rank >= 1 && rank <= width, "shadowkv: rank {} outside 1..{}", rank, width);
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  blas_check(cublasSetStream(blas_, stream), "cuBLAS stream");
  solver_check(cusolverDnSetStream(solver_, stream), "cuSOLVER stream");
  const int64_t chunk_pages = std::max<int64_t>(1, kChunkTokens / keys.page_size);
  const int64_t chunk_tokens = chunk_pages * keys.page_size;
  keys_.reserve(static_cast<size_t>(chunk_tokens * width), "shadowkv keys");
  gram_.reserve(static_cast<size_t>(width) * width, "shadowkv Gram matrix");
  coeffs_.reserve(static_cast<size_t>(chunk_tokens * rank), "shadowkv coefficients");
  values_.reserve(static_cast<size_t>(width), "shadowkv eigenvalues");

  // The keys of pages [first, first + n) into keys_.
  const auto unrotate = [&](int64_t first, int64_t n) {
    cuda::ShadowKvUnrotateParams chunk = keys;
    chunk.pages = keys.pages + first * keys.num_kv_heads;
    chunk.first_page = static_cast<int>(first);
    chunk.num_pages = static_cast<int>(n);
    chunk.keys = keys_.get();
    cuda_check(cuda::shadowkv_unrotate_keys(chunk, stream), "shadowkv key unrotation");
  };
  const float one = 1.0f, zero = 0.0f;
  // KᵀK, lower triangle: keys_ is column-major width x tokens.
  for (int64_t first = 0; first < keys.num_pages; first += chunk_pages) {
    const int64_t n = std::min<int64_t>(chunk_pages, keys.num_pages - first);
    unrotate(first, n);
    blas_check(cublasSsyrk(blas_, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, width, static_cast<int>(n * keys.page_size),
                           &one, keys_.get(), width, first == 0 ? &zero : &one, gram_.get(), width),
               "shadowkv Gram matrix");
  }
  // The `rank` largest eigenpairs: the first `rank` columns of gram_, ascending.
  int lwork = 0, found = 0;
  solver_check(cusolverDnSsyevdx_bufferSize(solver_, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I,
                                            CUBLAS_FILL_MODE_LOWER, width, gram_.get(), width, 0.0f, 0.0f,
                                            width - rank + 1, width, &found, values_.get(), &lwork),
               "shadowkv eigensolver workspace");
  work_.reserve(static_cast<size_t>(std::max(lwork, 1)), "shadowkv eigensolver workspace");
  solver_check(cusolverDnSsyevdx(solver_, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER, width,
                                 gram_.get(), width, 0.0f, 0.0f, width - rank + 1, width, &found, values_.get(),
                                 work_.get(), lwork, info_.get()),
               "shadowkv eigensolver");
  int info = 0;
  cuda_check(cudaMemcpyAsync(&info, info_.get(), sizeof(int), cudaMemcpyDeviceToHost, stream), "cuSOLVER status");
  cuda_check(cudaStreamSynchronize(stream), "shadowkv eigensolver");
  SPIN_CHECK(info == 0 && found == rank, "shadowkv: the key eigensolver failed (info {}, {} of {} eigenvectors)", info,
             found, rank);
  // A = K·B per chunk (column-major rank x tokens, i.e. row-major [token][rank]), then stored.
  store.basis = gram_.get();
  store.ld_basis = width;
  for (int64_t first = 0; first < keys.num_pages; first += chunk_pages) {
    const int64_t n = std::min<int64_t>(chunk_pages, keys.num_pages - first);
    unrotate(first, n);
    blas_check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rank, static_cast<int>(n * keys.page_size), width, &one,
                           gram_.get(), width, keys_.get(), width, &zero, coeffs_.get(), rank),
               "shadowkv coefficients");
    store.first_page = static_cast<int>(first);
    store.num_pages = static_cast<int>(n);
    store.coeffs = coeffs_.get();
    cuda_check(cuda::shadowkv_store_factors(store, stream), "shadowkv factor store");
    store.basis = nullptr;  // once
  }
}

}  // namespace spin
