#pragma once
// Attention of one query position for a GQA group over a list of KV pages (the paged store's
// layout: each page holds up to page_size consecutive key rows and value rows of one KV head).
// Two passes over the pages (the scores' maximum, then exponentials and values), no page list
// gathered; the result is bit for bit that of attend_group over the pages' rows concatenated,
// so a paged path that attends to every key matches the contiguous one exactly. Defined in
// attention.cpp beside attend_group, whose arithmetic it shares.
#include <cstdint>
#include <span>

namespace spin::cpu {

struct KvPageView {
  const float* k = nullptr;  // n_tokens rows of head_dim floats
  const float* v = nullptr;
  int64_t n_tokens = 0;
};

// Partial sums per head that the exponentials are added into (a fixed order of additions).
inline constexpr int64_t kPagedAttentionLanes = 16;

// Scratch floats attend_group_pages needs for a group and the largest page: the scores of one
// page, and per head the maximum and the partial sums.
inline int64_t paged_attention_scratch(int64_t group, int64_t max_page_tokens) {
  return group * (max_page_tokens + 1 + kPagedAttentionLanes);
}

// q: [group, head_dim]; out: [group, head_dim]. The keys are the pages' rows in list order; the
// result equals attend_group over their concatenation. At least one key in total.
void attend_group_pages(const float* q, int64_t group, std::span<const KvPageView> pages,
                        int64_t head_dim, float scale, float* out, float* scratch);

}  // namespace spin::cpu
