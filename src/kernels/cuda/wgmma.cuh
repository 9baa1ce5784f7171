#pragma once
// Hopper warpgroup MMA (wgmma, sm_90a only): the building blocks of the prefill attention's
// warpgroup kernel. A warpgroup is 4 consecutive warps (128 threads) that issue each wgmma
// together; the fp32 accumulator of m64nN gives warp w of the group rows 16 w .. 16 w + 15 with
// the mma.m16n8k16 accumulator layout per 8 columns: d[4 j + i] holds column 8 j + 2 (lane % 4)
// + (i % 2) of row lane / 4 + 8 (i / 2) (PTX ISA, "wgmma register fragments").
//
// Shared-memory operands are described by 64-bit descriptors (PTX ISA, "matrix descriptor"):
// start address, leading and stride byte offsets (all >> 4) and the swizzle mode. Tiles here use
// the 128-byte swizzle: 64 bf16 (128 bytes) per row, 8-row atoms of 1024 bytes, and within an atom
// 16-byte chunk c of row r stored at chunk c ^ (r % 8); the atom must be 1024-byte aligned.
//  - K-major (rows along M or N, the K dimension contiguous): 8-row atoms 1024 bytes apart (stride
//    offset); a k16 step is 32 bytes further into the row.
//  - MN-major (rows along K, N contiguous): 8-row atoms along K 1024 bytes apart (stride offset);
//    the next 64 columns of N `leading` bytes further.
#include <cstdint>

namespace spin::cuda {

__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3ffff) >> 4) | static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | uint64_t{1} << 62;
}

// Orders register writes before the wgmmas that read them (and accumulators between batches).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async included) visible to wgmma.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// mbarriers in shared memory (PTX ISA, "mbarrier"): a phase completes once `count` arrivals
// have happened; waiters name the phase by its parity.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival, made once every cp.async this thread issued before it has landed.
__device__ __forceinline__ void mbarrier_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` more of asynchronous (TMA) writes in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// A box of a 2-D tensor map (TMA) into the same shared-memory offset `dst` of every CTA of the
// cluster in `cta_mask`, each counted on its own barrier at `bar`'s offset as it lands.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* tensor_map, int x, int y, uint32_t bar,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], "
      "[%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
      : "memory");
}
// One arrival on the barrier at offset `bar` of CTA `cta` of the cluster (this one included).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// Every non-exited thread of the cluster meets here (barrier.cluster); orders shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Returns once the phase of parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once (the "previous" phase counts as complete).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nspin_mbarrier_retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra spin_mbarrier_retry;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Hands registers between the warpgroups of a block (every warp of a warpgroup executes it).
template <int Registers>
__device__ __forceinline__ void warpgroup_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
// Keeps the compiler from moving accesses of `x` across an in-flight wgmma.
__device__ __forceinline__ void wgmma_fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
// The same for all 64 accumulators of an m64n128 wgmma.
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) wgmma_fence_operand(d[i]);
}

// The 64 fp32 accumulators of an m64n128 wgmma: the register list of the instruction, and the
// asm output operands %0..%63 it names.
#define SPIN_WGMMA_D64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SPIN_WGMMA_D64(d) \
  "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
  "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
  "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
  "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
  "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), \
  "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
  "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
  "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])

// d (64x128, fp32) {=, +=} A (64x16, smem, K-major) * B (16x128, smem, K-major); scale_d 0: d = A B.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SPIN_WGMMA_D64_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : SPIN_WGMMA_D64(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

// d (64x128, fp32) += A (64x16, registers: the mma.m16n8k16 A fragment of each warp's 16 rows) *
// B (16x128, smem, MN-major: N contiguous).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SPIN_WGMMA_D64_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : SPIN_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

}  // namespace spin::cuda
