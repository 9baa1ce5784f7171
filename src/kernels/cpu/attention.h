#pragma once
// CPU attention kernels: one query position for one GQA group (decode), and a blocked causal
// attention of a chunk of query positions (prefill) whose products run through cblas_sgemm.
#include <cstdint>
#include <span>

namespace spin::cpu {

// q: [group, head_dim] contiguous; keys/values: n_keys rows of head_dim floats, row t at
// k + t * kv_stride (likewise v). out: [group, head_dim]. scores: scratch of group * n_keys
// floats. Two passes: the scores and their maximum, then the exponentials and the values.
// attend_group_pages (paged_attention.h) gives the same result bit for bit.
void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t n_keys,
                  int64_t kv_stride, int64_t head_dim, float scale, float* out, float* scores);

// The key and value rows of one KV head, key t (position t) at k + t * head_dim.
struct KvHeadRows {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t n_tokens = 0;
};

struct CausalShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // divides n_heads; query head h uses KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
  float scale = 1.0f;
};

// Causal attention of n_tokens consecutive query positions pos0 .. pos0 + n_tokens - 1 for
// every head: q and out are [n_tokens, n_heads, head_dim]; query token i attends keys
// 0 .. pos0 + i of its KV head. heads[g] holds KV head g's rows and at least pos0 + n_tokens of
// them. Equals attend_group per (token, KV head) within fp32 rounding: tiles of query rows
// (tokens x group heads) against tiles of keys, S = scale Q K^T and O += P V by cblas_sgemm, an
// online softmax in fp32 between them; OpenMP over (KV head, query tile). Call it outside any
// parallel region: OpenBLAS's OpenMP build runs a product called inside one on the calling
// thread, so each tile's products stay on its thread.
void attend_causal(const float* q, int64_t n_tokens, int64_t pos0,
                   std::span<const KvHeadRows> heads, const CausalShape& shape, float* out);

}  // namespace spin::cpu
