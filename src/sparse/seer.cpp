// `seer` (SeerAttention-R, Gao et al., 2025). Partition = block of `seer_block_tokens` (64)
// tokens, a whole number of pages.
//  - Index per (layer, KV head, page): max, min and sum of the page's pre-RoPE keys; a block
//    pools its indexed pages (max of maxes, min of mins, mean).
//  - Gate, trained (`seer_gate`, sparse/seer_gate.h): per layer and KV head, k_gate
//    [3·hd, hd] maps concat(max, min, mean) to a compressed key, RoPE'd at the block's first
//    position; q_gate [group·hd, hd] maps the group's concatenated (RoPE'd) query heads to the
//    gate query; score = gate query · compressed key. A block's compressed key pools all its
//    pages (those in the recent window too): it is made once, when the block is complete, as
//    SeerAttention-R's compressed-key cache (every block but the current one is complete).
//  - Gate, training-free (no file): no learned projection. The block's mean pre-RoPE key is
//    rotated to the block's centre position and scored against each query head of the group,
//    max over the group: the attention logit of a "typical" key of the block. (Max/min pooling
//    only feed the trained gate.)
//  - Select: the candidate pages of the current block first (always selected), then blocks by
//    score, all their candidate pages, until the page budget is used (a block that does not fit
//    whole contributes its first pages).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/error.h"
#include "kernels/cpu/ops.h"
#include "model/rope.h"
#include "sparse/algorithm.h"
#include "sparse/seer_gate.h"

namespace spin::sparse {
namespace {

class SeerAlgorithm final : public SparseAlgorithm {
 public:
  explicit SeerAlgorithm(const AlgorithmContext& context)
      : head_dim_(static_cast<uint32_t>(context.shape.head_dim)),
        num_kv_heads_(static_cast<uint32_t>(context.shape.n_kv_heads)),
        group_(static_cast<uint32_t>(context.shape.n_heads / context.shape.n_kv_heads)),
        page_size_(context.layout.page_size),
        block_tokens_(context.settings->seer_block_tokens),
        stats_(static_cast<size_t>(context.shape.n_layers * context.shape.n_kv_heads)),
        gate_(context.settings->seer_gate) {
    SPIN_CHECK(block_tokens_ > 0 && block_tokens_ % page_size_ == 0,
               "seer: block of {} tokens is not a whole number of {}-token pages", block_tokens_,
               page_size_);
    block_pages_ = block_tokens_ / page_size_;
    if (gate_) gate_->check_shape(context.shape);
  }

  AlgorithmTraits traits() const override {
    return {.placement = Placement::Offload, .pre_rope_keys = true};
  }

  void index(const IndexInput& in) override {
    const uint32_t hd = head_dim_;
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      std::vector<float>& s = stats_[size_t{in.layer} * num_kv_heads_ + g];
      SPIN_CHECK(s.size() == size_t{in.first_page} * 3 * hd,
                 "seer: page {} of layer {} indexed out of order", in.first_page, in.layer);
      for (uint32_t p = in.first_page; p < in.end_page; ++p) {
        const float* k = in.page_keys_pre_rope(g, p);
        const size_t at = s.size();
        s.resize(at + 3 * hd);
        float* hi = s.data() + at;
        float* lo = hi + hd;
        float* sum = lo + hd;
        std::copy(k, k + hd, hi);
        std::copy(k, k + hd, lo);
        std::copy(k, k + hd, sum);
        for (uint32_t t = 1; t < page_size_; ++t) {
          const float* row = k + size_t{t} * hd;
          for (uint32_t d = 0; d < hd; ++d) {
            hi[d] = std::max(hi[d], row[d]);
            lo[d] = std::min(lo[d], row[d]);
            sum[d] += row[d];
          }
        }
      }
    }
  }

