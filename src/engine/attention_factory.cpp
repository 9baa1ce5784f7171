#include "engine/attention_factory.h"

#include <algorithm>

#include <fmt/ranges.h>

#include "base/error.h"
#include "model/contiguous_attention.h"

namespace spin {

KvDemand& KvDemand::operator+=(const KvDemand& o) {
  blocks += o.blocks;
  device_pages += o.device_pages;
  host_pages += o.host_pages;
  slots += o.slots;
  dense_layer_pages += o.dense_layer_pages;
  return *this;
}

KvDemand& KvDemand::operator-=(const KvDemand& o) {
  blocks -= o.blocks;
  device_pages -= o.device_pages;
  host_pages -= o.host_pages;
  slots -= o.slots;
  dense_layer_pages -= o.dense_layer_pages;
  return *this;
}

bool KvDemand::fits_within(const KvDemand& c) const {
  return blocks <= c.blocks && device_pages <= c.device_pages && host_pages <= c.host_pages && slots <= c.slots &&
         dense_layer_pages <= c.dense_layer_pages;
}

KvDemand max_of(const KvDemand& a, const KvDemand& b) {
  return {std::max(a.blocks, b.blocks), std::max(a.device_pages, b.device_pages),
          std::max(a.host_pages, b.host_pages), std::max(a.slots, b.slots),
          std::max(a.dense_layer_pages, b.dense_layer_pages)};
}

void AttentionFactory::swap_out(SequenceKv&) { fail("this attention store cannot swap sequences out"); }

void AttentionFactory::swap_in(SequenceKv&) { fail("this attention store cannot swap sequences in"); }

void AttentionFactory::validate(const AttentionSettings& settings) const {
  const std::vector<std::string> known = algorithms();
  if (std::find(known.begin(), known.end(), settings.algorithm) == known.end()) {
    fail("unknown attention algorithm '{}' (known: {})", settings.algorithm, fmt::join(known, ", "));
  }
  SPIN_CHECK(settings.budget >= 0, "the attention budget must be >= 0, got {}", settings.budget);
}

KvDemand AttentionFactory::demand(const AttentionSettings&, int64_t tokens, int64_t, bool,
                                  int64_t block_tokens) const {
  return KvDemand{.blocks = (tokens + block_tokens - 1) / block_tokens};
}

namespace {

class ContiguousAttentionFactory final : public AttentionFactory {
 public:
  explicit ContiguousAttentionFactory(const AttentionShape& shape) : shape_(shape) {}

  std::vector<std::string> algorithms() const override { return {"dense"}; }

  std::unique_ptr<SequenceKv> create(const AttentionSettings& settings,
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
