#pragma once
// What the engine and the generator run: a batched forward pass over chunks of several
// sequences. The CPU Transformer implements it; a GPU model implements it with its own
// per-sequence KV handles (which it creates through its own AttentionFactory).
#include <cstdint>
#include <span>
#include <vector>

#include "model/attention.h"
#include "model/config.h"

namespace spin {

struct SequenceChunk {
  std::span<const int32_t> tokens;  // new tokens of this sequence
  int64_t pos0 = 0;                 // position of tokens[0]
  SequenceKv* attention = nullptr;  // made by the factory that goes with this model
};

class ForwardModel {
 public:
  virtual ~ForwardModel() = default;
  virtual const ModelConfig& config() const = 0;
  virtual AttentionShape attention_shape() const = 0;
  // Runs all chunks as one batch. logits: [rows, vocab], one row per token of every chunk when
  // all_logits, else one row per chunk (its last token). Not thread-safe: one caller at a time.
  virtual void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) = 0;
};

}  // namespace spin
