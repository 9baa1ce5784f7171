// GGUF reader and dequantization: images built byte by byte here, checked against what was
// written and against scalar references that follow the ggml block descriptions element by element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/half.h"
#include "model/gguf.h"

namespace spin {
namespace {

// ---- a tiny GGUF writer -------------------------------------------------------------------

class Bytes {
 public:
  template <typename T>
  Bytes& put(T v) {
    const size_t at = buf.size();
    buf.resize(at + sizeof(T));
    std::memcpy(buf.data() + at, &v, sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    buf.insert(buf.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& raw(const std::vector<uint8_t>& b) {
    buf.insert(buf.end(), b.begin(), b.end());
    return *this;
  }
  std::vector<uint8_t> buf;
};

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type;
  std::vector<uint8_t> data;
};

struct Image {
  uint32_t version = 3;
  std::vector<std::pair<std::string, Bytes>> kvs;  // key -> (type id + payload)
  std::vector<TensorSpec> tensors;
  uint64_t alignment = 32;

  void kv(const std::string& key, uint32_t type, const Bytes& payload) {
    Bytes b;
    b.put<uint32_t>(type).raw(payload.buf);
    kvs.emplace_back(key, b);
  }

  std::vector<uint8_t> build() const {
    Bytes out;
    out.put<uint32_t>(0x46554747).put<uint32_t>(version);
    out.put<uint64_t>(tensors.size()).put<uint64_t>(kvs.size());
    for (const auto& [key, value] : kvs) out.str(key).raw(value.buf);
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const TensorSpec& t : tensors) {
      out.str(t.name).put<uint32_t>(static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) out.put<uint64_t>(d);
      out.put<uint32_t>(t.type).put<uint64_t>(offset);
      offsets.push_back(offset);
      offset += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    while (out.buf.size() % alignment) out.put<uint8_t>(0);
    for (size_t i = 0; i < tensors.size(); ++i) {
      out.raw(tensors[i].data);
      if (i + 1 < tensors.size())
        while (out.buf.size() % alignment) out.put<uint8_t>(0);
    }
    return out.buf;
  }
};

GgufFile parse(const std::vector<uint8_t>& image) {
  return GgufFile::from_memory(image.data(), image.size(), "test.gguf");
}

std::string parse_error(const std::vector<uint8_t>& image) {
  try {
    parse(image);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// ---- metadata ------------------------------------------------------------------------------

class GgufVersions : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersions, ReadsEveryMetadataType) {
  Image img;
  img.version = GetParam();
  img.kv("u8", 0, Bytes().put<uint8_t>(200));
  img.kv("i8", 1, Bytes().put<int8_t>(-100));
  img.kv("u16", 2, Bytes().put<uint16_t>(60000));
  img.kv("i16", 3, Bytes().put<int16_t>(-30000));
  img.kv("u32", 4, Bytes().put<uint32_t>(4000000000u));
  img.kv("i32", 5, Bytes().put<int32_t>(-2000000000));
  img.kv("f32", 6, Bytes().put<float>(1.5f));
  img.kv("bool.t", 7, Bytes().put<uint8_t>(1));
  img.kv("bool.f", 7, Bytes().put<uint8_t>(0));
  img.kv("str", 8, Bytes().str("héllo 世界"));
  img.kv("u64", 10, Bytes().put<uint64_t>(18000000000000000000ull));
  img.kv("i64", 11, Bytes().put<int64_t>(-9000000000000000000ll));
  img.kv("f64", 12, Bytes().put<double>(-2.25e100));
  img.kv("arr.i32", 9, Bytes().put<uint32_t>(5).put<uint64_t>(3).put<int32_t>(7).put<int32_t>(-8).put<int32_t>(9));
  img.kv("arr.str", 9, Bytes().put<uint32_t>(8).put<uint64_t>(2).str("a").str(""));
  img.kv("arr.empty", 9, Bytes().put<uint32_t>(6).put<uint64_t>(0));
  // [[1, 2], [3]] as arrays of uint16, then an array of arrays of arrays of strings.
  img.kv("arr.nested", 9,
         Bytes().put<uint32_t>(9).put<uint64_t>(2)
             .put<uint32_t>(2).put<uint64_t>(2).put<uint16_t>(1).put<uint16_t>(2)
             .put<uint32_t>(2).put<uint64_t>(1).put<uint16_t>(3));
  img.kv("arr.nested3", 9,
         Bytes().put<uint32_t>(9).put<uint64_t>(1)
             .put<uint32_t>(9).put<uint64_t>(1)
             .put<uint32_t>(8).put<uint64_t>(2).str("x").str("yz"));
  const auto image = img.build();
  const GgufFile f = parse(image);

  EXPECT_EQ(f.version(), GetParam());
  EXPECT_EQ(f.metadata().size(), 18u);
  EXPECT_EQ(f.get("u8").as_int(), 200);
  EXPECT_EQ(f.get("u8").gguf_type, 0u);
  EXPECT_EQ(f.get("i8").as_int(), -100);
  EXPECT_EQ(f.get("u16").as_int(), 60000);
  EXPECT_EQ(f.get("i16").as_int(), -30000);
  EXPECT_EQ(f.get("u32").as_int(), 4000000000ll);
  EXPECT_EQ(f.get("i32").as_int(), -2000000000);
  EXPECT_EQ(f.get("f32").as_float(), 1.5);
  EXPECT_EQ(f.get("f32").kind, GgufValue::Kind::Float);
  EXPECT_TRUE(f.get("bool.t").as_bool());
  EXPECT_FALSE(f.get("bool.f").as_bool());
  EXPECT_EQ(f.get("str").as_string(), "héllo 世界");
  EXPECT_EQ(std::get<uint64_t>(f.get("u64").value), 18000000000000000000ull);
  EXPECT_THROW(f.get("u64").as_int(), Error);  // does not fit in int64
  EXPECT_EQ(f.get("i64").as_int(), -9000000000000000000ll);
  EXPECT_EQ(f.get("f64").as_float(), -2.25e100);
  EXPECT_EQ(f.get("f64").gguf_type, 12u);

  const GgufArray& ints = f.get("arr.i32").as_array();
  ASSERT_EQ(ints.size(), 3u);
  EXPECT_EQ(ints[0].as_int(), 7);
  EXPECT_EQ(ints[1].as_int(), -8);
  EXPECT_EQ(ints[2].as_int(), 9);
  EXPECT_EQ(ints[1].gguf_type, 5u);
  const GgufArray& strs = f.get("arr.str").as_array();
  ASSERT_EQ(strs.size(), 2u);
  EXPECT_EQ(strs[0].as_string(), "a");
  EXPECT_EQ(strs[1].as_string(), "");
  EXPECT_TRUE(f.get("arr.empty").as_array().empty());
  const GgufArray& nested = f.get("arr.nested").as_array();
  ASSERT_EQ(nested.size(), 2u);
  ASSERT_EQ(nested[0].as_array().size(), 2u);
  EXPECT_EQ(nested[0].as_array()[1].as_int(), 2);
  ASSERT_EQ(nested[1].as_array().size(), 1u);
  EXPECT_EQ(nested[1].as_array()[0].as_int(), 3);
  const GgufArray& deep = f.get("arr.nested3").as_array()[0].as_array()[0].as_array();
  ASSERT_EQ(deep.size(), 2u);
  EXPECT_EQ(deep[1].as_string(), "yz");

  // Accessors refuse the wrong kind, and absent keys are reported.
  EXPECT_THROW(f.get("str").as_int(), Error);
  EXPECT_THROW(f.get("u8").as_string(), Error);
  EXPECT_THROW(f.get("arr.i32").as_bool(), Error);
  EXPECT_THROW(f.get("f32").as_array(), Error);
  EXPECT_EQ(f.find("absent"), nullptr);
  EXPECT_THROW(f.get("absent"), Error);
  EXPECT_TRUE(f.tensors().empty());
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersions, ::testing::Values(2u, 3u));

// ---- tensors -------------------------------------------------------------------------------

Image two_tensor_image(uint64_t alignment) {
  Image img;
  img.alignment = alignment;
  if (alignment != 32) img.kv("general.alignment", 4, Bytes().put<uint32_t>(static_cast<uint32_t>(alignment)));
  img.kv("general.architecture", 8, Bytes().str("llama"));
  std::vector<float> a(6), b(3 * 2 * 2);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i) - 1.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i * i);
  img.tensors.push_back({"a", {3, 2}, 0, f32_bytes(a)});
  img.tensors.push_back({"b.weight", {2, 2, 3}, 0, f32_bytes(b)});
  return img;
}

TEST(Gguf, ReadsTensorInfosAndData) {
  for (uint64_t alignment : {32u, 64u, 8u, 1u}) {
    const auto image = two_tensor_image(alignment).build();
    const GgufFile f = parse(image);
    ASSERT_EQ(f.tensors().size(), 2u);
    const GgufTensorInfo* a = f.find_tensor("a");
    const GgufTensorInfo* b = f.find_tensor("b.weight");
    ASSERT_TRUE(a && b);
    EXPECT_EQ(f.find_tensor("c"), nullptr);
    EXPECT_EQ(a->dims, (std::vector<uint64_t>{3, 2}));
    EXPECT_EQ(a->n_elements, 6u);
    EXPECT_EQ(a->n_bytes, 24u);
    EXPECT_EQ(b->dims, (std::vector<uint64_t>{2, 2, 3}));
    EXPECT_EQ(b->n_elements, 12u);
    EXPECT_EQ(b->offset % alignment, 0u);
    const std::vector<float> av = f.dequantize(*a);
    const std::vector<float> bv = f.dequantize(*b);
    for (size_t i = 0; i < av.size(); ++i) EXPECT_EQ(av[i], 0.5f * static_cast<float>(i) - 1.0f);
    for (size_t i = 0; i < bv.size(); ++i) EXPECT_EQ(bv[i], static_cast<float>(i * i));
    // Data section starts at the first aligned offset after the infos.
    EXPECT_EQ(static_cast<size_t>(f.tensor_data(*a) - image.data()) % alignment, 0u);
  }
}

// ---- malformed images ----------------------------------------------------------------------

TEST(GgufErrors, EveryTruncationFails) {
  const auto image = two_tensor_image(32).build();
  ASSERT_NO_THROW(parse(image));
  for (size_t n = 0; n < image.size(); ++n) {
    const std::vector<uint8_t> cut(image.begin(), image.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_NE(parse_error(cut), "") << "prefix of " << n << " bytes parsed";
  }
}

TEST(GgufErrors, HeaderDefects) {
  auto image = two_tensor_image(32).build();
  auto bad = image;
  bad[0] = 'X';
  EXPECT_NE(parse_error(bad).find("magic"), std::string::npos);
  for (uint32_t v : {0u, 1u, 4u, 99u}) {
    bad = image;
    std::memcpy(bad.data() + 4, &v, 4);
    EXPECT_NE(parse_error(bad).find("version"), std::string::npos) << v;
  }
  bad = image;
  const uint64_t huge = uint64_t{1} << 63;
  std::memcpy(bad.data() + 8, &huge, 8);  // tensor count
  EXPECT_NE(parse_error(bad).find("tensor count"), std::string::npos);
  bad = image;
  std::memcpy(bad.data() + 16, &huge, 8);  // metadata count
  EXPECT_NE(parse_error(bad).find("metadata count"), std::string::npos);
}

TEST(GgufErrors, MetadataDefects) {
  auto error_for = [](auto add) {
    Image img;
    add(img);
    return parse_error(img.build());
  };
  EXPECT_NE(error_for([](Image& i) { i.kv("k", 13, Bytes().put<uint32_t>(0)); })
                .find("unknown metadata value type 13"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.kv("k", 9, Bytes().put<uint32_t>(77).put<uint64_t>(0)); })
                .find("unknown metadata value type 77"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.kv("k", 8, Bytes().put<uint64_t>(uint64_t{1} << 62)); })
                .find("string length"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) {
              i.kv("k", 9, Bytes().put<uint32_t>(0).put<uint64_t>(uint64_t{1} << 62));
            }).find("cannot fit"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) {
              Bytes b;  // 101 arrays, each holding the next
              for (int d = 0; d < 100; ++d) b.put<uint32_t>(9).put<uint64_t>(1);
              b.put<uint32_t>(0).put<uint64_t>(0);
              i.kv("k", 9, b);
            }).find("nesting"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) {
              i.kv("dup", 4, Bytes().put<uint32_t>(1));
              i.kv("dup", 4, Bytes().put<uint32_t>(2));
            }).find("duplicate metadata key 'dup'"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.kv("bad\xff", 4, Bytes().put<uint32_t>(1)); }).find("UTF-8"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.kv("\xc0\x80", 4, Bytes().put<uint32_t>(1)); }).find("UTF-8"),
            std::string::npos);  // overlong NUL
  EXPECT_NE(error_for([](Image& i) { i.kv("b", 7, Bytes().put<uint8_t>(2)); }).find("bool"),
            std::string::npos);
  for (uint32_t alignment : {0u, 3u, 48u}) {
    EXPECT_NE(error_for([&](Image& i) {
                i.kv("general.alignment", 4, Bytes().put<uint32_t>(alignment));
              }).find("power of two"),
              std::string::npos)
        << alignment;
  }
}

