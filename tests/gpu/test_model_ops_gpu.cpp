// The bf16 model-path kernels (kernels/cuda/model_ops.h) against the CPU reference kernels on the
// same bf16-rounded inputs: fresh random inputs each run (seed printed), every output buffer
// poisoned with 0xFF bytes (NaN in bf16/fp32) before the launch so unwritten outputs fail.
// Tolerances: copies and conversions are exact; bf16 results of fp32 math pass when
// max |gpu - ref| / max(|ref|, 0.05 * rms(ref)) <= 1e-2 (bf16 rounding alone gives <= 2^-9).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "base/half.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/model_ops.h"
#include "model/rope.h"

namespace spin {
namespace {

std::vector<float> to_float(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}

// The tolerance measure stated at the top; infinite for any non-finite output.
double bf16_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double ss = 0.0;
  for (float r : ref) ss += static_cast<double>(r) * r;
  const double floor = 0.05 * std::sqrt(ss / std::max<size_t>(ref.size(), 1));
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::abs(got[i] - ref[i]) / std::max<double>(std::abs(ref[i]), floor));
  }
  return worst;
}

constexpr double kBf16Tol = 1e-2;

class GpuModelOps : public SeededGpuTest<std::mt19937> {
 protected:
  // Distinct (page, slot) for every (token, KV head), pages below n_pages. A slot may be shared by
  // every (token, head), so n_pages must exceed the pairs: the search for a free page always ends.
  void random_slots(int64_t n_tokens, int n_kv_heads, int page_size, int n_pages, std::vector<int32_t>& page_of,
                    std::vector<int32_t>& slot_of) {
    slot_of.assign(n_tokens, 0);
    page_of.assign(n_tokens * n_kv_heads, 0);
    std::set<std::pair<int32_t, int32_t>> used;
    std::uniform_int_distribution<int32_t> pick_page(0, n_pages - 1), pick_slot(0, page_size - 1);
    for (int64_t t = 0; t < n_tokens; ++t) {
      slot_of[t] = pick_slot(rng_);
      for (int h = 0; h < n_kv_heads; ++h) {
        int32_t page;
        do page = pick_page(rng_);
        while (!used.insert({page, slot_of[t]}).second);
        page_of[t * n_kv_heads + h] = page;
      }
    }
  }
};

// ---- embedding and row gather: exact copies ---------------------------------------------------

