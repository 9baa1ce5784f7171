#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "base/checked.h"
#include "base/error.h"

namespace spin {

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;
// Nested arrays are legal but nothing real goes deeper than two levels; the bound keeps recursion
// on hostile input shallow.
constexpr int kMaxArrayDepth = 8;

enum GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

const char* value_type_name(uint32_t type) {
  static const char* const names[] = {"uint8", "int8",  "uint16", "int16", "uint32",
                                      "int32", "float32", "bool", "string", "array",
                                      "uint64", "int64", "float64"};
  return type <= kF64 ? names[type] : "unknown";
}

// The fewest bytes one value of this type occupies on disk; bounds element counts by the bytes
// left in the file, so an absurd count fails before anything is allocated.
uint64_t min_value_bytes(uint32_t type) {
  switch (type) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    case kString: return 8;     // length prefix
    case kArray: return 4 + 8;  // element type + count
    default: return 1;
  }
}

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    // Reject overlong forms, surrogates and values past U+10FFFF.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
      return false;
    i += len;
  }
  return true;
}

// Sequential little-endian reader over the untrusted image; every read is bounds-checked.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  void need(uint64_t n, const char* what) const {
    if (n > left())
      fail("{}: truncated file: {} needs {} bytes at offset {}, only {} left", name_, what, n,
           pos_, left());
  }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const char* what) {
    const uint64_t len = read<uint64_t>(what);
    if (len > left())
      fail("{}: string length {} for {} at offset {} exceeds the {} bytes left in the file", name_,
           len, what, pos_ - 8, left());
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

GgufValue read_value(Reader& r, uint32_t type, int depth, const std::string& key,
                     const std::string& file) {
  GgufValue v;
  v.gguf_type = type;
  switch (type) {
    case kU8: v.kind = GgufValue::Kind::UInt; v.value = uint64_t{r.read<uint8_t>("uint8 value")}; break;
    case kU16: v.kind = GgufValue::Kind::UInt; v.value = uint64_t{r.read<uint16_t>("uint16 value")}; break;
    case kU32: v.kind = GgufValue::Kind::UInt; v.value = uint64_t{r.read<uint32_t>("uint32 value")}; break;
    case kU64: v.kind = GgufValue::Kind::UInt; v.value = uint64_t{r.read<uint64_t>("uint64 value")}; break;
    case kI8: v.kind = GgufValue::Kind::Int; v.value = int64_t{r.read<int8_t>("int8 value")}; break;
    case kI16: v.kind = GgufValue::Kind::Int; v.value = int64_t{r.read<int16_t>("int16 value")}; break;
    case kI32: v.kind = GgufValue::Kind::Int; v.value = int64_t{r.read<int32_t>("int32 value")}; break;
    case kI64: v.kind = GgufValue::Kind::Int; v.value = int64_t{r.read<int64_t>("int64 value")}; break;
    case kF32: v.kind = GgufValue::Kind::Float; v.value = double{r.read<float>("float32 value")}; break;
    case kF64: v.kind = GgufValue::Kind::Float; v.value = r.read<double>("float64 value"); break;
    case kBool: {
      const uint8_t b = r.read<uint8_t>("bool value");
      if (b > 1) fail("{}: metadata '{}': bool value {} is neither 0 nor 1", file, key, b);
      v.kind = GgufValue::Kind::Bool;
      v.value = b == 1;
      break;
    }
    case kString:
      v.kind = GgufValue::Kind::String;
      v.value = r.read_string("string value");
      break;
    case kArray: {
      if (depth >= kMaxArrayDepth)
        fail("{}: metadata '{}': array nesting deeper than {} levels", file, key, kMaxArrayDepth);
      const uint32_t elem_type = r.read<uint32_t>("array element type");
      if (elem_type > kF64)
        fail("{}: metadata '{}': unknown metadata value type {} for array elements", file, key,
             elem_type);
      const uint64_t count = r.read<uint64_t>("array length");
      if (count > r.left() / min_value_bytes(elem_type))
        fail("{}: metadata '{}': array of {} {} elements cannot fit in the {} bytes left in the file",
             file, key, count, value_type_name(elem_type), r.left());
      auto arr = std::make_shared<GgufArray>();
      arr->reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i) arr->push_back(read_value(r, elem_type, depth + 1, key, file));
      v.kind = GgufValue::Kind::Array;
      v.value = std::move(arr);
      break;
    }
    default:
      fail("{}: metadata '{}': unknown metadata value type {}", file, key, type);
  }
  return v;
}

// Names of ggml types this reader does not dequantize, for clearer errors.
const char* other_ggml_type_name(uint32_t id) {
  switch (id) {
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 13: return "Q5_K";
    case 15: return "Q8_K";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    default: return nullptr;
  }
}

