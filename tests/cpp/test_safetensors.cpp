// safetensors reader, HF config.json parsing, HF weight loading, presets and dummy weights.
// Files are written here byte by byte (header JSON + little-endian data), so the expected values
// come from the test's own encoding, never from spin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/loader.h"
#include "model/safetensors.h"
#include "test_files.h"

namespace spin {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// ---------------------------------------------------------------- helpers

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

std::string raw_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

std::string f32_bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

std::string u16_bytes(const std::vector<uint16_t>& v) {
  std::string s;
  for (uint16_t x : v) {
    s += static_cast<char>(x & 0xff);
    s += static_cast<char>(x >> 8);
  }
  return s;
}

// A valid file: tensors laid out back to back in the given order.
std::string make_safetensors(const std::vector<TensorSpec>& tensors, const Json& metadata = {}) {
  Json header = Json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string data;
  for (const TensorSpec& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  return raw_file(header.dump(), data);
}

SafetensorsFile parse(const std::string& bytes) {
  return SafetensorsFile::from_memory(reinterpret_cast<const uint8_t*>(bytes.data()),
                                      bytes.size());
}

// parse(bytes) must throw spin::Error whose message contains every fragment.
void expect_parse_error(const std::string& bytes, const std::vector<std::string>& fragments) {
  expect_error([&] { parse(bytes); }, fragments);
}

// ---------------------------------------------------------------- reader: valid files

TEST(Safetensors, ReadsF32F16Bf16AndMetadata) {
  // fp16 / bf16 bit patterns written out by hand from the IEEE layouts.
  const std::vector<uint16_t> f16 = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x8000};
  const std::vector<float> f16_expected = {1.0f, -2.0f, 0.5f, 65504.0f, std::ldexp(1.0f, -24),
                                           -0.0f};
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC040, 0x3E20, 0x4780};
  const std::vector<float> bf16_expected = {1.0f, -3.0f, 0.15625f, 65536.0f};
  const std::vector<float> f32 = {0.25f, -1.5f, 3.0e-8f, 1.0e20f, 7.0f, -0.0f};
  const std::string bytes = make_safetensors(
      {{"a.f32", "F32", {2, 3}, f32_bytes(f32)},
       {"b.f16", "F16", {6}, u16_bytes(f16)},
       {"c.bf16", "BF16", {2, 1, 2}, u16_bytes(bf16)}},
      Json{{"format", "pt"}, {"note", "test"}});
  const SafetensorsFile file = parse(bytes);

  ASSERT_EQ(file.tensors().size(), 3u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "test");

  const Fp32Tensor a = file.read_f32("a.f32");
  EXPECT_EQ(a.shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(a.data, f32);

  const Fp32Tensor b = file.read_f32("b.f16");
  EXPECT_EQ(b.shape, (std::vector<uint64_t>{6}));
  ASSERT_EQ(b.data.size(), f16_expected.size());
  for (size_t i = 0; i < b.data.size(); ++i) {
    EXPECT_EQ(b.data[i], f16_expected[i]) << i;
    EXPECT_EQ(std::signbit(b.data[i]), std::signbit(f16_expected[i])) << i;
  }

  const Fp32Tensor c = file.read_f32("c.bf16");
  EXPECT_EQ(c.shape, (std::vector<uint64_t>{2, 1, 2}));
  EXPECT_EQ(c.data, bf16_expected);

  const SafetensorsTensorInfo* info = file.find("c.bf16");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->dtype, SafetensorsDtype::BF16);
  EXPECT_EQ(info->n_elements, 4u);
  EXPECT_EQ(info->end - info->begin, 8u);
  EXPECT_EQ(file.find("missing"), nullptr);
}

TEST(Safetensors, ReadsFromDiskWithUnalignedDataAndPaddedHeader) {
  TempDir dir;
  const std::vector<float> values = {1.0f, 2.0f, -4.5f};
  // Header padded with trailing spaces to an odd length, so the data starts unaligned.
  std::string header =
      R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  header += "  ";
  if ((8 + header.size()) % 4 == 0) header += " ";
  const fs::path path = dir.write("x.safetensors", raw_file(header, f32_bytes(values)));
  const SafetensorsFile file(path.string());
  EXPECT_EQ(file.read_f32("w").data, values);
}

TEST(Safetensors, EmptyTensorsAndEmptyHeader) {
  // from_memory keeps pointing into its buffer, so the bytes must outlive the file object.
  const std::string bytes =
      make_safetensors({{"empty", "F32", {0, 4}, ""}, {"scalar", "F32", {}, f32_bytes({3.5f})}});
  const SafetensorsFile file = parse(bytes);
  EXPECT_TRUE(file.read_f32("empty").data.empty());
  EXPECT_EQ(file.read_f32("scalar").data, std::vector<float>{3.5f});
  EXPECT_TRUE(parse(raw_file("{}", "")).tensors().empty());
}

TEST(Safetensors, OtherDtypesParseButDoNotConvert) {
  const std::string bytes = make_safetensors({{"ids", "I64", {2}, std::string(16, '\1')},
                                              {"mask", "BOOL", {3}, std::string("\1\0\1", 3)}});
  const SafetensorsFile file = parse(bytes);
  ASSERT_NE(file.find("ids"), nullptr);
  expect_error([&] { file.read_f32("ids"); }, {"I64", "ids"});
  expect_error([&] { file.read_f32("mask"); }, {"BOOL"});
  expect_error([&] { file.read_f32("nope"); }, {"no tensor named 'nope'"});
}

// ---------------------------------------------------------------- reader: bad files