TEST_F(GpuModelOps, EmbeddingAndGatherCopyExactRows) {
  // (table rows, width, tokens): SmolLM2 and Qwen3-14B hidden sizes (16-byte path), a width of
  // 6 (4-byte path) and an odd width (2-byte path).
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {1000, 576, 7}, {3000, 5120, 33}, {50, 6, 1}, {70, 77, 19}};
  for (const auto& [n_rows, width, n] : shapes) {
    const std::vector<uint16_t> table = random_bf16(n_rows * width, 1.0f);
    std::vector<int32_t> ids(n);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(n_rows - 1));
    for (int32_t& id : ids) id = pick(rng_);
    ids.front() = static_cast<int32_t>(n_rows - 1);  // the last row is reachable
    if (n > 2) ids[1] = ids[2];                      // repeats are fine
    std::vector<uint16_t> expect(n * width);
    for (int64_t t = 0; t < n; ++t)
      std::copy_n(table.begin() + ids[t] * width, width, expect.begin() + t * width);

    DeviceArray<uint16_t> d_table(table), d_out(n * width), d_out2(n * width);
    DeviceArray<int32_t> d_ids(ids);
    CUDA_OK(d_table.status());
    CUDA_OK(d_out.status());
    CUDA_OK(d_out2.status());
    CUDA_OK(d_ids.status());
    CUDA_OK(cuda::embedding_bf16(d_ids.get(), n, bf16_ptr(d_table), width, bf16_ptr(d_out), nullptr));
    CUDA_OK(cuda::gather_rows_bf16(bf16_ptr(d_table), d_ids.get(), n, width, bf16_ptr(d_out2),
                                   nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(d_out.download() == expect) << "embedding width " << width;
    EXPECT_TRUE(d_out2.download() == expect) << "gather width " << width;
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------

TEST_F(GpuModelOps, SiluMulMatchesCpu) {
  // (tokens, ffn): SmolLM2 (1536), Qwen3-14B (17408) on the 16-byte path, an odd ffn.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1536}, {7, 1536}, {5, 17408}, {3, 13}};
  for (const auto& [n, ffn] : shapes) {
    const std::vector<uint16_t> gate_up = random_bf16(n * 2 * ffn, 2.0f);
    std::vector<float> ref(n * ffn);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<float> gate(ffn), up(ffn);
      for (int64_t i = 0; i < ffn; ++i) {
        gate[i] = bf16_to_f32(gate_up[t * 2 * ffn + i]);
        up[i] = bf16_to_f32(gate_up[t * 2 * ffn + ffn + i]);
      }
      cpu::silu_mul(gate.data(), up.data(), ffn);
      std::copy(gate.begin(), gate.end(), ref.begin() + t * ffn);
    }
    DeviceArray<uint16_t> d_in(gate_up), d_out(n * ffn);
    CUDA_OK(d_in.status());
    CUDA_OK(d_out.status());
    CUDA_OK(cuda::silu_mul_bf16(bf16_ptr(d_in), n, ffn, bf16_ptr(d_out), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LE(bf16_error(to_float(d_out.download()), ref), kBf16Tol) << n << "x" << ffn;
  }
}

// ---- conversions -------------------------------------------------------------------------------

TEST_F(GpuModelOps, ConversionsAreExact) {
  const int64_t n = 1000003;  // odd: the tail after the 8-wide units
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng_) * std::exp2(static_cast<float>(static_cast<int>(dist(rng_)) * 4));
  std::vector<uint16_t> expect_bf16(n);
  for (int64_t i = 0; i < n; ++i) expect_bf16[i] = f32_to_bf16(f[i]);
  std::vector<float> expect_f32(n);
  for (int64_t i = 0; i < n; ++i) expect_f32[i] = bf16_to_f32(expect_bf16[i]);

  DeviceArray<float> d_f(f), d_back(n + 1);
  DeviceArray<uint16_t> d_b(n + 1);
  CUDA_OK(d_f.status());
  CUDA_OK(d_back.status());
  CUDA_OK(d_b.status());
  // Aligned (vector path), then shifted by one element (scalar path).
  for (int64_t shift : {0, 1}) {
    CUDA_OK(cudaMemset(d_b.get(), 0xff, (n + 1) * 2));
    CUDA_OK(cudaMemset(d_back.get(), 0xff, (n + 1) * 4));
    CUDA_OK(cuda::convert_f32_to_bf16(d_f.get(), bf16_ptr(d_b) + shift, n, nullptr));
    CUDA_OK(cuda::convert_bf16_to_f32(bf16_ptr(d_b) + shift, d_back.get() + shift, n, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> b = d_b.download();
    const std::vector<float> back = d_back.download();
    EXPECT_TRUE(std::equal(expect_bf16.begin(), expect_bf16.end(), b.begin() + shift))
        << "f32 -> bf16, shift " << shift;
    EXPECT_TRUE(std::memcmp(expect_f32.data(), back.data() + shift, n * 4) == 0)
        << "bf16 -> f32, shift " << shift;
  }
}

// ---- q/k norm + RoPE ---------------------------------------------------------------------------

struct RopeCase {
  const char* name;
  int n_heads, n_kv_heads, head_dim;
  int64_t n_tokens;
  bool qk_norm;
  bool k_pre_rope;
  RopeConfig rope;
  int32_t max_position;
};

RopeConfig rope_config(float theta, bool neox, RopeScaling scaling, float factor) {
  RopeConfig c;
  c.theta = theta;
  c.neox = neox;
  c.scaling = scaling;
  c.factor = factor;
  return c;
}

// CPU reference of one case: per-head RMSNorm (cpu::rmsnorm), k before RoPE, then cpu::rope.
struct RopeReference {
  std::vector<float> q, k, k_pre;
};

RopeReference rope_reference(const RopeCase& c, const RopeTable& table, bool neox,
                             const std::vector<uint16_t>& qkv, int64_t row_stride,
                             const std::vector<int32_t>& positions, const std::vector<float>& q_norm,
                             const std::vector<float>& k_norm, float eps) {
  const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.n_kv_heads} * c.head_dim;
  RopeReference r;
  r.q.resize(c.n_tokens * q_width);
  r.k.resize(c.n_tokens * kv_width);
  r.k_pre.resize(c.n_tokens * kv_width);
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    float* q = &r.q[t * q_width];
    float* k = &r.k[t * kv_width];
    for (int64_t i = 0; i < q_width; ++i) q[i] = bf16_to_f32(qkv[t * row_stride + i]);
    for (int64_t i = 0; i < kv_width; ++i) k[i] = bf16_to_f32(qkv[t * row_stride + q_width + i]);
    if (c.qk_norm) {
      cpu::rmsnorm(q, q_norm.data(), q, c.n_heads, c.head_dim, eps);
      cpu::rmsnorm(k, k_norm.data(), k, c.n_kv_heads, c.head_dim, eps);
    }
    std::copy_n(k, kv_width, &r.k_pre[t * kv_width]);
    cpu::rope(q, c.n_heads, c.head_dim, positions[t], table.inv_freq.data(), table.mscale, neox);
    cpu::rope(k, c.n_kv_heads, c.head_dim, positions[t], table.inv_freq.data(), table.mscale, neox);
  }
  return r;
}

TEST_F(GpuModelOps, QkNormRopeMatchesCpu) {
  RopeConfig yarn = rope_config(1e6f, true, RopeScaling::Yarn, 4.0f);
  yarn.original_max_position = 32768;
  RopeConfig llama3 = rope_config(500000.0f, false, RopeScaling::Llama3, 8.0f);
  const std::vector<RopeCase> cases = {
      {"SmolLM2-135M neox", 9, 3, 64, 5, false, false, rope_config(100000.0f, true, RopeScaling::None, 1.0f), 8192},
      {"SmolLM2-135M interleaved", 9, 3, 64, 1, false, true, rope_config(100000.0f, false, RopeScaling::None, 1.0f), 8192},
      {"Qwen3-14B qk-norm", 40, 8, 128, 13, true, true, rope_config(1e6f, true, RopeScaling::None, 1.0f), 40960},
      {"Llama-3 scaled interleaved", 32, 8, 128, 3, false, false, llama3, 131072},
      {"YaRN qk-norm", 16, 4, 64, 11, true, true, yarn, 131072},
      {"head_dim 256 interleaved qk-norm", 4, 2, 256, 7, true, true, rope_config(10000.0f, false, RopeScaling::None, 1.0f), 4096},
      {"head_dim 48 neox", 6, 2, 48, 4, false, true, rope_config(10000.0f, true, RopeScaling::None, 1.0f), 2048},
  };
  const float eps = 1e-6f;
  for (const RopeCase& c : cases) {
    SCOPED_TRACE(c.name);
    const RopeTable table = make_rope_table(c.rope, c.head_dim);
    if (c.rope.scaling == RopeScaling::Yarn) {
      ASSERT_NE(table.mscale, 1.0f);
    }
    const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
    const int64_t kv_width = int64_t{c.n_kv_heads} * c.head_dim;
    const int64_t row_stride = q_width + 2 * kv_width + 8;  // padding after v must stay untouched
    const std::vector<uint16_t> qkv = random_bf16(c.n_tokens * row_stride, 1.5f);
    std::vector<int32_t> positions(c.n_tokens);
    std::uniform_int_distribution<int32_t> pick(0, c.max_position - 1);
    for (int32_t& p : positions) p = pick(rng_);
    positions.back() = c.max_position - 1;
    std::vector<uint16_t> q_norm, k_norm;
    std::vector<float> q_norm_f, k_norm_f;
    if (c.qk_norm) {
      q_norm = random_bf16(c.head_dim, 0.3f);
      k_norm = random_bf16(c.head_dim, 0.3f);
      for (uint16_t& w : q_norm) w = f32_to_bf16(1.0f + bf16_to_f32(w));
      for (uint16_t& w : k_norm) w = f32_to_bf16(1.0f + bf16_to_f32(w));
      q_norm_f = to_float(q_norm);
      k_norm_f = to_float(k_norm);
    }
    const RopeReference ref =
        rope_reference(c, table, c.rope.neox, qkv, row_stride, positions, q_norm_f, k_norm_f, eps);

    DeviceArray<uint16_t> d_qkv(qkv), d_pre(c.n_tokens * kv_width), d_qn(q_norm), d_kn(k_norm);
    DeviceArray<int32_t> d_pos(positions);
    DeviceArray<float> d_freq(table.inv_freq);
    CUDA_OK(d_qkv.status());
    CUDA_OK(d_pre.status());
    CUDA_OK(d_qn.status());
    CUDA_OK(d_kn.status());
    CUDA_OK(d_pos.status());
    CUDA_OK(d_freq.status());
    cuda::QkRopeParams p;
    p.qkv = bf16_ptr(d_qkv);
    p.row_stride = row_stride;
    p.k_pre_rope = c.k_pre_rope ? bf16_ptr(d_pre) : nullptr;
    p.positions = d_pos.get();
    p.n_tokens = c.n_tokens;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = c.head_dim;
    p.q_norm = c.qk_norm ? bf16_ptr(d_qn) : nullptr;
    p.k_norm = c.qk_norm ? bf16_ptr(d_kn) : nullptr;
    p.norm_eps = eps;
    p.inv_freq = d_freq.get();
    p.mscale = table.mscale;
    p.neox = c.rope.neox;
    CUDA_OK(cuda::qk_norm_rope_bf16(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = d_qkv.download();

    std::vector<float> q(c.n_tokens * q_width), k(c.n_tokens * kv_width);
    bool rest_untouched = true;  // v heads and row padding, bit for bit
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      for (int64_t i = 0; i < q_width; ++i) q[t * q_width + i] = bf16_to_f32(out[t * row_stride + i]);
      for (int64_t i = 0; i < kv_width; ++i)
        k[t * kv_width + i] = bf16_to_f32(out[t * row_stride + q_width + i]);
      for (int64_t i = q_width + kv_width; i < row_stride; ++i)
        rest_untouched &= out[t * row_stride + i] == qkv[t * row_stride + i];
    }
    EXPECT_LE(bf16_error(q, ref.q), kBf16Tol);
    EXPECT_LE(bf16_error(k, ref.k), kBf16Tol);
    EXPECT_TRUE(rest_untouched);
    if (c.k_pre_rope) {
      EXPECT_LE(bf16_error(to_float(d_pre.download()), ref.k_pre), kBf16Tol);
    }

    // The check tells the pairings apart: the other pairing's reference is far off.
    const RopeReference other =
        rope_reference(c, table, !c.rope.neox, qkv, row_stride, positions, q_norm_f, k_norm_f, eps);
    EXPECT_GT(bf16_error(q, other.q), 0.1);
  }
}

// ---- KV page stores ----------------------------------------------------------------------------

TEST_F(GpuModelOps, StoreKvPagesScattersToSlotsOnly) {
  struct Case {
    int n_heads, n_kv_heads, head_dim, page_size;
    int64_t n_tokens;
    int64_t row_pad;  // 0: 16-byte path; odd: element path
  };
  const std::vector<Case> cases = {
      {9, 3, 64, 16, 37, 0},   // SmolLM2-135M
      {40, 8, 128, 16, 21, 0}, // Qwen3-14B
      {40, 8, 128, 64, 1, 0},  // one decode token, big pages
      {4, 2, 20, 8, 13, 3},    // unaligned rows
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "kv heads " << c.n_kv_heads << " head_dim " << c.head_dim
                                    << " page " << c.page_size << " tokens " << c.n_tokens);
    const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
    const int64_t kv_width = int64_t{c.n_kv_heads} * c.head_dim;
    const int64_t row_stride = q_width + 2 * kv_width + c.row_pad;
    const std::vector<uint16_t> qkv = random_bf16(c.n_tokens * row_stride, 1.0f);
    const int n_pages = static_cast<int>(c.n_tokens * c.n_kv_heads + 4);
    std::vector<int32_t> slot_of, page_of;
    random_slots(c.n_tokens, c.n_kv_heads, c.page_size, n_pages, page_of, slot_of);
    const int64_t page_elems = 2 * int64_t{c.page_size} * c.head_dim;
    std::vector<uint16_t> expect(n_pages * page_elems, 0xffff);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        uint16_t* page = &expect[page_of[t * c.n_kv_heads + h] * page_elems];
        const uint16_t* k = &qkv[t * row_stride + q_width + int64_t{h} * c.head_dim];
        std::copy_n(k, c.head_dim, page + int64_t{slot_of[t]} * c.head_dim);
        std::copy_n(k + kv_width, c.head_dim,
                    page + (int64_t{c.page_size} + slot_of[t]) * c.head_dim);
      }
    }
    // The first q_rows tokens' q heads, packed without the row stride; one row more stays poisoned.
    const int64_t q_rows = c.n_tokens / 2 + 1;
    std::vector<uint16_t> expect_q((q_rows + 1) * q_width, 0xffff);
    for (int64_t t = 0; t < q_rows; ++t)
      std::copy_n(&qkv[t * row_stride], q_width, &expect_q[t * q_width]);
    DeviceArray<uint16_t> d_qkv(qkv), d_pool(expect.size()), d_q(expect_q.size());
    DeviceArray<int32_t> d_page(page_of), d_slot(slot_of);
    CUDA_OK(d_qkv.status());
    CUDA_OK(d_pool.status());  // poisoned with 0xFF by construction
    CUDA_OK(d_q.status());
    CUDA_OK(d_page.status());
    CUDA_OK(d_slot.status());
    CUDA_OK(cuda::store_kv_pages_bf16(bf16_ptr(d_qkv), row_stride, q_width, d_page.get(),
                                      d_slot.get(), c.n_tokens, c.n_kv_heads, c.head_dim,
                                      c.page_size, bf16_ptr(d_pool), nullptr,
                                      cuda::QueryCopy{bf16_ptr(d_q), q_rows}));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(d_pool.download() == expect);
    EXPECT_TRUE(d_q.download() == expect_q);
  }
}

