#pragma once
// The forward pass's matrix products through cuBLASLt: activations [rows][in] times a weight
// matrix stored [out][in] (the HF layout), bf16 inputs, fp32 accumulation, bf16 or fp32 output.
// Each shape's descriptors and algorithm are chosen once and cached, so a step costs one
// cublasLtMatmul call per product and can be captured in a CUDA graph (fixed workspace, no
// allocation).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "model/cuda/device_buffer.h"

namespace spin {

class GemmRunner {
 public:
  GemmRunner();
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // out[rows][out_features] = a[rows][in_features] * w[out_features][in_features]^T
  void matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* out, int64_t rows,
                 int64_t out_features, int64_t in_features, cudaStream_t stream);
  void matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int64_t rows,
                 int64_t out_features, int64_t in_features, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t w = nullptr, a = nullptr, out = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;  // rows, out, in, output type

  const Plan& plan(int64_t rows, int64_t out_features, int64_t in_features, cudaDataType_t out_type);
  void run(const void* a, const __nv_bfloat16* w, void* out, int64_t rows, int64_t out_features,
           int64_t in_features, cudaDataType_t out_type, cudaStream_t stream);
  static void destroy(Plan& p);

  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<char> workspace_;
  std::map<Key, Plan> plans_;
};

}  // namespace spin
