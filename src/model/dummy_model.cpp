// Named model shapes and deterministic random weights for them (`--load-format dummy`): lets the
// engine run and be benchmarked at real model sizes without the weight files.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/memory.h"
#include "model/loader.h"

namespace spin {

namespace {

// Shapes as published in each model's config.json on the Hugging Face hub.
ModelConfig llama31(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads) {
  ModelConfig c;
  c.arch = "llama";
  c.vocab_size = 128256;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = 8;
  c.head_dim = hidden / heads;
  c.max_position = 131072;
  c.rms_eps = 1e-5f;
  c.tie_embeddings = false;
  c.rope.theta = 500000.0f;
  c.rope.neox = true;
  c.rope.scaling = RopeScaling::Llama3;
  c.rope.factor = 8.0f;
  c.rope.low_freq_factor = 1.0f;
  c.rope.high_freq_factor = 4.0f;
  c.rope.original_max_position = 8192;
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  return c;
}

ModelConfig qwen3(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads) {
  ModelConfig c;
  c.arch = "qwen3";
  c.qk_norm = true;
  c.vocab_size = 151936;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.max_position = 40960;
  c.rms_eps = 1e-6f;
  c.tie_embeddings = false;
  c.rope.theta = 1000000.0f;
  c.rope.neox = true;
  c.bos_token_id = 151643;
  c.eos_token_id = 151645;
  return c;
}

// A few-hundred-KB model with the features of its family: Llama 3 rope scaling with some
// frequencies in each of its three bands, untied output; Qwen3's q/k norms with
// n_heads * head_dim != hidden, tied output.
ModelConfig tiny(bool is_qwen3) {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.intermediate_size = 192;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.rope.neox = true;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  if (is_qwen3) {
    c.arch = "qwen3";
    c.qk_norm = true;
    c.head_dim = 32;
    c.max_position = 4096;
    c.rms_eps = 1e-6f;
    c.tie_embeddings = true;
    c.rope.theta = 1000000.0f;
  } else {
    c.arch = "llama";
    c.head_dim = 16;
    c.max_position = 8192;
    c.rms_eps = 1e-5f;
    c.tie_embeddings = false;
    c.rope.theta = 500000.0f;
    c.rope.scaling = RopeScaling::Llama3;
    c.rope.factor = 8.0f;
    c.rope.low_freq_factor = 1.0f;
    c.rope.high_freq_factor = 4.0f;
    c.rope.original_max_position = 1024;
  }
  return c;
}

constexpr const char* kPresetNames[] = {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-14b",
                                        "qwen3-32b",    "tiny-llama",    "tiny-qwen3"};

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills values with center + uniform noise of the given standard deviation. Each block of
// kBlock values has its own stream derived from (seed, tensor, block), so the result does not
// depend on the thread count.
void fill_uniform(std::vector<float>& values, uint64_t seed, uint64_t tensor_id, float center,
                  float stddev) {
  constexpr int64_t kBlock = 1 << 16;
  const float half_width = stddev * std::sqrt(3.0f);  // U(-a, a) has std a / sqrt(3)
  const int64_t n = static_cast<int64_t>(values.size());
  const int64_t n_blocks = (n + kBlock - 1) / kBlock;
  uint64_t tensor_state = seed ^ (tensor_id * 0xd1b54a32d192ed03ull);
  const uint64_t tensor_seed = splitmix64(tensor_state);
#pragma omp parallel for schedule(static) if (n_blocks > 1)
  for (int64_t b = 0; b < n_blocks; ++b) {
    uint64_t state = tensor_seed + static_cast<uint64_t>(b) * 0x632be59bd9b4e019ull;
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i) {
      // Top 24 bits give a uniform float in [0, 1) exactly.
      const float u = static_cast<float>(splitmix64(state) >> 40) * (1.0f / 16777216.0f);
      values[static_cast<size_t>(i)] = center + half_width * (2.0f * u - 1.0f);
    }
  }
}

class DummyFiller {
 public:
  explicit DummyFiller(uint64_t seed) : seed_(seed) {}

  // Standard deviation 1/sqrt(fan_in) keeps each projection's output at the scale of its input.
  Matrix matrix(int64_t rows, int64_t cols) {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data.resize(static_cast<size_t>(rows * cols));
    fill_uniform(m.data, seed_, next_id_++, 0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    return m;
  }
  // Norm gains near 1, as in trained models.
  std::vector<float> norm(int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    fill_uniform(v, seed_, next_id_++, 1.0f, 0.02f);
    return v;
  }

 private:
  uint64_t seed_;
  uint64_t next_id_ = 0;
};

}  // namespace

bool is_preset_name(const std::string& name) {
  for (const char* preset : kPresetNames) {
    if (name == preset) return true;
  }
  return false;
}

ModelConfig preset_config(const std::string& name) {
  if (name == "llama-3.1-8b") return llama31(4096, 14336, 32, 32);
  if (name == "llama-3.1-70b") return llama31(8192, 28672, 80, 64);
  if (name == "qwen3-8b") return qwen3(4096, 12288, 36, 32);
  if (name == "qwen3-14b") return qwen3(5120, 17408, 40, 40);
  if (name == "qwen3-32b") return qwen3(5120, 25600, 64, 64);
  if (name == "tiny-llama") return tiny(false);
  if (name == "tiny-qwen3") return tiny(true);
  std::string names;
  for (const char* preset : kPresetNames) names += std::string(names.empty() ? "" : ", ") + preset;
  fail("unknown model preset '{}' (presets: {})", name, names);
}

ModelWeights make_dummy_weights(const ModelConfig& config, uint64_t seed) {
  config.validate();
  const uint64_t needed = static_cast<uint64_t>(config.parameter_count()) * sizeof(float);
  const uint64_t usable = usable_memory_bytes();
  SPIN_CHECK(needed <= usable,
             "dummy weights need {:.1f} GB as fp32 ({} parameters) but this machine has {:.1f} GB "
             "of memory ({} > {} bytes)",
             needed / 1e9, config.parameter_count(), usable / 1e9, needed, usable);

  ModelWeights w;
  w.config = config;
  const ModelConfig& c = w.config;
  const int64_t q_dim = c.n_heads * c.head_dim;
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  DummyFiller fill(seed);
  w.tok_embd = fill.matrix(c.vocab_size, c.hidden_size);
  w.out_norm = fill.norm(c.hidden_size);
  if (!c.tie_embeddings) w.lm_head = fill.matrix(c.vocab_size, c.hidden_size);
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (LayerWeights& l : w.layers) {
    l.attn_norm = fill.norm(c.hidden_size);
    l.wq = fill.matrix(q_dim, c.hidden_size);
    l.wk = fill.matrix(kv_dim, c.hidden_size);
    l.wv = fill.matrix(kv_dim, c.hidden_size);
    l.wo = fill.matrix(c.hidden_size, q_dim);
    if (c.qk_norm) {
      l.q_norm = fill.norm(c.head_dim);
      l.k_norm = fill.norm(c.head_dim);
    }
    l.ffn_norm = fill.norm(c.hidden_size);
    l.w_gate = fill.matrix(c.intermediate_size, c.hidden_size);
    l.w_up = fill.matrix(c.intermediate_size, c.hidden_size);
    l.w_down = fill.matrix(c.hidden_size, c.intermediate_size);
  }
  w.validate_shapes();
  return w;
}

}  // namespace spin
