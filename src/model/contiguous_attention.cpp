#include "model/contiguous_attention.h"

#include <algorithm>
#include <cstring>

#include "base/checked.h"
#include "base/error.h"
#include "kernels/cpu/attention.h"

namespace spin {

ContiguousAttention::ContiguousAttention(const AttentionShape& shape, int64_t max_tokens)
    : shape_(shape), max_tokens_(max_tokens) {
  SPIN_CHECK(max_tokens > 0, "KV cache: capacity must be positive, got {}", max_tokens);
  // The largest buffer this cache may grow to must have a representable size.
  checked_mul(checked_mul(static_cast<uint64_t>(shape.n_layers * shape.n_kv_heads),
                          static_cast<uint64_t>(max_tokens), "KV cache size"),
              static_cast<uint64_t>(shape.head_dim) * sizeof(float), "KV cache size");
}

float* ContiguousAttention::k_row(int64_t layer, int64_t kv_head, int64_t pos) {
  return k_.data() + ((layer * shape_.n_kv_heads + kv_head) * capacity_ + pos) * shape_.head_dim;
}

float* ContiguousAttention::v_row(int64_t layer, int64_t kv_head, int64_t pos) {
  return v_.data() + ((layer * shape_.n_kv_heads + kv_head) * capacity_ + pos) * shape_.head_dim;
}

void ContiguousAttention::grow_to(int64_t tokens) {
  int64_t capacity = std::max<int64_t>(capacity_, 256);
  while (capacity < tokens) capacity *= 2;
  capacity = std::min(capacity, max_tokens_);
  const int64_t blocks = shape_.n_layers * shape_.n_kv_heads;
  const int64_t hd = shape_.head_dim;
  std::vector<float> k(static_cast<size_t>(blocks * capacity * hd));
  std::vector<float> v(k.size());
  // Every layer holds rows [0, length_) when a chunk starts, which is when growth happens.
  for (int64_t b = 0; b < blocks; ++b) {
    if (length_ == 0) break;
    std::memcpy(k.data() + b * capacity * hd, k_.data() + b * capacity_ * hd, sizeof(float) * length_ * hd);
    std::memcpy(v.data() + b * capacity * hd, v_.data() + b * capacity_ * hd, sizeof(float) * length_ * hd);
  }
  k_.swap(k);
  v_.swap(v);
  capacity_ = capacity;
}

void ContiguousAttention::forward(int64_t layer, int64_t pos0, int64_t n,
                                  const AttentionTokens& tokens, float* out) {
  const float* q = tokens.q;
  const float* k = tokens.k;
  const float* v = tokens.v;
  SPIN_CHECK(pos0 + n <= max_tokens_, "KV cache full: {} tokens requested, capacity {}", pos0 + n,
             max_tokens_);
  SPIN_CHECK(pos0 <= length_, "KV cache: write at position {} leaves a gap after {}", pos0, length_);
  if (pos0 + n > capacity_) grow_to(pos0 + n);
  const int64_t hd = shape_.head_dim;
  const int64_t n_kv = shape_.n_kv_heads;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < n_kv; ++g) {
      std::memcpy(k_row(layer, g, pos0 + i), k + (i * n_kv + g) * hd, sizeof(float) * hd);
      std::memcpy(v_row(layer, g, pos0 + i), v + (i * n_kv + g) * hd, sizeof(float) * hd);
    }
  }
  if (n == 1) {
    // Decode: one position per KV head, the same per-position kernel the paged decode path uses
    // (attend_group_pages) in summation order, so the two agree to fp32 rounding.
    const int64_t group = shape_.n_heads / n_kv;
#pragma omp parallel
    {
      std::vector<float> scores(static_cast<size_t>(group * (pos0 + 1)));
#pragma omp for schedule(static)
      for (int64_t g = 0; g < n_kv; ++g) {
        cpu::attend_group(q + g * group * hd, group, k_row(layer, g, 0), v_row(layer, g, 0),
                          pos0 + 1, hd, hd, shape_.scale, out + g * group * hd, scores.data());
      }
    }
  } else {
    // A chunk: the blocked causal kernel, which the paged prefill path runs as well.
    std::vector<cpu::KvHeadRows> heads(static_cast<size_t>(n_kv));
    for (int64_t g = 0; g < n_kv; ++g) heads[g] = {k_row(layer, g, 0), v_row(layer, g, 0), pos0 + n};
    cpu::attend_causal(q, n, pos0, heads, {shape_.n_heads, n_kv, hd, shape_.scale}, out);
  }
  if (layer == shape_.n_layers - 1) length_ = std::max(length_, pos0 + n);
}

}  // namespace spin
