// Paged decode attention on the GPU against a float64 CPU reference written here, on fresh random
// inputs each run: random page permutations, partial last pages, GQA groups 1/4/5/8, head_dim
// 64/128, page sizes 8..64, forced split-K. Outputs are poisoned (NaN) before each run and pool
// slots past the last token hold NaN, so an unwritten output or a read past the list fails.
// Tolerance: relative Frobenius error <= 1e-2 (bf16 K/V/Q inputs; probabilities enter P*V as
// bf16, as in flash attention; bf16 output rounding adds 2^-9). The optional log-sum-exp output
// (check_lse) is compared per row with an absolute tolerance of 1e-3 (it sees no bf16 rounding:
// fp32 scores and fp32 sums of exponentials, so only fp32 summation error remains).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"
#include "paged_kv_test.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/paged_attention.h"

namespace spin {
namespace {

using namespace gpu_test;

struct Shape {
  int num_seqs;
  int num_kv_heads;
  int group;
  int head_dim;
  int page_size;
  std::vector<int> tokens;  // per item (seq-major, then KV head)
  int tokens_per_split;     // 0: automatic
  float q_scale;            // larger values make the softmax peakier
};

class GpuPagedAttention : public GpuTest {
 protected:

  // Runs one shape with bf16 or fp32 output; returns the relative error against the reference.
  template <typename OutT>
  void run(const Shape& s, double tolerance) {
    const int items = s.num_seqs * s.num_kv_heads;
    ASSERT_EQ(static_cast<int>(s.tokens.size()), items);
    const int d = s.head_dim, ps = s.page_size;
    const int num_q_heads = s.num_kv_heads * s.group;
    std::normal_distribution<float> normal(0.0f, 1.0f);

    // Page lists: random distinct physical pages out of a pool with spare pages.
    std::vector<int32_t> offsets(items + 1, 0);
    int max_tokens = 0;
    for (int i = 0; i < items; ++i) {
      offsets[i + 1] = offsets[i] + (s.tokens[i] + ps - 1) / ps;
      max_tokens = std::max(max_tokens, s.tokens[i]);
    }
    const int used_pages = offsets[items];
    const int pool_pages = used_pages + 5;
    const std::vector<int32_t> ids = random_page_ids(used_pages, pool_pages, rng);
    // With fill_pages: one more page per list entry after those, a fill target.
    const int fill_first = pool_pages;
    const int all_pages = pool_pages + (fill_pages ? used_pages : 0);

    // Pool: random bf16 everywhere, NaN in slots no list covers (tails of partial pages, spares).
    const size_t page_elems = static_cast<size_t>(2) * ps * d;
    std::vector<uint16_t> pool(page_elems * all_pages, kBf16Nan);
    for (int i = 0; i < items; ++i) {
      for (int t = 0; t < s.tokens[i]; ++t) {
        const size_t base = key_offset(ids, offsets[i], t, ps, d);
        for (int j = 0; j < d; ++j) {
          pool[base + j] = f32_to_bf16(normal(rng));
          pool[base + static_cast<size_t>(ps) * d + j] = f32_to_bf16(normal(rng));
        }
      }
    }
    std::vector<uint16_t> q(static_cast<size_t>(s.num_seqs) * num_q_heads * d);
    for (uint16_t& v : q) v = f32_to_bf16(s.q_scale * normal(rng));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    // float64 reference from the same bf16 values; ref_lse: ln(sum_t exp(score_t)) per query row.
    std::vector<double> ref(q.size(), 0.0);
    std::vector<double> ref_lse(q.size() / d, -INFINITY);
    for (int i = 0; i < items; ++i) {
      const int seq = i / s.num_kv_heads, kvh = i % s.num_kv_heads;
      const int n = s.tokens[i];
      for (int g = 0; g < s.group; ++g) {
        const size_t row = (static_cast<size_t>(seq) * num_q_heads + kvh * s.group + g) * d;
        std::vector<double> score(n);
        double mx = -INFINITY;
        for (int t = 0; t < n; ++t) {
          const size_t base = key_offset(ids, offsets[i], t, ps, d);
          double dot = 0.0;
          for (int j = 0; j < d; ++j) dot += static_cast<double>(bf16_to_f32(q[row + j])) * bf16_to_f32(pool[base + j]);
          score[t] = dot * scale;
          mx = std::max(mx, score[t]);
        }
        double sum = 0.0;
        for (int t = 0; t < n; ++t) sum += (score[t] = std::exp(score[t] - mx));
        if (n > 0) ref_lse[row / d] = mx + std::log(sum);
        for (int t = 0; t < n; ++t) {
          const size_t vbase = key_offset(ids, offsets[i], t, ps, d) + static_cast<size_t>(ps) * d;
          for (int j = 0; j < d; ++j) ref[row + j] += score[t] / sum * bf16_to_f32(pool[vbase + j]);
        }
      }
    }

    DeviceBuffer<uint16_t> d_pool(pool.size()), d_q(q.size());
    DeviceBuffer<int32_t> d_ids(ids.size()), d_offsets(offsets.size()), d_tokens(items);
    DeviceBuffer<OutT> d_out(q.size());
    DeviceBuffer<float> d_lse(ref_lse.size());
    ASSERT_TRUE(d_pool.ptr && d_q.ptr && d_ids.ptr && d_offsets.ptr && d_tokens.ptr && d_out.ptr && d_lse.ptr);
    CUDA_OK(cudaMemcpy(d_pool.ptr, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ids.ptr, ids.data(), std::max<size_t>(ids.size(), 1) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_offsets.ptr, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_tokens.ptr, s.tokens.data(), items * 4, cudaMemcpyHostToDevice));
    cuda::PagedDecodeParams p;
    p.q = reinterpret_cast<const __nv_bfloat16*>(d_q.ptr);
    p.kv_pool = reinterpret_cast<const __nv_bfloat16*>(d_pool.ptr);
    p.page_ids = d_ids.ptr;
    p.list_offsets = d_offsets.ptr;
    p.num_tokens = d_tokens.ptr;
    p.num_seqs = s.num_seqs;
    p.num_kv_heads = s.num_kv_heads;
    p.group = s.group;
    p.head_dim = d;
    p.page_size = ps;
    p.max_tokens = std::max(max_tokens, max_tokens_bound);
    p.scale = scale;
    p.tokens_per_split = s.tokens_per_split;
    if (check_lse) p.lse = d_lse.ptr;
    last_splits = cuda::paged_decode_splits(p);
    const size_t ws_bytes = cuda::paged_decode_workspace_bytes(p);
    DeviceBuffer<char> ws(ws_bytes);
    ASSERT_TRUE(ws.ptr);

    // With host_pages: the same pool also in mapped pinned host memory, and a random half of the
    // list entries naming their page there (~id); the output must not change by a bit.
    void* host_pool = nullptr;
    DeviceBuffer<int32_t> d_host_ids(ids.size()), d_fills(ids.size());
    std::vector<int32_t> fills(ids.size(), -1);
    if (host_pages) {
      CUDA_OK(cudaHostAlloc(&host_pool, pool.size() * 2, cudaHostAllocMapped));
      std::memcpy(host_pool, pool.data(), pool.size() * 2);
      void* mapped = nullptr;
      CUDA_OK(cudaHostGetDevicePointer(&mapped, host_pool, 0));
      std::vector<int32_t> host_ids = ids;
      std::bernoulli_distribution on_host(0.5);
      for (int32_t& id : host_ids) id = on_host(rng) ? ~id : id;
      CUDA_OK(cudaMemcpy(d_host_ids.ptr, host_ids.data(), std::max<size_t>(ids.size(), 1) * 4, cudaMemcpyHostToDevice));
      p.host_pool = reinterpret_cast<const __nv_bfloat16*>(mapped);
      if (fill_pages) {  // most host entries get a fill page of their own; the rest none
        std::bernoulli_distribution filled(0.75);
        for (size_t k = 0; k < ids.size(); ++k) fills[k] = host_ids[k] < 0 && filled(rng) ? fill_first + static_cast<int>(k) : -1;
        CUDA_OK(cudaMemcpy(d_fills.ptr, fills.data(), std::max<size_t>(ids.size(), 1) * 4, cudaMemcpyHostToDevice));
      }
    }

    // Every load path (see PagedDecodeParams::load_path).
    for (int path = 0; path <= 2; ++path) {
      p.load_path = path;
      p.page_ids = d_ids.ptr;
      CUDA_OK(cudaMemset(d_out.ptr, 0xff, q.size() * sizeof(OutT)));  // NaN in fp32 and bf16
      if (ws_bytes > 0) CUDA_OK(cudaMemset(ws.ptr, 0xff, ws_bytes));
      if (check_lse) CUDA_OK(cudaMemset(d_lse.ptr, 0xff, ref_lse.size() * sizeof(float)));  // NaN
      CUDA_OK(cuda::paged_decode_attention(p, d_out.ptr, ws.ptr, ws_bytes, nullptr));
      CUDA_OK(cudaDeviceSynchronize());

      std::vector<OutT> out(q.size());
      CUDA_OK(cudaMemcpy(out.data(), d_out.ptr, out.size() * sizeof(OutT), cudaMemcpyDeviceToHost));
      if (check_lse) {
        std::vector<float> lse(ref_lse.size());
        CUDA_OK(cudaMemcpy(lse.data(), d_lse.ptr, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t r = 0; r < lse.size(); ++r) {
          if (std::isinf(ref_lse[r])) {  // an item with 0 tokens
            EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0.0f)
                << "load path " << path << " row " << r << ": lse " << lse[r] << ", want -inf";
          } else {
            EXPECT_NEAR(lse[r], ref_lse[r], 1e-3)  // NaN (unwritten) fails too
                << "load path " << path << " row " << r << " splits " << last_splits;
          }
        }
      }
      if (host_pages) {
        p.page_ids = d_host_ids.ptr;
        if (fill_pages) {
          p.fill_pages = d_fills.ptr;
          p.fill_pool = reinterpret_cast<__nv_bfloat16*>(d_pool.ptr);
        }
        CUDA_OK(cudaMemset(d_out.ptr, 0xff, q.size() * sizeof(OutT)));
        const cudaError_t e = cuda::paged_decode_attention(p, d_out.ptr, ws.ptr, ws_bytes, nullptr);
        p.fill_pages = nullptr;
        p.fill_pool = nullptr;
        if (fill_pages && path != 2) {  // only the default load path fills
          EXPECT_EQ(e, cudaErrorInvalidValue) << "load path " << path << " with fill pages";
        } else {
          CUDA_OK(e);
          CUDA_OK(cudaDeviceSynchronize());
          std::vector<OutT> from_host(q.size());
          CUDA_OK(cudaMemcpy(from_host.data(), d_out.ptr, out.size() * sizeof(OutT), cudaMemcpyDeviceToHost));
          EXPECT_EQ(std::memcmp(from_host.data(), out.data(), out.size() * sizeof(OutT)), 0)
              << "load path " << path << ": pages read from the host pool changed the output";
          if (fill_pages) check_fills(pool, d_pool, ids, fills, offsets, s.tokens, ps, page_elems, d);
        }
      }
      double num = 0.0, den = 0.0;
      size_t non_finite = 0;
      for (size_t k = 0; k < out.size(); ++k) {
        double v;
        if constexpr (sizeof(OutT) == 2) {
          uint16_t bits;
          std::memcpy(&bits, &out[k], 2);
          v = bf16_to_f32(bits);
        } else {
          v = out[k];
        }
        if (!std::isfinite(v)) ++non_finite;
        num += (v - ref[k]) * (v - ref[k]);
        den += ref[k] * ref[k];
      }
      const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      EXPECT_EQ(non_finite, 0u) << "load path " << path;
      EXPECT_LE(rel, tolerance) << "load path " << path << " seqs " << s.num_seqs << " kv_heads "
                                << s.num_kv_heads << " group " << s.group << " d " << d << " page "
                                << ps << " split " << s.tokens_per_split << " splits "
                                << cuda::paged_decode_splits(p);
    }
    if (host_pool) CUDA_OK(cudaFreeHost(host_pool));
  }