TEST(GgufErrors, TensorDefects) {
  auto error_for = [](auto mutate) {
    Image img = two_tensor_image(32);
    mutate(img);
    return parse_error(img.build());
  };
  EXPECT_NE(error_for([](Image& i) { i.tensors[1].name = "a"; }).find("duplicate tensor name 'a'"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].name = "\xed\xa0\x80"; }).find("UTF-8"),
            std::string::npos);  // a UTF-16 surrogate
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].type = 31; }).find("unknown tensor type id 31"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].type = 13; }).find("Q5_K"), std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].dims = {1, 1, 1, 1, 6}; }).find("dimensions"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].dims = {}; }).find("dimensions"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) {
              i.tensors[0].dims = {uint64_t{1} << 32, uint64_t{1} << 32};
            }).find("overflow"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) { i.tensors[0].dims = {uint64_t{1} << 40, 2}; }).find("past the end"),
            std::string::npos);
  EXPECT_NE(error_for([](Image& i) {
              i.tensors[0].type = 8;  // Q8_0 rows must be multiples of 32
            }).find("block size"),
            std::string::npos);
}

TEST(GgufErrors, MisalignedAndOutOfRangeOffsets) {
  const auto image = two_tensor_image(32).build();
  const GgufFile good = parse(image);
  // Locate the second tensor's offset field: it is the last 8 bytes before the padding that ends
  // the info section, so find it by its value after the name "b.weight".
  const std::string name = "b.weight";
  auto it = std::search(image.begin(), image.end(), name.begin(), name.end());
  ASSERT_NE(it, image.end());
  const size_t offset_at = static_cast<size_t>(it - image.begin()) + name.size() + 4 + 3 * 8 + 4;
  uint64_t stored;
  std::memcpy(&stored, image.data() + offset_at, 8);
  ASSERT_EQ(stored, good.find_tensor("b.weight")->offset);
  for (uint64_t bad_offset : {stored + 4, uint64_t{1} << 40, ~uint64_t{0} - 31}) {
    auto bad = image;
    std::memcpy(bad.data() + offset_at, &bad_offset, 8);
    const std::string err = parse_error(bad);
    EXPECT_TRUE(err.find("aligned") != std::string::npos || err.find("past the end") != std::string::npos)
        << bad_offset << ": " << err;
  }
}

