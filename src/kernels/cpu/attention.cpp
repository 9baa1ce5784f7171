#include "kernels/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/paged_attention.h"

namespace spin::cpu {

// The loops over scores run once per key and query row, so they are written with 16-float
// vectors (GCC/Clang vector extension) and, where GCC builds for x86-64, compiled three times
// and picked at load time by the CPU: AVX-512, AVX2+FMA, and the baseline SSE2 the project
// targets. The vectors never cross a function boundary (their calling convention differs
// between those targets).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPIN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPIN_CPU_CLONES
#endif

namespace {

using f32x16 = float __attribute__((vector_size(64)));
using f32x8 = float __attribute__((vector_size(32)));
using f32x4 = float __attribute__((vector_size(16)));
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int64_t kWidth = 16;

constexpr float kInf = std::numeric_limits<float>::infinity();

// scores[h * n_keys + t] = scale * (q_h . k_t) for h < group, t < n_keys; k_t at k + t * stride.
SPIN_CPU_CLONES void group_scores(const float* q, int64_t group, const float* k, int64_t n_keys,
                                  int64_t stride, int64_t head_dim, float scale, float* scores) {
  const int64_t vector_end = head_dim / kWidth * kWidth;
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* kt = k + t * stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * head_dim;
      f32x16 lanes{};
      for (int64_t d = 0; d < vector_end; d += kWidth) {
        f32x16 a, b;
        std::memcpy(&a, qh + d, sizeof a);
        std::memcpy(&b, kt + d, sizeof b);
        lanes += a * b;
      }
      f32x8 half, upper;
      std::memcpy(&half, &lanes, sizeof half);
      std::memcpy(&upper, reinterpret_cast<const char*>(&lanes) + sizeof half, sizeof upper);
      half += upper;
      f32x4 quarter, upper4;
      std::memcpy(&quarter, &half, sizeof quarter);
      std::memcpy(&upper4, reinterpret_cast<const char*>(&half) + sizeof quarter, sizeof upper4);
      quarter += upper4;
      float dot = (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
      for (int64_t d = vector_end; d < head_dim; ++d) dot += qh[d] * kt[d];
      scores[h * n_keys + t] = dot * scale;
    }
  }
}

// out[h] += sum over t of p[h * n_keys + t] * v_t, t in increasing order; v_t at v + t * stride.
SPIN_CPU_CLONES void group_accumulate(const float* p, int64_t group, const float* v,
                                      int64_t n_keys, int64_t stride, int64_t head_dim,
                                      float* out) {
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* vt = v + t * stride;
    for (int64_t h = 0; h < group; ++h) {
      const float ph = p[h * n_keys + t];
      float* oh = out + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) oh[d] += ph * vt[d];
    }
  }
}

