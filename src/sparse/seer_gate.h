#pragma once
// Seer's trained gate (SeerAttention-R): per layer and KV head, k_gate [3·head_dim, head_dim] maps a
// block's pooled pre-RoPE keys concat(max, min, mean) to its compressed key, and q_gate
// [group·head_dim, head_dim] maps the group's concatenated query heads to the gate query. Loaded
// once per engine (`--seer-gate FILE`) and shared by every Seer request, on either backend.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/attention.h"

namespace spin::sparse {

struct SeerGate {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t group = 0;
  uint32_t head_dim = 0;
  std::vector<float> k;  // [n_layers][n_kv_heads][3·head_dim][head_dim]
  std::vector<float> q;  // [n_layers][n_kv_heads][group·head_dim][head_dim]

  const float* k_gate(uint32_t layer, uint32_t kv_head) const {
    return k.data() + (size_t{layer} * n_kv_heads + kv_head) * 3 * head_dim * head_dim;
  }
  const float* q_gate(uint32_t layer, uint32_t kv_head) const {
    return q.data() + (size_t{layer} * n_kv_heads + kv_head) * group * head_dim * head_dim;
  }
  // Throws spin::Error when the gate was made for another attention shape.
  void check_shape(const AttentionShape& shape) const;
};

// Reads `layers.{l}.seer.k_gate` and `layers.{l}.seer.q_gate` (F32, F16 or BF16) for every layer of
// `shape` from a safetensors file. Throws spin::Error naming the file and the tensor at fault.
std::shared_ptr<const SeerGate> load_seer_gate(const std::string& path, const AttentionShape& shape);

// Gate weights of `shape` drawn from normal distributions (each gate output has the spread of one
// input row), for benchmarks and tests that have no trained gate.
std::shared_ptr<const SeerGate> random_seer_gate(const AttentionShape& shape, uint64_t seed);

// The KV heads [first, first + count) of every layer (a tensor-parallel rank's share); null for a
// null gate.
std::shared_ptr<const SeerGate> seer_gate_heads(const std::shared_ptr<const SeerGate>& gate, uint32_t first,
                                                uint32_t count);

}  // namespace spin::sparse
