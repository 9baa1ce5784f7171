#pragma once
// RMSNorm on the GPU, optionally fused with the residual add that precedes it in each block:
//   residual += x (if residual given);  y = residual / rms(residual) * w.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

cudaError_t rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps,
                    cudaStream_t stream);

// bf16 activations and weights, fp32 accumulation. residual may be null (then y = norm(x)).
cudaError_t rmsnorm_residual_bf16(const __nv_bfloat16* x, __nv_bfloat16* residual,
                                  const __nv_bfloat16* w, __nv_bfloat16* y, int64_t rows,
                                  int64_t n, float eps, cudaStream_t stream);

}  // namespace spin::cuda