TEST(SafetensorsBad, TruncatedAndAbsurdHeaderLengths) {
  expect_parse_error("", {"too short"});
  expect_parse_error(std::string("\x10\0\0", 3), {"too short"});
  expect_parse_error(le64(100) + "{}", {"runs past the end"});
  expect_parse_error(le64(1ull << 63) + "{}", {"exceeds the limit"});
  expect_parse_error(le64((100ull << 20) + 1) + "{}", {"exceeds the limit"});
  expect_parse_error(le64(0), {"does not start with"});
  // A valid file cut anywhere is rejected.
  const std::string good = make_safetensors({{"w", "F32", {4}, f32_bytes({1, 2, 3, 4})}});
  for (size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_THROW(parse(good.substr(0, cut)), Error) << "cut at " << cut;
  }
}

TEST(SafetensorsBad, InvalidJson) {
  expect_parse_error(raw_file("[1, 2]", ""), {"does not start with"});
  expect_parse_error(raw_file("{\"w\": ", ""), {"invalid JSON"});
  expect_parse_error(raw_file("{\"w\": {}} trailing", ""), {"invalid JSON"});
  expect_parse_error(raw_file("{\"\xff\xfe\": 1}", ""), {"invalid JSON"});
  expect_parse_error(raw_file(R"({"w": 5})", ""), {"'w'", "not an object"});
}

TEST(SafetensorsBad, DuplicateKeys) {
  const std::string entry = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  expect_parse_error(raw_file("{\"w\":" + entry + ",\"w\":" + entry + "}", f32_bytes({1.0f})),
                     {"duplicate", "'w'"});
  expect_parse_error(
      raw_file(R"({"w":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})",
               f32_bytes({1.0f})),
      {"duplicate", "dtype"});
}

TEST(SafetensorsBad, FieldsOfATensor) {
  const std::string four = f32_bytes({1.0f});
  auto one = [&](const std::string& fields, const std::string& data) {
    return raw_file("{\"w\":{" + fields + "}}", data);
  };
  expect_parse_error(one(R"("shape":[1],"data_offsets":[0,4])", four), {"no 'dtype'"});
  expect_parse_error(one(R"("dtype":"F32","data_offsets":[0,4])", four), {"no 'shape'"});
  expect_parse_error(one(R"("dtype":"F32","shape":[1])", four), {"no 'data_offsets'"});
  expect_parse_error(one(R"("dtype":"Q4","shape":[1],"data_offsets":[0,4])", four),
                     {"unknown dtype 'Q4'"});
  expect_parse_error(one(R"("dtype":7,"shape":[1],"data_offsets":[0,4])", four),
                     {"dtype is not a string"});
  expect_parse_error(one(R"("dtype":"F32","shape":[-1],"data_offsets":[0,4])", four),
                     {"negative"});
  expect_parse_error(one(R"("dtype":"F32","shape":[1.5],"data_offsets":[0,4])", four),
                     {"non-negative integers"});
  expect_parse_error(one(R"("dtype":"F32","shape":5,"data_offsets":[0,4])", four),
                     {"shape is not an array"});
  expect_parse_error(
      one(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4])", four),
      {"overflows"});
  expect_parse_error(
      one(R"("dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4])", four),
      {"overflows"});
  expect_parse_error(one(R"("dtype":"F32","shape":[1],"data_offsets":[0])", four),
                     {"[begin, end]"});
  expect_parse_error(one(R"("dtype":"F32","shape":[1],"data_offsets":[4,0])", four),
                     {"end before"});
  expect_parse_error(one(R"("dtype":"F32","shape":[1],"data_offsets":[0,8])", four),
                     {"past the end"});
  expect_parse_error(one(R"("dtype":"F32","shape":[2],"data_offsets":[0,4])", four),
                     {"span 4 bytes", "need 8"});
  expect_parse_error(
      one(R"("dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616])", four),
      {"non-negative integers"});
  expect_parse_error(raw_file(R"({"__metadata__":{"k":1}})", ""), {"__metadata__"});
  expect_parse_error(raw_file(R"({"__metadata__":[]})", ""), {"__metadata__"});
}

TEST(SafetensorsBad, DataSectionMustBeTiledExactly) {
  const std::string data = f32_bytes({1, 2, 3, 4});
  auto two = [&](const char* a, const char* b, const std::string& bytes) {
    return raw_file(std::string(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":)") + a +
                        R"(},"b":{"dtype":"F32","shape":[2],"data_offsets":)" + b + "}}",
                    bytes);
  };
  EXPECT_NO_THROW(parse(two("[8,16]", "[0,8]", data)));  // order in the header is free
  expect_parse_error(two("[0,8]", "[4,12]", data), {"overlap"});
  expect_parse_error(two("[0,8]", "[0,8]", data), {"overlap"});
  expect_parse_error(two("[0,8]", "[12,20]", data + data), {"belong to no tensor"});
  expect_parse_error(two("[0,8]", "[8,16]", data + "x"), {"trailing"});
}

// ---------------------------------------------------------------- config.json

Json llama_config() {
  return Json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"vocab_size", 1000},
              {"hidden_size", 256},
              {"intermediate_size", 512},
              {"num_hidden_layers", 3},
              {"num_attention_heads", 8},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 500000.0},
              {"max_position_embeddings", 4096},
              {"tie_word_embeddings", true},
              {"bos_token_id", 7},
              {"eos_token_id", 9}};
}

ModelConfig config_of(const Json& json) {
  TempDir dir;
  const fs::path p = dir.write("config.json", json.dump());
  return config_from_hf_file(p.string());
}

