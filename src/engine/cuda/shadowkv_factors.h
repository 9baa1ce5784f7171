#pragma once
// ShadowKV's Index on the GPU, the part that is not a kernel: the rank-r factorisation of a
// prompt's pre-RoPE keys in each layer, K ≈ A·Bᵀ with B the top-r eigenvectors of KᵀK
// (K's right singular vectors) and A = K·B, as the CPU reference (src/sparse/shadowkv.cpp) does
// in double. Here: the keys turned back by RoPE in fp32 (kernels/cuda/shadowkv.h), KᵀK by one
// cuBLAS GEMM per chunk of tokens, the eigenvectors of every layer's KᵀK by one batched cuSOLVER
// call (SYEVBATCHED: 2.3 ms a layer for 1024-wide keys on an H200, against 10.5 ms for one SYEVDX
// or SYEVD call each), A by one GEMM per chunk, stored into the sequence's factor groups. Both
// GEMMs round their inputs to TF32 for the tensor cores: its 10-bit mantissa is finer than the
// bf16 the keys are stored in and the factors are written in. At 32K tokens x 38 layers of
// 1024-wide keys, KᵀK takes 63 ms by fp32 SYRK (which has no TF32 path) and 14.5 ms by a TF32 GEMM
// of the whole matrix; A 13.6 ms in fp32 and 3.9 ms in TF32 (docs/results/h200/session14).
#include <cublas_v2.h>
#include <cusolverDn.h>

#include <span>
#include <vector>

#include "kernels/cuda/shadowkv.h"
#include "model/cuda/device_buffer.h"

namespace spin {

class ShadowKvFactorizer {
 public:
  explicit ShadowKvFactorizer(int device);
  ~ShadowKvFactorizer();
  ShadowKvFactorizer(const ShadowKvFactorizer&) = delete;
  ShadowKvFactorizer& operator=(const ShadowKvFactorizer&) = delete;

  // One layer of a prompt: the keys (first_page 0: the whole prompt) and where its factors go
  // (store's pages, coeffs and basis are set here). The factor groups may be the prompt pages'
  // own: a layer's keys are all read before its factors are written.
  struct Layer {
    cuda::ShadowKvUnrotateParams keys;
    cuda::ShadowKvStoreParams store;
  };
  // Factorises every layer at its store.rank (all the same shape). Waits for the stream: the
  // eigensolver's status comes back to the host.
  void factorize(std::span<const Layer> layers, cudaStream_t stream);

 private:
  int device_;
  cublasHandle_t blas_ = nullptr;
  cusolverDnHandle_t solver_ = nullptr;
  cusolverDnParams_t params_ = nullptr;
  DeviceBuffer<float> keys_;    // a chunk of pre-RoPE keys, [tokens][width]
  DeviceBuffer<float> gram_;    // per layer KᵀK, then its eigenvectors (column-major, width x width)
  DeviceBuffer<float> coeffs_;  // one layer's A, [tokens][rank]
  DeviceBuffer<float> values_;  // eigenvalues
  DeviceBuffer<char> work_;
  std::vector<char> host_work_;
  DeviceBuffer<int> info_;
};

}  // namespace spin