bool is_supported_type(uint32_t id) {
  switch (static_cast<GgmlType>(id)) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::Q4_0: case GgmlType::Q4_1:
    case GgmlType::Q8_0: case GgmlType::Q4_K: case GgmlType::Q6_K: case GgmlType::BF16:
      return true;
  }
  return false;
}

}  // namespace

const char* ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return "F32";
    case GgmlType::F16: return "F16";
    case GgmlType::Q4_0: return "Q4_0";
    case GgmlType::Q4_1: return "Q4_1";
    case GgmlType::Q8_0: return "Q8_0";
    case GgmlType::Q4_K: return "Q4_K";
    case GgmlType::Q6_K: return "Q6_K";
    case GgmlType::BF16: return "BF16";
  }
  return "unknown";
}

uint64_t ggml_block_bytes(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return 4;
    case GgmlType::F16: return 2;
    case GgmlType::BF16: return 2;
    case GgmlType::Q4_0: return 2 + 16;
    case GgmlType::Q4_1: return 2 + 2 + 16;
    case GgmlType::Q8_0: return 2 + 32;
    case GgmlType::Q4_K: return 2 + 2 + 12 + 128;
    case GgmlType::Q6_K: return 128 + 64 + 16 + 2;
  }
  fail("unknown ggml tensor type id {}", static_cast<uint32_t>(type));
}

uint64_t ggml_block_elements(GgmlType type) {
  switch (type) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: return 1;
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q8_0: return 32;
    case GgmlType::Q4_K: case GgmlType::Q6_K: return 256;
  }
  fail("unknown ggml tensor type id {}", static_cast<uint32_t>(type));
}

int64_t GgufValue::as_int() const {
  if (kind == Kind::Int) return std::get<int64_t>(value);
  if (kind == Kind::UInt) {
    const uint64_t u = std::get<uint64_t>(value);
    SPIN_CHECK(u <= static_cast<uint64_t>(INT64_MAX), "GGUF value {} does not fit in int64", u);
    return static_cast<int64_t>(u);
  }
  fail("GGUF value of type {} is not an integer", value_type_name(gguf_type));
}

double GgufValue::as_float() const {
  if (kind == Kind::Float) return std::get<double>(value);
  if (kind == Kind::Int) return static_cast<double>(std::get<int64_t>(value));
  if (kind == Kind::UInt) return static_cast<double>(std::get<uint64_t>(value));
  fail("GGUF value of type {} is not a number", value_type_name(gguf_type));
}

bool GgufValue::as_bool() const {
  SPIN_CHECK(kind == Kind::Bool, "GGUF value of type {} is not a bool", value_type_name(gguf_type));
  return std::get<bool>(value);
}

const std::string& GgufValue::as_string() const {
  SPIN_CHECK(kind == Kind::String, "GGUF value of type {} is not a string",
             value_type_name(gguf_type));
  return std::get<std::string>(value);
}

const GgufArray& GgufValue::as_array() const {
  SPIN_CHECK(kind == Kind::Array, "GGUF value of type {} is not an array",
             value_type_name(gguf_type));
  return *std::get<std::shared_ptr<GgufArray>>(value);
}

GgufFile::GgufFile(const std::string& path) : name_(path) {
  file_.emplace(path);
  parse(file_->data(), file_->size());
}

GgufFile GgufFile::from_memory(const uint8_t* data, size_t size, std::string name) {
  GgufFile f;
  f.name_ = std::move(name);
  f.parse(data, size);
  return f;
}