SPIN_CPU_CLONES float max_of(const float* s, int64_t n) {
  f32x16 lanes = f32x16{} - kInf;
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    f32x16 x;
    std::memcpy(&x, s + j, sizeof x);
    lanes = lanes < x ? x : lanes;
  }
  float m = -kInf;
  for (int64_t l = 0; l < kWidth; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[i] = e^(s[i] - shift) for i < n (shift >= every s[i]), each added to
// lane_sums[(offset + i) % kWidth]. A lane receives its terms in increasing i whatever the
// offset, so summing a row in pieces (a page list) adds exactly what summing it whole does.
//
// e^x = 2^n e^r with x = n ln2 + r, |r| <= ln2/2; e^r by its Taylor series to r^7 (truncation
// below 6e-9 relative), 2^n through the exponent bits. x is clamped at -87, so e^x never
// underflows to a denormal: about e^-87 instead of less changes no sum that holds the row
// maximum's e^0 = 1 (not even in its last bit).
SPIN_CPU_CLONES void exp_into_lanes(float* s, int64_t n, float shift, int64_t offset,
                                    float* lane_sums) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // 15 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLowest = -87.0f;
  f32x16 sums;
  std::memcpy(&sums, lane_sums, sizeof sums);
  for (int64_t i = 0; i < n;) {
    const int64_t lane0 = (offset + i) % kWidth;
    const int64_t count = std::min(kWidth - lane0, n - i);
    const bool whole = count == kWidth;
    float part[kWidth];  // a partial vector, its terms at their lanes
    f32x16 x;
    if (whole) {
      std::memcpy(&x, s + i, sizeof x);
    } else {
      std::fill(part, part + kWidth, shift);
      std::copy(s + i, s + i + count, part + lane0);
      std::memcpy(&x, part, sizeof x);
    }
    x -= shift;
    x = x < kLowest ? f32x16{} + kLowest : x;
    const f32x16 nf = (x * kLog2e + kRound) - kRound;
    const f32x16 r = (x - nf * kLn2Hi) - nf * kLn2Lo;
    f32x16 p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i32x16 exponent_bits = (__builtin_convertvector(nf, i32x16) + 127) << 23;
    f32x16 two_to_n;
    std::memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
    p *= two_to_n;
    if (whole) {
      std::memcpy(s + i, &p, sizeof p);
    } else {
      std::memcpy(part, &p, sizeof p);
      std::copy(part + lane0, part + lane0 + count, s + i);
      std::fill(part, part + lane0, 0.0f);
      std::fill(part + lane0 + count, part + kWidth, 0.0f);
      std::memcpy(&p, part, sizeof p);
    }
    sums += p;
    i += count;
  }
  std::memcpy(lane_sums, &sums, sizeof sums);
}

// The lanes' total, always in the same order.
float sum_lanes(const float* lanes) {
  float part[kWidth];
  std::copy(lanes, lanes + kWidth, part);
  for (int64_t w = kWidth / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
  }
  return part[0];
}

// A run of key and value rows, row t at k + t * stride (likewise v).
struct KeyRun {
  const float* k;
  const float* v;
  int64_t n;
  int64_t stride;
};

// Attention of one position for a GQA group over the concatenation of n_runs runs of keys
// (run_at(i) gives run i). Two passes, so the result does not depend on how the keys are split
// into runs: the scores' maximum per head first, then the exponentials (summed per lane by
// their index in the concatenation) and the unnormalised sum of values, divided at the end.
// scores: group * (largest run) floats; stats: group * (1 + kWidth) floats. A single run keeps
// its scores between the passes instead of computing them again.
template <class RunAt>
void attend_runs(const float* q, int64_t group, int64_t n_runs, RunAt run_at, int64_t head_dim,
                 float scale, float* out, float* scores, float* stats) {
  float* head_max = stats;
  float* lane_sums = stats + group;
  std::fill(head_max, head_max + group, -kInf);
  std::fill(lane_sums, lane_sums + group * kWidth, 0.0f);
  int64_t total = 0;
  for (int64_t i = 0; i < n_runs; ++i) {
    const KeyRun run = run_at(i);
    if (run.n == 0) continue;
    group_scores(q, group, run.k, run.n, run.stride, head_dim, scale, scores);
    for (int64_t h = 0; h < group; ++h)
      head_max[h] = std::max(head_max[h], max_of(scores + h * run.n, run.n));
    total += run.n;
  }
  SPIN_CHECK(total > 0, "attention over no keys");
  std::memset(out, 0, sizeof(float) * group * head_dim);
  int64_t offset = 0;
  for (int64_t i = 0; i < n_runs; ++i) {
    const KeyRun run = run_at(i);
    if (run.n == 0) continue;
    if (n_runs > 1) group_scores(q, group, run.k, run.n, run.stride, head_dim, scale, scores);
    for (int64_t h = 0; h < group; ++h)
      exp_into_lanes(scores + h * run.n, run.n, head_max[h], offset, lane_sums + h * kWidth);
    group_accumulate(scores, group, run.v, run.n, run.stride, head_dim, out);
    offset += run.n;
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = 1.0f / sum_lanes(lane_sums + h * kWidth);
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] *= inv;
  }
}

