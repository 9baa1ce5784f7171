#pragma once
// The seam between the forward pass and the KV store: the model hands each layer's new q/k/v of
// one sequence to a SequenceAttention, which stores k/v wherever it keeps them (a contiguous
// buffer, per-head pages in two tiers, ...) and returns the attention output. Sparse algorithms
// plug in behind this interface; the forward pass knows none of them.
#include <cstdint>

namespace spin {

struct RopeTable;

struct AttentionShape {
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;  // softmax scale, 1/sqrt(head_dim)
};

// One layer's new tokens of one sequence, as the forward pass hands them over.
// q: [n, n_heads * head_dim], k, v, k_pre_rope: [n, n_kv_heads * head_dim].
struct AttentionTokens {
  const float* q = nullptr;           // RoPE applied
  const float* k = nullptr;           // RoPE applied
  const float* v = nullptr;
  const float* k_pre_rope = nullptr;  // k before RoPE (ShadowKV and Seer summarise these)
  const RopeTable* rope = nullptr;    // the rotation that turned k_pre_rope into k
};

// One sequence's KV, whatever backend holds it. The engine owns these (made by an
// AttentionFactory) and hands them back to the forward pass that made sense of them.
class SequenceKv {
 public:
  virtual ~SequenceKv() = default;
  // Tokens stored so far (positions [0, length())).
  virtual int64_t length() const = 0;
};

// A host-side SequenceKv the CPU forward pass calls layer by layer.
class SequenceAttention : public SequenceKv {
 public:
  // Stores k/v of the tokens at positions [pos0, pos0 + n) for `layer` and writes, for each of
  // those tokens, causal attention over positions [0, its own position].
  // out: [n, n_heads * head_dim]. k_pre_rope and rope may be null where no algorithm needs them.
  virtual void forward(int64_t layer, int64_t pos0, int64_t n, const AttentionTokens& tokens,
                       float* out) = 0;
};

}  // namespace spin
