#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

#include "base/error.h"
#include "base/half.h"

namespace spin {

namespace {

using Json = nlohmann::ordered_json;

struct DtypeEntry {
  const char* name;
  SafetensorsDtype dtype;
  uint64_t bytes;
};

constexpr DtypeEntry kDtypes[] = {
    {"BOOL", SafetensorsDtype::Bool, 1},       {"U8", SafetensorsDtype::U8, 1},
    {"I8", SafetensorsDtype::I8, 1},           {"F8_E5M2", SafetensorsDtype::F8_E5M2, 1},
    {"F8_E4M3", SafetensorsDtype::F8_E4M3, 1}, {"I16", SafetensorsDtype::I16, 2},
    {"U16", SafetensorsDtype::U16, 2},         {"F16", SafetensorsDtype::F16, 2},
    {"BF16", SafetensorsDtype::BF16, 2},       {"I32", SafetensorsDtype::I32, 4},
    {"U32", SafetensorsDtype::U32, 4},         {"F32", SafetensorsDtype::F32, 4},
    {"F64", SafetensorsDtype::F64, 8},         {"I64", SafetensorsDtype::I64, 8},
    {"U64", SafetensorsDtype::U64, 8},
};

const DtypeEntry& dtype_entry(SafetensorsDtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  fail("safetensors: invalid dtype enum value {}", static_cast<int>(dtype));
}

const DtypeEntry* dtype_by_name(std::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// JSON parsers silently keep one of two equal keys; a safetensors header with a repeated tensor
// name is ambiguous (two byte ranges for one name), so repeated keys are rejected at any depth.
Json parse_header_json(std::string_view text, const std::string& file_name) {
  std::vector<std::set<std::string>> keys_per_open_object;
  auto reject_duplicates = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys_per_open_object.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys_per_open_object.empty()) keys_per_open_object.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!keys_per_open_object.empty() && !keys_per_open_object.back().insert(key).second) {
          fail("safetensors '{}': duplicate key '{}' in the header", file_name, key);
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), reject_duplicates);
  } catch (const Json::exception& e) {
    fail("safetensors '{}': invalid JSON header: {}", file_name, e.what());
  }
}

uint64_t json_unsigned(const Json& value, const std::string& file_name, const std::string& tensor,
                       const char* field) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    fail("safetensors '{}': tensor '{}': {} has a negative value {}", file_name, tensor, field,
         value.get<int64_t>());
  }
  fail("safetensors '{}': tensor '{}': {} must hold non-negative integers, got {}", file_name,
       tensor, field, value.dump());
}

}  // namespace

const char* safetensors_dtype_name(SafetensorsDtype dtype) { return dtype_entry(dtype).name; }

uint64_t safetensors_dtype_bytes(SafetensorsDtype dtype) { return dtype_entry(dtype).bytes; }

SafetensorsFile::SafetensorsFile(const std::string& path) : name_(path) {
  file_.emplace(path);
  parse(file_->data(), file_->size());
}

SafetensorsFile SafetensorsFile::from_memory(const uint8_t* data, size_t size, std::string name) {
  SafetensorsFile f;
  f.name_ = std::move(name);
  f.parse(data, size);
  return f;
}