// ---- dequantization against element-wise references ----------------------------------------

float ref_f16(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 31;
  const int mant = h & 1023;
  if (exp == 31) return mant ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return static_cast<float>(sign * std::ldexp(mant, -24));
  return static_cast<float>(sign * std::ldexp(1024 + mant, exp - 25));
}

uint16_t u16_at(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Random bytes whose f16 fields (at the given offsets in each block) hold finite scales.
std::vector<uint8_t> random_blocks(size_t n_blocks, size_t block_bytes,
                                   const std::vector<size_t>& f16_at, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.1f, 0.1f);
  std::vector<uint8_t> b(n_blocks * block_bytes);
  for (auto& x : b) x = static_cast<uint8_t>(byte(rng));
  for (size_t blk = 0; blk < n_blocks; ++blk)
    for (size_t at : f16_at) {
      const uint16_t h = f32_to_f16(scale(rng));
      b[blk * block_bytes + at] = static_cast<uint8_t>(h & 0xff);
      b[blk * block_bytes + at + 1] = static_cast<uint8_t>(h >> 8);
    }
  return b;
}

// Element i of a Q4_0 / Q4_1 block: byte i % 16, low nibble for the first 16 values.
int nibble32(const uint8_t* qs, int i) { return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4); }

float ref_q4_0(const uint8_t* blk, int i) { return ref_f16(u16_at(blk)) * (nibble32(blk + 2, i) - 8); }
float ref_q4_1(const uint8_t* blk, int i) {
  return ref_f16(u16_at(blk)) * nibble32(blk + 4, i) + ref_f16(u16_at(blk + 2));
}
float ref_q8_0(const uint8_t* blk, int i) {
  return ref_f16(u16_at(blk)) * static_cast<int8_t>(blk[2 + i]);
}

