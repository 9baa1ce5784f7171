// `spin inspect`: what a GGUF file holds (version, metadata, tensor table), tensors exported as
// float32 .npy files, and an optional check that the file loads as a model.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "base/error.h"
#include "cli/commands.h"
#include "model/gguf.h"
#include "model/loader.h"

namespace spin::cli {

namespace {

constexpr size_t kArrayPreview = 8;
constexpr size_t kStringPreview = 120;

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s.size() > kStringPreview ? s.substr(0, kStringPreview) : s) {
    switch (c) {
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        else
          out += c;
    }
  }
  out += "\"";
  if (s.size() > kStringPreview) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

const char* value_type_label(uint32_t gguf_type) {
  static const char* const names[] = {"u8",  "i8",  "u16",  "i16",    "u32", "i32", "f32",
                                      "bool", "str", "array", "u64", "i64", "f64"};
  return gguf_type < 13 ? names[gguf_type] : "?";
}

std::string format_value(const GgufValue& v) {
  switch (v.kind) {
    case GgufValue::Kind::UInt: return fmt::format("{}", std::get<uint64_t>(v.value));
    case GgufValue::Kind::Int: return fmt::format("{}", std::get<int64_t>(v.value));
    case GgufValue::Kind::Float:
      // float32 values print at their own precision (1e-05, not 9.999999747378752e-06).
      if (v.gguf_type == 6) return fmt::format("{}", static_cast<float>(std::get<double>(v.value)));
      return fmt::format("{}", std::get<double>(v.value));
    case GgufValue::Kind::Bool: return std::get<bool>(v.value) ? "true" : "false";
    case GgufValue::Kind::String: return quoted(std::get<std::string>(v.value));
    case GgufValue::Kind::Array: {
      const GgufArray& a = v.as_array();
      std::string out = "[";
      for (size_t i = 0; i < a.size() && i < kArrayPreview; ++i) {
        if (i) out += ", ";
        out += format_value(a[i]);
      }
      if (a.size() > kArrayPreview) out += fmt::format(", ... ({} elements)", a.size());
      return out + "]";
    }
  }
  return "?";
}

std::string type_label(const GgufValue& v) {
  if (v.kind != GgufValue::Kind::Array) return value_type_label(v.gguf_type);
  const GgufArray& a = v.as_array();
  return fmt::format("array[{}]", a.empty() ? "" : type_label(a.front()));
}

// numpy's .npy v1.0: magic, version, little-endian header length, a Python dict literal padded
// with spaces to a 64-byte boundary and ended by '\n', then the raw little-endian float32 data.
void write_npy(const std::string& path, const std::vector<uint64_t>& numpy_shape,
               const std::vector<float>& values) {
  std::string shape = "(";
  for (size_t i = 0; i < numpy_shape.size(); ++i) {
    shape += fmt::format("{}", numpy_shape[i]);
    if (numpy_shape.size() == 1 || i + 1 < numpy_shape.size()) shape += ",";
    if (i + 1 < numpy_shape.size()) shape += " ";
  }
  shape += ")";
  std::string header =
      fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}", shape);
  const size_t preamble = 10;  // magic (6) + version (2) + header length (2)
  const size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header += '\n';

  std::ofstream out(path, std::ios::binary);
  if (!out) fail("cannot create '{}'", path);
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(magic, 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!out.flush()) fail("cannot write '{}'", path);
}

void export_tensor(const GgufFile& gguf, const GgufTensorInfo& info, const std::string& path) {
  const std::vector<float> values = gguf.dequantize(info);
  // ggml lists dims fastest-first; numpy lists them slowest-first.
  write_npy(path, std::vector<uint64_t>(info.dims.rbegin(), info.dims.rend()), values);
}

void print_summary(const GgufFile& gguf) {
  std::printf("GGUF version %u: %zu metadata keys, %zu tensors\n", gguf.version(),
              gguf.metadata().size(), gguf.tensors().size());
  std::printf("\nmetadata:\n");
  for (const auto& [key, value] : gguf.metadata())
    std::printf("  %-48s %-12s %s\n", key.c_str(), type_label(value).c_str(),
                format_value(value).c_str());
  std::printf("\ntensors:\n  %-40s %-6s %-24s %14s %12s\n", "name", "type", "dims (ggml order)",
              "offset", "bytes");
  uint64_t total_bytes = 0;
  for (const GgufTensorInfo& t : gguf.tensors()) {
    std::string dims = "[";
    for (size_t i = 0; i < t.dims.size(); ++i) dims += fmt::format("{}{}", i ? ", " : "", t.dims[i]);
    dims += "]";
    std::printf("  %-40s %-6s %-24s %14llu %12llu\n", t.name.c_str(), ggml_type_name(t.type),
                dims.c_str(), static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.n_bytes));
    total_bytes += t.n_bytes;
  }
  std::printf("  total tensor data: %llu bytes\n", static_cast<unsigned long long>(total_bytes));
}

void check_model(const GgufFile& gguf) {
  const ModelWeights weights = load_gguf_weights(gguf);
  const ModelConfig& c = weights.config;
  std::printf(
      "\nmodel OK: arch %s, %lld layers, hidden %lld, heads %lld/%lld (head_dim %lld), ffn %lld, "
      "vocab %lld, %s embeddings, %lld parameters\n",
      c.arch.c_str(), static_cast<long long>(c.n_layers), static_cast<long long>(c.hidden_size),
      static_cast<long long>(c.n_heads), static_cast<long long>(c.n_kv_heads),
      static_cast<long long>(c.head_dim), static_cast<long long>(c.intermediate_size),
      static_cast<long long>(c.vocab_size), c.tie_embeddings ? "tied" : "untied",
      static_cast<long long>(c.parameter_count()));
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  struct Options {
    std::string model;
    std::string tensor;
    std::string out;
    std::string all_out;
    bool check = false;
  };
  auto opts = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show a GGUF file's metadata and tensors");
  cmd->add_option("--model", opts->model, "GGUF file")->required();
  cmd->add_option("--tensor", opts->tensor, "Tensor to export (with --out)");
  cmd->add_option("--out", opts->out, "Write --tensor dequantized as a float32 .npy file");
  cmd->add_option("--all-out", opts->all_out,
                  "Write every tensor dequantized as DIR/<name>.npy (float32, numpy dim order)");
  cmd->add_flag("--check", opts->check,
                "Also load the weights as a model and fail if the config or any shape is wrong");
  cmd->callback([opts] {
    if (opts->tensor.empty() != opts->out.empty()) fail("inspect: --tensor and --out go together");
    const GgufFile gguf(opts->model);
    if (!opts->tensor.empty()) {
      const GgufTensorInfo* info = gguf.find_tensor(opts->tensor);
      if (!info) fail("inspect: no tensor named '{}' in {}", opts->tensor, gguf.name());
      export_tensor(gguf, *info, opts->out);
    }
    if (!opts->all_out.empty()) {
      std::filesystem::create_directories(opts->all_out);
      for (const GgufTensorInfo& t : gguf.tensors()) {
        // Names come from the file: keep them from escaping the output directory.
        if (t.name.empty() || t.name.find('/') != std::string::npos ||
            t.name.find('\0') != std::string::npos)
          fail("inspect: tensor name '{}' cannot be used as a file name", t.name);
        export_tensor(gguf, t, (std::filesystem::path(opts->all_out) / (t.name + ".npy")).string());
      }
    }
    if (opts->tensor.empty() && opts->all_out.empty()) print_summary(gguf);
    if (opts->check) check_model(gguf);
  });
}

}  // namespace spin::cli