// The fused launch (norm, RoPE, page store and q packing) against the two launches it replaces,
// which the tests above check against the CPU: the same bits in qkv, the pages and the packed q.
TEST_F(GpuModelOps, RopeThatStoresPagesEqualsRopeThenStore) {
  struct Case {
    int n_heads, n_kv_heads, head_dim, page_size;
    int64_t n_tokens, row_pad;
    bool qk_norm, neox;
  };
  const std::vector<Case> cases = {
      {40, 8, 128, 16, 1, 0, true, true},    // Qwen3-14B, one decode row
      {32, 8, 128, 16, 19, 0, false, true},  // Llama-3.1-8B, a decode batch and a prefill chunk
      {9, 3, 64, 64, 37, 0, false, true},    // SmolLM2-135M, big pages
      {4, 2, 20, 8, 13, 3, true, false},     // unaligned rows, adjacent pairs
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "heads " << c.n_heads << "/" << c.n_kv_heads << " x " << c.head_dim
                                    << " tokens " << c.n_tokens << " norm " << c.qk_norm << " neox " << c.neox);
    const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
    const int64_t row_stride = q_width + 2 * int64_t{c.n_kv_heads} * c.head_dim + c.row_pad;
    const std::vector<uint16_t> qkv = random_bf16(c.n_tokens * row_stride, 1.0f);
    const int n_pages = static_cast<int>(c.n_tokens * c.n_kv_heads + 4);
    std::vector<int32_t> slot_of, page_of, positions(c.n_tokens);
    random_slots(c.n_tokens, c.n_kv_heads, c.page_size, n_pages, page_of, slot_of);
    std::uniform_int_distribution<int32_t> pick_position(0, 1 << 17);
    for (int32_t& p : positions) p = pick_position(rng_);
    const RopeTable table = make_rope_table(rope_config(5e5f, c.neox, RopeScaling::None, 1.0f), c.head_dim);
    const std::vector<uint16_t> q_norm = random_bf16(c.head_dim, 1.0f), k_norm = random_bf16(c.head_dim, 1.0f);
    const int64_t q_rows = (c.n_tokens + 1) / 2;
    const size_t pool_elems = static_cast<size_t>(n_pages) * 2 * c.page_size * c.head_dim;
    DeviceArray<int32_t> d_page(page_of), d_slot(slot_of), d_pos(positions);
    DeviceArray<float> d_freq(table.inv_freq);
    DeviceArray<uint16_t> d_qn(q_norm), d_kn(k_norm);
    struct Outputs {
      std::vector<uint16_t> qkv, pool, q;
    };
    const auto run = [&](bool fused) -> Outputs {
      DeviceArray<uint16_t> d_qkv(qkv), d_pool(pool_elems), d_q((q_rows + 1) * q_width);  // poisoned
      cuda::QkRopeParams p{.qkv = bf16_ptr(d_qkv),
                           .row_stride = row_stride,
                           .positions = d_pos.get(),
                           .n_tokens = c.n_tokens,
                           .n_heads = c.n_heads,
                           .n_kv_heads = c.n_kv_heads,
                           .head_dim = c.head_dim,
                           .q_norm = c.qk_norm ? bf16_ptr(d_qn) : nullptr,
                           .k_norm = c.qk_norm ? bf16_ptr(d_kn) : nullptr,
                           .inv_freq = d_freq.get(),
                           .mscale = table.mscale,
                           .neox = c.neox};
      const cuda::QueryCopy q_copy{bf16_ptr(d_q), q_rows};
      if (fused) {
        p.kv_pool = bf16_ptr(d_pool);
        p.page_of = d_page.get();
        p.slot_of = d_slot.get();
        p.page_size = c.page_size;
        p.q_copy = q_copy;
        EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaSuccess);
      } else {
        EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaSuccess);
        EXPECT_EQ(cuda::store_kv_pages_bf16(bf16_ptr(d_qkv), row_stride, q_width, d_page.get(), d_slot.get(),
                                          c.n_tokens, c.n_kv_heads, c.head_dim, c.page_size, bf16_ptr(d_pool),
                                          nullptr, q_copy),
                  cudaSuccess);
      }
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return Outputs{d_qkv.download(), d_pool.download(), d_q.download()};
    };
    const Outputs apart = run(false), fused = run(true);
    EXPECT_TRUE(fused.qkv == apart.qkv);
    EXPECT_TRUE(fused.pool == apart.pool);
    EXPECT_TRUE(fused.q == apart.q);
    EXPECT_FALSE(fused.qkv == qkv);  // RoPE moved q and k
  }
}