// Q4_K: 8 sub-blocks of 32; 6-bit scale/min pairs: sub-blocks 0-3 use the low 6 bits of bytes
// 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from bytes 8-11 (scale: low
// nibble, min: high nibble) and their high 2 bits from the top bits of bytes 0-3 / 4-7.
float ref_q4_k(const uint8_t* blk, int i) {
  const float d = ref_f16(u16_at(blk));
  const float dmin = ref_f16(u16_at(blk + 2));
  const uint8_t* s = blk + 4;
  const int sub = i / 32;
  int sc, mn;
  if (sub < 4) {
    sc = s[sub] % 64;
    mn = s[sub + 4] % 64;
  } else {
    sc = s[sub + 4] % 16 + (s[sub - 4] / 64) * 16;
    mn = s[sub + 4] / 16 + (s[sub] / 64) * 16;
  }
  const uint8_t byte = blk[16 + (sub / 2) * 32 + i % 32];
  const int q = sub % 2 == 0 ? byte % 16 : byte / 16;
  return d * sc * q - dmin * mn;
}

// Q6_K: 256 values in two halves of 128; in a half, value v takes its low 4 bits from ql byte
// v % 64 (low nibble if v < 64) and its high 2 bits from qh byte v % 32, bit pair v / 32; int8
// scale per 16 values; d at the end.
float ref_q6_k(const uint8_t* blk, int i) {
  const int half = i / 128, v = i % 128;
  const uint8_t l = blk[half * 64 + v % 64];
  const uint8_t h = blk[128 + half * 32 + v % 32];
  const int lo = v < 64 ? l % 16 : l / 16;
  const int hi = (h >> (2 * (v / 32))) % 4;
  const int q = lo + 16 * hi - 32;
  const auto scale = static_cast<int8_t>(blk[192 + i / 16]);
  return ref_f16(u16_at(blk + 208)) * scale * q;
}