void expect_config_error(const Json& json, const std::vector<std::string>& fragments) {
  TempDir dir;
  const fs::path p = dir.write("config.json", json.dump());
  expect_error([&] { config_from_hf_file(p.string()); }, fragments);
}

TEST(HfConfig, ReadsAllFields) {
  const ModelConfig c = config_of(llama_config());
  EXPECT_EQ(c.arch, "llama");
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.max_position, 4096);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope.theta, 500000.0f);
  EXPECT_TRUE(c.rope.neox);
  EXPECT_EQ(c.rope.scaling, RopeScaling::None);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.bos_token_id, 7);
  EXPECT_EQ(c.eos_token_id, 9);
}

TEST(HfConfig, DefaultsOfTheTransformersConfigClasses) {
  Json j = llama_config();
  for (const char* k : {"num_key_value_heads", "rms_norm_eps", "rope_theta",
                        "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                        "eos_token_id"}) {
    j.erase(k);
  }
  j["head_dim"] = nullptr;
  const ModelConfig c = config_of(j);
  EXPECT_EQ(c.n_kv_heads, 8);     // = num_attention_heads
  EXPECT_EQ(c.head_dim, 256 / 8);  // hidden / heads
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
  EXPECT_FLOAT_EQ(c.rope.theta, 10000.0f);
  EXPECT_EQ(c.max_position, 2048);  // LlamaConfig default
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, -1);
}

TEST(HfConfig, Architectures) {
  Json q3 = llama_config();
  q3["architectures"] = {"Qwen3ForCausalLM"};
  q3["head_dim"] = 64;  // independent of hidden / heads in Qwen3
  ModelConfig c = config_of(q3);
  EXPECT_EQ(c.arch, "qwen3");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 64);

  Json by_type = llama_config();
  by_type.erase("architectures");
  by_type["model_type"] = "qwen3";
  EXPECT_EQ(config_of(by_type).arch, "qwen3");

  for (const char* cls : {"MistralForCausalLM", "Qwen2ForCausalLM"}) {
    Json j = llama_config();
    j["architectures"] = {cls};
    c = config_of(j);
    EXPECT_EQ(c.arch, "llama") << cls;
    EXPECT_FALSE(c.qk_norm) << cls;
  }

  Json unknown = llama_config();
  unknown["architectures"] = {"GPTNeoXForCausalLM"};
  expect_config_error(unknown, {"unsupported architecture", "GPTNeoXForCausalLM"});
  Json none = llama_config();
  none.erase("architectures");
  none.erase("model_type");
  expect_config_error(none, {"architecture"});
}

TEST(HfConfig, EosListTakesTheFirst) {
  Json j = llama_config();
  j["eos_token_id"] = {128001, 128008, 128009};
  EXPECT_EQ(config_of(j).eos_token_id, 128001);
}

TEST(HfConfig, RopeScalingTypes) {
  Json j = llama_config();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  ModelConfig c = config_of(j);
  EXPECT_EQ(c.rope.scaling, RopeScaling::Linear);
  EXPECT_FLOAT_EQ(c.rope.factor, 4.0f);

  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};  // the older key name
  c = config_of(j);
  EXPECT_EQ(c.rope.scaling, RopeScaling::Linear);
  EXPECT_FLOAT_EQ(c.rope.factor, 2.0f);

  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  c = config_of(j);
  EXPECT_EQ(c.rope.scaling, RopeScaling::Llama3);
  EXPECT_FLOAT_EQ(c.rope.factor, 8.0f);
  EXPECT_FLOAT_EQ(c.rope.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.rope.high_freq_factor, 4.0f);
  EXPECT_EQ(c.rope.original_max_position, 8192);

  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  c = config_of(j);
  EXPECT_EQ(c.rope.scaling, RopeScaling::Yarn);
  EXPECT_FLOAT_EQ(c.rope.factor, 4.0f);
  EXPECT_EQ(c.rope.original_max_position, 4096);  // defaults to max_position_embeddings
  EXPECT_FLOAT_EQ(c.rope.yarn_beta_fast, 32.0f);
  EXPECT_FLOAT_EQ(c.rope.yarn_beta_slow, 1.0f);
  EXPECT_FLOAT_EQ(c.rope.yarn_attn_factor, 1.0f);

  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"original_max_position_embeddings", 32768},
                       {"beta_fast", 16.0},
                       {"beta_slow", 2.0},
                       {"attention_factor", 1.5}};
  c = config_of(j);
  EXPECT_EQ(c.rope.original_max_position, 32768);
  EXPECT_FLOAT_EQ(c.rope.yarn_beta_fast, 16.0f);
  EXPECT_FLOAT_EQ(c.rope.yarn_beta_slow, 2.0f);
  // HF's attention_factor is the whole scale; RopeConfig holds it relative to 0.1 ln(s) + 1.
  EXPECT_NEAR(c.rope.yarn_attn_factor * (0.1 * std::log(4.0) + 1.0), 1.5, 1e-6);

  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(config_of(j).rope.scaling, RopeScaling::None);
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(config_of(j).rope.scaling, RopeScaling::None);

  // transformers >= 5 layout
  Json v5 = llama_config();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 3.0}, {"rope_theta", 123456.0}};
  c = config_of(v5);
  EXPECT_EQ(c.rope.scaling, RopeScaling::Linear);
  EXPECT_FLOAT_EQ(c.rope.factor, 3.0f);
  EXPECT_FLOAT_EQ(c.rope.theta, 123456.0f);
}

