#include "model/weights.h"

#include "base/error.h"

namespace spin {

namespace {

void check_matrix(const Matrix& m, int64_t rows, int64_t cols, const std::string& name) {
  SPIN_CHECK(!m.empty(), "weights: tensor {} is missing", name);
  SPIN_CHECK(m.rows == rows && m.cols == cols && static_cast<int64_t>(m.data.size()) == rows * cols,
             "weights: tensor {} has shape [{}, {}] ({} values), expected [{}, {}]", name, m.rows,
             m.cols, m.data.size(), rows, cols);
}

void check_vector(const std::vector<float>& v, int64_t n, const std::string& name) {
  SPIN_CHECK(static_cast<int64_t>(v.size()) == n, "weights: tensor {} has {} values, expected {}",
             name, v.size(), n);
}

}  // namespace

void ModelWeights::validate_shapes() const {
  const ModelConfig& c = config;
  c.validate();
  const int64_t q = c.n_heads * c.head_dim;
  const int64_t kv = c.n_kv_heads * c.head_dim;
  check_matrix(tok_embd, c.vocab_size, c.hidden_size, "token embeddings");
  check_vector(out_norm, c.hidden_size, "output norm");
  if (!c.tie_embeddings) check_matrix(lm_head, c.vocab_size, c.hidden_size, "lm_head");
  SPIN_CHECK(static_cast<int64_t>(layers.size()) == c.n_layers, "weights: {} layers, expected {}",
             layers.size(), c.n_layers);
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& l = layers[i];
    const std::string p = "layer " + std::to_string(i) + " ";
    check_vector(l.attn_norm, c.hidden_size, p + "attn_norm");
    check_matrix(l.wq, q, c.hidden_size, p + "q_proj");
    check_matrix(l.wk, kv, c.hidden_size, p + "k_proj");
    check_matrix(l.wv, kv, c.hidden_size, p + "v_proj");
    check_matrix(l.wo, c.hidden_size, q, p + "o_proj");
    if (c.qk_norm) {
      check_vector(l.q_norm, c.head_dim, p + "q_norm");
      check_vector(l.k_norm, c.head_dim, p + "k_norm");
    }
    check_vector(l.ffn_norm, c.hidden_size, p + "ffn_norm");
    check_matrix(l.w_gate, c.intermediate_size, c.hidden_size, p + "gate_proj");
    check_matrix(l.w_up, c.intermediate_size, c.hidden_size, p + "up_proj");
    check_matrix(l.w_down, c.hidden_size, c.intermediate_size, p + "down_proj");
  }
}

}  // namespace spin
