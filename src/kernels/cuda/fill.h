#pragma once
// Random weights made on the device, so a dummy model of any size needs no host memory and no
// host-to-device copy (a 14B model would otherwise take 59 GB of fp32 on the host).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

// out[i] = bf16(center + half_width * (2u - 1)), u uniform in [0, 1) from 24 random bits, with
// the random stream of model/dummy_model.cpp's fill_uniform: the values of tensor `tensor_id`
// are cut into blocks of 2^16, block b draws splitmix64 outputs starting from
// splitmix64(seed ^ tensor_id * 0xd1b54a32d192ed03) + b * 0x632be59bd9b4e019, so element i of
// the tensor equals the host's fp32 value rounded to bf16 (the float arithmetic is the same, in
// the same order, without fused multiply-adds).
cudaError_t fill_dummy_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, uint64_t tensor_id,
                            float center, float half_width, cudaStream_t stream);

}  // namespace spin::cuda
