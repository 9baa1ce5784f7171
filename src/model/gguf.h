#pragma once
// GGUF v2/v3 reader: memory-mapped, every size/count/offset checked against the file before use.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "base/mapped_file.h"

namespace spin {

// ggml tensor types this reader understands (values are ggml's on-disk ids).
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q8_0 = 8,
  Q4_K = 12,
  Q6_K = 14,
  BF16 = 30,
};

const char* ggml_type_name(GgmlType type);
// Bytes of one block and elements per block; throws spin::Error for an unknown type id.
uint64_t ggml_block_bytes(GgmlType type);
uint64_t ggml_block_elements(GgmlType type);

struct GgufValue;
using GgufArray = std::vector<GgufValue>;

// One metadata value. Integers of every width are kept as int64/uint64, floats as double.
struct GgufValue {
  enum class Kind { UInt, Int, Float, Bool, String, Array } kind = Kind::UInt;
  uint32_t gguf_type = 0;  // the on-disk type id, e.g. 4 = uint32, 8 = string, 9 = array
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<GgufArray>> value;

  // Typed accessors; each throws spin::Error naming the expected kind on mismatch.
  int64_t as_int() const;    // UInt (if it fits) or Int
  double as_float() const;   // Float, or any integer
  bool as_bool() const;
  const std::string& as_string() const;
  const GgufArray& as_array() const;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // ggml order: dims[0] is the fastest-varying (row length)
  GgmlType type;
  uint64_t offset = 0;         // from the start of the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
};

class GgufFile {
 public:
  // Maps and parses the file; throws spin::Error with a message naming the file and the defect.
  explicit GgufFile(const std::string& path);
  // Parses an in-memory image (used by the fuzzer and tests); the buffer must outlive the object.
  static GgufFile from_memory(const uint8_t* data, size_t size, std::string name = "<memory>");

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;   // nullptr if absent
  const GgufValue& get(const std::string& key) const;    // throws if absent

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  // Raw bytes of a tensor inside the mapping (bounds already checked at parse time).
  const uint8_t* tensor_data(const GgufTensorInfo& info) const;
  // Dequantizes a whole tensor to fp32.
  std::vector<float> dequantize(const GgufTensorInfo& info) const;

  const std::string& name() const { return name_; }

 private:
  GgufFile() = default;
  void parse(const uint8_t* data, size_t size);

  std::string name_;
  std::optional<MappedFile> file_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
};

// Dequantizes n_elements (a multiple of the type's block size) from src into dst.
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, uint64_t n_elements);

}  // namespace spin