void GgufFile::parse(const uint8_t* data, size_t size) {
  data_ = data;
  size_ = size;
  Reader r(data, size, name_);

  const uint32_t magic = r.read<uint32_t>("magic");
  if (magic != kGgufMagic) fail("{}: not a GGUF file (bad magic 0x{:08x})", name_, magic);
  version_ = r.read<uint32_t>("version");
  if (version_ == 1)
    fail("{}: GGUF version 1 is not supported (re-convert the model; versions 2 and 3 are)", name_);
  if (version_ != 2 && version_ != 3)
    fail("{}: unsupported GGUF version {} (expected 2 or 3)", name_, version_);

  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.read<uint64_t>("metadata count");
  // Each key/value takes at least a key length, a type and one byte of value.
  if (n_kv > r.left() / (8 + 4 + 1))
    fail("{}: metadata count {} cannot fit in the {} bytes left in the file", name_, n_kv, r.left());

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.read_string("metadata key");
    if (!valid_utf8(key)) fail("{}: metadata key #{} is not valid UTF-8", name_, i);
    if (metadata_.count(key)) fail("{}: duplicate metadata key '{}'", name_, key);
    const uint32_t type = r.read<uint32_t>("metadata value type");
    GgufValue value = read_value(r, type, 0, key, name_);
    metadata_.emplace(std::move(key), std::move(value));
  }

  uint64_t alignment = kDefaultAlignment;
  if (const GgufValue* a = find("general.alignment")) {
    SPIN_CHECK(a->kind == GgufValue::Kind::UInt || a->kind == GgufValue::Kind::Int,
               "{}: general.alignment must be an integer", name_);
    const int64_t v = a->as_int();
    if (v <= 0 || (v & (v - 1)) != 0 || v > (int64_t{1} << 30))
      fail("{}: general.alignment {} is not a power of two (between 1 and 2^30)", name_, v);
    alignment = static_cast<uint64_t>(v);
  }

  // A tensor info takes at least a name length, a dims count, one dim, a type and an offset.
  if (n_tensors > r.left() / (8 + 4 + 8 + 4 + 8))
    fail("{}: tensor count {} cannot fit in the {} bytes left in the file", name_, n_tensors,
         r.left());
  tensors_.reserve(static_cast<size_t>(n_tensors));
  std::set<std::string> names;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = r.read_string("tensor name");
    if (!valid_utf8(t.name)) fail("{}: tensor name #{} is not valid UTF-8", name_, i);
    if (!names.insert(t.name).second) fail("{}: duplicate tensor name '{}'", name_, t.name);
    const uint32_t n_dims = r.read<uint32_t>("tensor dims count");
    if (n_dims < 1 || n_dims > kMaxDims)
      fail("{}: tensor '{}' has {} dimensions (1 to {} allowed)", name_, t.name, n_dims, kMaxDims);
    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>("tensor dimension");
      t.dims.push_back(dim);
      if (__builtin_mul_overflow(t.n_elements, dim, &t.n_elements) ||
          t.n_elements > static_cast<uint64_t>(INT64_MAX))
        fail("{}: tensor '{}': dimension product overflows", name_, t.name);
    }
    const uint32_t type_id = r.read<uint32_t>("tensor type");
    if (!is_supported_type(type_id)) {
      if (const char* other = other_ggml_type_name(type_id))
        fail("{}: tensor '{}' has ggml type {} (id {}), which spin does not support", name_,
             t.name, other, type_id);
      fail("{}: tensor '{}' has unknown tensor type id {}", name_, t.name, type_id);
    }
    t.type = static_cast<GgmlType>(type_id);
    const uint64_t block = ggml_block_elements(t.type);
    if (t.dims[0] % block != 0)
      fail("{}: tensor '{}': row length {} is not a multiple of the {} block size {}", name_,
           t.name, t.dims[0], ggml_type_name(t.type), block);
    t.n_bytes = checked_mul(t.n_elements / block, ggml_block_bytes(t.type), "tensor byte size");
    t.offset = r.read<uint64_t>("tensor offset");
    if (t.offset % alignment != 0)
      fail("{}: tensor '{}': offset {} is not aligned to {}", name_, t.name, t.offset, alignment);
    tensors_.push_back(std::move(t));
  }

  data_offset_ = (static_cast<uint64_t>(r.pos()) + alignment - 1) / alignment * alignment;
  for (const GgufTensorInfo& t : tensors_) {
    uint64_t begin, end;
    if (__builtin_add_overflow(data_offset_, t.offset, &begin) ||
        __builtin_add_overflow(begin, t.n_bytes, &end) || end > size_)
      fail("{}: tensor '{}': data at offset {} ({} bytes) lies past the end of the file (file "
           "size {}, data section at {})",
           name_, t.name, t.offset, t.n_bytes, size_, data_offset_);
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufValue& GgufFile::get(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail("{}: metadata key '{}' is missing", name_, key);
  return *v;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  for (const GgufTensorInfo& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const uint8_t* GgufFile::tensor_data(const GgufTensorInfo& info) const {
  return data_ + data_offset_ + info.offset;
}

std::vector<float> GgufFile::dequantize(const GgufTensorInfo& info) const {
  std::vector<float> out(static_cast<size_t>(info.n_elements));
  // Chunks of whole blocks, large enough to amortise the thread hand-off.
  const uint64_t block = ggml_block_elements(info.type);
  const uint64_t block_bytes = ggml_block_bytes(info.type);
  const uint64_t blocks_per_chunk = std::max<uint64_t>(1, (uint64_t{1} << 16) / block);
  const uint64_t n_blocks = info.n_elements / block;
  const int64_t n_chunks = static_cast<int64_t>((n_blocks + blocks_per_chunk - 1) / blocks_per_chunk);
  const uint8_t* src = tensor_data(info);
#pragma omp parallel for schedule(static) if (n_chunks > 1)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const uint64_t first = static_cast<uint64_t>(c) * blocks_per_chunk;
    const uint64_t count = std::min(blocks_per_chunk, n_blocks - first);
    dequantize_row(info.type, src + first * block_bytes, out.data() + first * block,
                   count * block);
  }
  return out;
}

}  // namespace spin
