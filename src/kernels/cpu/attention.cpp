#include "kernels/cpu/attention.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/ops.h"

namespace spin::cpu {

void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t n_keys,
                  int64_t kv_stride, int64_t head_dim, float scale, float* out, float* scores) {
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* kt = k + t * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kt[d];
      scores[h * n_keys + t] = dot * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax(scores + h * n_keys, n_keys);
  std::memset(out, 0, sizeof(float) * group * head_dim);
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* vt = v + t * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * n_keys + t];
      float* oh = out + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vt[d];
    }
  }
}

namespace {

constexpr int64_t kQueryRows = 128;  // query rows (tokens x group heads) per tile, at most
constexpr int64_t kKeyTile = 256;    // keys per score tile (a multiple of kWidth): S, K and V
                                     // tiles stay in L2

// The softmax of a score tile runs as often as the products and its exponentials are its cost,
// so it is written with 16-float vectors (GCC/Clang vector extension) and, where GCC builds for
// x86-64, compiled three times and picked at load time by the CPU: AVX-512, AVX2+FMA, and the
// baseline SSE2 the project targets. The vectors never cross a function boundary (their calling
// convention differs between those targets).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPIN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPIN_CPU_CLONES
#endif

using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int64_t kWidth = 16;

// One key tile of the online softmax. s: rows x nk scores, row r at s + r * ld, where ld is a
// multiple of kWidth and >= nk. Row r sees its first clamp(visible0 + r / group, 0, nk) keys; the
// rest become probability 0. The visible scores become e^(score - m), m the row's running
// maximum (row_max), row_sum takes their sum, and the row's output accumulated so far (o, rows x
// head_dim) is rescaled to the new maximum.
SPIN_CPU_CLONES void softmax_tile(float* s, int64_t rows, int64_t nk, int64_t ld, int64_t visible0,
                                  int64_t group, float* row_max, float* row_sum, float* o,
                                  int64_t head_dim) {
  // e^x = 2^n e^r with x = n ln2 + r, |r| <= ln2/2; e^r by its Taylor series to r^7
  // (truncation below 6e-9 relative), 2^n through the exponent bits. x is clamped at -87, so
  // e^x never underflows to a denormal: about e^-87 instead of less changes no sum that holds
  // the row maximum's e^0 = 1 (not even in its last bit).
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // 15 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLowest = -87.0f;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * ld;
    const int64_t visible = std::clamp<int64_t>(visible0 + r / group, 0, nk);
    if (visible == 0) {
      std::fill(sr, sr + nk, 0.0f);
      continue;
    }
    // Whole vectors up to `end`: the hidden scores in between count as -inf.
    const int64_t end = (visible + kWidth - 1) / kWidth * kWidth;
    std::fill(sr + visible, sr + end, -kInf);

    f32x16 lane_max = f32x16{} - kInf;
    for (int64_t j = 0; j < end; j += kWidth) {
      f32x16 x;
      std::memcpy(&x, sr + j, sizeof x);
      lane_max = lane_max < x ? x : lane_max;
    }
    float tile_max = -kInf;
    for (int64_t l = 0; l < kWidth; ++l) tile_max = std::max(tile_max, lane_max[l]);
    const float old_max = row_max[r];
    const float new_max = std::max(old_max, tile_max);

    f32x16 lane_sum{};
    for (int64_t j = 0; j < end; j += kWidth) {
      f32x16 x;
      std::memcpy(&x, sr + j, sizeof x);
      x -= new_max;
      x = x < kLowest ? f32x16{} + kLowest : x;
      const f32x16 n = (x * kLog2e + kRound) - kRound;
      const f32x16 t = (x - n * kLn2Hi) - n * kLn2Lo;
      f32x16 p = t * (1.0f / 5040.0f) + 1.0f / 720.0f;
      p = p * t + 1.0f / 120.0f;
      p = p * t + 1.0f / 24.0f;
      p = p * t + 1.0f / 6.0f;
      p = p * t + 0.5f;
      p = p * t + 1.0f;
      p = p * t + 1.0f;
      const i32x16 exponent_bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
      f32x16 two_to_n;
      std::memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
      p *= two_to_n;
      std::memcpy(sr + j, &p, sizeof p);
      lane_sum += p;
    }
    float sum = 0.0f;
    for (int64_t l = 0; l < kWidth; ++l) sum += lane_sum[l];
    std::fill(sr + visible, sr + nk, 0.0f);

    // What was accumulated under the old maximum shrinks by e^(old - new); the first key tile
    // holds key 0, which every row sees, so new_max is finite from there on.
    const float rescale = std::exp(old_max - new_max);
    row_sum[r] = row_sum[r] * rescale + sum;
    row_max[r] = new_max;
    if (rescale != 1.0f) {
      for (int64_t d = 0; d < head_dim; ++d) o[r * head_dim + d] *= rescale;
    }
  }
}

