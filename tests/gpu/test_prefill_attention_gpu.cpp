// Causal prefill attention over paged KV on the GPU against a CPU reference written here (plain
// loops, fp32 products with fp64 softmax sums, from the same bf16 inputs), on fresh random inputs
// each run (the seed is printed). Batches mix sequences of 1, 7, 64 and 300 new tokens, some
// starting at position 0 and some later (earlier chunks' K/V are read from the pages); page lists
// are random permutations of a pool. The output is poisoned (NaN) before each launch; pool slots
// no list covers and the padding of strided q rows hold NaN, so a missed write or a read out of
// bounds fails. Tolerance: every (token, query head) row's relative L2 error <= 1e-2 (bf16
// inputs; probabilities enter P*V as bf16, as in flash attention; bf16 output adds 2^-9).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"
#include "paged_kv_test.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/prefill_attention.h"

namespace spin {
namespace {

using namespace gpu_test;

struct SeqSpec {
  int new_tokens;
  int first_pos;
};

struct Case {
  int num_kv_heads;
  int group;
  int head_dim;
  int page_size;
  std::vector<SeqSpec> seqs;
  int q_row_pad = 0;     // extra elements per q row (q_row_stride = width + pad; 0: stride left 0)
  float q_scale = 1.0f;  // larger values make the softmax peakier
  int check_every = 1;   // reference rows: every n-th token plus the first and last 48
};

class GpuPrefillAttention : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    std::printf("GpuPrefillAttention seed %u\n", seed_);
  }

