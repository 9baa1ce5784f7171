#include "sparse/seer_gate.h"

#include <cmath>
#include <random>

#include <fmt/ranges.h>

#include "base/error.h"
#include "model/safetensors.h"

namespace spin::sparse {

void SeerGate::check_shape(const AttentionShape& shape) const {
  SPIN_CHECK(int64_t{n_layers} == shape.n_layers && int64_t{n_kv_heads} == shape.n_kv_heads &&
                 int64_t{group} * n_kv_heads == shape.n_heads && int64_t{head_dim} == shape.head_dim,
             "the seer gate has {} layers, {} KV heads of {} query heads, head_dim {}; the model has {} layers, {} "
             "KV heads, {} query heads, head_dim {}",
             n_layers, n_kv_heads, group, head_dim, shape.n_layers, shape.n_kv_heads, shape.n_heads, shape.head_dim);
}

std::shared_ptr<const SeerGate> load_seer_gate(const std::string& path, const AttentionShape& shape) {
  SPIN_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.n_heads % shape.n_kv_heads == 0,
             "seer gate: bad attention shape");
  const SafetensorsFile file(path);
  auto gate = std::make_shared<SeerGate>();
  gate->n_layers = static_cast<uint32_t>(shape.n_layers);
  gate->n_kv_heads = static_cast<uint32_t>(shape.n_kv_heads);
  gate->group = static_cast<uint32_t>(shape.n_heads / shape.n_kv_heads);
  gate->head_dim = static_cast<uint32_t>(shape.head_dim);
  const uint64_t hd = gate->head_dim;
  const auto read = [&](const std::string& name, uint64_t rows, std::vector<float>& into) {
    const SafetensorsTensorInfo* info = file.find(name);
    SPIN_CHECK(info != nullptr, "seer gate file {} lacks tensor {}", path, name);
    const std::vector<uint64_t> want{gate->n_kv_heads, rows, hd};
    SPIN_CHECK(info->shape == want, "seer gate {} in {} has shape [{}], expected [{}, {}, {}]", name, path,
               fmt::join(info->shape, ", "), gate->n_kv_heads, rows, hd);
    const std::vector<float> values = file.to_f32(*info);
    into.insert(into.end(), values.begin(), values.end());
  };
  for (uint32_t l = 0; l < gate->n_layers; ++l) {
    const std::string prefix = "layers." + std::to_string(l) + ".seer.";
    read(prefix + "k_gate", 3 * hd, gate->k);
    read(prefix + "q_gate", uint64_t{gate->group} * hd, gate->q);
  }
  return gate;
}

std::shared_ptr<const SeerGate> random_seer_gate(const AttentionShape& shape, uint64_t seed) {
  SPIN_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.n_heads % shape.n_kv_heads == 0,
             "seer gate: bad attention shape");
  auto gate = std::make_shared<SeerGate>();
  gate->n_layers = static_cast<uint32_t>(shape.n_layers);
  gate->n_kv_heads = static_cast<uint32_t>(shape.n_kv_heads);
  gate->group = static_cast<uint32_t>(shape.n_heads / shape.n_kv_heads);
  gate->head_dim = static_cast<uint32_t>(shape.head_dim);
  std::mt19937_64 rng(seed);
  const auto fill = [&](std::vector<float>& w, size_t rows) {
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(rows)));
    w.resize(size_t{gate->n_layers} * gate->n_kv_heads * rows * gate->head_dim);
    for (float& x : w) x = normal(rng);
  };
  fill(gate->k, size_t{3} * gate->head_dim);
  fill(gate->q, size_t{gate->group} * gate->head_dim);
  return gate;
}

std::shared_ptr<const SeerGate> seer_gate_heads(const std::shared_ptr<const SeerGate>& gate, uint32_t first,
                                                uint32_t count) {
  if (!gate) return nullptr;
  SPIN_CHECK(count > 0 && first + count <= gate->n_kv_heads, "seer gate: KV heads {}..{} outside 0..{}", first,
             first + count, gate->n_kv_heads);
  auto out = std::make_shared<SeerGate>(SeerGate{.n_layers = gate->n_layers, .n_kv_heads = count, .group = gate->group,
                                                 .head_dim = gate->head_dim, .k = {}, .q = {}});
  const size_t k_head = size_t{3} * gate->head_dim * gate->head_dim;
  const size_t q_head = size_t{gate->group} * gate->head_dim * gate->head_dim;
  for (uint32_t l = 0; l < gate->n_layers; ++l) {
    out->k.insert(out->k.end(), gate->k_gate(l, first), gate->k_gate(l, first) + count * k_head);
    out->q.insert(out->q.end(), gate->q_gate(l, first), gate->q_gate(l, first) + count * q_head);
  }
  return out;
}

}  // namespace spin::sparse
