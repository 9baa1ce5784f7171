#pragma once
// safetensors reader: memory-mapped; the header length, the JSON header, every dtype, shape and
// data range are checked against the file before any tensor byte is touched.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON (an object mapping tensor names
// to {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional "__metadata__" object of
// string values), then the data section that the offsets index (relative to its start).
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/mapped_file.h"

namespace spin {

// Every dtype the format defines, so that any well-formed file parses; only F32, F16 and BF16
// convert to fp32 (the others fail with an error naming the dtype).
enum class SafetensorsDtype {
  Bool, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64
};

const char* safetensors_dtype_name(SafetensorsDtype dtype);
uint64_t safetensors_dtype_bytes(SafetensorsDtype dtype);

struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::F32;
  std::vector<uint64_t> shape;  // row-major, outermost first (the HF / PyTorch order)
  uint64_t n_elements = 0;
  uint64_t begin = 0;           // byte range inside the data section
  uint64_t end = 0;
};

struct Fp32Tensor {
  std::vector<uint64_t> shape;
  std::vector<float> data;
};

class SafetensorsFile {
 public:
  // Maps and parses the file; throws spin::Error naming the file and the defect.
  explicit SafetensorsFile(const std::string& path);
  // Parses an in-memory image (fuzzers, tests); the buffer must outlive the object.
  static SafetensorsFile from_memory(const uint8_t* data, size_t size,
                                     std::string name = "<memory>");

  // Largest JSON header accepted (the reference implementation's limit too).
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  const std::string& name() const { return name_; }
  // Tensors in header order.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  const SafetensorsTensorInfo* find(const std::string& tensor_name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's raw bytes (range checked at parse time).
  const uint8_t* tensor_data(const SafetensorsTensorInfo& info) const;
  // Converts a F32/F16/BF16 tensor to fp32; throws for other dtypes.
  std::vector<float> to_f32(const SafetensorsTensorInfo& info) const;
  // Looks the tensor up by name (throws if absent) and converts it.
  Fp32Tensor read_f32(const std::string& tensor_name) const;

 private:
  SafetensorsFile() = default;
  void parse(const uint8_t* data, size_t size);

  std::string name_;
  std::optional<MappedFile> file_;
  const uint8_t* data_section_ = nullptr;
  uint64_t data_size_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

}  // namespace spin