  void run(const Case& c) {
    const int H = c.num_kv_heads, G = c.group, d = c.head_dim, ps = c.page_size;
    const int num_seqs = static_cast<int>(c.seqs.size());
    const int num_q_heads = H * G;
    const int width = num_q_heads * d;
    const int64_t stride = width + c.q_row_pad;
    std::normal_distribution<float> normal(0.0f, 1.0f);

    std::vector<int32_t> token_offsets(num_seqs + 1, 0), first_pos(num_seqs);
    int max_new = 0;
    for (int s = 0; s < num_seqs; ++s) {
      token_offsets[s + 1] = token_offsets[s] + c.seqs[s].new_tokens;
      first_pos[s] = c.seqs[s].first_pos;
      max_new = std::max(max_new, c.seqs[s].new_tokens);
    }
    const int total_tokens = token_offsets[num_seqs];

    // Page lists per (seq, KV head) covering positions [0, first_pos + new), drawn from a
    // shuffled pool with spare pages.
    std::vector<int32_t> list_offsets(num_seqs * H + 1, 0);
    for (int s = 0; s < num_seqs; ++s)
      for (int h = 0; h < H; ++h) {
        const int kv_len = c.seqs[s].first_pos + c.seqs[s].new_tokens;
        list_offsets[s * H + h + 1] = list_offsets[s * H + h] + (kv_len + ps - 1) / ps;
      }
    const int used_pages = list_offsets.back();
    const int pool_pages = used_pages + 5;
    const std::vector<int32_t> ids = random_page_ids(used_pages, pool_pages, rng_);

    // K/V: random bf16 at covered positions (kept as floats for the reference), NaN elsewhere.
    const size_t page_elems = static_cast<size_t>(2) * ps * d;
    std::vector<uint16_t> pool(page_elems * pool_pages, kBf16Nan);
    std::vector<std::vector<float>> k_ref(num_seqs * H), v_ref(num_seqs * H);
    for (int s = 0; s < num_seqs; ++s)
      for (int h = 0; h < H; ++h) {
        const int item = s * H + h;
        const int kv_len = c.seqs[s].first_pos + c.seqs[s].new_tokens;
        k_ref[item].resize(static_cast<size_t>(kv_len) * d);
        v_ref[item].resize(static_cast<size_t>(kv_len) * d);
        for (int t = 0; t < kv_len; ++t) {
          const size_t base = key_offset(ids, list_offsets[item], t, ps, d);
          for (int j = 0; j < d; ++j) {
            const uint16_t kb = f32_to_bf16(normal(rng_)), vb = f32_to_bf16(normal(rng_));
            pool[base + j] = kb;
            pool[base + static_cast<size_t>(ps) * d + j] = vb;
            k_ref[item][static_cast<size_t>(t) * d + j] = bf16_to_f32(kb);
            v_ref[item][static_cast<size_t>(t) * d + j] = bf16_to_f32(vb);
          }
        }
      }
    std::vector<uint16_t> q(static_cast<size_t>(total_tokens) * stride, kBf16Nan);
    for (int t = 0; t < total_tokens; ++t)
      for (int j = 0; j < width; ++j) q[t * stride + j] = f32_to_bf16(c.q_scale * normal(rng_));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    // Reference rows (token, query head) of the checked tokens.
    std::vector<char> checked(total_tokens, 0);
    for (int s = 0; s < num_seqs; ++s)
      for (int i = 0; i < c.seqs[s].new_tokens; ++i)
        checked[token_offsets[s] + i] =
            i % c.check_every == 0 || i < 48 || i >= c.seqs[s].new_tokens - 48;
    std::vector<float> ref(static_cast<size_t>(total_tokens) * width, 0.0f);
    std::vector<float> qrow(d);
    std::vector<double> score;
    std::vector<double> acc(d);
    for (int s = 0; s < num_seqs; ++s)
      for (int i = 0; i < c.seqs[s].new_tokens; ++i) {
        const int t = token_offsets[s] + i;
        if (!checked[t]) continue;
        const int pos = c.seqs[s].first_pos + i;
        for (int qh = 0; qh < num_q_heads; ++qh) {
          const int item = s * H + qh / G;
          for (int j = 0; j < d; ++j) qrow[j] = bf16_to_f32(q[t * stride + qh * d + j]);
          score.assign(pos + 1, 0.0);
          double mx = -INFINITY;
          for (int k = 0; k <= pos; ++k) {
            const float* kr = &k_ref[item][static_cast<size_t>(k) * d];
            float dot[4] = {0, 0, 0, 0};
            for (int j = 0; j < d; j += 4)
              for (int u = 0; u < 4; ++u) dot[u] += qrow[j + u] * kr[j + u];
            score[k] = static_cast<double>(dot[0] + dot[1] + dot[2] + dot[3]) * scale;
            mx = std::max(mx, score[k]);
          }
          double sum = 0.0;
          for (double& x : score) sum += (x = std::exp(x - mx));
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int k = 0; k <= pos; ++k) {
            const float* vr = &v_ref[item][static_cast<size_t>(k) * d];
            const double w = score[k] / sum;
            for (int j = 0; j < d; ++j) acc[j] += w * vr[j];
          }
          for (int j = 0; j < d; ++j) ref[(static_cast<size_t>(t) * num_q_heads + qh) * d + j] = static_cast<float>(acc[j]);
        }
      }

    DeviceBuffer<uint16_t> d_pool(pool.size()), d_q(q.size()), d_out(ref.size());
    DeviceBuffer<int32_t> d_ids(ids.size()), d_lists(list_offsets.size()), d_tokens(token_offsets.size()),
        d_first(first_pos.size());
    ASSERT_TRUE(d_pool.ptr && d_q.ptr && d_out.ptr && d_ids.ptr && d_lists.ptr && d_tokens.ptr && d_first.ptr);
    CUDA_OK(cudaMemcpy(d_pool.ptr, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ids.ptr, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_lists.ptr, list_offsets.data(), list_offsets.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_tokens.ptr, token_offsets.data(), token_offsets.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_first.ptr, first_pos.data(), first_pos.size() * 4, cudaMemcpyHostToDevice));

