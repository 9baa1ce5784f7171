#pragma once
// Dense attention over a contiguous per-(layer, KV head) KV buffer: the exact reference every
// paged and sparse path is compared against.
#include <vector>

#include "model/attention.h"

namespace spin {

class ContiguousAttention final : public SequenceAttention {
 public:
  // Memory grows with the tokens stored (doubling), up to max_tokens.
  ContiguousAttention(const AttentionShape& shape, int64_t max_tokens);

  void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens,
               float* out) override;
  int64_t length() const override { return length_; }

 private:
  float* k_row(int64_t layer, int64_t kv_head, int64_t pos);
  float* v_row(int64_t layer, int64_t kv_head, int64_t pos);
  void grow_to(int64_t tokens);

  AttentionShape shape_;
  int64_t max_tokens_;
  int64_t capacity_ = 0;  // tokens each (layer, KV head) row block holds now
  int64_t length_ = 0;
  std::vector<float> k_;  // [layer][kv_head][capacity_][head_dim]
  std::vector<float> v_;
};

}  // namespace spin
