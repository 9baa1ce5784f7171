#pragma once
// Products of a few rows with a weight matrix kept in a GGUF file's own blocks: each row of the
// [out, in] matrix is in / 32 blocks of 32 values. A decode step reads the weights once per row
// batch, so reading the blocks (Q4_1: 0.625 bytes a value, Q8_0: 1.0625) instead of fp32 copies
// (4 bytes) is what bounds its time. Block layouts as ggml stores them (model/quant.cpp):
//   Q4_1, 20 bytes: f16 d, f16 m, 16 bytes whose low nibbles are values 0..15 and high nibbles
//         values 16..31; value = d * nibble + m.
//   Q8_0, 34 bytes: f16 d, 32 int8; value = d * q.
// Each output is sum over blocks of d * (x . q) (+ m * sum(x) for Q4_1) in fp32: the same values
// as the dequantized matrix, summed in another order. A row's outputs do not depend on the other
// rows of x (the sums are taken per row, in one order).
#include <cstdint>

namespace spin::cpu {

enum class BlockFormat : uint8_t { q4_1, q8_0 };

inline constexpr int64_t kBlockValues = 32;
int64_t block_bytes(BlockFormat format);

// Whether this CPU runs block_matmul_nt (AVX2, FMA, F16C); callers use the fp32 values otherwise.
bool block_matmul_supported();

// y[m, n] = x[m, k] · W[n, k]^T with W's rows in `format` blocks (k a multiple of 32; row r at
// w + r * (k / 32) * block_bytes(format)). Needs block_matmul_supported().
void block_matmul_nt(const float* x, const uint8_t* w, BlockFormat format, float* y, int64_t m, int64_t n,
                     int64_t k);

}  // namespace spin::cpu
