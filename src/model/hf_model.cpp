// Hugging Face model directories: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/memory.h"
#include "base/mapped_file.h"
#include "model/loader.h"
#include "model/safetensors.h"

namespace spin {

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// config.json / index.json are a few KB; anything far larger is not one.
constexpr size_t kMaxJsonFileBytes = 64ull << 20;

Json read_json_file(const std::string& path, const char* what) {
  MappedFile file(path);
  SPIN_CHECK(file.size() <= kMaxJsonFileBytes, "{} '{}' is {} bytes, larger than any real one",
             what, path, file.size());
  const char* begin = reinterpret_cast<const char*>(file.data());
  try {
    return Json::parse(begin, begin + file.size());
  } catch (const Json::exception& e) {
    fail("{} '{}' is not valid JSON: {}", what, path, e.what());
  }
}

// Typed access to config.json fields; a JSON null counts as absent (HF writes "head_dim": null).
class ConfigFields {
 public:
  ConfigFields(const Json& json, std::string path) : json_(json), path_(std::move(path)) {}

  const Json* find(const Json& object, const char* key) const {
    auto it = object.find(key);
    return (it == object.end() || it->is_null()) ? nullptr : &*it;
  }
  const Json* find(const char* key) const { return find(json_, key); }

  int64_t integer(const Json& value, const char* key) const {
    SPIN_CHECK(value.is_number_integer(), "config '{}': field '{}' must be an integer, got {}",
               path_, key, value.dump());
    SPIN_CHECK(!value.is_number_unsigned() ||
                   value.get<uint64_t>() <= static_cast<uint64_t>(
                                                std::numeric_limits<int64_t>::max()),
               "config '{}': field '{}' is too large: {}", path_, key, value.dump());
    return value.get<int64_t>();
  }
  double number(const Json& value, const char* key) const {
    SPIN_CHECK(value.is_number(), "config '{}': field '{}' must be a number, got {}", path_, key,
               value.dump());
    const double v = value.get<double>();
    // Every number read lands in a float or an int field.
    SPIN_CHECK(std::isfinite(v) && std::fabs(v) <= std::numeric_limits<float>::max(),
               "config '{}': field '{}' is out of range: {}", path_, key, value.dump());
    return v;
  }

  int64_t required_int(const char* key) const {
    const Json* v = find(key);
    SPIN_CHECK(v != nullptr, "config '{}': missing required field '{}'", path_, key);
    return integer(*v, key);
  }
  int64_t optional_int(const char* key, int64_t fallback) const {
    const Json* v = find(key);
    return v ? integer(*v, key) : fallback;
  }
  double optional_number(const char* key, double fallback) const {
    const Json* v = find(key);
    return v ? number(*v, key) : fallback;
  }
  bool optional_bool(const char* key, bool fallback) const {
    const Json* v = find(key);
    if (!v) return fallback;
    SPIN_CHECK(v->is_boolean(), "config '{}': field '{}' must be true or false, got {}", path_, key,
               v->dump());
    return v->get<bool>();
  }

  const std::string& path() const { return path_; }

