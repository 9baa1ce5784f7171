#pragma once
// Dense attention over a contiguous per-(layer, KV head) KV buffer: the exact reference every
// paged and sparse path is compared against.
#include <vector>

#include "model/attention.h"

namespace spin {

class ContiguousAttention final : public SequenceAttention {
 public:
  ContiguousAttention(const AttentionShape& shape, int64_t max_tokens);

  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens,
               float* out) override;
  int64_t length() const override { return length_; }
  int64_t capacity() const { return max_tokens_; }

 private:
  float* k_row(int64_t layer, int64_t kv_head, int64_t pos);
  float* v_row(int64_t layer, int64_t kv_head, int64_t pos);

  AttentionShape shape_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  std::vector<float> k_;  // [layer][kv_head][token][head_dim]
  std::vector<float> v_;
};

}  // namespace spin
