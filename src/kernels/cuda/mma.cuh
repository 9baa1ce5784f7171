#pragma once
// Tensor-core building blocks shared by kernels (sm_80+): ldmatrix and the bf16 m16n8k16 MMA.
// Fragment layouts (PTX ISA, mma.m16n8k16): A is 16x16 row-major in four 8x8 pieces (rows 0-7 /
// 8-15 by columns 0-7 / 8-15, in the order a0 a1 a2 a3 = (r0-7,c0-7) (r8-15,c0-7) (r0-7,c8-15)
// (r8-15,c8-15)); B is 16x8 "col", i.e. stored as [n][k]; the fp32 accumulator gives lane l the
// elements (row l / 4, columns 2 (l % 4) + {0, 1}) in c0 c1 and row l / 4 + 8 in c2 c3.
#include <cstdint>

namespace spin::cuda {

// Four 8x8 bf16 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 32-bit word i of 16 bytes: the bf16 pair a thread passes as one fragment register when it loads
// 8 contiguous columns of a row at once.
__device__ __forceinline__ uint32_t component(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// c += A (16x16, bf16) * B (16x8, bf16), fp32 sums.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace spin::cuda