struct QuantCase {
  GgmlType type;
  size_t block_bytes;
  int block_elems;
  std::vector<size_t> f16_at;
  float (*ref)(const uint8_t*, int);
};

TEST(Dequant, BlockFormatsMatchElementwiseReference) {
  const std::vector<QuantCase> cases = {
      {GgmlType::Q4_0, 18, 32, {0}, ref_q4_0},
      {GgmlType::Q4_1, 20, 32, {0, 2}, ref_q4_1},
      {GgmlType::Q8_0, 34, 32, {0}, ref_q8_0},
      {GgmlType::Q4_K, 144, 256, {0, 2}, ref_q4_k},
      {GgmlType::Q6_K, 210, 256, {208}, ref_q6_k},
  };
  for (const QuantCase& c : cases) {
    SCOPED_TRACE(ggml_type_name(c.type));
    EXPECT_EQ(ggml_block_bytes(c.type), c.block_bytes);
    EXPECT_EQ(ggml_block_elements(c.type), static_cast<uint64_t>(c.block_elems));
    const size_t n_blocks = 37;
    const auto src = random_blocks(n_blocks, c.block_bytes, c.f16_at, 1234);
    std::vector<float> got(n_blocks * c.block_elems);
    dequantize_row(c.type, src.data(), got.data(), got.size());
    for (size_t b = 0; b < n_blocks; ++b)
      for (int i = 0; i < c.block_elems; ++i) {
        const float want = c.ref(src.data() + b * c.block_bytes, i);
        const float g = got[b * c.block_elems + i];
        ASSERT_NEAR(g, want, 1e-6f * std::max(1.0f, std::fabs(want))) << "block " << b << " i " << i;
      }
    EXPECT_THROW(dequantize_row(c.type, src.data(), got.data(), c.block_elems + 1), Error);
  }
}