    cuda::PagedPrefillParams p;
    p.q = reinterpret_cast<const __nv_bfloat16*>(d_q.ptr);
    p.q_row_stride = c.q_row_pad > 0 ? stride : 0;
    p.kv_pool = reinterpret_cast<const __nv_bfloat16*>(d_pool.ptr);
    p.page_ids = d_ids.ptr;
    p.list_offsets = d_lists.ptr;
    p.token_offsets = d_tokens.ptr;
    p.first_pos = d_first.ptr;
    p.num_seqs = num_seqs;
    p.num_kv_heads = H;
    p.group = G;
    p.head_dim = d;
    p.page_size = ps;
    p.max_new_tokens = max_new;
    p.scale = scale;

    for (int variant : {-1, 0, 1, 2}) {  // -1: the default choice
      p.variant = variant;
      if (variant == 2 && (d != 128 || !cuda::prefill_wgmma_available())) continue;
      CUDA_OK(cudaMemset(d_out.ptr, 0xff, ref.size() * 2));  // bf16 NaN
      CUDA_OK(cuda::paged_prefill_attention(p, reinterpret_cast<__nv_bfloat16*>(d_out.ptr), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> out(ref.size());
      CUDA_OK(cudaMemcpy(out.data(), d_out.ptr, out.size() * 2, cudaMemcpyDeviceToHost));

      size_t non_finite = 0, bad_rows = 0, rows = 0;
      double worst = 0.0;
      int worst_seq = -1, worst_token = -1, worst_head = -1;
      for (int s = 0; s < num_seqs; ++s)
        for (int i = 0; i < c.seqs[s].new_tokens; ++i) {
          const int t = token_offsets[s] + i;
          for (int qh = 0; qh < num_q_heads; ++qh) {
            const size_t base = (static_cast<size_t>(t) * num_q_heads + qh) * d;
            double num = 0.0, den = 0.0;
            for (int j = 0; j < d; ++j) {
              const double v = bf16_to_f32(out[base + j]);
              if (!std::isfinite(v)) ++non_finite;
              num += (v - ref[base + j]) * (v - ref[base + j]);
              den += static_cast<double>(ref[base + j]) * ref[base + j];
            }
            if (!checked[t]) continue;
            ++rows;
            const double rel = std::sqrt(num / den);
            if (!(rel <= 1e-2)) ++bad_rows;
            if (!(rel <= worst)) {
              worst = rel;
              worst_seq = s;
              worst_token = i;
              worst_head = qh;
            }
          }
        }
      EXPECT_EQ(non_finite, 0u) << "variant " << variant << " seed " << seed_;
      EXPECT_EQ(bad_rows, 0u) << "of " << rows << " rows; worst relative error " << worst << " at seq "
                              << worst_seq << " token " << worst_token << " head " << worst_head
                              << "; variant " << variant << " kv_heads " << H << " group " << G << " d "
                              << d << " page " << ps << " seed " << seed_;
    }
  }

  // Sequences of 1, 7, 64 and 300 new tokens in random order, two starting at position 0 and two
  // later (random first positions).
  std::vector<SeqSpec> mixed_batch() {
    std::vector<int> counts{1, 7, 64, 300};
    std::shuffle(counts.begin(), counts.end(), rng_);
    std::vector<int> starts{0, 0, 1, 1};
    std::shuffle(starts.begin(), starts.end(), rng_);
    std::uniform_int_distribution<int> later(1, 300);
    std::vector<SeqSpec> seqs;
    for (int i = 0; i < 4; ++i) seqs.push_back({counts[i], starts[i] ? later(rng_) : 0});
    return seqs;
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(GpuPrefillAttention, MixedBatchGroupsHeadDimsPageSizes) {
  int n = 0;
  for (int d : {64, 128})
    for (int group : {1, 3, 4, 5, 8})
      for (int ps : {16, 24, 32, 48, 64}) {  // 24, 48: pages straddle the 128-key tiles
        Case c{2, group, d, ps, mixed_batch()};
        c.q_row_pad = (n++ % 2) * 8 * (1 + group);  // every other case: strided q rows
        run(c);
      }
}

TEST_F(GpuPrefillAttention, EveryGroupSizeAndSmallPages) {
  for (int group = 1; group <= 8; ++group) {
    Case c{3, group, group % 2 ? 64 : 128, 8, {{1, 0}, {40, 0}, {23, 57}, {1, 130}}};
    run(c);
  }
}

TEST_F(GpuPrefillAttention, PeakySoftmax) {
  // q scaled 3x: a few keys dominate, so running-max bookkeeping errors show.
  Case c{2, 5, 128, 16, {{300, 0}, {129, 200}, {1, 77}}};
  c.q_scale = 3.0f;
  run(c);
}

TEST_F(GpuPrefillAttention, LongPromptAndLongChunk) {
  // One 4096-token prompt, and a 2048-token chunk after 6000 earlier positions; the reference
  // checks every 16th token plus the first and last 48 of each.
  Case prompt{2, 4, 128, 16, {{4096, 0}}};
  prompt.check_every = 16;
  run(prompt);
  Case chunk{1, 5, 128, 64, {{2048, 6000}}};
  chunk.check_every = 16;
  run(chunk);
}

TEST_F(GpuPrefillAttention, RejectsUnsupportedParams) {
  DeviceBuffer<int32_t> buf(64);
  ASSERT_TRUE(buf.ptr);
  auto* any = reinterpret_cast<__nv_bfloat16*>(buf.ptr);
  cuda::PagedPrefillParams p;
  p.q = any;
  p.kv_pool = any;
  p.page_ids = buf.ptr;
  p.list_offsets = buf.ptr;
  p.token_offsets = buf.ptr;
  p.first_pos = buf.ptr;
  p.num_seqs = 1;
  p.num_kv_heads = 1;
  p.max_new_tokens = 4;
  p.scale = 0.125f;
  using Edit = std::function<void(cuda::PagedPrefillParams&)>;
  const std::vector<Edit> bad{
      [](cuda::PagedPrefillParams& x) { x.group = 0; },
      [](cuda::PagedPrefillParams& x) { x.group = 9; },
      [](cuda::PagedPrefillParams& x) { x.head_dim = 96; },
      [](cuda::PagedPrefillParams& x) { x.page_size = 12; },
      [](cuda::PagedPrefillParams& x) { x.page_size = 72; },
      [](cuda::PagedPrefillParams& x) { x.scale = 0.0f; },
      [](cuda::PagedPrefillParams& x) { x.scale = NAN; },
      [](cuda::PagedPrefillParams& x) { x.q_row_stride = 64; },   // < heads * head_dim
      [](cuda::PagedPrefillParams& x) { x.q_row_stride = 132; },  // not a multiple of 8
      [](cuda::PagedPrefillParams& x) { x.variant = 3; },
      [](cuda::PagedPrefillParams& x) {  // the warpgroup kernel is head_dim 128 only
        x.variant = 2;
        x.head_dim = 64;
      },
      [](cuda::PagedPrefillParams& x) { x.num_kv_heads = 0; },
      [](cuda::PagedPrefillParams& x) { x.num_seqs = -1; },
      [](cuda::PagedPrefillParams& x) { x.page_ids = nullptr; },
      [&](cuda::PagedPrefillParams& x) { x.q = any + 1; },  // not 16-byte aligned
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    cuda::PagedPrefillParams x = p;
    bad[i](x);
    EXPECT_EQ(cuda::paged_prefill_attention(x, any, nullptr), cudaErrorInvalidValue) << "edit " << i;
  }
  EXPECT_EQ(cuda::paged_prefill_attention(p, nullptr, nullptr), cudaErrorInvalidValue);
  // An empty batch launches nothing.
  cuda::PagedPrefillParams empty = p;
  empty.num_seqs = 0;
  EXPECT_EQ(cuda::paged_prefill_attention(empty, any, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace spin