  void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget&) override {
    const uint32_t first = query.first_candidate, end = query.end_candidate;
    const uint32_t n = end - first;
    if (query.budget_pages >= n) return select_all(query, out);
    SPIN_CHECK(query.rope != nullptr, "seer needs the model's RoPE to place block keys");
    const uint32_t current_block = (query.context_tokens - 1) / block_tokens_;
    const uint32_t first_block = first / block_pages_;
    const uint32_t end_block = (end + block_pages_ - 1) / block_pages_;
    std::vector<float> scores(end_block - first_block);
    std::vector<uint32_t> order, chosen;
    for (uint32_t g = 0; g < query.num_kv_heads; ++g) {
      const std::vector<float>& s = stats_[size_t{query.layer} * num_kv_heads_ + g];
      SPIN_CHECK(size_t{end} * 3 * head_dim_ <= s.size(),
                 "seer: page {} of layer {} selected before it was indexed", end - 1, query.layer);
      for (uint32_t b = first_block; b < end_block; ++b)
        scores[b - first_block] = block_score(query, g, b, end);
      order.resize(end_block - first_block);
      std::iota(order.begin(), order.end(), first_block);
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        return scores[a - first_block] > scores[b - first_block];
      });
      // The current block first.
      if (current_block >= first_block && current_block < end_block) {
        const auto it = std::find(order.begin(), order.end(), current_block);
        std::rotate(order.begin(), it, it + 1);
      }
      chosen.clear();
      for (uint32_t b : order) {
        for (uint32_t p = std::max(first, b * block_pages_);
             p < std::min(end, (b + 1) * block_pages_) && chosen.size() < query.budget_pages; ++p)
          chosen.push_back(p);
        if (chosen.size() == query.budget_pages) break;
      }
      out.add_head(chosen);
    }
  }

  // Gate score of block b for KV head g: its pages [b·bp, (b+1)·bp) below `end` (the training-free
  // gate) or indexed (the trained gate).
  float block_score(const SelectQuery& query, uint32_t g, uint32_t b, uint32_t end) const {
    const uint32_t hd = head_dim_;
    const std::vector<float>& s = stats_[size_t{query.layer} * num_kv_heads_ + g];
    const auto indexed = static_cast<uint32_t>(s.size() / (size_t{3} * hd));
    const uint32_t p0 = b * block_pages_, p1 = std::min(gate_ ? indexed : end, (b + 1) * block_pages_);
    pooled_.assign(3 * size_t{hd}, 0.0f);
    float* hi = pooled_.data();
    float* lo = hi + hd;
    float* mean = lo + hd;
    std::fill(hi, hi + hd, -std::numeric_limits<float>::infinity());
    std::fill(lo, lo + hd, std::numeric_limits<float>::infinity());
    for (uint32_t p = p0; p < p1; ++p) {
      const float* st = s.data() + size_t{p} * 3 * hd;
      for (uint32_t d = 0; d < hd; ++d) {
        hi[d] = std::max(hi[d], st[d]);
        lo[d] = std::min(lo[d], st[hd + d]);
        mean[d] += st[2 * hd + d];
      }
    }
    for (uint32_t d = 0; d < hd; ++d) mean[d] /= static_cast<float>((p1 - p0) * page_size_);
    const RopeTable& rope = *query.rope;
    key_.resize(hd);
    if (!gate_) {
      std::copy(mean, mean + hd, key_.begin());
      cpu::rope(key_.data(), 1, hd, int64_t{b} * block_tokens_ + block_tokens_ / 2,
                rope.inv_freq.data(), rope.mscale, rope.neox);
      float best = -std::numeric_limits<float>::infinity();
      for (uint32_t h = g * query.group; h < (g + 1) * query.group; ++h) {
        const float* q = query.q + size_t{h} * hd;
        float dot = 0.0f;
        for (uint32_t d = 0; d < hd; ++d) dot += q[d] * key_[d];
        best = std::max(best, dot);
      }
      return best;
    }
    // compressed key = pooled [3hd] · k_gate [3hd, hd], RoPE'd at the block start.
    const float* kw = gate_->k_gate(query.layer, g);
    std::fill(key_.begin(), key_.end(), 0.0f);
    for (uint32_t i = 0; i < 3 * hd; ++i)
      for (uint32_t d = 0; d < hd; ++d) key_[d] += pooled_[i] * kw[size_t{i} * hd + d];
    cpu::rope(key_.data(), 1, hd, int64_t{b} * block_tokens_, rope.inv_freq.data(), rope.mscale,
              rope.neox);
    const float* qw = gate_->q_gate(query.layer, g);
    const float* q = query.q + size_t{g} * group_ * hd;
    float score = 0.0f;
    for (uint32_t d = 0; d < hd; ++d) {
      float gq = 0.0f;
      for (uint32_t i = 0; i < group_ * hd; ++i) gq += q[i] * qw[size_t{i} * hd + d];
      score += gq * key_[d];
    }
    return score;
  }

  uint64_t summary_bytes() const override {
    uint64_t bytes = 0;
    for (const auto& s : stats_) bytes += s.size() * sizeof(float);
    return bytes;
  }

 private:
  uint32_t head_dim_;
  uint32_t num_kv_heads_;
  uint32_t group_;
  uint32_t page_size_;
  uint32_t block_tokens_;
  uint32_t block_pages_ = 1;
  // Per (layer, KV head): per page, max, min and sum of pre-RoPE keys (hd floats each).
  std::vector<std::vector<float>> stats_;
  std::shared_ptr<const SeerGate> gate_;  // null: the training-free gate
  mutable std::vector<float> pooled_, key_;
};

}  // namespace

void register_seer(AlgorithmRegistry& registry) {
  registry.add("seer", [](const AlgorithmContext& context) {
    return std::make_unique<SeerAlgorithm>(context);
  });
}

}  // namespace spin::sparse
