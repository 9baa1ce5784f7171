#pragma once
// Where the engine gets each request's SequenceAttention. The engine asks a factory, so another
// attention (paged, sparse) plugs in without touching the scheduler.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/attention.h"

namespace spin {

// Per-request attention settings (the server's "spin" extension object).
struct AttentionSettings {
  std::string algorithm = "dense";
  int64_t budget = 0;  // tokens selected per KV head at decode; 0 = the algorithm's default
};

class AttentionFactory {
 public:
  virtual ~AttentionFactory() = default;
  // Algorithms create() accepts.
  virtual std::vector<std::string> algorithms() const = 0;
  // KV for one sequence of at most max_tokens tokens. Throws spin::Error for an unknown algorithm.
  virtual std::unique_ptr<SequenceAttention> create(const AttentionSettings& settings,
                                                    int64_t max_tokens) = 0;
};

// Dense attention over a contiguous buffer per sequence (model/contiguous_attention.h).
std::unique_ptr<AttentionFactory> make_contiguous_attention_factory(const AttentionShape& shape);

// KV bytes one token takes in fp32 K and V over all layers and KV heads.
int64_t kv_bytes_per_token(const AttentionShape& shape);

}  // namespace spin
