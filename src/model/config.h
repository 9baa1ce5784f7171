#pragma once
// The shape of a Llama-family decoder, whatever file it came from (GGUF, HF config.json, preset).
#include <cstdint>
#include <string>

namespace spin {

enum class RopeScaling { None, Linear, Llama3, Yarn };

struct RopeConfig {
  float theta = 10000.0f;
  // true: rotate the two halves of each head (HF "rotate_half", GGUF qwen2/qwen3);
  // false: rotate adjacent pairs (GGUF llama, whose Q/K rows llama.cpp's converter permuted).
  bool neox = true;
  RopeScaling scaling = RopeScaling::None;
  float factor = 1.0f;                 // linear / llama3 / yarn scale factor
  float low_freq_factor = 1.0f;        // llama3
  float high_freq_factor = 4.0f;       // llama3
  int original_max_position = 8192;    // llama3 / yarn
  float yarn_beta_fast = 32.0f;        // yarn
  float yarn_beta_slow = 1.0f;         // yarn
  float yarn_attn_factor = 0.0f;       // yarn: HF "attention_factor"; 0 = 0.1 * ln(factor) + 1
};

struct ModelConfig {
  std::string arch = "llama";  // "llama" or "qwen3" (qwen2 behaves as llama with biases absent)
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t max_position = 0;  // context length the model was trained for
  float rms_eps = 1e-5f;
  bool tie_embeddings = false;
  bool qk_norm = false;  // Qwen3: RMSNorm over each head of q and k before RoPE
  RopeConfig rope;
  int32_t bos_token_id = -1;
  int32_t eos_token_id = -1;

  // Throws spin::Error naming the first inconsistent field (zero sizes, heads not dividing, ...).
  void validate() const;
  // Parameter count of the weights this config describes.
  int64_t parameter_count() const;
};

}  // namespace spin
