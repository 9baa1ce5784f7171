#include "kernels/cuda/gemv.h"

#include <algorithm>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/per_device.h"

namespace spin::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A block sums a group of outs<R> outputs (rows of w) at a time, reading all R rows of a for them;
// each thread has depth<R> 16-byte pieces of each of those rows in flight. A block reads every row
// of a once a group, so from 3 rows on a group is six outputs one piece deep: fewer reads of a per
// piece of w, about the same bytes of w in flight, and no spills (eight outputs spill).
template <int R>
constexpr int outs = R <= 2 ? 4 : 6;
template <int R>
constexpr int depth = R <= 2 ? 2 : 1;

__device__ __forceinline__ float dot8(const uint4& x, const uint4& y, float acc) {
  const auto* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
  const auto* yp = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(xp[i]), b = __bfloat1622float2(yp[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// A piece of w, read once: kept out of L1, which then holds the rows of a that every group re-reads.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void store(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// Thread t's pieces of round `base` (pieces base + d * kThreads + t, d < Depth) of the rows of w
// that output group `group` covers (the last row repeated past n); zeros past the row's end.
template <int Depth, int Outs>
__device__ __forceinline__ void load_round(uint4 (&dst)[Depth][Outs], const bf16* w, int64_t group, int64_t n,
                                           int64_t base, int64_t pieces) {
#pragma unroll
  for (int o = 0; o < Outs; ++o) {
    const auto* row = reinterpret_cast<const uint4*>(w + min(group * Outs + o, n - 1) * (pieces * 8));
#pragma unroll
    for (int d = 0; d < Depth; ++d) {
      const int64_t j = base + d * kThreads + threadIdx.x;
      dst[d][o] = j < pieces ? load_streaming(row + j) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Output groups of outs<R> outputs, taken by the blocks in turn (block b: groups b, b + gridDim.x,
// ...), each group's rows of w read in rounds of depth<R> pieces a thread. A block loads the next
// round, of its group or its next group, before it sums the current one, so its loads stay in
// flight through each group's closing reduction; the grid is sized to stay resident. Unlike the
// other kernels `launch` runs, it reads w before wait_for_prior_grids(): no kernel writes the
// weights.
template <int R, typename Out>
__global__ void __launch_bounds__(kThreads, 2) gemv_nt_kernel(const bf16* a, const bf16* w, Out* out, int64_t n,
                                                           int64_t k) {
  constexpr int kOuts = outs<R>, kDepth = depth<R>;
  __shared__ float partial[2][kWarps][kOuts][R];
  const int64_t pieces = k / 8;
  const int64_t rounds = (pieces + kDepth * kThreads - 1) / (kDepth * kThreads);
  const int64_t groups = (n + kOuts - 1) / kOuts;
  int64_t group = blockIdx.x, round = 0;
  uint4 cur[kDepth][kOuts];
  load_round(cur, w, group, n, 0, pieces);
  enter_dependent_grid();
  const auto* x = reinterpret_cast<const uint4*>(a);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float acc[kOuts][R];
#pragma unroll
  for (int o = 0; o < kOuts; ++o)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[o][r] = 0.0f;
  for (int parity = 0;; parity ^= (round == 0)) {
    int64_t next_group = group, next_round = round + 1;
    if (next_round == rounds) {
      next_group += gridDim.x;
      next_round = 0;
    }
    uint4 next[kDepth][kOuts];
    if (next_group < groups) load_round(next, w, next_group, n, next_round * kDepth * kThreads, pieces);
    const int64_t base = round * kDepth * kThreads;
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      // No early exit past the row's end: the loads of a stay free to issue together, and the
      // pieces of w there are zeros.
      const int64_t j = base + d * kThreads + threadIdx.x;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4 xr = j < pieces ? x[r * pieces + j] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int o = 0; o < kOuts; ++o) acc[o][r] = dot8(cur[d][o], xr, acc[o][r]);
      }
    }
    if (next_round == 0) {
      // The group is summed: its warps' sums meet in this group's half of `partial` (the other
      // half may still be read for the group before).
#pragma unroll
      for (int o = 0; o < kOuts; ++o)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float v = acc[o][r];
          acc[o][r] = 0.0f;
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
          if (lane == 0) partial[parity][warp][o][r] = v;
        }
      __syncthreads();
      if (threadIdx.x < kOuts * R) {
        const int o = threadIdx.x / R, r = threadIdx.x % R;
        float sum = 0.0f;
        for (int i = 0; i < kWarps; ++i) sum += partial[parity][i][o][r];
        if (group * kOuts + o < n) store(out + r * n + group * kOuts + o, sum);
      }
    }
    if (next_group >= groups) return;
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int o = 0; o < kOuts; ++o) cur[d][o] = next[d][o];
    group = next_group;
    round = next_round;
  }
}

// The kernel instance for `rows` rows (1..kMaxGemvRows), from R up, on as many blocks as stay
// resident together (at most one a group).
template <int R, typename Out>
cudaError_t launch_rows(const bf16* a, const bf16* w, Out* out, int64_t rows, int64_t n, int64_t k,
                        cudaStream_t stream) {
  if constexpr (R < kMaxGemvRows) {
    if (rows > R) return launch_rows<R + 1>(a, w, out, rows, n, k, stream);
  }
  const int resident = per_device<int>([] {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_nt_kernel<R, Out>, kThreads, 0) != cudaSuccess)
      per_sm = 1;
    return std::max(per_sm, 1) * multiprocessor_count();
  });
  const int64_t groups = (n + outs<R> - 1) / outs<R>;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(groups, resident));
  return launch(gemv_nt_kernel<R, Out>, blocks, kThreads, 0, stream, a, w, out, n, k);
}

template <typename Out>
cudaError_t dispatch(const bf16* a, const bf16* w, Out* out, int64_t rows, int64_t n, int64_t k,
                     cudaStream_t stream) {
  if (!gemv_fits(a, w, rows, n, k) || !out) return cudaErrorInvalidValue;
  return launch_rows<1>(a, w, out, rows, n, k, stream);
}

}  // namespace

bool gemv_fits(const void* a, const void* w, int64_t rows, int64_t out_features, int64_t in_features) {
  const auto aligned16 = [](const void* p) { return p && reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return rows >= 1 && rows <= kMaxGemvRows && in_features > 0 && in_features % 8 == 0 && out_features >= 1 &&
         out_features <= INT32_MAX && aligned16(a) && aligned16(w);
}

cudaError_t gemv_nt(const bf16* a, const bf16* w, bf16* out, int64_t rows, int64_t out_features, int64_t in_features,
                    cudaStream_t stream) {
  return dispatch(a, w, out, rows, out_features, in_features, stream);
}

cudaError_t gemv_nt(const bf16* a, const bf16* w, float* out, int64_t rows, int64_t out_features, int64_t in_features,
                    cudaStream_t stream) {
  return dispatch(a, w, out, rows, out_features, in_features, stream);
}

}  // namespace spin::cuda