TEST(HfConfig, BadRopeScaling) {
  Json j = llama_config();
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  expect_config_error(j, {"unsupported rope_scaling type 'dynamic'"});
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  expect_config_error(j, {"longrope"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_config_error(j, {"low_freq_factor"});
  j["rope_scaling"] = {{"rope_type", "linear"}};
  expect_config_error(j, {"factor"});
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", "big"}};
  expect_config_error(j, {"factor", "number"});
  j["rope_scaling"] = {{"factor", 2.0}};
  expect_config_error(j, {"no rope_type"});
  j["rope_scaling"] = "linear";
  expect_config_error(j, {"rope_scaling"});
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 1e300}};
  expect_config_error(j, {"factor", "out of range"});
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 1e30}};
  expect_config_error(j, {"original_max_position_embeddings"});
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0},
                       {"original_max_position_embeddings", -5}};
  expect_config_error(j, {"original_max_position_embeddings", "positive integer"});
}

TEST(HfConfig, YarnExtendsTheContextToOriginalTimesFactor) {
  Json j = llama_config();
  j["max_position_embeddings"] = 40960;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  EXPECT_EQ(config_of(j).max_position, 131072);  // Qwen3's documented 128K setting
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  EXPECT_EQ(config_of(j).max_position, 81920);  // original defaults to max_position_embeddings
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 1.0}, {"original_max_position_embeddings", 1024}};
  EXPECT_EQ(config_of(j).max_position, 40960);  // never shortened
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  EXPECT_EQ(config_of(j).max_position, 40960);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 0.5}};
  expect_config_error(j, {"yarn", "factor >= 1"});
}

void expect_override_error(const std::string& value, const std::vector<std::string>& fragments) {
  ModelConfig c = preset_config("qwen3-14b");
  const ModelConfig before = c;
  expect_error([&] { override_rope_scaling(c, value); }, fragments);
  EXPECT_EQ(c.rope.scaling, before.rope.scaling) << value;  // untouched by a bad value
  EXPECT_EQ(c.max_position, before.max_position) << value;
}

TEST(RopeScalingOverride, MatchesTheSameScalingInConfigJson) {
  const Json scaling = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 2048},
                        {"beta_fast", 16.0}, {"attention_factor", 1.2}};
  ModelConfig overridden = config_of(llama_config());
  override_rope_scaling(overridden, scaling.dump());
  Json j = llama_config();
  j["rope_scaling"] = scaling;
  const ModelConfig in_file = config_of(j);
  EXPECT_EQ(overridden.rope.scaling, RopeScaling::Yarn);
  EXPECT_EQ(overridden.rope.scaling, in_file.rope.scaling);
  EXPECT_FLOAT_EQ(overridden.rope.theta, in_file.rope.theta);
  EXPECT_FLOAT_EQ(overridden.rope.factor, in_file.rope.factor);
  EXPECT_EQ(overridden.rope.original_max_position, in_file.rope.original_max_position);
  EXPECT_FLOAT_EQ(overridden.rope.yarn_beta_fast, in_file.rope.yarn_beta_fast);
  EXPECT_FLOAT_EQ(overridden.rope.yarn_beta_slow, in_file.rope.yarn_beta_slow);
  EXPECT_FLOAT_EQ(overridden.rope.yarn_attn_factor, in_file.rope.yarn_attn_factor);
  EXPECT_EQ(overridden.max_position, 8192);
  EXPECT_EQ(overridden.max_position, in_file.max_position);
}

TEST(RopeScalingOverride, ReplacesThePresetsScaling) {
  ModelConfig qwen = preset_config("qwen3-14b");
  const float theta = qwen.rope.theta;
  override_rope_scaling(qwen, R"({"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768})");
  EXPECT_EQ(qwen.rope.scaling, RopeScaling::Yarn);
  EXPECT_EQ(qwen.max_position, 131072);
  EXPECT_FLOAT_EQ(qwen.rope.theta, theta);
  EXPECT_TRUE(qwen.rope.neox);

  ModelConfig llama = preset_config("llama-3.1-8b");  // Llama 3 scaling of its own
  ASSERT_EQ(llama.rope.scaling, RopeScaling::Llama3);
  override_rope_scaling(llama, R"({"rope_type":"default"})");
  EXPECT_EQ(llama.rope.scaling, RopeScaling::None);
  EXPECT_FLOAT_EQ(llama.rope.factor, 1.0f);
  EXPECT_EQ(llama.max_position, 131072);
}

TEST(RopeScalingOverride, BadValues) {
  expect_override_error("yarn", {"--rope-scaling", "not valid JSON"});
  expect_override_error("[4]", {"--rope-scaling", "JSON object"});
  expect_override_error(R"({"rope_type":"dynamic","factor":2})", {"--rope-scaling", "unsupported rope_scaling type"});
  expect_override_error(R"({"rope_type":"yarn"})", {"--rope-scaling", "needs 'factor'"});
  expect_override_error(R"({"rope_type":"yarn","factor":"4"})", {"--rope-scaling", "factor", "number"});
  expect_override_error(R"({"rope_type":"yarn","factor":0.25})", {"--rope-scaling", "factor >= 1"});
  expect_override_error(R"({"rope_type":"yarn","factor":1e9,"original_max_position_embeddings":32768})",
                        {"--rope-scaling", "2^31"});
}

