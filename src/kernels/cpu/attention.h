#pragma once
// Attention of one query position for the query heads that share one KV head (a GQA group).
#include <cstdint>

namespace spin::cpu {

// q: [group, head_dim] contiguous; keys/values: n_keys rows of head_dim floats, row t at
// k + t * kv_stride (likewise v). out: [group, head_dim]. scores: scratch of group * n_keys
// floats. Each key and value row is read once for the whole group.
void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t n_keys,
                  int64_t kv_stride, int64_t head_dim, float scale, float* out, float* scores);

}  // namespace spin::cpu
