#include "kernels/cpu/block_matmul.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace spin::cpu {

namespace {

// Rows of x handled together: their products share one unpacking of each weight block.
constexpr int64_t kRowTile = 4;
// How far ahead of the block being multiplied its thread asks for weights.
constexpr int64_t kPrefetchBytes = 2048;

// Per row of x and block: the sum of its 32 values (Q4_1's m term), into `sums`. Kept per
// thread: a decode step makes 7 products a layer, and none should allocate.
const float* block_sums(const float* x, int64_t m, int64_t k) {
  thread_local std::vector<float> sums;
  const int64_t blocks = k / kBlockValues;
  sums.resize(static_cast<size_t>(m * blocks));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.0f;
      for (int64_t j = 0; j < kBlockValues; ++j) s += x[r * k + b * kBlockValues + j];
      sums[static_cast<size_t>(r * blocks + b)] = s;
    }
  }
  return sums.data();
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Outputs [out_begin, out_end) of rows [r0, r0 + rows) (rows <= kRowTile): a block's 32 values
// as four vectors of 8 floats, one accumulator vector per row, reduced once at the end. sums:
// block_sums of x for Q4_1, null for Q8_0.
__attribute__((target("avx2,fma,f16c"))) void tile(const float* x, const float* sums, const uint8_t* w,
                                                    BlockFormat format, float* y, int64_t r0, int64_t rows,
                                                    int64_t out_begin, int64_t out_end, int64_t n, int64_t k) {
  const int64_t blocks = k / kBlockValues, bytes = block_bytes(format);
  for (int64_t o = out_begin; o < out_end; ++o) {
    __m256 acc[kRowTile];
    float m_acc[kRowTile] = {};
    for (int64_t r = 0; r < kRowTile; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* row = w + o * blocks * bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * bytes;
      // A thread walks its rows' blocks in address order, 20 or 34 bytes at a time: the hardware
      // prefetcher alone kept it at half its in-cache rate (docs/results/cpu-decode/session23/).
      // The address may lie past the matrix (a prefetch never faults), so it is formed as an integer.
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(blk) + kPrefetchBytes), _MM_HINT_T0);
      __m256 q[4];
      if (format == BlockFormat::q4_1) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m128i lo = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      } else {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
      }
      // d (and Q4_1's m) are the block's first two f16 values: one conversion for both.
      uint32_t dm;
      std::memcpy(&dm, blk, 4);
      const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
      const __m256 d = _mm256_broadcastss_ps(scales);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xb = x + (r0 + r) * k + b * kBlockValues;
        __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], dot);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], dot);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], dot);
        acc[r] = _mm256_fmadd_ps(d, dot, acc[r]);
      }
      if (sums != nullptr) {  // Q4_1's minimum times each row's block sum
        const float mn = _mm_cvtss_f32(_mm_movehdup_ps(scales));
        for (int64_t r = 0; r < rows; ++r) m_acc[r] += mn * sums[(r0 + r) * blocks + b];
      }
    }
    for (int64_t r = 0; r < rows; ++r) y[(r0 + r) * n + o] = hsum(acc[r]) + m_acc[r];
  }
}

}  // namespace

bool block_matmul_supported() {
  // F16C from CPUID (clang's __builtin_cpu_supports does not know it).
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

int64_t block_bytes(BlockFormat format) { return format == BlockFormat::q4_1 ? 20 : 34; }

void block_matmul_nt(const float* x, const uint8_t* w, BlockFormat format, float* y, int64_t m, int64_t n,
                     int64_t k) {
  const float* sums = format == BlockFormat::q4_1 ? block_sums(x, m, k) : nullptr;
  // Threads split the output features: each reads its share of the weights once per row tile.
  constexpr int64_t kOutChunk = 16;
  const int64_t chunks = (n + kOutChunk - 1) / kOutChunk;
  for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, m - r0);
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t c = 0; c < chunks; ++c) {
      tile(x, sums, w, format, y, r0, rows, c * kOutChunk, std::min(n, (c + 1) * kOutChunk), n, k);
    }
  }
}

}  // namespace spin::cpu
