// `quest` (Tang et al., 2024): partitions are pages; Index keeps each page's elementwise
// minimum and maximum key; Select scores a page by the upper bound of q·k over it,
// Σ_d max(q_d·max_d, q_d·min_d), and keeps the top pages (at least 3). The first 2 layers are
// dense. GQA (the paper evaluates multi-head models only): a KV head's page score is the MAX of
// its query heads' bounds, which stays an upper bound of q·k for every head of the group, so a
// page critical to any one head ranks high.
#include <algorithm>
#include <limits>

#include "base/error.h"
#include "sparse/algorithm.h"

namespace spin::sparse {
namespace {

class QuestAlgorithm final : public SparseAlgorithm {
 public:
  explicit QuestAlgorithm(const AlgorithmContext& context)
      : head_dim_(static_cast<uint32_t>(context.shape.head_dim)),
        page_size_(context.layout.page_size),
        num_kv_heads_(static_cast<uint32_t>(context.shape.n_kv_heads)),
        summaries_(static_cast<size_t>(context.shape.n_layers * context.shape.n_kv_heads)) {}

  AlgorithmTraits traits() const override {
    return {.placement = Placement::Offload, .first_dense_layers = 2, .min_selected_pages = 3};
  }

  void index(const IndexInput& in) override {
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      std::vector<float>& s = stream(in.layer, g);
      SPIN_CHECK(s.size() == size_t{in.first_page} * 2 * head_dim_,
                 "quest: page {} of layer {} indexed out of order", in.first_page, in.layer);
      for (uint32_t p = in.first_page; p < in.end_page; ++p) {
        const float* k = in.page_keys(g, p);
        const size_t at = s.size();
        s.resize(at + 2 * head_dim_);
        float* lo = s.data() + at;
        float* hi = lo + head_dim_;
        std::copy(k, k + head_dim_, lo);
        std::copy(k, k + head_dim_, hi);
        for (uint32_t t = 1; t < page_size_; ++t) {
          const float* row = k + size_t{t} * head_dim_;
          for (uint32_t d = 0; d < head_dim_; ++d) {
            lo[d] = std::min(lo[d], row[d]);
            hi[d] = std::max(hi[d], row[d]);
          }
        }
      }
    }
  }

  void score_pages(const SelectQuery& query, uint32_t kv_head,
                   std::span<float> scores) const override {
    const std::vector<float>& s = summaries_[size_t{query.layer} * num_kv_heads_ + kv_head];
    SPIN_CHECK(size_t{query.end_candidate} * 2 * head_dim_ <= s.size(),
               "quest: page {} of layer {} selected before it was indexed", query.end_candidate - 1,
               query.layer);
    for (uint32_t p = query.first_candidate; p < query.end_candidate; ++p) {
      const float* lo = s.data() + size_t{p} * 2 * head_dim_;
      const float* hi = lo + head_dim_;
      float best = -std::numeric_limits<float>::infinity();
      for (uint32_t h = kv_head * query.group; h < (kv_head + 1) * query.group; ++h) {
        const float* q = query.q + size_t{h} * head_dim_;
        float bound = 0.0f;
        for (uint32_t d = 0; d < head_dim_; ++d) bound += std::max(q[d] * hi[d], q[d] * lo[d]);
        best = std::max(best, bound);
      }
      scores[p - query.first_candidate] = best;
    }
  }

  uint64_t summary_bytes() const override {
    uint64_t bytes = 0;
    for (const auto& s : summaries_) bytes += s.size() * sizeof(float);
    return bytes;
  }

 private:
  std::vector<float>& stream(uint32_t layer, uint32_t kv_head) {
    return summaries_[size_t{layer} * num_kv_heads_ + kv_head];
  }

  uint32_t head_dim_;
  uint32_t page_size_;
  uint32_t num_kv_heads_;
  // Per (layer, KV head): per page, min key then max key (head_dim floats each).
  std::vector<std::vector<float>> summaries_;
};

}  // namespace

void register_quest(AlgorithmRegistry& registry) {
  registry.add("quest", [](const AlgorithmContext& context) {
    return std::make_unique<QuestAlgorithm>(context);
  });
}

}  // namespace spin::sparse
