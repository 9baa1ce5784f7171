// `--model` / `--load-format` dispatch: a .gguf file, a HF directory, or (dummy) a preset name or
// config whose weights are made up.
#include "model/loader.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "base/error.h"
#include "model/gguf.h"

namespace spin {

namespace {

namespace fs = std::filesystem;

constexpr const char* kPresetList =
    "llama-3.1-8b, llama-3.1-70b, qwen3-8b, qwen3-14b, qwen3-32b, tiny-llama, tiny-qwen3";

bool is_file_at(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

bool is_dir_at(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

bool exists_at(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

bool has_gguf_extension(const fs::path& p) { return p.extension() == ".gguf"; }

// The name of a directory, also when the path ends in a separator ("models/qwen/").
std::string directory_name(const fs::path& p) {
  fs::path normal = p.lexically_normal();
  if (!normal.has_filename()) normal = normal.parent_path();
  std::string name = normal.filename().string();
  if (name.empty() || name == "." || name == "..") {
    std::error_code ec;
    name = fs::weakly_canonical(p, ec).filename().string();
  }
  return name.empty() ? p.string() : name;
}

std::unique_ptr<Tokenizer> tokenizer_in_directory(const fs::path& dir) {
  const fs::path path = dir / "tokenizer.json";
  if (!is_file_at(path)) return nullptr;
  return std::make_unique<Tokenizer>(Tokenizer::from_json_file(path.string()));
}

[[noreturn]] void model_not_found(const std::string& model, bool dummy) {
  if (dummy) {
    fail("model not found: {} (with --load-format dummy, give a preset name ({}), a config.json "
         "or a HF model directory)",
         model, kPresetList);
  }
  if (is_preset_name(model)) {
    fail("model not found: {} is a preset name; add --load-format dummy to run it with random "
         "weights",
         model);
  }
  fail("model not found: {} (expected a .gguf file or a HF model directory with config.json; "
       "presets ({}) need --load-format dummy)",
       model, kPresetList);
}

LoadedModel load_gguf(const fs::path& path) {
  SPIN_CHECK(is_file_at(path), "'{}' is not a file; a GGUF model is a single .gguf file",
             path.string());
  const GgufFile gguf(path.string());
  LoadedModel m;
  m.name = path.stem().string();
  m.weights = load_gguf_weights(gguf);
  m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_gguf(gguf));
  return m;
}

LoadedModel load_hf_directory(const fs::path& dir) {
  SPIN_CHECK(is_dir_at(dir), "'{}' is not a directory; a HF model is a directory holding "
             "config.json and safetensors files", dir.string());
  SPIN_CHECK(is_file_at(dir / "config.json"),
             "HF model directory '{}' has no config.json", dir.string());
  LoadedModel m;
  m.name = directory_name(dir);
  m.weights = load_hf_weights(dir.string());
  m.tokenizer = tokenizer_in_directory(dir);
  return m;
}

LoadedModel load_dummy(const std::string& model, uint64_t seed, bool weights_on_host) {
  LoadedModel m;
  ModelConfig config;
  const fs::path path(model);
  if (is_preset_name(model) && !exists_at(path)) {
    m.name = model;
    config = preset_config(model);
  } else if (is_dir_at(path)) {
    SPIN_CHECK(is_file_at(path / "config.json"),
               "HF model directory '{}' has no config.json", model);
    m.name = directory_name(path);
    config = config_from_hf_file((path / "config.json").string());
    m.tokenizer = tokenizer_in_directory(path);
  } else if (is_file_at(path) && has_gguf_extension(path)) {
    const GgufFile gguf(model);
    m.name = path.stem().string();
    config = config_from_gguf(gguf);
    m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_gguf(gguf));
  } else if (is_file_at(path)) {
    m.name = path.filename() == "config.json" ? directory_name(path.parent_path())
                                              : path.stem().string();
    config = config_from_hf_file(model);
  } else {
    model_not_found(model, true);
  }
  if (weights_on_host) {
    m.weights = make_dummy_weights(config, seed);
  } else {
    config.validate();
    m.weights.config = config;
  }
  return m;
}

LoadedModel load_as_stored(const LoadOptions& options) {
  const std::string& model = options.model;
  const std::string& format = options.load_format;
  SPIN_CHECK(!model.empty(), "no model given (--model)");
  if (format == "dummy") return load_dummy(model, options.seed, options.dummy_weights_on_host);
  SPIN_CHECK(format == "auto" || format == "gguf" || format == "safetensors",
             "unknown load format '{}' (expected auto, gguf, safetensors or dummy)", format);

  const fs::path path(model);
  if (!exists_at(path)) model_not_found(model, false);
  if (format == "gguf") return load_gguf(path);
  if (format == "safetensors") return load_hf_directory(path);

  if (is_file_at(path) && has_gguf_extension(path)) return load_gguf(path);
  if (is_dir_at(path)) {
    SPIN_CHECK(is_file_at(path / "config.json"),
               "'{}' is a directory without config.json, so not a HF model directory", model);
    return load_hf_directory(path);
  }
  fail("cannot tell the format of '{}': expected a .gguf file or a HF model directory with "
       "config.json (or pass --load-format)",
       model);
}

}  // namespace

LoadedModel load_model(const LoadOptions& options) {
  LoadedModel m = load_as_stored(options);
  if (!options.rope_scaling.empty()) {
    override_rope_scaling(m.weights.config, options.rope_scaling);
    spdlog::info("RoPE scaling from --rope-scaling {}: context {} tokens", options.rope_scaling,
                 m.weights.config.max_position);
  }
  return m;
}

}  // namespace spin