  // After a run that filled: each fill page holds its host page's attended rows (K and V) and
  // NaN elsewhere; every other page of the pool is as it was.
  static void check_fills(const std::vector<uint16_t>& pool, const DeviceBuffer<uint16_t>& d_pool,
                          const std::vector<int32_t>& ids, const std::vector<int32_t>& fills,
                          const std::vector<int32_t>& offsets, const std::vector<int>& tokens, int ps,
                          size_t page_elems, int d) {
    std::vector<uint16_t> expect = pool;
    size_t filled = 0;
    for (size_t i = 0; i + 1 < offsets.size(); ++i) {
      for (int k = offsets[i]; k < offsets[i + 1]; ++k) {
        if (fills[k] < 0) continue;
        ++filled;
        const int rows = std::min(ps, tokens[i] - (k - offsets[i]) * ps);
        for (int half = 0; half < 2; ++half) {  // K rows, then V rows
          const size_t src = ids[k] * page_elems + static_cast<size_t>(half) * ps * d;
          const size_t dst = fills[k] * page_elems + static_cast<size_t>(half) * ps * d;
          std::copy_n(pool.begin() + src, static_cast<size_t>(rows) * d, expect.begin() + dst);
        }
      }
    }
    EXPECT_GT(filled, 0u) << "no entry had a fill page";
    std::vector<uint16_t> got(pool.size());
    CUDA_OK(cudaMemcpy(got.data(), d_pool.ptr, got.size() * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t e = 0; e < got.size(); ++e) bad += got[e] != expect[e];
    EXPECT_EQ(bad, 0u) << "pool elements that differ from the fills' expectation, of " << got.size();
  }

  bool host_pages = false;
  bool fill_pages = false;  // with host_pages: the host entries also fill device pages
  bool check_lse = false;  // also request and check PagedDecodeParams::lse
  int max_tokens_bound = 0;  // > 0: PagedDecodeParams::max_tokens, above the longest list
  int last_splits = 0;     // splits the last run() used

  std::vector<int> random_lengths(int items, int max_len) {
    std::uniform_int_distribution<int> len(1, max_len);
    std::vector<int> v(items);
    for (int& x : v) x = len(rng);
    return v;
  }

  std::mt19937 rng{std::random_device{}()};
};

TEST_F(GpuPagedAttention, GroupsHeadDimsAndPageSizes) {
  for (int d : {64, 128})
    for (int group : {1, 4, 5, 8})
      for (int ps : {8, 16, 32, 64}) {
        Shape s{2, 3, group, d, ps, random_lengths(6, 700), 0, 1.0f};
        run<__nv_bfloat16>(s, 1e-2);
      }
}

TEST_F(GpuPagedAttention, PartialPagesAndOddCounts) {
  // Lengths around page and tile edges, one empty list (its output must be zeros).
  Shape s{3, 4, 5, 128, 16, {1, 7, 15, 16, 17, 31, 33, 47, 0, 113, 255, 1001}, 0, 1.0f};
  run<__nv_bfloat16>(s, 1e-2);
  Shape s8{2, 2, 4, 64, 8, {1, 9, 23, 65}, 0, 1.0f};
  run<float>(s8, 1e-2);
}

TEST_F(GpuPagedAttention, SplitKMergeMatchesReference) {
  for (int tps : {64, 128, 192, 1024}) {
    Shape s{2, 2, 5, 128, 16, random_lengths(4, 3000), tps, 1.0f};
    run<__nv_bfloat16>(s, 1e-2);
    Shape s64{1, 8, 4, 64, 32, random_lengths(8, 2000), tps, 1.0f};
    run<float>(s64, 1e-2);
  }
}

TEST_F(GpuPagedAttention, PagesInMappedHostMemoryReadTheSame) {
  host_pages = true;
  for (int tps : {0, 128}) {
    Shape s{2, 4, 5, 128, 16, random_lengths(8, 1500), tps, 1.0f};
    run<__nv_bfloat16>(s, 1e-2);
    Shape s64{2, 2, 8, 64, 32, random_lengths(4, 900), tps, 1.0f};
    run<float>(s64, 1e-2);
  }
}

TEST_F(GpuPagedAttention, HostPagesFillTheirDevicePages) {
  // The sparse path's fetch in the attention: host pages read once, attended, and written to
  // their fill pages; partial last pages, splits that share a page (page 32 with 64-token splits)
  // and both head dims.
  host_pages = fill_pages = true;
  for (int tps : {0, 64}) {
    Shape s{2, 4, 5, 128, 16, random_lengths(8, 1500), tps, 1.0f};
    run<__nv_bfloat16>(s, 1e-2);
    Shape s32{1, 8, 4, 128, 32, {1, 33, 95, 96, 97, 640, 7, 300}, tps, 1.0f};
    run<__nv_bfloat16>(s32, 1e-2);
    Shape s64{2, 2, 8, 64, 64, random_lengths(4, 900), tps, 1.0f};
    run<float>(s64, 1e-2);
  }
}

TEST_F(GpuPagedAttention, PeakySoftmaxAndLongLists) {
  // q scaled 4x: a few tokens dominate, so running-max bookkeeping errors show.
  Shape peaky{1, 2, 8, 128, 16, {4099, 2500}, 0, 4.0f};
  run<float>(peaky, 1e-2);
  Shape longest{1, 1, 5, 128, 64, {20000}, 0, 1.0f};
  run<__nv_bfloat16>(longest, 1e-2);
}

TEST_F(GpuPagedAttention, LogSumExpMatchesReference) {
  // lse is written by the main kernel's epilogue with one split and by the merge kernel with
  // several; both paths see an item with 0 tokens (-inf) among lists of odd lengths.
  check_lse = true;
  for (int d : {64, 128}) {
    // One split: tokens_per_split covers the longest list.
    Shape one{2, 3, 5, d, 16, {1, 17, 0, 300, 1001, 64}, 1024, 1.0f};
    run<__nv_bfloat16>(one, 1e-2);
    EXPECT_EQ(last_splits, 1);
    one.q_scale = 4.0f;  // peaky: the max dominates the sum
    run<float>(one, 1e-2);
    EXPECT_EQ(last_splits, 1);
    // Several splits of 64 tokens; the 0-token item and short lists use fewer than the grid has.
    Shape many{2, 4, 8, d, 32, {3000, 0, 129, 64, 65, 2500, 1, 777}, 64, 1.0f};
    run<__nv_bfloat16>(many, 1e-2);
    EXPECT_EQ(last_splits, 47);
    many.q_scale = 4.0f;
    run<float>(many, 1e-2);
    EXPECT_EQ(last_splits, 47);
  }
  // Automatic split choice.
  Shape autos{1, 2, 4, 128, 16, {0, 5000}, 0, 1.0f};
  run<__nv_bfloat16>(autos, 1e-2);
  EXPECT_GT(last_splits, 1);
}

TEST_F(GpuPagedAttention, AutomaticSplitsFollowEachItemsLength) {
  // The engine bounds max_tokens by a power-of-two context bucket, so lists are often much
  // shorter than the grid was sized for (sparse lists always are): each item takes the splits the
  // policy gives its own length. Outputs against the reference, with 1 to more than 32 partials
  // per item in the merge.
  check_lse = true;
  max_tokens_bound = 65536;
  Shape batch1{1, 8, 5, 128, 16, {33000, 3000, 70, 0, 1, 16400, 65536, 640}, 0, 1.0f};
  run<__nv_bfloat16>(batch1, 1e-2);
  Shape two{1, 2, 4, 64, 32, {40000, 129}, 0, 4.0f};
  run<float>(two, 1e-2);
  Shape many{6, 8, 4, 128, 16, random_lengths(48, 700), 0, 1.0f};  // 48 items: the many-item rule
  run<__nv_bfloat16>(many, 1e-2);

  cuda::PagedDecodeParams p;
  p.num_kv_heads = 8;
  p.group = 5;
  p.max_tokens = 65536;
  p.scale = 1.0f;
  p.num_seqs = 1;
  const int grid = cuda::paged_decode_splits(p);
  ASSERT_GT(grid, 1);
  // Batch 1: a short (sparse) list still spreads, unlike one cut at the grid's split size.
  EXPECT_GT(cuda::paged_decode_item_splits(p, 512), 1);
  EXPECT_GT(cuda::paged_decode_item_splits(p, 33000), cuda::paged_decode_item_splits(p, 512));
  EXPECT_LE(cuda::paged_decode_item_splits(p, 65536), grid);
  EXPECT_EQ(cuda::paged_decode_item_splits(p, 0), 1);
  // Batch 16: short lists take fewer splits than the grid has (about one wave in all, not four).
  p.num_seqs = 16;
  EXPECT_LT(cuda::paged_decode_item_splits(p, 512), cuda::paged_decode_splits(p));
  // A fixed split size is the caller's.
  p.tokens_per_split = 1024;
  EXPECT_EQ(cuda::paged_decode_item_splits(p, 3000), 3);
}

TEST_F(GpuPagedAttention, RejectsUnsupportedShapes) {
  cuda::PagedDecodeParams p;
  p.num_seqs = 1;
  p.num_kv_heads = 1;
  p.max_tokens = 16;
  p.scale = 1.0f;
  float* out = nullptr;
  using Edit = void (*)(cuda::PagedDecodeParams&);
  for (Edit bad : std::initializer_list<Edit>{[](cuda::PagedDecodeParams& x) { x.group = 9; },
                   [](cuda::PagedDecodeParams& x) { x.head_dim = 96; },
                   [](cuda::PagedDecodeParams& x) { x.page_size = 12; },
                   [](cuda::PagedDecodeParams& x) { x.page_size = 128; },
                   [](cuda::PagedDecodeParams& x) { x.tokens_per_split = 100; },
                   [](cuda::PagedDecodeParams& x) { x.load_path = 3; }}) {
    cuda::PagedDecodeParams x = p;
    bad(x);
    EXPECT_EQ(cuda::paged_decode_attention(x, out, nullptr, 0, nullptr), cudaErrorInvalidValue);
  }
  // A workspace smaller than required is refused before any launch.
  cuda::PagedDecodeParams split = p;
  split.max_tokens = 100000;
  ASSERT_GT(cuda::paged_decode_workspace_bytes(split), 0u);
  EXPECT_EQ(cuda::paged_decode_attention(split, out, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace spin
