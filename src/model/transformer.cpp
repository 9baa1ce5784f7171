#include "model/transformer.h"

#include <cmath>
#include <cstring>

#include "base/error.h"
#include "kernels/cpu/block_matmul.h"
#include "kernels/cpu/ops.h"

namespace spin {

namespace {

// Products of a decode step's few rows read the GGUF file's blocks where the matrix has them:
// the weights' bytes bound such a step. Longer ones (prefill chunks) run OpenBLAS on fp32.
constexpr int64_t kBlockProductRows = 8;

void product(const float* x, const Matrix& w, float* y, int64_t rows) {
  if (rows <= kBlockProductRows && w.decodes_from_blocks()) {
    cpu::block_matmul_nt(x, w.blocks.data(), w.block_format, y, rows, w.rows, w.cols);
  } else {
    cpu::matmul_nt(x, w.data.data(), y, rows, w.rows, w.cols);
  }
}

}  // namespace

Transformer::Transformer(const ModelWeights& weights, Communicator* communicator)
    : weights_(weights), communicator_(communicator), rope_(make_rope_table(weights.config.rope, weights.config.head_dim)) {}

AttentionShape Transformer::attention_shape() const {
  const ModelConfig& c = weights_.config;
  return AttentionShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)))};
}

void Transformer::forward(std::span<const SequenceChunk> chunks, bool all_logits,
                          std::vector<float>& logits) {
  const ModelConfig& c = weights_.config;
  const int64_t hidden = c.hidden_size;
  const int64_t q_width = c.n_heads * c.head_dim;
  const int64_t kv_width = c.n_kv_heads * c.head_dim;
  const int64_t ffn = c.intermediate_size;

  int64_t n_tokens = 0;
  for (const SequenceChunk& chunk : chunks) {
    SPIN_CHECK(!chunk.tokens.empty() && chunk.attention != nullptr, "forward: empty chunk");
    SPIN_CHECK(dynamic_cast<SequenceAttention*>(chunk.attention) != nullptr,
               "forward: the CPU model needs host-side attention (a factory of another backend made this KV)");
    n_tokens += static_cast<int64_t>(chunk.tokens.size());
  }
  x_.resize(n_tokens * hidden);
  h_.resize(n_tokens * hidden);
  q_.resize(n_tokens * q_width);
  k_.resize(n_tokens * kv_width);
  k_pre_rope_.resize(n_tokens * kv_width);
  v_.resize(n_tokens * kv_width);
  attn_.resize(n_tokens * q_width);
  gate_.resize(n_tokens * ffn);
  up_.resize(n_tokens * ffn);

  // Embeddings; remember each token's position.
  std::vector<int64_t> positions(n_tokens);
  {
    int64_t t = 0;
    for (const SequenceChunk& chunk : chunks) {
      for (size_t i = 0; i < chunk.tokens.size(); ++i, ++t) {
        const int32_t id = chunk.tokens[i];
        SPIN_CHECK(id >= 0 && id < c.vocab_size, "token id {} outside the vocabulary (0..{})", id,
                   c.vocab_size - 1);
        std::memcpy(&x_[t * hidden], &weights_.tok_embd.data[id * hidden], sizeof(float) * hidden);
        positions[t] = chunk.pos0 + static_cast<int64_t>(i);
      }
    }
  }

  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = weights_.layers[l];
    cpu::rmsnorm(x_.data(), L.attn_norm.data(), h_.data(), n_tokens, hidden, c.rms_eps);
    product(h_.data(), L.wq, q_.data(), n_tokens);
    product(h_.data(), L.wk, k_.data(), n_tokens);
    product(h_.data(), L.wv, v_.data(), n_tokens);
    if (c.qk_norm) {
      cpu::rmsnorm(q_.data(), L.q_norm.data(), q_.data(), n_tokens * c.n_heads, c.head_dim, c.rms_eps);
      cpu::rmsnorm(k_.data(), L.k_norm.data(), k_.data(), n_tokens * c.n_kv_heads, c.head_dim,
                   c.rms_eps);
    }
    // Some sparse algorithms summarise keys before RoPE.
    std::memcpy(k_pre_rope_.data(), k_.data(), sizeof(float) * n_tokens * kv_width);
#pragma omp parallel for if (n_tokens > 1)
    for (int64_t t = 0; t < n_tokens; ++t) {
      cpu::rope(&q_[t * q_width], c.n_heads, c.head_dim, positions[t], rope_.inv_freq.data(),
                rope_.mscale, rope_.neox);
      cpu::rope(&k_[t * kv_width], c.n_kv_heads, c.head_dim, positions[t], rope_.inv_freq.data(),
                rope_.mscale, rope_.neox);
    }
    int64_t t0 = 0;
    for (const SequenceChunk& chunk : chunks) {
      const int64_t n = static_cast<int64_t>(chunk.tokens.size());
      const AttentionTokens tokens{.q = &q_[t0 * q_width],
                                   .k = &k_[t0 * kv_width],
                                   .v = &v_[t0 * kv_width],
                                   .k_pre_rope = &k_pre_rope_[t0 * kv_width],
                                   .rope = &rope_};
      static_cast<SequenceAttention*>(chunk.attention)->forward(l, chunk.pos0, n, tokens, &attn_[t0 * q_width]);
      t0 += n;
    }
    product(attn_.data(), L.wo, h_.data(), n_tokens);
    if (communicator_) communicator_->all_reduce_sum(h_.data(), n_tokens * hidden);
    cpu::add_inplace(x_.data(), h_.data(), n_tokens * hidden);

    cpu::rmsnorm(x_.data(), L.ffn_norm.data(), h_.data(), n_tokens, hidden, c.rms_eps);
    product(h_.data(), L.w_gate, gate_.data(), n_tokens);
    product(h_.data(), L.w_up, up_.data(), n_tokens);
    cpu::silu_mul(gate_.data(), up_.data(), n_tokens * ffn);
    product(gate_.data(), L.w_down, h_.data(), n_tokens);
    if (communicator_) communicator_->all_reduce_sum(h_.data(), n_tokens * hidden);
    cpu::add_inplace(x_.data(), h_.data(), n_tokens * hidden);
  }

  // Final norm and logits for the rows asked for.
  int64_t n_rows = all_logits ? n_tokens : static_cast<int64_t>(chunks.size());
  rows_.resize(n_rows * hidden);
  if (all_logits) {
    cpu::rmsnorm(x_.data(), weights_.out_norm.data(), rows_.data(), n_tokens, hidden, c.rms_eps);
  } else {
    int64_t t_end = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      t_end += static_cast<int64_t>(chunks[i].tokens.size());
      cpu::rmsnorm(&x_[(t_end - 1) * hidden], weights_.out_norm.data(), &rows_[i * hidden], 1,
                   hidden, c.rms_eps);
    }
  }
  const Matrix& out = weights_.output_matrix();
  logits.resize(n_rows * c.vocab_size);
  product(rows_.data(), out, logits.data(), n_rows);
}

}  // namespace spin
