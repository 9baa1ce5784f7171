// GGUF -> ModelConfig and ModelWeights for the Llama family (llama.cpp's key and tensor names).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/gguf.h"
#include "model/loader.h"

namespace spin {

namespace {

const GgufValue* find_key(const GgufFile& gguf, const std::string& key) { return gguf.find(key); }

int64_t int_key(const GgufFile& gguf, const std::string& key) {
  const GgufValue* v = find_key(gguf, key);
  if (!v) fail("{}: required metadata key '{}' is missing", gguf.name(), key);
  if (v->kind != GgufValue::Kind::UInt && v->kind != GgufValue::Kind::Int)
    fail("{}: metadata key '{}' must be an integer", gguf.name(), key);
  try {
    return v->as_int();
  } catch (const Error& e) {
    fail("{}: metadata key '{}': {}", gguf.name(), key, e.what());
  }
}

int64_t int_key_or(const GgufFile& gguf, const std::string& key, int64_t fallback) {
  return find_key(gguf, key) ? int_key(gguf, key) : fallback;
}

float float_key_or(const GgufFile& gguf, const std::string& key, float fallback) {
  const GgufValue* v = find_key(gguf, key);
  if (!v) return fallback;
  if (v->kind != GgufValue::Kind::Float && v->kind != GgufValue::Kind::UInt &&
      v->kind != GgufValue::Kind::Int)
    fail("{}: metadata key '{}' must be a number", gguf.name(), key);
  const double d = v->as_float();
  if (!std::isfinite(d)) fail("{}: metadata key '{}' is not finite", gguf.name(), key);
  return static_cast<float>(d);
}

int32_t token_id_key(const GgufFile& gguf, const std::string& key, int64_t vocab_size) {
  if (!find_key(gguf, key)) return -1;
  const int64_t id = int_key(gguf, key);
  if (id < 0 || id >= vocab_size)
    fail("{}: metadata key '{}' = {} is outside the vocabulary (size {})", gguf.name(), key, id,
         vocab_size);
  return static_cast<int32_t>(id);
}

std::string dims_string(const std::vector<uint64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + "]";
}

const GgufTensorInfo& require_tensor(const GgufFile& gguf, const std::string& name,
                                     const std::vector<uint64_t>& expected_dims) {
  const GgufTensorInfo* info = gguf.find_tensor(name);
  if (!info) fail("{}: missing tensor '{}'", gguf.name(), name);
  if (info->dims != expected_dims)
    fail("{}: tensor '{}' has wrong shape {} (ggml order), expected {}", gguf.name(), name,
         dims_string(info->dims), dims_string(expected_dims));
  return *info;
}

// A job that dequantizes one tensor into its destination; a matrix also keeps the blocks of the
// formats the CPU's products read directly.
struct TensorLoad {
  const GgufTensorInfo* info;
  std::vector<float>* dst;
  Matrix* matrix = nullptr;
};

std::optional<cpu::BlockFormat> block_format(GgmlType type) {
  if (type == GgmlType::Q4_1) return cpu::BlockFormat::q4_1;
  if (type == GgmlType::Q8_0) return cpu::BlockFormat::q8_0;
  return std::nullopt;
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& gguf) {
  const GgufValue* arch_value = find_key(gguf, "general.architecture");
  if (!arch_value || arch_value->kind != GgufValue::Kind::String)
    fail("{}: metadata key 'general.architecture' is missing or not a string", gguf.name());
  const std::string arch = arch_value->as_string();
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3")
    fail("{}: unsupported architecture '{}' (spin loads llama, qwen2 and qwen3)", gguf.name(),
         arch);
  const std::string p = arch + ".";

  ModelConfig c;
  c.arch = arch == "qwen3" ? "qwen3" : "llama";
  c.qk_norm = arch == "qwen3";
  c.n_layers = int_key(gguf, p + "block_count");
  c.hidden_size = int_key(gguf, p + "embedding_length");
  c.intermediate_size = int_key(gguf, p + "feed_forward_length");
  c.n_heads = int_key(gguf, p + "attention.head_count");
  c.n_kv_heads = int_key_or(gguf, p + "attention.head_count_kv", c.n_heads);
  if (find_key(gguf, p + "attention.key_length")) {
    c.head_dim = int_key(gguf, p + "attention.key_length");
  } else {
    if (c.n_heads <= 0 || c.hidden_size % c.n_heads != 0)
      fail("{}: embedding_length {} does not divide into {} attention heads", gguf.name(),
           c.hidden_size, c.n_heads);
    c.head_dim = c.hidden_size / c.n_heads;
  }
  const int64_t value_length = int_key_or(gguf, p + "attention.value_length", c.head_dim);
  if (value_length != c.head_dim)
    fail("{}: attention.value_length {} differs from key_length {} (unsupported)", gguf.name(),
         value_length, c.head_dim);
  const int64_t rope_dims = int_key_or(gguf, p + "rope.dimension_count", c.head_dim);
  if (rope_dims != c.head_dim)
    fail("{}: rope.dimension_count {} differs from head_dim {} (partial RoPE is unsupported)",
         gguf.name(), rope_dims, c.head_dim);
  c.max_position = int_key(gguf, p + "context_length");
  c.rms_eps = float_key_or(gguf, p + "attention.layer_norm_rms_epsilon", 1e-5f);

  if (find_key(gguf, p + "vocab_size")) {
    c.vocab_size = int_key(gguf, p + "vocab_size");
  } else if (const GgufValue* tokens = find_key(gguf, "tokenizer.ggml.tokens");
             tokens && tokens->kind == GgufValue::Kind::Array) {
    c.vocab_size = static_cast<int64_t>(tokens->as_array().size());
  } else if (const GgufTensorInfo* embd = gguf.find_tensor("token_embd.weight");
             embd && embd->dims.size() == 2) {
    c.vocab_size = static_cast<int64_t>(embd->dims[1]);
  }
  c.tie_embeddings = gguf.find_tensor("output.weight") == nullptr;

  c.rope.neox = arch != "llama";  // llama.cpp's converter permuted llama's Q/K rows
  c.rope.theta = float_key_or(gguf, p + "rope.freq_base", 10000.0f);
  if (gguf.find_tensor("rope_freqs.weight"))
    fail("{}: Llama-3 style RoPE scaling (tensor 'rope_freqs.weight') is not supported for GGUF "
         "yet; load the HF checkpoint instead",
         gguf.name());
  std::string scaling = "none";
  if (const GgufValue* t = find_key(gguf, p + "rope.scaling.type")) {
    if (t->kind != GgufValue::Kind::String)
      fail("{}: metadata key '{}rope.scaling.type' must be a string", gguf.name(), p);
    scaling = t->as_string();
  } else if (find_key(gguf, p + "rope.scale_linear")) {
    scaling = "linear";
    c.rope.factor = float_key_or(gguf, p + "rope.scale_linear", 1.0f);
  }
  if (scaling == "linear") {
    c.rope.scaling = RopeScaling::Linear;
    c.rope.factor = float_key_or(gguf, p + "rope.scaling.factor", c.rope.factor);
  } else if (scaling == "yarn") {
    c.rope.scaling = RopeScaling::Yarn;
    c.rope.factor = float_key_or(gguf, p + "rope.scaling.factor", 1.0f);
    const int64_t original =
        int_key_or(gguf, p + "rope.scaling.original_context_length", c.max_position);
    if (original <= 0 || original > (int64_t{1} << 30))
      fail("{}: rope.scaling.original_context_length {} is out of range", gguf.name(), original);
    c.rope.original_max_position = static_cast<int>(original);
    c.rope.yarn_beta_fast = float_key_or(gguf, p + "rope.scaling.yarn_beta_fast", 32.0f);
    c.rope.yarn_beta_slow = float_key_or(gguf, p + "rope.scaling.yarn_beta_slow", 1.0f);
    c.rope.yarn_attn_factor = float_key_or(gguf, p + "rope.scaling.attn_factor", 1.0f);
  } else if (scaling != "none") {
    fail("{}: unsupported rope.scaling.type '{}' (none, linear and yarn are supported)",
         gguf.name(), scaling);
  }

  c.validate();
  c.bos_token_id = token_id_key(gguf, "tokenizer.ggml.bos_token_id", c.vocab_size);
  c.eos_token_id = token_id_key(gguf, "tokenizer.ggml.eos_token_id", c.vocab_size);
  return c;
}

ModelWeights load_gguf_weights(const GgufFile& gguf) {
  ModelWeights w;
  w.config = config_from_gguf(gguf);
  const ModelConfig& c = w.config;
  const auto hidden = static_cast<uint64_t>(c.hidden_size);
  const auto vocab = static_cast<uint64_t>(c.vocab_size);
  const auto q_dim = static_cast<uint64_t>(c.n_heads * c.head_dim);
  const auto kv_dim = static_cast<uint64_t>(c.n_kv_heads * c.head_dim);
  const auto ffn = static_cast<uint64_t>(c.intermediate_size);
  const auto head_dim = static_cast<uint64_t>(c.head_dim);

  // Every shape is checked against the config before any tensor is dequantized, so a bad file
  // fails without allocating its (possibly huge) tensors.
  std::vector<TensorLoad> loads;
  auto matrix = [&](const std::string& name, Matrix& m, uint64_t rows, uint64_t cols) {
    // ggml dims are fastest-first: an [out, in] matrix is stored as dims {in, out}.
    loads.push_back({&require_tensor(gguf, name, {cols, rows}), &m.data, &m});
    m.rows = static_cast<int64_t>(rows);
    m.cols = static_cast<int64_t>(cols);
  };
  auto vector = [&](const std::string& name, std::vector<float>& v, uint64_t n) {
    loads.push_back({&require_tensor(gguf, name, {n}), &v});
  };

  matrix("token_embd.weight", w.tok_embd, vocab, hidden);
  vector("output_norm.weight", w.out_norm, hidden);
  if (!c.tie_embeddings) matrix("output.weight", w.lm_head, vocab, hidden);
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string b = fmt::format("blk.{}.", i);
    for (const char* bias : {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"})
      if (gguf.find_tensor(b + bias))
        fail("{}: tensor '{}{}': attention biases are not supported yet", gguf.name(), b, bias);
    vector(b + "attn_norm.weight", l.attn_norm, hidden);
    matrix(b + "attn_q.weight", l.wq, q_dim, hidden);
    matrix(b + "attn_k.weight", l.wk, kv_dim, hidden);
    matrix(b + "attn_v.weight", l.wv, kv_dim, hidden);
    matrix(b + "attn_output.weight", l.wo, hidden, q_dim);
    if (c.qk_norm) {
      vector(b + "attn_q_norm.weight", l.q_norm, head_dim);
      vector(b + "attn_k_norm.weight", l.k_norm, head_dim);
    }
    vector(b + "ffn_norm.weight", l.ffn_norm, hidden);
    matrix(b + "ffn_gate.weight", l.w_gate, ffn, hidden);
    matrix(b + "ffn_up.weight", l.w_up, ffn, hidden);
    matrix(b + "ffn_down.weight", l.w_down, hidden, ffn);
  }

  // One parallel region over whole tensors: enough work per task, a single fork/join.
  const auto n_loads = static_cast<int64_t>(loads.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_loads; ++i) {
    const TensorLoad& load = loads[static_cast<size_t>(i)];
    *load.dst = gguf.dequantize(*load.info);
    if (load.matrix == nullptr) continue;
    // Rows of whole blocks only (a valid file's are; the fp32 copy serves any other).
    const auto format = block_format(load.info->type);
    if (format && load.matrix->cols % cpu::kBlockValues == 0) {
      const uint8_t* bytes = gguf.tensor_data(*load.info);
      load.matrix->blocks.assign(bytes, bytes + load.info->n_bytes);
      load.matrix->block_format = *format;
    }
  }
  w.validate_shapes();
  return w;
}

}  // namespace spin
