// Dequantization of the ggml block formats spin loads (layouts as ggml stores them on disk).
#include <cstring>

#include "base/error.h"
#include "base/half.h"
#include "model/gguf.h"

namespace spin {

namespace {

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Q4_0 block (18 bytes, 32 values): f16 scale d, then 16 bytes whose low nibbles are values 0..15
// and high nibbles values 16..31; value = d * (nibble - 8).
void dequant_q4_0(const uint8_t* src, float* dst, uint64_t n_blocks) {
  for (uint64_t b = 0; b < n_blocks; ++b, src += 18, dst += 32) {
    const float d = load_f16(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}

// Q4_1 block (20 bytes, 32 values): f16 scale d, f16 minimum m, 16 nibble bytes as in Q4_0;
// value = d * nibble + m.
void dequant_q4_1(const uint8_t* src, float* dst, uint64_t n_blocks) {
  for (uint64_t b = 0; b < n_blocks; ++b, src += 20, dst += 32) {
    const float d = load_f16(src);
    const float m = load_f16(src + 2);
    const uint8_t* qs = src + 4;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      dst[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// Q8_0 block (34 bytes, 32 values): f16 scale d, 32 int8 values; value = d * q.
void dequant_q8_0(const uint8_t* src, float* dst, uint64_t n_blocks) {
  for (uint64_t b = 0; b < n_blocks; ++b, src += 34, dst += 32) {
    const float d = load_f16(src);
    const auto* qs = reinterpret_cast<const int8_t*>(src + 2);
    for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(qs[j]);
  }
}

// Q4_K super-block (144 bytes, 256 values): f16 d, f16 dmin, 12 bytes packing eight 6-bit scales
// and eight 6-bit mins, then 128 nibble bytes. Sub-block s (32 values) uses byte chunk s/2, low
// nibbles for even s and high nibbles for odd s; value = d*scale[s]*q - dmin*min[s].
void dequant_q4_k(const uint8_t* src, float* dst, uint64_t n_blocks) {
  for (uint64_t b = 0; b < n_blocks; ++b, src += 144, dst += 256) {
    const float d = load_f16(src);
    const float dmin = load_f16(src + 2);
    const uint8_t* sc = src + 4;
    const uint8_t* qs = src + 16;
    for (int s = 0; s < 8; ++s) {
      uint8_t scale, min;
      if (s < 4) {
        scale = sc[s] & 63;
        min = sc[s + 4] & 63;
      } else {
        scale = static_cast<uint8_t>((sc[s + 4] & 0x0F) | ((sc[s - 4] >> 6) << 4));
        min = static_cast<uint8_t>((sc[s + 4] >> 4) | ((sc[s] >> 6) << 4));
      }
      const float ds = d * static_cast<float>(scale);
      const float dm = dmin * static_cast<float>(min);
      const uint8_t* q = qs + (s / 2) * 32;
      const int shift = (s % 2) * 4;
      float* out = dst + s * 32;
      for (int j = 0; j < 32; ++j) out[j] = ds * static_cast<float>((q[j] >> shift) & 0x0F) - dm;
    }
  }
}

// Q6_K super-block (210 bytes, 256 values): 128 bytes of low nibbles, 64 bytes of 2-bit high
// parts, 16 int8 scales (one per 16 values), f16 d; value = d * scale * (q - 32). Each half of
// 128 values takes 64 low-nibble bytes (low nibbles for values 0..63, high for 64..127) and 32
// high-bit bytes (bit pair k for values 32k..32k+31).
void dequant_q6_k(const uint8_t* src, float* dst, uint64_t n_blocks) {
  for (uint64_t b = 0; b < n_blocks; ++b, src += 210, dst += 256) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(src + 192);
    const float d = load_f16(src + 208);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* l = ql + half * 64;
      const uint8_t* h = qh + half * 32;
      float* out = dst + half * 128;
      for (int part = 0; part < 4; ++part) {
        const int l_shift = (part / 2) * 4;
        const int h_shift = part * 2;
        const uint8_t* lp = l + (part % 2) * 32;
        for (int group = 0; group < 2; ++group) {
          const float ds = d * static_cast<float>(scales[half * 8 + part * 2 + group]);
          for (int j = 0; j < 16; ++j) {
            const int k = group * 16 + j;
            const int q = ((lp[k] >> l_shift) & 0x0F) | (((h[k] >> h_shift) & 0x03) << 4);
            out[part * 32 + k] = ds * static_cast<float>(q - 32);
          }
        }
      }
    }
  }
}

}  // namespace

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, uint64_t n_elements) {
  const uint64_t block = ggml_block_elements(type);
  SPIN_CHECK(n_elements % block == 0, "dequantize: {} elements is not a multiple of the {} block {}",
             n_elements, ggml_type_name(type), block);
  const uint64_t n_blocks = n_elements / block;
  if (n_elements == 0) return;
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, n_elements * 4);
      return;
    case GgmlType::F16:
      for (uint64_t i = 0; i < n_elements; ++i) dst[i] = load_f16(src + 2 * i);
      return;
    case GgmlType::BF16:
      for (uint64_t i = 0; i < n_elements; ++i) dst[i] = bf16_to_f32(load_u16(src + 2 * i));
      return;
    case GgmlType::Q4_0: dequant_q4_0(src, dst, n_blocks); return;
    case GgmlType::Q4_1: dequant_q4_1(src, dst, n_blocks); return;
    case GgmlType::Q8_0: dequant_q8_0(src, dst, n_blocks); return;
    case GgmlType::Q4_K: dequant_q4_k(src, dst, n_blocks); return;
    case GgmlType::Q6_K: dequant_q6_k(src, dst, n_blocks); return;
  }
  fail("dequantize: unknown ggml tensor type id {}", static_cast<uint32_t>(type));
}

}  // namespace spin