TEST(Dequant, FloatFormats) {
  std::vector<uint8_t> f16(2 * 65536), bf16(2 * 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    f16[2 * h] = bf16[2 * h] = static_cast<uint8_t>(h & 0xff);
    f16[2 * h + 1] = bf16[2 * h + 1] = static_cast<uint8_t>(h >> 8);
  }
  std::vector<float> out(65536);
  dequantize_row(GgmlType::F16, f16.data(), out.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = ref_f16(static_cast<uint16_t>(h));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(out[h])) << h;
    else
      ASSERT_EQ(out[h], want) << h;
  }
  dequantize_row(GgmlType::BF16, bf16.data(), out.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    // bf16 is the top half of an fp32: sign, 8 exponent bits, 7 mantissa bits.
    const int exp = (h >> 7) & 255, mant = h & 127;
    const double sign = (h >> 15) ? -1.0 : 1.0;
    if (exp == 255) {
      if (mant) EXPECT_TRUE(std::isnan(out[h])) << h;
      else EXPECT_EQ(out[h], static_cast<float>(sign * INFINITY));
      continue;
    }
    const double want = exp == 0 ? sign * std::ldexp(mant, -133) : sign * std::ldexp(128 + mant, exp - 134);
    ASSERT_EQ(out[h], static_cast<float>(want)) << h;
  }
  const std::vector<float> f32 = {1.0f, -0.0f, 3.25e-30f, INFINITY};
  const auto f32b = f32_bytes(f32);
  dequantize_row(GgmlType::F32, f32b.data(), out.data(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(std::memcmp(&out[i], &f32[i], 4), 0);
}

TEST(HalfConversion, RoundTripsAndRoundsToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << h;
  }
  // Midpoints between neighbouring positive finite halves go to the one with an even mantissa;
  // anything above the midpoint goes up.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = ref_f16(static_cast<uint16_t>(h)), hi = ref_f16(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);  // exactly representable in fp32
    ASSERT_EQ(f32_to_f16(mid), (h % 2 == 0) ? h : h + 1) << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, INFINITY)), h + 1) << h;
    ASSERT_EQ(f32_to_f16(-std::nextafter(mid, 0.0f)), 0x8000u | h) << h;
  }
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00u);
  EXPECT_EQ(f32_to_f16(-1e6f), 0xfc00u);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bffu);
}

// The value of a bf16 bit pattern in double; the pattern just past the largest finite value
// counts as 2^128, the point where rounding to nearest goes to infinity.
double bf16_value(uint16_t p) {
  const int exp = (p >> 7) & 255, mant = p & 127;
  const double sign = (p >> 15) ? -1.0 : 1.0;
  if (exp == 255) return sign * std::ldexp(1.0, 128);
  return exp == 0 ? sign * std::ldexp(mant, -133) : sign * std::ldexp(128 + mant, exp - 134);
}

TEST(HalfConversion, Bf16RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int n = 0; n < 200000; ++n) {
    const uint32_t u = n < 4 ? std::vector<uint32_t>{0x7f7f8000u, 0x7f7fffffu, 0x3f808000u, 0x3f818000u}[n]
                             : bits(rng);
    const float f = bits_to_f32(u);
    const uint16_t b = f32_to_bf16(f);
    const auto down = static_cast<uint16_t>(u >> 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(b)));
      continue;
    }
    if (std::isinf(f)) {
      EXPECT_EQ(b, down);
      continue;
    }
    // Nearer of the truncation and the next pattern away from zero; ties to the even one.
    const double dist_down = std::fabs(f - bf16_value(down));
    const double dist_up = std::fabs(bf16_value(static_cast<uint16_t>(down + 1)) - f);
    const bool up = dist_up < dist_down || (dist_up == dist_down && (down & 1));
    ASSERT_EQ(b, up ? down + 1 : down) << std::hex << u;
  }
}

}  // namespace
}  // namespace spin
