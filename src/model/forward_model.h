#pragma once
// What the engine and the generator run: a batched forward pass over chunks of several
// sequences. The CPU Transformer implements it; a GPU model implements it with its own
// per-sequence KV handles (which it creates through its own AttentionFactory).
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "base/error.h"
#include "model/attention.h"
#include "model/config.h"

namespace spin {

struct SequenceChunk {
  std::span<const int32_t> tokens;  // new tokens of this sequence
  int64_t pos0 = 0;                 // position of tokens[0]
  SequenceKv* attention = nullptr;  // made by the factory that goes with this model
};

// How one chunk's next token is drawn on the model's device: the rules of the engine's Sampler
// (temperature 0 = greedy, lowest index among equal maxima; else top-k, min-p and top-p on the
// tempered distribution), with a counter-based random draw keyed by (seed, step), so a token
// depends on its own request only, never on the batch it ran in.
struct DeviceSampling {
  float temperature = 0.0f;
  int top_k = 0;       // 0 = off
  float top_p = 1.0f;  // 1 = off
  float min_p = 0.0f;  // 0 = off
  uint64_t seed = 0;
  uint64_t step = 0;   // tokens this request has drawn before
};

// How a device model ran its forwards, for /metrics: where a serving step's time goes.
struct ForwardStats {
  int64_t eager_steps = 0;      // forwards enqueued kernel by kernel
  int64_t graphs_captured = 0;  // decode shapes captured into a CUDA graph
  int64_t graph_replays = 0;    // forwards launched as a graph (a capture's first launch too)
  // The caller's time blocked at the end of its forwards until the device finished them. The rest
  // of a forward's time is host work (tables, uploads, launches) and any wait earlier in it (e.g.
  // ShadowKV's factorisation at a request's first decode step).
  double device_wait_seconds = 0.0;
};

class ForwardModel {
 public:
  virtual ~ForwardModel() = default;
  virtual const ModelConfig& config() const = 0;
  virtual AttentionShape attention_shape() const = 0;
  // Runs all chunks as one batch. logits: [rows, vocab], one row per token of every chunk when
  // all_logits, else one row per chunk (its last token). Not thread-safe: one caller at a time.
  virtual void forward(std::span<const SequenceChunk> chunks, bool all_logits, std::vector<float>& logits) = 0;
  // Models whose logits live on a device can draw the next tokens there, so a step moves token
  // ids to the host instead of [chunks, vocab] logits.
  virtual bool samples_on_device() const { return false; }
  // forward(chunks, false, logits), then tokens[i] drawn by sampling[i] from the first `vocab`
  // logits of chunk i. Only the rows of the chunks in logit_rows (ascending) reach `logits`, each
  // at its chunk's place ([chunks, vocab]); the other rows are left unspecified, and with no
  // logit_rows `logits` is untouched. Only where samples_on_device().
  virtual void forward_sampled(std::span<const SequenceChunk>, std::span<const DeviceSampling>, int64_t,
                               std::span<const int64_t>, std::vector<float>&, std::vector<int32_t>&) {
    fail("this model draws tokens on the host (samples_on_device() is false)");
  }
  // Device models count their forwards; the CPU model has none to report.
  virtual std::optional<ForwardStats> forward_stats() const { return std::nullopt; }
};

}  // namespace spin
