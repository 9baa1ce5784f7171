#pragma once
// fp32 CPU kernels of the forward pass. Each works on plain row-major arrays so the reference
// tests (tests/cpp/test_cpu_ops.cpp) can compare them against naive loops.
#include <cstdint>

namespace spin::cpu {

// Sets the threads used by the kernels (OpenMP) and by OpenBLAS; 0 keeps the default.
void set_num_threads(int n);
int num_threads();

// y[r, :] = x[r, :] / rms(x[r, :]) * w, for each of `rows` rows of length n. y may alias x.
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);

// y[m, n] = x[m, k] · w[n, k]^T  (w is a row-major [out, in] weight matrix).
void matmul_nt(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k);

// gate[i] = silu(gate[i]) * up[i].
void silu_mul(float* gate, const float* up, int64_t n);

// dst[i] += src[i].
void add_inplace(float* dst, const float* src, int64_t n);

// Rotates each of `n_heads` heads of length head_dim in x (one token at position `pos`).
// inv_freq has head_dim/2 entries; the angle of pair i is pos * inv_freq[i]; cos and sin are
// multiplied by mscale (YaRN). neox: pairs are (i, i + head_dim/2); otherwise (2i, 2i+1).
void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t pos, const float* inv_freq,
          float mscale, bool neox);

// In-place numerically stable softmax over n values.
void softmax(float* x, int64_t n);

}  // namespace spin::cpu
