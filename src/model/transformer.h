#pragma once
// The Llama-family forward pass on the CPU (fp32, GEMMs through OpenBLAS). Tokens of several
// sequences run as one batch: projections and MLP are shared GEMMs, attention goes to each
// sequence's SequenceAttention.
#include <cstdint>
#include <span>
#include <vector>

#include "model/forward_model.h"
#include "model/rope.h"
#include "model/weights.h"

namespace spin {

class Transformer final : public ForwardModel {
 public:
  explicit Transformer(const ModelWeights& weights);

  const ModelConfig& config() const override { return weights_.config; }
  AttentionShape attention_shape() const override;
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override;

 private:
  const ModelWeights& weights_;
  RopeTable rope_;
  // Activations, reused across steps: [tokens, width].
  std::vector<float> x_, h_, q_, k_, k_pre_rope_, v_, attn_, gate_, up_, rows_;
};

}  // namespace spin
