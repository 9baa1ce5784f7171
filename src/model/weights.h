#pragma once
// Model weights in fp32 on the host, dequantized at load. Matrices are row-major
// [out_features, in_features] (the HF and GGUF layout), so y = W x is a GEMV over rows.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/block_matmul.h"
#include "model/config.h"

namespace spin {

struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> data;  // rows * cols, or empty for an absent optional tensor
  // The GGUF file's own blocks of the same values, when it stored the matrix as Q4_1 or Q8_0
  // (else empty): the CPU's decode products read these, 4-6x fewer bytes than `data`.
  std::vector<uint8_t> blocks;
  cpu::BlockFormat block_format = cpu::BlockFormat::q4_1;

  bool empty() const { return data.empty(); }
  // Whether the CPU's decode products read `blocks` (this CPU runs them), not `data`.
  bool decodes_from_blocks() const { return !blocks.empty() && cpu::block_matmul_supported(); }
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  Matrix wq;                     // [n_heads * head_dim, hidden]
  Matrix wk;                     // [n_kv_heads * head_dim, hidden]
  Matrix wv;                     // [n_kv_heads * head_dim, hidden]
  Matrix wo;                     // [hidden, n_heads * head_dim]
  std::vector<float> q_norm;     // [head_dim], Qwen3 only
  std::vector<float> k_norm;     // [head_dim], Qwen3 only
  std::vector<float> ffn_norm;   // [hidden]
  Matrix w_gate;                 // [intermediate, hidden]
  Matrix w_up;                   // [intermediate, hidden]
  Matrix w_down;                 // [hidden, intermediate]
};

struct ModelWeights {
  ModelConfig config;
  Matrix tok_embd;                // [vocab, hidden]
  std::vector<float> out_norm;    // [hidden]
  Matrix lm_head;                 // [vocab, hidden]; empty when tied to tok_embd
  std::vector<LayerWeights> layers;

  const Matrix& output_matrix() const { return lm_head.empty() ? tok_embd : lm_head; }
  // Throws spin::Error if any present tensor's shape disagrees with the config, or a required one
  // is missing.
  void validate_shapes() const;
};

}  // namespace spin
