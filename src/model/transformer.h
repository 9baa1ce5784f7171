#pragma once
// The Llama-family forward pass on the CPU (fp32, GEMMs through OpenBLAS). Tokens of several
// sequences run as one batch: projections and MLP are shared GEMMs, attention goes to each
// sequence's SequenceAttention.
#include <cstdint>
#include <span>
#include <vector>

#include "model/attention.h"
#include "model/rope.h"
#include "model/weights.h"

namespace spin {

struct SequenceChunk {
  std::span<const int32_t> tokens;  // new tokens of this sequence
  int64_t pos0 = 0;                 // position of tokens[0]
  SequenceAttention* attention = nullptr;
};

class Transformer {
 public:
  explicit Transformer(const ModelWeights& weights);

  const ModelConfig& config() const { return weights_.config; }
  AttentionShape attention_shape() const;

  // Runs all chunks as one batch. logits: [rows, vocab], one row per token of every chunk when
  // all_logits, else one row per chunk (its last token).
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits);

 private:
  const ModelWeights& weights_;
  RopeTable rope_;
  // Activations, reused across steps: [tokens, width].
  std::vector<float> x_, h_, q_, k_, k_pre_rope_, v_, attn_, gate_, up_, rows_;
};

}  // namespace spin