TEST_F(GpuModelOps, RejectsBadShapes) {
  cuda::QkRopeParams p;
  p.n_tokens = 1;
  p.n_heads = 2;
  p.n_kv_heads = 1;
  p.head_dim = 258;  // above the 256 limit
  p.row_stride = 4 * 258;
  EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 63;  // odd
  EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaErrorInvalidValue);
  std::vector<uint16_t> buffer(4 * 64);
  DeviceArray<uint16_t> d_buffer(buffer);
  DeviceArray<int32_t> d_index(std::vector<int32_t>{0});
  DeviceArray<float> d_freq(std::vector<float>(32, 1.0f));
  p.head_dim = 64;
  p.row_stride = 4 * 64;
  p.qkv = bf16_ptr(d_buffer);
  p.positions = d_index.get();
  p.inv_freq = d_freq.get();
  p.kv_pool = bf16_ptr(d_buffer);  // pages without their tables
  EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaErrorInvalidValue);
  p.kv_pool = nullptr;
  p.q_copy = cuda::QueryCopy{bf16_ptr(d_buffer), 2};  // more q rows than tokens
  EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaErrorInvalidValue);
  p.q_copy = cuda::QueryCopy{};
  EXPECT_EQ(cuda::qk_norm_rope_bf16(p, nullptr), cudaSuccess);
  EXPECT_EQ(cuda::store_kv_pages_bf16(nullptr, 10, 8, nullptr, nullptr, 1, 1, 4, 16, nullptr,
                                      nullptr),
            cudaErrorInvalidValue);  // row_stride < q_width + 2 * kv_width
  EXPECT_EQ(cuda::store_kv_pages_bf16(nullptr, 16, 8, nullptr, nullptr, 1, 1, 4, 16, nullptr, nullptr,
                                      cuda::QueryCopy{nullptr, 2}),
            cudaErrorInvalidValue);  // more q rows than tokens
  EXPECT_EQ(cuda::silu_mul_bf16(nullptr, 1, 0, nullptr, nullptr), cudaErrorInvalidValue);
}

