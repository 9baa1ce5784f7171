#include "sparse/algorithm.h"

#include <algorithm>
#include <numeric>

#include "base/error.h"
#include "kernels/cpu/paged_attention.h"

namespace spin::sparse {

void SparseAlgorithm::index(const IndexInput&) {}

void SparseAlgorithm::score_pages(const SelectQuery&, uint32_t, std::span<float>) const {
  fail("this sparse algorithm neither scores pages nor overrides select");
}

void SparseAlgorithm::select(const SelectQuery& query, kv::LayerSelection& out, StepBudget&) {
  const uint32_t n = query.end_candidate - query.first_candidate;
  const uint32_t keep = std::min(n, query.budget_pages);
  if (keep == n) return select_all(query, out);  // everything fits: no need to score
  std::vector<float> scores(n);
  std::vector<uint32_t> chosen;
  for (uint32_t g = 0; g < query.num_kv_heads; ++g) {
    score_pages(query, g, scores);
    chosen.resize(n);
    std::iota(chosen.begin(), chosen.end(), 0u);
    keep_top(chosen, keep, [&](uint32_t i) { return scores[i]; });
    for (uint32_t& p : chosen) p += query.first_candidate;
    out.add_head(chosen);
  }
}

void select_all(const SelectQuery& query, kv::LayerSelection& out) {
  std::vector<uint32_t> pages(query.end_candidate - query.first_candidate);
  std::iota(pages.begin(), pages.end(), query.first_candidate);
  for (uint32_t g = 0; g < query.num_kv_heads; ++g) out.add_head(pages);
}

void SparseAlgorithm::attend(const AttendInput& in, float* out) { attend_pages(in, out); }

void attend_pages(const AttendInput& in, float* out) {
  const int64_t hd = in.shape.head_dim;
  const int64_t n_kv = in.shape.n_kv_heads;
  const int64_t group = in.shape.n_heads / n_kv;
  const uint32_t last_page = (in.context_tokens - 1) / in.page_size;
  const uint32_t last_tokens = in.context_tokens - last_page * in.page_size;
#pragma omp parallel for schedule(static) if (n_kv > 1)
  for (int64_t g = 0; g < n_kv; ++g) {
    const auto logical = in.pages->head(static_cast<uint32_t>(g));
    const uint32_t offset = in.pages->offsets[g];
    std::vector<cpu::KvPageView> views(logical.size());
    for (size_t i = 0; i < logical.size(); ++i) {
      const kv::PageId page = in.device_pages[offset + i];
      views[i] = {in.memory->keys(page), in.memory->values(page),
                  logical[i] == last_page ? last_tokens : in.page_size};
    }
    std::vector<float> scratch(cpu::paged_attention_scratch(group, in.page_size));
    cpu::attend_group_pages(in.q + g * group * hd, group, views, hd, in.shape.scale,
                            out + g * group * hd, scratch.data());
  }
}

}  // namespace spin::sparse
