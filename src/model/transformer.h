#pragma once
// The Llama-family forward pass on the CPU (fp32, GEMMs through OpenBLAS). Tokens of several
// sequences run as one batch: projections and MLP are shared GEMMs, attention goes to each
// sequence's SequenceAttention. With a Communicator it is one rank of a tensor-parallel model
// (model/tensor_parallel.h): its weights hold the rank's heads and MLP slice, and the partial
// outputs of the O and down projections are summed over the ranks before each residual add.
#include <cstdint>
#include <span>
#include <vector>

#include "model/communicator.h"
#include "model/forward_model.h"
#include "model/rope.h"
#include "model/weights.h"

namespace spin {

class Transformer final : public ForwardModel {
 public:
  // communicator: null for a whole model; else this rank's, and weights are the rank's shard.
  explicit Transformer(const ModelWeights& weights, Communicator* communicator = nullptr);

  const ModelConfig& config() const override { return weights_.config; }
  AttentionShape attention_shape() const override;
  void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) override;

 private:
  const ModelWeights& weights_;
  Communicator* communicator_;
  RopeTable rope_;
  // Activations, reused across steps: [tokens, width].
  std::vector<float> x_, h_, q_, k_, k_pre_rope_, v_, attn_, gate_, up_, rows_;
};

}  // namespace spin
