#include "engine/attention_factory.h"

#include "base/error.h"
#include "model/contiguous_attention.h"

namespace spin {

namespace {

class ContiguousAttentionFactory final : public AttentionFactory {
 public:
  explicit ContiguousAttentionFactory(const AttentionShape& shape) : shape_(shape) {}

  std::vector<std::string> algorithms() const override { return {"dense"}; }

  std::unique_ptr<SequenceAttention> create(const AttentionSettings& settings,
                                            int64_t max_tokens) override {
    SPIN_CHECK(settings.algorithm == "dense", "unknown attention algorithm '{}' (known: dense)",
               settings.algorithm);
    SPIN_CHECK(max_tokens > 0, "attention capacity must be positive, got {}", max_tokens);
    return std::make_unique<ContiguousAttention>(shape_, max_tokens);
  }

 private:
  AttentionShape shape_;
};

}  // namespace

std::unique_ptr<AttentionFactory> make_contiguous_attention_factory(const AttentionShape& shape) {
  return std::make_unique<ContiguousAttentionFactory>(shape);
}

int64_t kv_bytes_per_token(const AttentionShape& shape) {
  return 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * static_cast<int64_t>(sizeof(float));
}

}  // namespace spin