struct TileScratch {
  std::vector<float> q, o, s, row_max, row_sum;
  TileScratch(int64_t rows, int64_t head_dim)
      : q(static_cast<size_t>(rows * head_dim)),
        o(q.size()),
        s(static_cast<size_t>(rows * kKeyTile)),
        row_max(static_cast<size_t>(rows)),
        row_sum(static_cast<size_t>(rows)) {}
};

// Query tokens [t0, t1) of KV head g: rows r = (token - t0) * group + head in the group.
void attend_tile(const float* q, int64_t pos0, int64_t t0, int64_t t1, int64_t g,
                 const KvHeadRows& kv, const CausalShape& shape, float* out, TileScratch& w) {
  const int64_t hd = shape.head_dim;
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  const int64_t rows = (t1 - t0) * group;
  const int64_t token_width = group * hd;  // one token's query rows of the group are adjacent
  for (int64_t i = t0; i < t1; ++i) {
    std::memcpy(&w.q[(i - t0) * token_width], q + (i * shape.n_heads + g * group) * hd,
                sizeof(float) * token_width);
  }
  std::fill_n(w.o.begin(), rows * hd, 0.0f);
  std::fill_n(w.row_max.begin(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(w.row_sum.begin(), rows, 0.0f);
  float* o = w.o.data();
  const int64_t n_keys = pos0 + t1;  // keys the tile's last token sees
  for (int64_t j0 = 0; j0 < n_keys; j0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, n_keys - j0);
    const int64_t ld = (nk + kWidth - 1) / kWidth * kWidth;
    float* s = w.s.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows),
                static_cast<blasint>(nk), static_cast<blasint>(hd), shape.scale, w.q.data(),
                static_cast<blasint>(hd), kv.k + j0 * hd, static_cast<blasint>(hd), 0.0f, s,
                static_cast<blasint>(ld));
    softmax_tile(s, rows, nk, ld, pos0 + t0 + 1 - j0, group, w.row_max.data(), w.row_sum.data(),
                 o, hd);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(rows),
                static_cast<blasint>(hd), static_cast<blasint>(nk), 1.0f, s,
                static_cast<blasint>(ld), kv.v + j0 * hd, static_cast<blasint>(hd), 1.0f, o,
                static_cast<blasint>(hd));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t0 + r / group;
    float* dst = out + (i * shape.n_heads + g * group + r % group) * hd;
    const float inv = 1.0f / w.row_sum[r];
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[r * hd + d] * inv;
  }
}

}  // namespace

void attend_causal(const float* q, int64_t n_tokens, int64_t pos0,
                   std::span<const KvHeadRows> heads, const CausalShape& shape, float* out) {
  SPIN_CHECK(shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0 &&
                 static_cast<int64_t>(heads.size()) == shape.n_kv_heads && shape.head_dim > 0,
             "causal attention: {} query heads over {} KV heads ({} given), head_dim {}",
             shape.n_heads, shape.n_kv_heads, heads.size(), shape.head_dim);
  SPIN_CHECK(n_tokens > 0 && pos0 >= 0, "causal attention: {} tokens at position {}", n_tokens,
             pos0);
  for (const KvHeadRows& h : heads) {
    SPIN_CHECK(h.n_tokens >= pos0 + n_tokens, "causal attention: {} key rows for position {}",
               h.n_tokens, pos0 + n_tokens - 1);
  }
  const int64_t n_kv = shape.n_kv_heads;
  const int64_t group = shape.n_heads / n_kv;
  // Tiles of up to kQueryRows rows, smaller when that leaves too few tasks for the threads.
  const int64_t threads = omp_get_max_threads();
  const int64_t tile_tokens =
      std::clamp<int64_t>((n_tokens * n_kv + 4 * threads - 1) / (4 * threads), 1,
                          std::max<int64_t>(1, kQueryRows / group));
  const int64_t n_tiles = (n_tokens + tile_tokens - 1) / tile_tokens;
#pragma omp parallel
  {
    TileScratch scratch(tile_tokens * group, shape.head_dim);
    // Later tiles see more keys: hand them out first so the threads finish together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tiles * n_kv; ++task) {
      const int64_t tile = n_tiles - 1 - task / n_kv;
      const int64_t g = task % n_kv;
      const int64_t t0 = tile * tile_tokens;
      attend_tile(q, pos0, t0, std::min(n_tokens, t0 + tile_tokens), g, heads[g], shape, out,
                  scratch);
    }
  }
}

}  // namespace spin::cpu
