#pragma once
// Decode-sized products: out[r][o] = sum_i a[r][i] * w[o][i] for r < rows <= kMaxGemvRows, a and w
// bf16 ([rows][in], [out][in]: the HF layout), fp32 sums, bf16 or fp32 out ([rows][out]). Such a
// product only streams w, so it runs at HBM speed if enough of w's bytes stay in flight:
//  - as many blocks as stay resident, each taking groups of four outputs (six from 3 rows on) in
//    turn, its 256 threads over the rows in 16-byte pieces; a block loads its next pieces (of this
//    group or its next) before it sums the ones it holds, so its loads stay in flight through each
//    group's reduction; w's pieces bypass L1, which keeps the rows of a that every group re-reads;
//  - each block's first loads of w are issued before it waits for the kernel before it in the
//    stream (launch.cuh), so they overlap that kernel's end. So w must not be written by the
//    kernel right before the product in its stream (weights are written once, at load).
// Each output is summed in one fixed order (pieces in thread order, then the warps in order), the
// same for any row count. Against cuBLASLt on an H100 (docs/results/gpu.md, session 39), products
// alone: 1.06-1.29x at 1 row, 0.99-1.25x at 2, 0.96-1.10x at 3, 0.82-0.98x at 4 (every block
// re-reads all rows of a per piece of w); whole decode steps gain at 1 and 2 rows, lose at 3 and 4.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spin::cuda {

inline constexpr int64_t kMaxGemvRows = 4;

// Whether gemv_nt takes these operands: 1..kMaxGemvRows rows, in_features a positive multiple of
// 8, a and w 16-byte aligned, out_features >= 1.
bool gemv_fits(const void* a, const void* w, int64_t rows, int64_t out_features, int64_t in_features);

// cudaErrorInvalidValue where gemv_fits does not hold, else the launch status.
cudaError_t gemv_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* out, int64_t rows,
                    int64_t out_features, int64_t in_features, cudaStream_t stream);
cudaError_t gemv_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int64_t rows, int64_t out_features,
                    int64_t in_features, cudaStream_t stream);

}  // namespace spin::cuda