constexpr int64_t kQueryRows = 128;  // query rows (tokens x group heads) per tile, at most
constexpr int64_t kKeyTile = 256;    // keys per score tile: S, K and V tiles stay in L2

// Every product has the same shape, kQueryRows x kKeyTile x head_dim (tiles padded with zero
// rows), because OpenBLAS picks its kernels by shape and kernels for different shapes round
// differently. Tiles are also aligned to absolute positions, so a token's rows sit at the same
// row of every product however the prompt was split into chunks: some OpenBLAS kernels (AVX2)
// round the rows of one product differently by their place in it. A query row's result then
// depends on its own keys only.
struct TileScratch {
  std::vector<float> q, o, s, row_max, row_sum, k_pad, v_pad;
  explicit TileScratch(int64_t head_dim)
      : q(static_cast<size_t>(kQueryRows * head_dim)),
        o(q.size()),
        s(static_cast<size_t>(kQueryRows * kKeyTile)),
        row_max(static_cast<size_t>(kQueryRows)),
        row_sum(static_cast<size_t>(kQueryRows)),
        k_pad(static_cast<size_t>(kKeyTile * head_dim)),
        v_pad(k_pad.size()) {}
};

// Query tokens [t0, t1) of KV head g, whose tile starts `lead` tokens before t0: rows
// r = (token - t0 + lead) * group + head in the group; the first lead * group rows are padding.
void attend_tile(const float* q, int64_t pos0, int64_t t0, int64_t t1, int64_t lead, int64_t g,
                 const KvHeadRows& kv, const CausalShape& shape, float* out, TileScratch& w) {
  const int64_t hd = shape.head_dim;
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  const int64_t first_row = lead * group;
  const int64_t rows = first_row + (t1 - t0) * group;
  const int64_t token_width = group * hd;  // one token's query rows of the group are adjacent
  // Zero padding rows score 0 against every key, so their probabilities (left unnormalised)
  // are 0 and their outputs stay 0.
  std::fill(w.q.begin(), w.q.end(), 0.0f);
  for (int64_t i = t0; i < t1; ++i) {
    std::memcpy(&w.q[first_row * hd + (i - t0) * token_width], q + (i * shape.n_heads + g * group) * hd,
                sizeof(float) * token_width);
  }
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  std::fill_n(w.row_max.begin(), rows, -kInf);
  std::fill_n(w.row_sum.begin(), rows, 0.0f);
  float* o = w.o.data();
  float* s = w.s.data();
  const int64_t n_keys = pos0 + t1;  // keys the tile's last token sees
  for (int64_t j0 = 0; j0 < n_keys; j0 += kKeyTile) {
    const float* k = kv.k + j0 * hd;
    const float* v = kv.v + j0 * hd;
    if (j0 + kKeyTile > kv.n_tokens) {  // the head's last rows, padded with zero rows
      const int64_t present = (kv.n_tokens - j0) * hd;
      std::copy_n(k, present, w.k_pad.begin());
      std::copy_n(v, present, w.v_pad.begin());
      std::fill(w.k_pad.begin() + present, w.k_pad.end(), 0.0f);
      std::fill(w.v_pad.begin() + present, w.v_pad.end(), 0.0f);
      k = w.k_pad.data();
      v = w.v_pad.data();
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(kQueryRows),
                static_cast<blasint>(kKeyTile), static_cast<blasint>(hd), shape.scale,
                w.q.data(), static_cast<blasint>(hd), k, static_cast<blasint>(hd), 0.0f, s,
                static_cast<blasint>(kKeyTile));
    // Online softmax: row r (token t0 + r / group) sees keys up to its position; the first key
    // tile holds key 0, which every row sees, so a row's maximum is finite from there on.
    for (int64_t r = first_row; r < rows; ++r) {
      float* sr = s + r * kKeyTile;
      const int64_t visible = std::clamp<int64_t>(pos0 + t0 + (r - first_row) / group + 1 - j0, 0, kKeyTile);
      if (visible > 0) {
        const float old_max = w.row_max[r];
        const float new_max = std::max(old_max, max_of(sr, visible));
        float lanes[kWidth] = {};
        exp_into_lanes(sr, visible, new_max, 0, lanes);
        // What was accumulated under the old maximum shrinks by e^(old - new).
        const float rescale = std::exp(old_max - new_max);
        w.row_sum[r] = w.row_sum[r] * rescale + sum_lanes(lanes);
        w.row_max[r] = new_max;
        if (rescale != 1.0f) {
          for (int64_t d = 0; d < hd; ++d) o[r * hd + d] *= rescale;
        }
      }
      std::fill(sr + visible, sr + kKeyTile, 0.0f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(kQueryRows),
                static_cast<blasint>(hd), static_cast<blasint>(kKeyTile), 1.0f, s,
                static_cast<blasint>(kKeyTile), v, static_cast<blasint>(hd), 1.0f, o,
                static_cast<blasint>(hd));
  }
  for (int64_t r = first_row; r < rows; ++r) {
    const int64_t i = t0 + (r - first_row) / group;
    float* dst = out + (i * shape.n_heads + g * group + r % group) * hd;
    const float inv = 1.0f / w.row_sum[r];
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[r * hd + d] * inv;
  }
}

}  // namespace