// Achieved bandwidth on the shapes of a Qwen3-14B prefill chunk (reported, not asserted).
TEST_F(GpuModelOps, BandwidthReport) {
  const int64_t n = 4096, ffn = 17408, hidden = 5120;
  const int n_heads = 40, n_kv = 8, hd = 128;
  const int64_t row = int64_t{n_heads + 2 * n_kv} * hd;
  DeviceArray<uint16_t> gate_up(n * 2 * ffn), act(n * ffn), table(152064 * hidden), emb(n * hidden),
      qkv(n * row), pool(int64_t{n} * n_kv * 2 * hd);
  std::vector<int32_t> ids(n), pos(n), pages(n * n_kv), slots(n, 0);
  std::uniform_int_distribution<int32_t> pick(0, 152063);
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = pick(rng_);
    pos[i] = static_cast<int32_t>(i);
  }
  for (int64_t i = 0; i < n * n_kv; ++i) pages[i] = static_cast<int32_t>(i);  // page size 1
  CUDA_OK(cudaMemset(gate_up.get(), 0, n * 2 * ffn * 2));
  CUDA_OK(cudaMemset(qkv.get(), 0, n * row * 2));
  DeviceArray<int32_t> d_ids(ids), d_pos(pos), d_pages(pages), d_slots(slots);
  const RopeTable rope = make_rope_table(rope_config(1e6f, true, RopeScaling::None, 1.0f), hd);
  DeviceArray<float> d_freq(rope.inv_freq);
  DeviceArray<uint16_t> norm(std::vector<uint16_t>(hd, f32_to_bf16(1.0f)));
  cuda::QkRopeParams p;
  p.qkv = bf16_ptr(qkv);
  p.row_stride = row;
  p.positions = d_pos.get();
  p.n_tokens = n;
  p.n_heads = n_heads;
  p.n_kv_heads = n_kv;
  p.head_dim = hd;
  p.q_norm = p.k_norm = bf16_ptr(norm);
  p.inv_freq = d_freq.get();

  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  auto time_us = [&](auto&& launch) {
    launch();
    cudaEventRecord(start);
    for (int i = 0; i < 10; ++i) launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    return ms * 100.0;  // per launch, microseconds
  };
  const double silu = time_us([&] { cuda::silu_mul_bf16(bf16_ptr(gate_up), n, ffn, bf16_ptr(act), nullptr); });
  const double embed = time_us([&] {
    cuda::embedding_bf16(d_ids.get(), n, bf16_ptr(table), hidden, bf16_ptr(emb), nullptr);
  });
  const double rope_us = time_us([&] { cuda::qk_norm_rope_bf16(p, nullptr); });
  const double store = time_us([&] {
    cuda::store_kv_pages_bf16(bf16_ptr(qkv), row, int64_t{n_heads} * hd, d_pages.get(),
                              d_slots.get(), n, n_kv, hd, 1, bf16_ptr(pool), nullptr);
  });
  CUDA_OK(cudaGetLastError());
  auto gbps = [](double bytes, double us) { return bytes / us / 1e3; };
  std::printf("silu_mul  %dx%d: %.1f us, %.0f GB/s\n", static_cast<int>(n), static_cast<int>(ffn),
              silu, gbps(n * ffn * 6.0, silu));
  std::printf("embedding %dx%d: %.1f us, %.0f GB/s\n", static_cast<int>(n),
              static_cast<int>(hidden), embed, gbps(n * hidden * 4.0, embed));
  std::printf("qk_norm_rope %d tokens 40/8x128: %.1f us, %.0f GB/s\n", static_cast<int>(n),
              rope_us, gbps(n * (n_heads + n_kv) * hd * 4.0, rope_us));
  std::printf("store_kv_pages %d tokens 8x128: %.1f us, %.0f GB/s\n", static_cast<int>(n), store,
              gbps(n * n_kv * hd * 2 * 4.0, store));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace spin