 private:
  const Json& json_;
  std::string path_;
};

// The HF architectures spin runs, with the defaults their transformers config classes use for
// fields a config.json may leave out.
struct HfArchitecture {
  const char* class_name;
  const char* model_type;
  const char* arch;  // ModelConfig::arch
  bool qk_norm;
  int64_t default_max_position;
};

constexpr HfArchitecture kArchitectures[] = {
    {"LlamaForCausalLM", "llama", "llama", false, 2048},
    {"MistralForCausalLM", "mistral", "llama", false, 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", "llama", false, 32768},
    {"Qwen3ForCausalLM", "qwen3", "qwen3", true, 32768},
};

const HfArchitecture& resolve_architecture(const ConfigFields& fields) {
  std::string name;
  bool by_class = false;
  if (const Json* archs = fields.find("architectures")) {
    SPIN_CHECK(archs->is_array(), "config '{}': 'architectures' must be a list", fields.path());
    if (!archs->empty()) {
      SPIN_CHECK((*archs)[0].is_string(), "config '{}': 'architectures' must hold strings",
                 fields.path());
      name = (*archs)[0].get<std::string>();
      by_class = true;
    }
  }
  if (!by_class) {
    const Json* type = fields.find("model_type");
    SPIN_CHECK(type != nullptr && type->is_string(),
               "config '{}': neither 'architectures' nor 'model_type' names the architecture",
               fields.path());
    name = type->get<std::string>();
  }
  for (const HfArchitecture& a : kArchitectures) {
    if (name == (by_class ? a.class_name : a.model_type)) return a;
  }
  fail("config '{}': unsupported architecture '{}' (supported: LlamaForCausalLM, "
       "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)",
       fields.path(), name);
}

// HF's YaRN default attention scaling, 0.1 ln(s) + 1 (1 for s <= 1).
float yarn_default_mscale(float factor) {
  return factor <= 1.0f ? 1.0f : 0.1f * std::log(factor) + 1.0f;
}

// Applies a rope_scaling object (HF's format) to config.rope. YaRN also extends max_position to
// original_max_position_embeddings x factor, the context it was made for (as vLLM derives it).
void apply_rope_scaling(const ConfigFields& fields, const Json& scaling, ModelConfig& config) {
  const std::string& path = fields.path();

  const Json* type_json = fields.find(scaling, "rope_type");
  if (!type_json) type_json = fields.find(scaling, "type");
  if (!type_json) {
    // A rope_parameters block holding only rope_theta is plain RoPE.
    SPIN_CHECK(fields.find(scaling, "factor") == nullptr,
               "config '{}': rope_scaling has a factor but no rope_type", path);
    return;
  }
  SPIN_CHECK(type_json->is_string(), "config '{}': rope_type must be a string", path);
  const std::string type = type_json->get<std::string>();

  auto required = [&](const char* key) {
    const Json* v = fields.find(scaling, key);
    SPIN_CHECK(v != nullptr, "config '{}': rope_scaling of type '{}' needs '{}'", path, type, key);
    return fields.number(*v, key);
  };
  auto optional = [&](const char* key, double fallback) {
    const Json* v = fields.find(scaling, key);
    return v ? fields.number(*v, key) : fallback;
  };
  auto position = [&](double v, const char* key) {
    SPIN_CHECK(v >= 1.0 && v <= std::numeric_limits<int32_t>::max() && v == std::floor(v),
               "config '{}': {} must be a positive integer, got {}", path, key, v);
    return static_cast<int>(v);
  };
  RopeConfig& rope = config.rope;
  if (type == "default") {
    rope.scaling = RopeScaling::None;
  } else if (type == "linear") {
    rope.scaling = RopeScaling::Linear;
    rope.factor = static_cast<float>(required("factor"));
  } else if (type == "llama3") {
    rope.scaling = RopeScaling::Llama3;
    rope.factor = static_cast<float>(required("factor"));
    rope.low_freq_factor = static_cast<float>(required("low_freq_factor"));
    rope.high_freq_factor = static_cast<float>(required("high_freq_factor"));
    rope.original_max_position = position(required("original_max_position_embeddings"),
                                          "original_max_position_embeddings");
    SPIN_CHECK(rope.low_freq_factor > 0.0f && rope.high_freq_factor > rope.low_freq_factor,
               "config '{}': llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor "
               "(got {} and {})",
               path, rope.low_freq_factor, rope.high_freq_factor);
  } else if (type == "yarn") {
    rope.scaling = RopeScaling::Yarn;
    rope.factor = static_cast<float>(required("factor"));
    SPIN_CHECK(rope.factor >= 1.0f, "config '{}': yarn rope scaling needs a factor >= 1, got {}", path, rope.factor);
    rope.original_max_position =
        position(optional("original_max_position_embeddings",
                          static_cast<double>(config.max_position)),
                 "original_max_position_embeddings");
    rope.yarn_beta_fast = static_cast<float>(optional("beta_fast", 32.0));
    rope.yarn_beta_slow = static_cast<float>(optional("beta_slow", 1.0));
    // HF's attention_factor replaces the default mscale; RopeConfig keeps a multiplier on it.
    if (const Json* a = fields.find(scaling, "attention_factor")) {
      rope.yarn_attn_factor = static_cast<float>(fields.number(*a, "attention_factor")) /
                              yarn_default_mscale(rope.factor);
    }
    const double extended = static_cast<double>(rope.original_max_position) * rope.factor;
    SPIN_CHECK(extended <= std::numeric_limits<int32_t>::max(),
               "config '{}': yarn rope scaling extends the context past 2^31 tokens", path);
    config.max_position = std::max<int64_t>(config.max_position, static_cast<int64_t>(extended));
  } else {
    fail("config '{}': unsupported rope_scaling type '{}' (supported: linear, llama3, yarn)", path,
         type);
  }
}

void parse_rope(const ConfigFields& fields, ModelConfig& config) {
  // transformers >= 5 nests theta and scaling in "rope_parameters"; older configs use
  // "rope_theta" and "rope_scaling" at the top level.
  const Json* scaling = fields.find("rope_scaling");
  if (!scaling) scaling = fields.find("rope_parameters");
  double theta = 10000.0;
  if (scaling && scaling->is_object()) {
    if (const Json* t = fields.find(*scaling, "rope_theta")) theta = fields.number(*t, "rope_theta");
  }
  config.rope.theta = static_cast<float>(fields.optional_number("rope_theta", theta));
  config.rope.neox = true;  // HF's rotate_half layout
  if (!scaling) return;
  SPIN_CHECK(scaling->is_object(), "config '{}': rope_scaling must be an object or null", fields.path());
  apply_rope_scaling(fields, *scaling, config);
}

int32_t parse_token_id(const ConfigFields& fields, const char* key) {
  const Json* v = fields.find(key);
  if (!v) return -1;
  const Json* id = v;
  if (v->is_array()) {
    if (v->empty()) return -1;
    id = &(*v)[0];
    if (v->size() > 1) {
      spdlog::info("config '{}': {} lists {} ids; using the first, {}", fields.path(), key,
                   v->size(), id->dump());
    }
  }
  const int64_t value = fields.integer(*id, key);
  SPIN_CHECK(value >= 0 && value <= std::numeric_limits<int32_t>::max(),
             "config '{}': {} {} is out of range", fields.path(), key, value);
  return static_cast<int32_t>(value);
}

// Shards of one checkpoint: every tensor name mapped to the file that holds it.
class CheckpointTensors {
 public:
  explicit CheckpointTensors(const std::string& dir) : dir_(dir) {
    const fs::path single = fs::path(dir) / "model.safetensors";
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    if (fs::exists(single)) {
      add_whole_file(single.filename().string());
    } else if (fs::exists(index)) {
      add_index(index.string());
    } else {
      fail("HF model '{}' has neither model.safetensors nor model.safetensors.index.json", dir);
    }
  }

  struct Entry {
    const SafetensorsFile* file;
    const SafetensorsTensorInfo* info;
  };

  const Entry* find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  bool sharded() const { return sharded_; }

 private:
  const SafetensorsFile& open(const std::string& file_name) {
    auto it = files_.find(file_name);
    if (it != files_.end()) return *it->second;
    const fs::path path = fs::path(dir_) / file_name;
    SPIN_CHECK(fs::exists(path), "HF model '{}': shard '{}' listed in model.safetensors.index.json "
               "is missing", dir_, file_name);
    auto file = std::make_unique<SafetensorsFile>(path.string());
    return *files_.emplace(file_name, std::move(file)).first->second;
  }

  void add_whole_file(const std::string& file_name) {
    const SafetensorsFile& file = open(file_name);
    for (const SafetensorsTensorInfo& info : file.tensors()) entries_[info.name] = {&file, &info};
  }

  void add_index(const std::string& index_path) {
    sharded_ = true;
    const Json index = read_json_file(index_path, "index");
    SPIN_CHECK(index.is_object(), "index '{}' is not a JSON object", index_path);
    auto map_it = index.find("weight_map");
    SPIN_CHECK(map_it != index.end() && map_it->is_object(),
               "index '{}' has no 'weight_map' object", index_path);
    for (const auto& [tensor, shard_json] : map_it->items()) {
      SPIN_CHECK(shard_json.is_string(), "index '{}': shard of tensor '{}' is not a string",
                 index_path, tensor);
      const std::string shard = shard_json.get<std::string>();
      // Shards live beside the index; a path that leaves the directory is not a shard name.
      const fs::path shard_path(shard);
      SPIN_CHECK(!shard.empty() && shard_path.is_relative() &&
                     shard_path.filename().string() == shard && shard != "." && shard != "..",
                 "index '{}': shard name '{}' of tensor '{}' is not a file name in the model "
                 "directory",
                 index_path, shard, tensor);
      const SafetensorsFile& file = open(shard);
      const SafetensorsTensorInfo* info = file.find(tensor);
      SPIN_CHECK(info != nullptr,
                 "index '{}' maps tensor '{}' to shard '{}', which does not contain it",
                 index_path, tensor, shard);
      entries_[tensor] = {&file, info};
    }
  }

  std::string dir_;
  bool sharded_ = false;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> entries_;
};

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

class WeightReader {
 public:
  WeightReader(const CheckpointTensors& tensors, std::string dir)
      : tensors_(tensors), dir_(std::move(dir)) {}

  const CheckpointTensors::Entry& require(const std::string& name) const {
    const CheckpointTensors::Entry* e = tensors_.find(name);
    SPIN_CHECK(e != nullptr, "HF model '{}': missing tensor '{}'{}", dir_, name,
               tensors_.sharded() ? " (not in the weight_map of model.safetensors.index.json)"
                                  : "");
    return *e;
  }

  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const {
    const CheckpointTensors::Entry& e = require(name);
    const std::vector<uint64_t>& shape = e.info->shape;
    SPIN_CHECK(shape.size() == 2 && shape[0] == static_cast<uint64_t>(rows) &&
                   shape[1] == static_cast<uint64_t>(cols),
               "HF model '{}': tensor '{}' has shape {}, expected [{}, {}]", dir_, name,
               shape_string(shape), rows, cols);
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data = e.file->to_f32(*e.info);
    return m;
  }

  std::vector<float> vector(const std::string& name, int64_t n) const {
    const CheckpointTensors::Entry& e = require(name);
    const std::vector<uint64_t>& shape = e.info->shape;
    SPIN_CHECK(shape.size() == 1 && shape[0] == static_cast<uint64_t>(n),
               "HF model '{}': tensor '{}' has shape {}, expected [{}]", dir_, name,
               shape_string(shape), n);
    return e.file->to_f32(*e.info);
  }

 private:
  const CheckpointTensors& tensors_;
  std::string dir_;
};

}  // namespace

ModelConfig config_from_hf_file(const std::string& config_json_path) {
  const Json json = read_json_file(config_json_path, "config");
  SPIN_CHECK(json.is_object(), "config '{}' is not a JSON object", config_json_path);
  const ConfigFields fields(json, config_json_path);
  const HfArchitecture& arch = resolve_architecture(fields);

  ModelConfig c;
  c.arch = arch.arch;
  c.qk_norm = arch.qk_norm;
  c.vocab_size = fields.required_int("vocab_size");
  c.hidden_size = fields.required_int("hidden_size");
  c.intermediate_size = fields.required_int("intermediate_size");
  c.n_layers = fields.required_int("num_hidden_layers");
  c.n_heads = fields.required_int("num_attention_heads");
  c.n_kv_heads = fields.optional_int("num_key_value_heads", c.n_heads);
  if (fields.find("head_dim")) {
    c.head_dim = fields.required_int("head_dim");
  } else {
    SPIN_CHECK(c.n_heads > 0 && c.hidden_size % c.n_heads == 0,
               "config '{}': hidden_size ({}) is not divisible by num_attention_heads ({}) and "
               "no head_dim is given",
               config_json_path, c.hidden_size, c.n_heads);
    c.head_dim = c.hidden_size / c.n_heads;
  }
  c.max_position = fields.optional_int("max_position_embeddings", arch.default_max_position);
  SPIN_CHECK(c.max_position > 0 && c.max_position <= std::numeric_limits<int32_t>::max(),
             "config '{}': max_position_embeddings must be in [1, 2^31), got {}",
             config_json_path, c.max_position);
  c.rms_eps = static_cast<float>(fields.optional_number("rms_norm_eps", 1e-6));
  c.tie_embeddings = fields.optional_bool("tie_word_embeddings", false);
  c.bos_token_id = parse_token_id(fields, "bos_token_id");
  c.eos_token_id = parse_token_id(fields, "eos_token_id");
  parse_rope(fields, c);
  try {
    c.validate();
  } catch (const Error& e) {
    fail("config '{}': {}", config_json_path, e.what());
  }
  return c;
}

void override_rope_scaling(ModelConfig& config, const std::string& rope_scaling_json) {
  constexpr const char* kSource = "--rope-scaling";
  Json json;
  try {
    json = Json::parse(rope_scaling_json);
  } catch (const Json::exception& e) {
    fail("{} is not valid JSON: {}", kSource, e.what());
  }
  SPIN_CHECK(json.is_object(), "{} must be a JSON object such as '{{\"rope_type\":\"yarn\",\"factor\":4.0,"
             "\"original_max_position_embeddings\":32768}}', got {}", kSource, json.dump());
  // The model's own scaling is replaced whole; its base frequency and layout stay. A bad value
  // leaves config as it was.
  ModelConfig updated = config;
  updated.rope = RopeConfig{};
  updated.rope.theta = config.rope.theta;
  updated.rope.neox = config.rope.neox;
  apply_rope_scaling(ConfigFields(json, kSource), json, updated);
  updated.validate();
  config = updated;
}

ModelWeights load_hf_weights(const std::string& dir) {
  ModelWeights w;
  w.config = config_from_hf_file((fs::path(dir) / "config.json").string());
  const ModelConfig& c = w.config;

  const uint64_t needed = static_cast<uint64_t>(c.parameter_count()) * sizeof(float);
  const uint64_t usable = usable_memory_bytes();
  SPIN_CHECK(needed <= usable,
             "HF model '{}' needs {:.1f} GB as fp32 weights but this machine has {:.1f} GB of "
             "memory ({} > {} bytes)",
             dir, needed / 1e9, usable / 1e9, needed, usable);

  const CheckpointTensors tensors(dir);
  for (const auto& [name, entry] : tensors.entries()) {
    const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    SPIN_CHECK(!is_bias,
               "HF model '{}': tensor '{}' is a bias; attention/MLP biases (e.g. Qwen2's q/k/v "
               "biases) are not supported yet",
               dir, name);
  }

  const WeightReader read(tensors, dir);
  const int64_t q_dim = c.n_heads * c.head_dim;
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  w.tok_embd = read.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size);
  w.out_norm = read.vector("model.norm.weight", c.hidden_size);
  if (!c.tie_embeddings) {
    SPIN_CHECK(tensors.find("lm_head.weight") != nullptr,
               "HF model '{}': lm_head.weight is missing and tie_word_embeddings is false", dir);
    w.lm_head = read.matrix("lm_head.weight", c.vocab_size, c.hidden_size);
  }
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    l.attn_norm = read.vector(p + "input_layernorm.weight", c.hidden_size);
    l.wq = read.matrix(p + "self_attn.q_proj.weight", q_dim, c.hidden_size);
    l.wk = read.matrix(p + "self_attn.k_proj.weight", kv_dim, c.hidden_size);
    l.wv = read.matrix(p + "self_attn.v_proj.weight", kv_dim, c.hidden_size);
    l.wo = read.matrix(p + "self_attn.o_proj.weight", c.hidden_size, q_dim);
    if (c.qk_norm) {
      l.q_norm = read.vector(p + "self_attn.q_norm.weight", c.head_dim);
      l.k_norm = read.vector(p + "self_attn.k_norm.weight", c.head_dim);
    }
    l.ffn_norm = read.vector(p + "post_attention_layernorm.weight", c.hidden_size);
    l.w_gate = read.matrix(p + "mlp.gate_proj.weight", c.intermediate_size, c.hidden_size);
    l.w_up = read.matrix(p + "mlp.up_proj.weight", c.intermediate_size, c.hidden_size);
    l.w_down = read.matrix(p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size);
  }
  w.validate_shapes();
  return w;
}

}  // namespace spin
