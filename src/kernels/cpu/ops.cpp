#include "kernels/cpu/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

namespace spin::cpu {

void set_num_threads(int n) {
  if (n <= 0) return;
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

void matmul_nt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) {
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k), 1.0f,
                w, static_cast<blasint>(k), x, 1, 0.0f, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k), w,
              static_cast<blasint>(k), 0.0f, y, static_cast<blasint>(n));
}

void silu_mul(float* gate, const float* up, int64_t n) {
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add_inplace(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t pos, const float* inv_freq,
          float mscale, bool neox) {
  const int64_t half = head_dim / 2;
  float cos_t[2048];
  float sin_t[2048];
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(pos) * inv_freq[i];
    cos_t[i] = static_cast<float>(std::cos(angle)) * mscale;
    sin_t[i] = static_cast<float>(std::sin(angle)) * mscale;
  }
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = neox ? i : 2 * i;
      const int64_t b = neox ? i + half : 2 * i + 1;
      const float x0 = v[a];
      const float x1 = v[b];
      v[a] = x0 * cos_t[i] - x1 * sin_t[i];
      v[b] = x0 * sin_t[i] + x1 * cos_t[i];
    }
  }
}

void softmax(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace spin::cpu