TEST(HfConfig, BadFields) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads"}) {
    Json j = llama_config();
    j.erase(key);
    expect_config_error(j, {"missing required field", key});
  }
  Json j = llama_config();
  j["num_key_value_heads"] = 3;
  expect_config_error(j, {"num_attention_heads (8)", "num_key_value_heads (3)"});
  j = llama_config();
  j["num_attention_heads"] = 7;
  j["num_key_value_heads"] = 7;
  expect_config_error(j, {"not divisible"});
  j = llama_config();
  j["hidden_size"] = "256";
  expect_config_error(j, {"hidden_size", "integer"});
  j = llama_config();
  j["num_hidden_layers"] = 0;
  expect_config_error(j, {"num_hidden_layers"});
  j = llama_config();
  j["vocab_size"] = 18446744073709551615ull;
  expect_config_error(j, {"vocab_size"});
  j = llama_config();
  j["max_position_embeddings"] = -1;
  expect_config_error(j, {"max_position_embeddings"});
  j = llama_config();
  j["rms_norm_eps"] = -1e-6;
  expect_config_error(j, {"rms_norm_eps"});
  j = llama_config();
  j["tie_word_embeddings"] = 1;
  expect_config_error(j, {"tie_word_embeddings"});

  TempDir dir;
  const fs::path bad = dir.write("config.json", "{\"vocab_size\": ");
  expect_error([&] { config_from_hf_file(bad.string()); }, {"not valid JSON"});
  expect_error([&] { config_from_hf_file((dir.path() / "nope.json").string()); }, {"nope.json"});
}

// ---------------------------------------------------------------- HF weights

// A tiny HF checkpoint with values from a fixed-seed generator; the test keeps every array.
struct TinyCheckpoint {
  Json config;
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<uint64_t>> shapes;

  explicit TinyCheckpoint(bool qwen3, bool tied) {
    config = llama_config();
    config["vocab_size"] = 40;
    config["hidden_size"] = 16;
    config["intermediate_size"] = 24;
    config["num_hidden_layers"] = 2;
    config["num_attention_heads"] = 4;
    config["num_key_value_heads"] = 2;
    config["tie_word_embeddings"] = tied;
    const int64_t head_dim = qwen3 ? 8 : 4;
    if (qwen3) {
      config["architectures"] = {"Qwen3ForCausalLM"};
      config["head_dim"] = head_dim;
    }
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto add = [&](const std::string& name, std::vector<uint64_t> shape) {
      uint64_t n = 1;
      for (uint64_t d : shape) n *= d;
      std::vector<float> v(n);
      for (float& x : v) x = dist(rng);
      values[name] = v;
      shapes[name] = shape;
    };
    add("model.embed_tokens.weight", {40, 16});
    add("model.norm.weight", {16});
    if (!tied) add("lm_head.weight", {40, 16});
    for (int i = 0; i < 2; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      add(p + "input_layernorm.weight", {16});
      add(p + "self_attn.q_proj.weight", {uint64_t(4 * head_dim), 16});
      add(p + "self_attn.k_proj.weight", {uint64_t(2 * head_dim), 16});
      add(p + "self_attn.v_proj.weight", {uint64_t(2 * head_dim), 16});
      add(p + "self_attn.o_proj.weight", {16, uint64_t(4 * head_dim)});
      if (qwen3) {
        add(p + "self_attn.q_norm.weight", {uint64_t(head_dim)});
        add(p + "self_attn.k_norm.weight", {uint64_t(head_dim)});
      }
      add(p + "post_attention_layernorm.weight", {16});
      add(p + "mlp.gate_proj.weight", {24, 16});
      add(p + "mlp.up_proj.weight", {24, 16});
      add(p + "mlp.down_proj.weight", {16, 24});
    }
  }

  std::vector<TensorSpec> specs(const std::function<bool(const std::string&)>& keep) const {
    std::vector<TensorSpec> out;
    for (const auto& [name, v] : values) {
      if (keep(name)) out.push_back({name, "F32", shapes.at(name), f32_bytes(v)});
    }
    return out;
  }

  void write_single(const TempDir& dir) const {
    dir.write("config.json", config.dump());
    dir.write("model.safetensors", make_safetensors(specs([](const std::string&) { return true; })));
  }

  // Layer 1 in the second shard, everything else in the first.
  void write_sharded(const TempDir& dir) const {
    dir.write("config.json", config.dump());
    auto in_second = [](const std::string& n) { return n.rfind("model.layers.1.", 0) == 0; };
    dir.write("model-00001-of-00002.safetensors",
              make_safetensors(specs([&](const std::string& n) { return !in_second(n); })));
    dir.write("model-00002-of-00002.safetensors", make_safetensors(specs(in_second)));
    Json map = Json::object();
    for (const auto& [name, v] : values) {
      map[name] = in_second(name) ? "model-00002-of-00002.safetensors"
                                  : "model-00001-of-00002.safetensors";
    }
    dir.write("model.safetensors.index.json",
              Json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump());
  }