void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t n_keys,
                  int64_t kv_stride, int64_t head_dim, float scale, float* out, float* scores) {
  std::vector<float> stats(static_cast<size_t>(group * (1 + kWidth)));
  attend_runs(
      q, group, 1, [&](int64_t) { return KeyRun{k, v, n_keys, kv_stride}; }, head_dim, scale,
      out, scores, stats.data());
}

void attend_group_pages(const float* q, int64_t group, std::span<const KvPageView> pages,
                        int64_t head_dim, float scale, float* out, float* scratch) {
  static_assert(kPagedAttentionLanes == kWidth);
  int64_t max_tokens = 0;
  for (const KvPageView& p : pages) max_tokens = std::max(max_tokens, p.n_tokens);
  attend_runs(
      q, group, static_cast<int64_t>(pages.size()),
      [&](int64_t i) {
        const KvPageView& p = pages[static_cast<size_t>(i)];
        return KeyRun{p.k, p.v, p.n_tokens, head_dim};
      },
      head_dim, scale, out, scratch, scratch + group * max_tokens);
}


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
  const int64_t tile_tokens = std::max<int64_t>(1, kQueryRows / group);
  SPIN_CHECK(tile_tokens * group <= kQueryRows, "causal attention: GQA groups of {} heads exceed "
             "the {} query rows of a tile", group, kQueryRows);
  // Tiles of absolute positions [k * tile_tokens, (k + 1) * tile_tokens).
  const int64_t first_tile = pos0 / tile_tokens;
  const int64_t n_tiles = (pos0 + n_tokens - 1) / tile_tokens - first_tile + 1;
#pragma omp parallel
  {
    TileScratch scratch(shape.head_dim);
    // Later tiles see more keys: hand them out first so the threads finish together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tiles * n_kv; ++task) {
      const int64_t tile_start = (first_tile + n_tiles - 1 - task / n_kv) * tile_tokens;
      const int64_t g = task % n_kv;
      const int64_t t0 = std::max(tile_start, pos0) - pos0;
      const int64_t t1 = std::min(tile_start + tile_tokens, pos0 + n_tokens) - pos0;
      attend_tile(q, pos0, t0, t1, pos0 + t0 - tile_start, g, heads[g], shape, out, scratch);
    }
  }
}

}  // namespace spin::cpu
