#pragma once
// Shape of the KV cache that the store holds: one page = K and V of `page_size` tokens for ONE
// (layer, KV head). Element type is a parameter so the CUDA backend can keep bf16 pages while
// the CPU backend keeps fp32.
#include <cstdint>

namespace spin::kv {

enum class ElemType : uint8_t { F32, F16, BF16 };

inline uint32_t elem_bytes(ElemType type) { return type == ElemType::F32 ? 4 : 2; }

struct KvLayout {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t page_size = 16;  // tokens per page, 8..64
  ElemType elem = ElemType::F32;

  // Bytes of K (or V) for one token of one head.
  uint64_t token_bytes() const { return uint64_t{head_dim} * elem_bytes(elem); }
  // A page stores K for its tokens, then V: [K: page_size x head_dim][V: page_size x head_dim].
  uint64_t page_bytes() const { return 2 * uint64_t{page_size} * token_bytes(); }
  uint32_t streams() const { return num_layers * num_kv_heads; }  // (layer, head) pairs
  uint32_t pages_for_tokens(uint64_t tokens) const {
    return static_cast<uint32_t>((tokens + page_size - 1) / page_size);
  }
};

// Throws spin::Error when the layout is unusable (zero sizes, page size outside 8..64).
void validate(const KvLayout& layout);

}  // namespace spin::kv