  void expect_loaded(const ModelWeights& w) const {
    EXPECT_EQ(w.tok_embd.data, values.at("model.embed_tokens.weight"));
    EXPECT_EQ(w.tok_embd.rows, 40);
    EXPECT_EQ(w.tok_embd.cols, 16);
    EXPECT_EQ(w.out_norm, values.at("model.norm.weight"));
    if (values.count("lm_head.weight")) {
      EXPECT_EQ(w.lm_head.data, values.at("lm_head.weight"));
    } else {
      EXPECT_TRUE(w.lm_head.empty());
    }
    ASSERT_EQ(w.layers.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      const LayerWeights& l = w.layers[i];
      EXPECT_EQ(l.attn_norm, values.at(p + "input_layernorm.weight"));
      EXPECT_EQ(l.wq.data, values.at(p + "self_attn.q_proj.weight"));
      EXPECT_EQ(l.wk.data, values.at(p + "self_attn.k_proj.weight"));
      EXPECT_EQ(l.wv.data, values.at(p + "self_attn.v_proj.weight"));
      EXPECT_EQ(l.wo.data, values.at(p + "self_attn.o_proj.weight"));
      EXPECT_EQ(l.wo.rows, 16);
      if (values.count(p + "self_attn.q_norm.weight")) {
        EXPECT_EQ(l.q_norm, values.at(p + "self_attn.q_norm.weight"));
        EXPECT_EQ(l.k_norm, values.at(p + "self_attn.k_norm.weight"));
      }
      EXPECT_EQ(l.ffn_norm, values.at(p + "post_attention_layernorm.weight"));
      EXPECT_EQ(l.w_gate.data, values.at(p + "mlp.gate_proj.weight"));
      EXPECT_EQ(l.w_up.data, values.at(p + "mlp.up_proj.weight"));
      EXPECT_EQ(l.w_down.data, values.at(p + "mlp.down_proj.weight"));
      EXPECT_EQ(l.w_down.cols, 24);
    }
  }
};

TEST(HfWeights, SingleFileLlamaUntied) {
  TempDir dir;
  const TinyCheckpoint ckpt(false, false);
  ckpt.write_single(dir);
  const ModelWeights w = load_hf_weights(dir.path().string());
  EXPECT_EQ(w.config.arch, "llama");
  ckpt.expect_loaded(w);
}

TEST(HfWeights, ShardedQwen3Tied) {
  TempDir dir;
  const TinyCheckpoint ckpt(true, true);
  ckpt.write_sharded(dir);
  const ModelWeights w = load_hf_weights(dir.path().string());
  EXPECT_TRUE(w.config.qk_norm);
  ckpt.expect_loaded(w);
}

TEST(HfWeights, TiedModelIgnoresASavedLmHead) {
  TempDir dir;
  TinyCheckpoint ckpt(false, true);
  ckpt.write_single(dir);
  std::vector<TensorSpec> specs = ckpt.specs([](const std::string&) { return true; });
  specs.push_back({"lm_head.weight", "F32", {40, 16}, f32_bytes(std::vector<float>(640, 9.0f))});
  dir.write("model.safetensors", make_safetensors(specs));
  const ModelWeights w = load_hf_weights(dir.path().string());
  EXPECT_TRUE(w.lm_head.empty());
  EXPECT_EQ(&w.output_matrix(), &w.tok_embd);
}

TEST(HfWeights, Bf16CheckpointConverts) {
  TempDir dir;
  TinyCheckpoint ckpt(false, true);
  dir.write("config.json", ckpt.config.dump());
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<float>> expected;
  for (const auto& [name, v] : ckpt.values) {
    // Truncating fp32 to its top 16 bits is a valid bf16 value that converts back exactly.
    std::vector<uint16_t> bits(v.size());
    std::vector<float> back(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &v[i], 4);
      bits[i] = static_cast<uint16_t>(u >> 16);
      u &= 0xffff0000u;
      std::memcpy(&back[i], &u, 4);
    }
    specs.push_back({name, "BF16", ckpt.shapes.at(name), u16_bytes(bits)});
    expected[name] = back;
  }
  dir.write("model.safetensors", make_safetensors(specs));
  const ModelWeights w = load_hf_weights(dir.path().string());
  EXPECT_EQ(w.tok_embd.data, expected.at("model.embed_tokens.weight"));
  EXPECT_EQ(w.layers[1].w_down.data, expected.at("model.layers.1.mlp.down_proj.weight"));
}

TEST(HfWeights, BadCheckpoints) {
  const TinyCheckpoint ckpt(false, false);
  auto without = [&](const std::string& dropped) {
    return ckpt.specs([&](const std::string& n) { return n != dropped; });
  };
  {
    TempDir dir;
    dir.write("config.json", ckpt.config.dump());
    dir.write("model.safetensors", make_safetensors(without("lm_head.weight")));
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"lm_head.weight", "tie_word_embeddings"});
  }
  {
    TempDir dir;
    dir.write("config.json", ckpt.config.dump());
    dir.write("model.safetensors",
              make_safetensors(without("model.layers.1.self_attn.k_proj.weight")));
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"missing tensor", "model.layers.1.self_attn.k_proj.weight"});
  }
  {
    TempDir dir;
    dir.write("config.json", ckpt.config.dump());
    std::vector<TensorSpec> specs = without("model.layers.0.mlp.up_proj.weight");
    specs.push_back({"model.layers.0.mlp.up_proj.weight", "F32", {16, 24},
                     f32_bytes(std::vector<float>(384, 0.0f))});
    dir.write("model.safetensors", make_safetensors(specs));
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"up_proj", "[16, 24]", "expected [24, 16]"});
  }
  {
    TempDir dir;
    dir.write("config.json", ckpt.config.dump());
    std::vector<TensorSpec> specs = without("");
    specs.push_back({"model.layers.0.self_attn.q_proj.bias", "F32", {16},
                     f32_bytes(std::vector<float>(16, 0.0f))});
    dir.write("model.safetensors", make_safetensors(specs));
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"q_proj.bias", "not supported"});
  }
  {
    TempDir dir;
    dir.write("config.json", ckpt.config.dump());
    expect_error([&] { load_hf_weights(dir.path().string()); }, {"model.safetensors"});
  }
  {
    TempDir dir;
    ckpt.write_sharded(dir);
    fs::remove(dir.path() / "model-00002-of-00002.safetensors");
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"model-00002-of-00002.safetensors", "missing"});
  }
  {
    TempDir dir;
    ckpt.write_sharded(dir);
    Json index = Json::parse(std::ifstream(dir.path() / "model.safetensors.index.json"));
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors";
    dir.write("model.safetensors.index.json", index.dump());
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"model.layers.0.extra.weight", "does not contain"});
  }
  {
    TempDir dir;
    ckpt.write_sharded(dir);
    Json index = Json::parse(std::ifstream(dir.path() / "model.safetensors.index.json"));
    index["weight_map"].erase("model.norm.weight");
    dir.write("model.safetensors.index.json", index.dump());
    expect_error([&] { load_hf_weights(dir.path().string()); },
                 {"model.norm.weight", "weight_map"});
  }
  {
    TempDir dir;
    ckpt.write_sharded(dir);
    Json index = Json::parse(std::ifstream(dir.path() / "model.safetensors.index.json"));
    index["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors";
    dir.write("model.safetensors.index.json", index.dump());
    expect_error([&] { load_hf_weights(dir.path().string()); }, {"not a file name"});
  }
}