void SafetensorsFile::parse(const uint8_t* data, size_t size) {
  const std::string& fname = name_;
  SPIN_CHECK(size >= 8, "safetensors '{}': file is {} bytes, too short for the 8-byte header length",
             fname, size);
  const uint64_t header_len = read_le64(data);
  SPIN_CHECK(header_len <= kMaxHeaderBytes,
             "safetensors '{}': header length {} exceeds the limit of {} bytes", fname, header_len,
             kMaxHeaderBytes);
  SPIN_CHECK(header_len <= size - 8,
             "safetensors '{}': header length {} runs past the end of the file ({} bytes)", fname,
             header_len, size);
  const char* header_text = reinterpret_cast<const char*>(data + 8);
  SPIN_CHECK(header_len > 0 && header_text[0] == '{',
             "safetensors '{}': header does not start with '{{' (not a safetensors file?)", fname);
  data_section_ = data + 8 + header_len;
  data_size_ = size - 8 - header_len;

  const Json header = parse_header_json(std::string_view(header_text, header_len), fname);
  SPIN_CHECK(header.is_object(), "safetensors '{}': header is not a JSON object", fname);

  for (const auto& item : header.items()) {
    // Named references, not a structured binding: lambdas below capture them (C++20 allows
    // capturing bindings, clang 14 does not).
    const std::string& key = item.key();
    const Json& value = item.value();
    if (key == "__metadata__") {
      SPIN_CHECK(value.is_object(), "safetensors '{}': __metadata__ is not an object", fname);
      for (const auto& [mkey, mvalue] : value.items()) {
        SPIN_CHECK(mvalue.is_string(),
                   "safetensors '{}': __metadata__ value of '{}' is not a string", fname, mkey);
        metadata_[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    SPIN_CHECK(value.is_object(), "safetensors '{}': entry of tensor '{}' is not an object", fname,
               key);
    auto field = [&](const char* name) -> const Json& {
      auto it = value.find(name);
      SPIN_CHECK(it != value.end(), "safetensors '{}': tensor '{}' has no '{}'", fname, key, name);
      return *it;
    };
    SafetensorsTensorInfo info;
    info.name = key;

    const Json& dtype = field("dtype");
    SPIN_CHECK(dtype.is_string(), "safetensors '{}': tensor '{}': dtype is not a string", fname,
               key);
    const DtypeEntry* entry = dtype_by_name(dtype.get_ref<const std::string&>());
    SPIN_CHECK(entry != nullptr, "safetensors '{}': tensor '{}' has unknown dtype '{}'", fname, key,
               dtype.get_ref<const std::string&>());
    info.dtype = entry->dtype;

    const Json& shape = field("shape");
    SPIN_CHECK(shape.is_array(), "safetensors '{}': tensor '{}': shape is not an array", fname,
               key);
    info.n_elements = 1;
    for (const Json& dim : shape) {
      const uint64_t d = json_unsigned(dim, fname, key, "shape");
      info.shape.push_back(d);
      uint64_t product;
      SPIN_CHECK(!__builtin_mul_overflow(info.n_elements, d, &product),
                 "safetensors '{}': tensor '{}': shape {} overflows 64-bit element count", fname,
                 key, shape.dump());
      info.n_elements = product;
    }
    uint64_t n_bytes;
    SPIN_CHECK(!__builtin_mul_overflow(info.n_elements, entry->bytes, &n_bytes),
               "safetensors '{}': tensor '{}': byte size of shape {} overflows 64 bits", fname, key,
               shape.dump());

    const Json& offsets = field("data_offsets");
    SPIN_CHECK(offsets.is_array() && offsets.size() == 2,
               "safetensors '{}': tensor '{}': data_offsets must be [begin, end]", fname, key);
    info.begin = json_unsigned(offsets[0], fname, key, "data_offsets");
    info.end = json_unsigned(offsets[1], fname, key, "data_offsets");
    SPIN_CHECK(info.begin <= info.end,
               "safetensors '{}': tensor '{}': data_offsets [{}, {}] end before they begin", fname,
               key, info.begin, info.end);
    SPIN_CHECK(info.end <= data_size_,
               "safetensors '{}': tensor '{}': data_offsets [{}, {}] run past the end of the data "
               "section ({} bytes)",
               fname, key, info.begin, info.end, data_size_);
    SPIN_CHECK(info.end - info.begin == n_bytes,
               "safetensors '{}': tensor '{}': data_offsets [{}, {}] span {} bytes but dtype {} "
               "and shape {} need {}",
               fname, key, info.begin, info.end, info.end - info.begin, entry->name, shape.dump(),
               n_bytes);
    index_[key] = tensors_.size();
    tensors_.push_back(std::move(info));
  }

  // The format requires the tensors to tile the data section exactly: no overlaps (one byte read
  // as two tensors) and no holes (bytes that belong to nothing).
  std::vector<const SafetensorsTensorInfo*> by_offset;
  for (const SafetensorsTensorInfo& t : tensors_) by_offset.push_back(&t);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const auto* a, const auto* b) {
                     return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
                   });
  uint64_t covered = 0;
  for (const SafetensorsTensorInfo* t : by_offset) {
    SPIN_CHECK(t->begin >= covered,
               "safetensors '{}': tensor '{}': data_offsets [{}, {}] overlap another tensor's data",
               fname, t->name, t->begin, t->end);
    SPIN_CHECK(t->begin == covered,
               "safetensors '{}': bytes [{}, {}) of the data section belong to no tensor", fname,
               covered, t->begin);
    covered = t->end;
  }
  SPIN_CHECK(covered == data_size_,
             "safetensors '{}': the data section has {} bytes but the tensors cover only {} "
             "(trailing bytes)",
             fname, data_size_, covered);
}

const SafetensorsTensorInfo* SafetensorsFile::find(const std::string& tensor_name) const {
  auto it = index_.find(tensor_name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const uint8_t* SafetensorsFile::tensor_data(const SafetensorsTensorInfo& info) const {
  return data_section_ + info.begin;
}

std::vector<float> SafetensorsFile::to_f32(const SafetensorsTensorInfo& info) const {
  SPIN_CHECK(info.dtype == SafetensorsDtype::F32 || info.dtype == SafetensorsDtype::F16 ||
                 info.dtype == SafetensorsDtype::BF16,
             "safetensors '{}': tensor '{}' has dtype {}; only F32, F16 and BF16 are supported",
             name_, info.name, safetensors_dtype_name(info.dtype));
  const uint8_t* src = tensor_data(info);
  const int64_t n = static_cast<int64_t>(info.n_elements);
  std::vector<float> out(info.n_elements);
  switch (info.dtype) {
    case SafetensorsDtype::F32:
      if (n > 0) std::memcpy(out.data(), src, info.n_elements * sizeof(float));
      break;
    case SafetensorsDtype::F16:
#pragma omp parallel for schedule(static) if (n > (1 << 20))
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      break;
    case SafetensorsDtype::BF16:
#pragma omp parallel for schedule(static) if (n > (1 << 20))
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      break;
    default:
      break;  // rejected above
  }
  return out;
}

Fp32Tensor SafetensorsFile::read_f32(const std::string& tensor_name) const {
  const SafetensorsTensorInfo* info = find(tensor_name);
  SPIN_CHECK(info != nullptr, "safetensors '{}': no tensor named '{}'", name_, tensor_name);
  return Fp32Tensor{info->shape, to_f32(*info)};
}

}  // namespace spin
