#include "model/config.h"

#include "base/error.h"

namespace spin {

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    SPIN_CHECK(v > 0, "model config: {} must be positive, got {}", name, v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(n_layers, "num_hidden_layers");
  positive(n_heads, "num_attention_heads");
  positive(n_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(intermediate_size, "intermediate_size");
  SPIN_CHECK(n_heads % n_kv_heads == 0,
             "model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
             n_heads, n_kv_heads);
  SPIN_CHECK(head_dim % 2 == 0, "model config: head_dim ({}) must be even for RoPE", head_dim);
  // Generous upper bounds keep products of these far from int64 overflow.
  SPIN_CHECK(vocab_size <= (1 << 24) && hidden_size <= (1 << 18) && n_layers <= 4096 &&
                 n_heads <= 4096 && head_dim <= 4096 && intermediate_size <= (1 << 20),
             "model config: implausible sizes (vocab {}, hidden {}, layers {}, heads {}, "
             "head_dim {}, intermediate {})",
             vocab_size, hidden_size, n_layers, n_heads, head_dim, intermediate_size);
  SPIN_CHECK(rms_eps > 0.0f, "model config: rms_norm_eps must be positive");
  SPIN_CHECK(rope.theta > 0.0f, "model config: rope_theta must be positive");
  SPIN_CHECK(rope.factor > 0.0f, "model config: rope scaling factor must be positive");
}

int64_t ModelConfig::parameter_count() const {
  const int64_t q = n_heads * head_dim;
  const int64_t kv = n_kv_heads * head_dim;
  int64_t per_layer = 2 * hidden_size                   // norms
                      + hidden_size * (q + 2 * kv)      // q, k, v
                      + q * hidden_size                 // o
                      + 3 * hidden_size * intermediate_size;
  if (qk_norm) per_layer += 2 * head_dim;
  int64_t total = per_layer * n_layers + vocab_size * hidden_size + hidden_size;
  if (!tie_embeddings) total += vocab_size * hidden_size;
  return total;
}

}  // namespace spin
