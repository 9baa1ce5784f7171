#pragma once
// Entry point that turns `--model` / `--load-format` into weights and a tokenizer.
#include <cstdint>
#include <memory>
#include <string>

#include "model/config.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace spin {

class GgufFile;

struct LoadOptions {
  std::string model;                 // .gguf file, HF directory, config.json, or preset name
  std::string load_format = "auto";  // auto | gguf | safetensors | dummy
  uint64_t seed = 0;                 // dummy weights
  // false: a dummy load returns the config (and tokenizer) with no weights; a GPU backend makes
  // them on the device instead of in host memory.
  bool dummy_weights_on_host = true;
  // --rope-scaling: a rope_scaling object in HF's config.json format that replaces the model's
  // own (e.g. YaRN for Qwen3 past 32K); empty keeps the model's.
  std::string rope_scaling;
};

struct LoadedModel {
  std::string name;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;  // null for dummy weights without tokenizer files
};

LoadedModel load_model(const LoadOptions& options);

// GGUF (model/gguf_model.cpp)
ModelConfig config_from_gguf(const GgufFile& gguf);
ModelWeights load_gguf_weights(const GgufFile& gguf);

// HF directories (model/hf_model.cpp): config.json + model.safetensors or sharded with
// model.safetensors.index.json.
ModelConfig config_from_hf_file(const std::string& config_json_path);
ModelWeights load_hf_weights(const std::string& dir);
// Replaces config.rope's scaling by a rope_scaling JSON object (HF's format: linear, llama3 or
// yarn); YaRN also extends max_position to original_max_position_embeddings x factor. Throws
// spin::Error naming --rope-scaling for bad JSON or fields.
void override_rope_scaling(ModelConfig& config, const std::string& rope_scaling_json);

// Dummy weights (model/dummy_model.cpp): named presets (llama-3.1-8b, qwen3-8b, qwen3-14b,
// qwen3-32b, llama-3.1-70b, tiny-llama, tiny-qwen3) and random weights for a config.
bool is_preset_name(const std::string& name);
ModelConfig preset_config(const std::string& name);
ModelWeights make_dummy_weights(const ModelConfig& config, uint64_t seed);

}  // namespace spin
