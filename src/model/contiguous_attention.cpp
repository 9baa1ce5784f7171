#include "model/contiguous_attention.h"

#include <algorithm>
#include <cstring>

#include "base/error.h"
#include "kernels/cpu/attention.h"

namespace spin {

ContiguousAttention::ContiguousAttention(const AttentionShape& shape, int64_t max_tokens)
    : shape_(shape), max_tokens_(max_tokens) {
  const size_t n = static_cast<size_t>(shape.n_layers * shape.n_kv_heads * max_tokens * shape.head_dim);
  k_.resize(n);
  v_.resize(n);
}

float* ContiguousAttention::k_row(int64_t layer, int64_t kv_head, int64_t pos) {
  return k_.data() + ((layer * shape_.n_kv_heads + kv_head) * max_tokens_ + pos) * shape_.head_dim;
}

float* ContiguousAttention::v_row(int64_t layer, int64_t kv_head, int64_t pos) {
  return v_.data() + ((layer * shape_.n_kv_heads + kv_head) * max_tokens_ + pos) * shape_.head_dim;
}

void ContiguousAttention::forward(int64_t layer, int64_t pos0, int64_t n,
                                  const AttentionTokens& tokens, float* out) {
  const float* q = tokens.q;
  const float* k = tokens.k;
  const float* v = tokens.v;
  SPIN_CHECK(pos0 + n <= max_tokens_, "KV cache full: {} tokens requested, capacity {}", pos0 + n,
             max_tokens_);
  SPIN_CHECK(pos0 <= length_, "KV cache: write at position {} leaves a gap after {}", pos0, length_);
  const int64_t hd = shape_.head_dim;
  const int64_t n_kv = shape_.n_kv_heads;
  const int64_t group = shape_.n_heads / n_kv;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < n_kv; ++g) {
      std::memcpy(k_row(layer, g, pos0 + i), k + (i * n_kv + g) * hd, sizeof(float) * hd);
      std::memcpy(v_row(layer, g, pos0 + i), v + (i * n_kv + g) * hd, sizeof(float) * hd);
    }
  }
  // One task per (token, KV head): each reads its group's keys once.
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < n_kv; ++g) {
        const int64_t n_keys = pos0 + i + 1;
        scores.resize(static_cast<size_t>(group * n_keys));
        const int64_t head0 = g * group;
        cpu::attend_group(q + (i * shape_.n_heads + head0) * hd, group, k_row(layer, g, 0),
                          v_row(layer, g, 0), n_keys, hd, hd, shape_.scale,
                          out + (i * shape_.n_heads + head0) * hd, scores.data());
      }
    }
  }
  if (layer == shape_.n_layers - 1) length_ = std::max(length_, pos0 + n);
}

}  // namespace spin
