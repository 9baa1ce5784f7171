#pragma once
// ShadowKV's Index on the GPU, the part that is not a kernel: the rank-r factorisation of a
// prompt's pre-RoPE keys, one layer at a time, K ≈ A·Bᵀ with B the top-r eigenvectors of KᵀK
// (K's right singular vectors) and A = K·B, as the CPU reference (src/sparse/shadowkv.cpp) does
// in double. Here: the keys turned back by RoPE in fp32 (kernels/cuda/shadowkv.h), KᵀK by cuBLAS
// SYRK over chunks of tokens, the eigenvectors by cuSOLVER's SYEVDX (only the r largest), A by one
// GEMM per chunk, stored into the sequence's factor groups.
#include <cublas_v2.h>
#include <cusolverDn.h>

#include "kernels/cuda/shadowkv.h"
#include "model/cuda/device_buffer.h"

namespace spin {

class ShadowKvFactorizer {
 public:
  explicit ShadowKvFactorizer(int device);
  ~ShadowKvFactorizer();
  ShadowKvFactorizer(const ShadowKvFactorizer&) = delete;
  ShadowKvFactorizer& operator=(const ShadowKvFactorizer&) = delete;

  // Factorises the keys `keys` describes (its first_page must be 0: the whole prompt) at rank
  // store.rank and writes A and B as `store` says (its pages, coeffs and basis are set here).
  // Waits for the stream: SYEVDX returns its eigenvalue count to the host.
  void factorize(const cuda::ShadowKvUnrotateParams& keys, cuda::ShadowKvStoreParams store, cudaStream_t stream);

 private:
  int device_;
  cublasHandle_t blas_ = nullptr;
  cusolverDnHandle_t solver_ = nullptr;
  DeviceBuffer<float> keys_;    // a chunk of pre-RoPE keys, [tokens][width]
  DeviceBuffer<float> gram_;    // KᵀK, then its eigenvectors (column-major, width x width)
  DeviceBuffer<float> coeffs_;  // a chunk of A, [tokens][rank]
  DeviceBuffer<float> values_;  // eigenvalues
  DeviceBuffer<float> work_;
  DeviceBuffer<int> info_;
};

}  // namespace spin
