// Products with weights in GGUF blocks (kernels/cpu/block_matmul.h) against double-precision sums
// over the same matrix dequantized by the loader's own code (model/quant.cpp), on fresh random
// blocks each run. The whole model's decode with them is checked against the numpy reference in
// tests/python/test_forward.py (SmolLM2's Q4_1 GGUF).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cpu/block_matmul.h"
#include "model/gguf.h"

namespace spin {
namespace {

struct BlockMatmul : ::testing::Test {
  std::mt19937 rng{std::random_device{}()};

  // n rows of k values in `format` blocks: random scales (and Q4_1 minimums) and quantized values.
  std::vector<uint8_t> random_blocks(cpu::BlockFormat format, int64_t n, int64_t k) {
    const int64_t bytes = cpu::block_bytes(format), blocks = n * k / cpu::kBlockValues;
    std::vector<uint8_t> out(static_cast<size_t>(blocks * bytes));
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = out.data() + b * bytes;
      for (int64_t i = 0; i < bytes; ++i) blk[i] = static_cast<uint8_t>(byte(rng));
      const uint16_t d = f32_to_f16(scale(rng)), m = f32_to_f16(8.0f * scale(rng));
      std::memcpy(blk, &d, 2);
      if (format == cpu::BlockFormat::q4_1) std::memcpy(blk + 2, &m, 2);
    }
    return out;
  }
};

TEST_F(BlockMatmul, MatchesTheDequantizedMatrixAndRowsDoNotDependOnTheBatch) {
  if (!cpu::block_matmul_supported()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  for (const cpu::BlockFormat format : {cpu::BlockFormat::q4_1, cpu::BlockFormat::q8_0}) {
    const GgmlType type = format == cpu::BlockFormat::q4_1 ? GgmlType::Q4_1 : GgmlType::Q8_0;
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{1, 32}, {17, 96}, {64, 576}, {200, 1536}}) {
      const std::vector<uint8_t> w = random_blocks(format, n, k);
      std::vector<float> dense(static_cast<size_t>(n * k));
      dequantize_row(type, w.data(), dense.data(), static_cast<uint64_t>(n * k));
      for (const int64_t m : {1, 3, 4, 5, 8}) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> x(static_cast<size_t>(m * k)), y(static_cast<size_t>(m * n), NAN);
        for (float& v : x) v = normal(rng);
        cpu::block_matmul_nt(x.data(), w.data(), format, y.data(), m, n, k);
        for (int64_t r = 0; r < m; ++r) {
          std::vector<float> alone(static_cast<size_t>(n), NAN);
          cpu::block_matmul_nt(x.data() + r * k, w.data(), format, alone.data(), 1, n, k);
          for (int64_t o = 0; o < n; ++o) {
            double ref = 0.0, scale = 0.0;
            for (int64_t j = 0; j < k; ++j) {
              ref += static_cast<double>(x[r * k + j]) * dense[o * k + j];
              scale += std::abs(static_cast<double>(x[r * k + j]) * dense[o * k + j]);
            }
            const float got = y[r * n + o];
            ASSERT_LE(std::abs(got - ref), 1e-5 * scale + 1e-30)
                << "format " << static_cast<int>(format) << " n " << n << " k " << k << " m " << m << " row " << r
                << " out " << o;
            ASSERT_EQ(got, alone[o]) << "a row's product changed with the rows beside it (m " << m << ")";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace spin