// ---------------------------------------------------------------- presets

struct PublishedModel {
  const char* preset;
  // From the model's config.json on the Hugging Face hub.
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  // From the model card.
  double published_parameters;
};

TEST(Presets, ShapesAndParameterCountsMatchThePublishedModels) {
  const PublishedModel models[] = {
      {"llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, 8.03e9},
      {"llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 128, 70.6e9},
      {"qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, 8.2e9},
      {"qwen3-14b", 151936, 5120, 17408, 40, 40, 8, 128, 14.8e9},
      {"qwen3-32b", 151936, 5120, 25600, 64, 64, 8, 128, 32.8e9},
  };
  for (const PublishedModel& m : models) {
    SCOPED_TRACE(m.preset);
    ASSERT_TRUE(is_preset_name(m.preset));
    const ModelConfig c = preset_config(m.preset);
    EXPECT_NO_THROW(c.validate());
    EXPECT_EQ(c.vocab_size, m.vocab);
    EXPECT_EQ(c.hidden_size, m.hidden);
    EXPECT_EQ(c.intermediate_size, m.intermediate);
    EXPECT_EQ(c.n_layers, m.layers);
    EXPECT_EQ(c.n_heads, m.heads);
    EXPECT_EQ(c.n_kv_heads, m.kv_heads);
    EXPECT_EQ(c.head_dim, m.head_dim);
    EXPECT_FALSE(c.tie_embeddings);
    // Embeddings + untied head + final norm; per layer two norms, q/k/v/o and three MLP matrices,
    // plus the q/k norms in Qwen3.
    const bool qwen3 = std::string(m.preset).rfind("qwen3", 0) == 0;
    const double per_layer = 2.0 * m.hidden + m.hidden * double(m.heads * m.head_dim) * 2 +
                             m.hidden * double(m.kv_heads * m.head_dim) * 2 +
                             3.0 * m.hidden * m.intermediate + (qwen3 ? 2.0 * m.head_dim : 0.0);
    const double expected = m.layers * per_layer + 2.0 * m.vocab * m.hidden + m.hidden;
    EXPECT_NEAR(static_cast<double>(c.parameter_count()), expected, 0.01 * expected);
    EXPECT_NEAR(static_cast<double>(c.parameter_count()), m.published_parameters,
                0.01 * m.published_parameters);
  }
  for (const char* llama : {"llama-3.1-8b", "llama-3.1-70b"}) {
    const ModelConfig c = preset_config(llama);
    EXPECT_EQ(c.rope.scaling, RopeScaling::Llama3);
    EXPECT_FLOAT_EQ(c.rope.factor, 8.0f);
    EXPECT_FLOAT_EQ(c.rope.low_freq_factor, 1.0f);
    EXPECT_FLOAT_EQ(c.rope.high_freq_factor, 4.0f);
    EXPECT_EQ(c.rope.original_max_position, 8192);
    EXPECT_FLOAT_EQ(c.rope.theta, 500000.0f);
    EXPECT_FALSE(c.qk_norm);
  }
  for (const char* qwen : {"qwen3-8b", "qwen3-14b", "qwen3-32b"}) {
    const ModelConfig c = preset_config(qwen);
    EXPECT_TRUE(c.qk_norm);
    EXPECT_EQ(c.arch, "qwen3");
    EXPECT_FLOAT_EQ(c.rope.theta, 1e6f);
    EXPECT_EQ(c.rope.scaling, RopeScaling::None);
  }
  EXPECT_FALSE(is_preset_name("llama-3.1-9b"));
  expect_error([] { preset_config("gpt-5"); }, {"unknown model preset 'gpt-5'", "tiny-llama"});
}

size_t count_values(const ModelWeights& w) {
  size_t n = w.tok_embd.data.size() + w.out_norm.size() + w.lm_head.data.size();
  for (const LayerWeights& l : w.layers) {
    n += l.attn_norm.size() + l.wq.data.size() + l.wk.data.size() + l.wv.data.size() +
         l.wo.data.size() + l.q_norm.size() + l.k_norm.size() + l.ffn_norm.size() +
         l.w_gate.data.size() + l.w_up.data.size() + l.w_down.data.size();
  }
  return n;
}

bool all_finite(const ModelWeights& w) {
  auto finite = [](const std::vector<float>& v) {
    for (float x : v) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  };
  bool ok = finite(w.tok_embd.data) && finite(w.out_norm) && finite(w.lm_head.data);
  for (const LayerWeights& l : w.layers) {
    ok = ok && finite(l.attn_norm) && finite(l.wq.data) && finite(l.wk.data) && finite(l.wv.data) &&
         finite(l.wo.data) && finite(l.q_norm) && finite(l.k_norm) && finite(l.ffn_norm) &&
         finite(l.w_gate.data) && finite(l.w_up.data) && finite(l.w_down.data);
  }
  return ok;
}

TEST(DummyWeights, TinyPresetsAreSmallValidDeterministicAndScaled) {
  for (const char* preset : {"tiny-llama", "tiny-qwen3"}) {
    SCOPED_TRACE(preset);
    const ModelConfig c = preset_config(preset);
    const ModelWeights a = make_dummy_weights(c, 7);
    const ModelWeights b = make_dummy_weights(c, 7);
    const ModelWeights other = make_dummy_weights(c, 8);
    EXPECT_NO_THROW(a.validate_shapes());
    EXPECT_EQ(count_values(a), static_cast<size_t>(c.parameter_count()));
    EXPECT_LT(count_values(a) * 4, 8u << 20);  // a few MB at most
    EXPECT_TRUE(all_finite(a));
    EXPECT_EQ(a.tok_embd.data, b.tok_embd.data);
    EXPECT_EQ(a.layers[1].w_down.data, b.layers[1].w_down.data);
    EXPECT_EQ(a.layers[0].ffn_norm, b.layers[0].ffn_norm);
    EXPECT_NE(a.tok_embd.data, other.tok_embd.data);
    EXPECT_NE(a.layers[1].w_down.data, other.layers[1].w_down.data);
    EXPECT_NE(a.layers[0].wq.data, a.layers[1].wq.data);  // every tensor has its own stream

    // Projections: mean 0, std 1/sqrt(fan_in) (tolerances: > 5 standard errors at n >= 4096).
    for (const Matrix* m : {&a.layers[0].w_gate, &a.layers[1].w_down, &a.tok_embd}) {
      double sum = 0, sum_sq = 0;
      for (float x : m->data) {
        sum += x;
        sum_sq += double(x) * x;
      }
      const double n = static_cast<double>(m->data.size());
      const double mean = sum / n;
      const double stddev = std::sqrt(sum_sq / n - mean * mean);
      const double want = 1.0 / std::sqrt(static_cast<double>(m->cols));
      EXPECT_NEAR(mean, 0.0, 0.05 * want);
      EXPECT_NEAR(stddev, want, 0.05 * want);
    }
    for (float g : a.layers[0].attn_norm) EXPECT_NEAR(g, 1.0f, 0.1f);
  }
  EXPECT_FALSE(preset_config("tiny-llama").tie_embeddings);
  EXPECT_TRUE(preset_config("tiny-qwen3").tie_embeddings);
  EXPECT_TRUE(make_dummy_weights(preset_config("tiny-qwen3"), 1).lm_head.empty());
}

TEST(DummyWeights, TooLargeForMemoryFailsBeforeAllocating) {
  // 70.6e9 parameters as fp32 are 282 GB, more than any machine this suite runs on.
  expect_error([] { make_dummy_weights(preset_config("llama-3.1-70b"), 0); },
               {"GB", "memory"});
}

// ---------------------------------------------------------------- load_model dispatch

TEST(LoadModel, DummyPresetAndHfDirectory) {
  LoadedModel m = load_model({"tiny-qwen3", "dummy", 3});
  EXPECT_EQ(m.name, "tiny-qwen3");
  EXPECT_FALSE(m.tokenizer);
  EXPECT_EQ(m.weights.config.arch, "qwen3");
  EXPECT_EQ(m.weights.tok_embd.data, make_dummy_weights(preset_config("tiny-qwen3"), 3).tok_embd.data);

  TempDir dir;
  const TinyCheckpoint ckpt(false, false);
  ckpt.write_single(dir);
  m = load_model({dir.path().string(), "auto", 0});
  EXPECT_EQ(m.name, dir.path().filename().string());
  ckpt.expect_loaded(m.weights);
  m = load_model({dir.path().string() + "/", "safetensors", 0});
  EXPECT_EQ(m.name, dir.path().filename().string());

  // dummy from a HF directory or its config.json: its shapes, made-up values.
  m = load_model({dir.path().string(), "dummy", 0});
  EXPECT_EQ(m.weights.config.hidden_size, 16);
  EXPECT_NE(m.weights.tok_embd.data, ckpt.values.at("model.embed_tokens.weight"));
  m = load_model({(dir.path() / "config.json").string(), "dummy", 0});
  EXPECT_EQ(m.weights.config.vocab_size, 40);
  EXPECT_EQ(m.name, dir.path().filename().string());
}

TEST(LoadModel, ClearErrors) {
  expect_error([] { load_model({"/no/such/model.gguf", "auto", 0}); },
               {"model not found: /no/such/model.gguf"});
  expect_error([] { load_model({"qwen3-8b", "auto", 0}); }, {"--load-format dummy"});
  expect_error([] { load_model({"no-such-preset", "dummy", 0}); },
               {"model not found", "preset"});
  expect_error([] { load_model({"tiny-llama", "pickle", 0}); }, {"unknown load format 'pickle'"});
  expect_error([] { load_model({"", "auto", 0}); }, {"no model"});
  TempDir dir;
  expect_error([&] { load_model({dir.path().string(), "auto", 0}); }, {"config.json"});
  const fs::path text = dir.write("weights.bin", "hello");
  expect_error([&] { load_model({text.string(), "auto", 0}); }, {"cannot tell the format"});
  expect_error([&] { load_model({text.string(), "safetensors", 0}); }, {"not a directory"});
}

}  // namespace
}  // namespace spin
