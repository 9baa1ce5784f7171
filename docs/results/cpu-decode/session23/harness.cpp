// The CPU block product (kernels/cpu/block_matmul) at 1 and 4 rows of x, two builds side by side:
// `base` (the repository's kernel) and `variant` (with a patch applied), both compiled into this
// program under different namespaces by run.sh. Streamed: SmolLM2-135M's 210 layer products
// (random Q4_1 blocks, 66 MB) in a row; in cache: one 576 x 576 product repeated. Checks that both
// builds give the same bits.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/cpu/block_matmul.h"

namespace base {
void block_matmul_nt(const float*, const uint8_t*, spin::cpu::BlockFormat, float*, int64_t, int64_t, int64_t);
}
namespace variant {
void block_matmul_nt(const float*, const uint8_t*, spin::cpu::BlockFormat, float*, int64_t, int64_t, int64_t);
}
using spin::cpu::BlockFormat;
using Product = void (*)(const float*, const uint8_t*, BlockFormat, float*, int64_t, int64_t, int64_t);

struct Matrix {
  std::vector<uint8_t> w;
  int64_t n, k;
};

Matrix random_q4_1(std::mt19937& rng, int64_t n, int64_t k) {
  Matrix m{std::vector<uint8_t>(static_cast<size_t>(n * k / 32 * 20)), n, k};
  for (size_t i = 0; i < m.w.size(); i += 20) {
    for (int j = 4; j < 20; ++j) m.w[i + j] = static_cast<uint8_t>(rng());
    const uint16_t d = 0x2000 | (rng() & 0x3ff), mn = 0xa000 | (rng() & 0x3ff);  // small f16 d and m
    std::memcpy(&m.w[i], &d, 2);
    std::memcpy(&m.w[i + 2], &mn, 2);
  }
  return m;
}

double seconds(Product f, const std::vector<Matrix>& ms, const float* x, float* y, int64_t rows, int iters) {
  const auto t = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it)
    for (const Matrix& m : ms) f(x, m.w.data(), BlockFormat::q4_1, y, rows, m.n, m.k);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / iters;
}

int main() {
  std::mt19937 rng(1);
  const int64_t shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  std::vector<Matrix> layers, one;
  for (int l = 0; l < 30; ++l)
    for (const auto& s : shapes) layers.push_back(random_q4_1(rng, s[0], s[1]));
  one.push_back(random_q4_1(rng, 576, 576));
  std::normal_distribution<float> normal;
  std::printf("| case | rows | base G weights/s | variant G weights/s | same bits |\n|---|---|---|---|---|\n");
  struct Case {
    const char* name;
    const std::vector<Matrix>* ms;
    int iters;
  };
  for (const Case& c : {Case{"streamed, 210 products", &layers, 20}, Case{"in cache, 576 x 576", &one, 3000}}) {
    const char* name = c.name;
    const std::vector<Matrix>* ms = c.ms;
    const int iters = c.iters;
    double weights = 0;
    for (const Matrix& m : *ms) weights += static_cast<double>(m.n * m.k);
    for (int64_t rows : {1, 4}) {
      std::vector<float> x(static_cast<size_t>(rows * 1536)), y1(x.size()), y2(x.size());
      for (float& v : x) v = normal(rng);
      bool same = true;
      for (const Matrix& m : *ms) {
        base::block_matmul_nt(x.data(), m.w.data(), BlockFormat::q4_1, y1.data(), rows, m.n, m.k);
        variant::block_matmul_nt(x.data(), m.w.data(), BlockFormat::q4_1, y2.data(), rows, m.n, m.k);
        same &= std::memcmp(y1.data(), y2.data(), static_cast<size_t>(rows * m.n) * 4) == 0;
      }
      for (int rep = 0; rep < 3; ++rep) {
        const double b = seconds(base::block_matmul_nt, *ms, x.data(), y1.data(), rows, iters);
        const double v = seconds(variant::block_matmul_nt, *ms, x.data(), y2.data(), rows, iters);
        std::printf("| %s | %lld | %.1f | %.1f | %s |\n", name, static_cast<long long>(rows), weights / b / 1e9,
                    weights / v / 1e9, same ? "yes" : "NO");
      }
    }
  }
}
