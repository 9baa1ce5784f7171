// ShadowKV on the GPU (kernels/cuda/shadowkv.h, engine/cuda/shadowkv_factors.h), on fresh random
// inputs each run (seed printed):
//  * Index: each listed page's landmark against the mean of its keys in double (bf16 rounding:
//    within 4e-3 relative), its flag 0, and the negated smallest cosine of its keys to the mean
//    (within 1e-4); entries not listed keep their poison.
//  * Score, against double over the same bf16 landmarks and queries: pass 1's logit of each
//    candidate and head within 1e-4 of scale * sum |q_d l_d| (tensor-core fp32 sums of exact
//    products, the bound Quest's score test uses), each block of 256 candidates' max and sum of
//    exp per head, and each candidate's largest softmax probability over its group's heads
//    (within 1e-3 relative), +inf for flagged chunks; slots and blocks past the candidates keep
//    their poison. Groups 1..8, head_dim 64 and 128, first candidates off the 16-page tiles, ends
//    too, items of one to three blocks.
//  * Factorisation + rebuild: keys of exactly rank r (plus 1e-3 noise) stored with RoPE, factorised
//    at rank r and rebuilt (tensor cores) into other pages: within 2e-2 of the stored keys (bf16 rounding of keys
//    and factors), values of the destination pages untouched; at rank r / 2 the error is
//    large (the rank is really used). Both RoPE pair layouts, head_dim 64 and 128, pages 8 and 16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/half.h"
#include "engine/cuda/shadowkv_factors.h"
#include "kernels/cuda/shadowkv.h"
#include "kernels/cuda/sparse_select.h"

namespace spin {
namespace {

using cuda::kSummaryChunkPages;

__nv_bfloat16* as_bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
bool is_poison(uint16_t bits) { return bits == 0xffff; }

class GpuShadowKv : public SeededGpuTest<std::mt19937> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  float normal(float sigma) { return std::normal_distribution<float>(0.0f, sigma)(rng_); }
};

TEST_F(GpuShadowKv, IndexWritesLandmarksFlagsAndCosines) {
  for (int head_dim : {64, 128})
    for (int page_size : {8, 16, 64}) {
      const int pool_pages = 23, entries = 41, listed = 30;
      const size_t page_elems = size_t{2} * page_size * head_dim;
      std::vector<uint16_t> pool(pool_pages * page_elems);
      for (size_t e = 0; e < pool.size(); ++e)
        pool[e] = f32_to_bf16(e % page_elems >= page_elems / 2 ? 1e4f : normal(1.0f) + (e / page_elems % 3 == 0 ? 2.0f : 0.0f));
      std::vector<int32_t> src(listed), dst(entries), at(listed);
      for (int32_t& s : src) s = chance(0.15) ? -1 : uniform(0, pool_pages - 1);
      std::iota(dst.begin(), dst.end(), 0);
      std::shuffle(dst.begin(), dst.end(), rng_);
      dst.resize(listed);
      for (int i = 0; i < listed; ++i) at[i] = chance(0.2) ? -1 : i;
      DeviceArray<uint16_t> d_pool(pool), d_summaries(size_t{entries} * 2 * head_dim);
      DeviceArray<int32_t> d_src(src), d_dst(dst), d_at(at);
      DeviceArray<float> d_cos(listed);
      for (cudaError_t st : {d_pool.status(), d_summaries.status(), d_src.status(), d_dst.status(), d_at.status(),
                             d_cos.status()})
        CUDA_OK(st);
      cuda::ShadowKvIndexParams p;
      p.kv_pool = as_bf16(d_pool.get());
      p.src_pages = d_src.get();
      p.dst_entries = d_dst.get();
      p.num_pages = listed;
      p.head_dim = head_dim;
      p.page_size = page_size;
      p.summaries = as_bf16(d_summaries.get());
      p.min_cos = d_cos.get();
      p.min_cos_at = d_at.get();
      CUDA_OK(cuda::shadowkv_index_pages(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got = d_summaries.download();
      const std::vector<float> cos = d_cos.download();
      std::vector<bool> written(entries, false);
      int bad = 0;
      for (int i = 0; i < listed && bad < 8; ++i) {
        if (src[i] < 0) continue;
        written[dst[i]] = true;
        const uint16_t* keys = pool.data() + src[i] * page_elems;
        std::vector<double> mean(head_dim, 0.0);
        for (int t = 0; t < page_size; ++t)
          for (int d = 0; d < head_dim; ++d) mean[d] += bf16_to_f32(keys[t * head_dim + d]) / page_size;
        const uint16_t* entry = got.data() + static_cast<size_t>(dst[i]) * 2 * head_dim;
        for (int d = 0; d < head_dim; ++d) {
          const double g = bf16_to_f32(entry[d]);
          if (!(std::abs(g - mean[d]) <= 4e-3 * std::abs(mean[d]) + 1e-6)) {
            ++bad;
            ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " page " << i << " dim " << d << ": landmark "
                          << g << " vs " << mean[d];
            break;
          }
        }
        EXPECT_EQ(bf16_to_f32(entry[head_dim]), 0.0f) << "the index clears the outlier flag";
        if (at[i] < 0) continue;
        double worst = 2.0;
        for (int t = 0; t < page_size; ++t) {
          double ab = 0, aa = 0, bb = 0;
          for (int d = 0; d < head_dim; ++d) {
            const double k = bf16_to_f32(keys[t * head_dim + d]);
            ab += k * mean[d];
            aa += k * k;
            bb += mean[d] * mean[d];
          }
          worst = std::min(worst, ab / std::sqrt(aa * bb));
        }
        EXPECT_NEAR(cos[at[i]], -worst, 1e-4) << "hd " << head_dim << " ps " << page_size << " page " << i;
      }
      for (int e = 0; e < entries; ++e) {
        if (!written[e]) {
          EXPECT_TRUE(is_poison(got[static_cast<size_t>(e) * 2 * head_dim])) << "entry " << e << " not listed";
        }
      }
    }
}

TEST_F(GpuShadowKv, ScoresAreTheGroupsLargestSoftmaxProbability) {
  for (int head_dim : {64, 128})
    for (int group = 1; group <= 8; ++group) {
      // Sequence s owns seq_chunks[s] shuffled summary chunks. 0: an unaligned first and an end off
      // the 16-page tiles, two blocks of 256; 1: one candidate; 2: unaligned, one block; 3: up to
      // three blocks from any first.
      const int seqs = 4, kv_heads = 2, max_candidates = 700;
      const std::vector<int32_t> seq_chunks{5, 1, 5, 12}, dir_offsets{0, 5, 6, 11};
      const int chunks = 23;
      const int chunk_entries = chunks * kv_heads * kSummaryChunkPages;
      std::vector<uint16_t> summaries(size_t{chunk_entries} * 2 * head_dim);
      for (size_t e = 0; e < summaries.size(); ++e) {
        const size_t d = e % (2 * head_dim);
        summaries[e] = d < static_cast<size_t>(head_dim) ? f32_to_bf16(normal(1.0f))
                       : d == static_cast<size_t>(head_dim) ? f32_to_bf16(chance(0.05) ? 1.0f : 0.0f)
                                                            : uint16_t{0xffff};
      }
      std::vector<int32_t> dir(chunks);
      std::iota(dir.begin(), dir.end(), 0);
      std::shuffle(dir.begin(), dir.end(), rng_);
      const int first3 = uniform(0, 60);
      const std::vector<int32_t> first{uniform(1, 15), 0, 40, first3},
          end{16 * uniform(17, 19) + uniform(1, 15), 1, 40 + uniform(1, 200), first3 + uniform(513, max_candidates)};
      for (int s = 0; s < seqs; ++s) ASSERT_LE(end[s], seq_chunks[s] * kSummaryChunkPages);
      std::vector<uint16_t> q(size_t{seqs} * kv_heads * group * head_dim);
      for (uint16_t& x : q) x = f32_to_bf16(normal(2.0f));
      const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      const int items = seqs * kv_heads, blocks = (max_candidates + 255) / 256;
      DeviceArray<uint16_t> d_summaries(summaries), d_q(q);
      DeviceArray<int32_t> d_dir(dir), d_offsets(dir_offsets), d_first(first), d_end(end);
      DeviceArray<float> d_logits(static_cast<size_t>(cuda::shadowkv_score_scratch(items, group, max_candidates))),
          d_scores(size_t{items} * max_candidates);
      for (cudaError_t st : {d_summaries.status(), d_q.status(), d_dir.status(), d_offsets.status(), d_first.status(),
                             d_end.status(), d_logits.status(), d_scores.status()})
        CUDA_OK(st);
      cuda::ShadowKvScoreParams p;
      p.q = as_bf16(d_q.get());
      p.summaries = as_bf16(d_summaries.get());
      p.summary_dir = d_dir.get();
      p.dir_offsets = d_offsets.get();
      p.first_candidate = d_first.get();
      p.end_candidate = d_end.get();
      p.num_seqs = seqs;
      p.num_kv_heads = kv_heads;
      p.group = group;
      p.head_dim = head_dim;
      p.scale = scale;
      p.max_candidates = max_candidates;
      p.logits = d_logits.get();
      p.scores = d_scores.get();
      CUDA_OK(cuda::shadowkv_score_pages(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = d_scores.download();
      const std::vector<float> scratch = d_logits.download();
      const float* partials = scratch.data() + cuda::shadowkv_score_partials_at(items, group, max_candidates);
      int bad = 0;
      // head < 0: a candidate's score (over the group).
      const auto fail = [&](const char* what, int item, int head, int at, double value, double ref) {
        if (bad++ < 8)
          ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << item
                        << (head >= 0 ? " head " + std::to_string(head) : std::string()) << " " << what << " " << at
                        << ": " << value << " vs " << ref;
      };
      for (int s = 0; s < seqs; ++s)
        for (int h = 0; h < kv_heads; ++h) {
          const int item = s * kv_heads + h, count = end[s] - first[s];
          const auto entry = [&](int page) {
            const int64_t e = (int64_t{dir[dir_offsets[s] + page / kSummaryChunkPages]} * kv_heads + h) *
                                  kSummaryChunkPages + page % kSummaryChunkPages;
            return summaries.data() + e * 2 * head_dim;
          };
          std::vector<double> best(count, 0.0);
          for (int g = 0; g < group; ++g) {
            const uint16_t* qh = q.data() + (static_cast<size_t>(item) * group + g) * head_dim;
            // Pass 1's logits: fp32 sums of exact bf16 products on the tensor cores, whose
            // accumulation may round less carefully than an FMA chain; 1e-4 of the sum of |terms|
            // still lies far below bf16's 4e-3.
            std::vector<double> logit(count), tolerance(count);
            const float* got_logit = scratch.data() + (static_cast<size_t>(item) * group + g) * max_candidates;
            for (int c = 0; c < count; ++c) {
              double dot = 0.0, magnitude = 0.0;
              for (int d = 0; d < head_dim; ++d) {
                const double term = double{bf16_to_f32(qh[d])} * bf16_to_f32(entry(first[s] + c)[d]);
                dot += term;
                magnitude += std::abs(term);
              }
              logit[c] = dot * scale;
              tolerance[c] = 1e-4 * magnitude * scale;
              if (!(std::abs(got_logit[c] - logit[c]) <= tolerance[c]))
                fail("logit", item, g, c, got_logit[c], logit[c]);
            }
            for (int c = count; c < max_candidates; ++c)
              if (!std::isnan(got_logit[c])) fail("logit past the candidates", item, g, c, got_logit[c], NAN);
            // Each block's (max, sum of exp(logit - max)) of this head; blocks past the candidates
            // write none.
            for (int b = 0; b < blocks; ++b) {
              const float* partial = partials + (static_cast<size_t>(item) * blocks + b) * group * 2 + g * 2;
              if (b * 256 >= count) {
                if (!std::isnan(partial[0]) || !std::isnan(partial[1]))
                  fail("partials of no candidate, block", item, g, b, partial[0], NAN);
                continue;
              }
              double top = -1e300, worst = 0.0, sum = 0.0;
              for (int c = b * 256; c < std::min(count, b * 256 + 256); ++c) {
                top = std::max(top, logit[c]);
                worst = std::max(worst, tolerance[c]);
                sum += std::exp(logit[c] - partial[0]);
              }
              if (!(std::abs(partial[0] - top) <= worst)) fail("block max", item, g, b, partial[0], top);
              // Each term within its logit's tolerance, plus __expf's and the fp32 sums' rounding.
              if (!(std::abs(partial[1] - sum) <= (2 * worst + 1e-4) * sum))
                fail("block sum", item, g, b, partial[1], sum);
            }
            double top = -1e300, sum = 0.0;
            for (double l : logit) top = std::max(top, l);
            for (double l : logit) sum += std::exp(l - top);
            for (int c = 0; c < count; ++c) best[c] = std::max(best[c], std::exp(logit[c] - top) / sum);
          }
          for (int c = 0; c < count; ++c) {
            const float g = got[static_cast<size_t>(item) * max_candidates + c];
            const bool outlier = bf16_to_f32(entry(first[s] + c)[head_dim]) != 0.0f;
            const double ref = outlier ? INFINITY : best[c];
            const bool ok = outlier ? std::isinf(g) && g > 0 : std::abs(g - ref) <= 1e-3 * ref + 1e-9;
            if (!ok) fail("score", item, -1, c, g, ref);
          }
          for (int c = count; c < max_candidates; ++c) {
            const float g = got[static_cast<size_t>(item) * max_candidates + c];
            if (!std::isnan(g)) fail("score past the candidates", item, -1, c, g, NAN);
          }
        }
    }
}

// Keys of rank `true_rank` (+ noise), stored with RoPE in prompt pages; factorised at `rank` and
// rebuilt into fresh pages. Returns the largest per-page relative error of the rebuilt keys.
double rebuild_error(std::mt19937& rng, int head_dim, int page_size, bool neox, int true_rank, int rank,
                     bool& values_kept) {
  const int kv = 2, width = kv * head_dim, prompt_pages = 37, tokens = prompt_pages * page_size;
  const size_t page_elems = size_t{2} * page_size * head_dim;
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> u(static_cast<size_t>(tokens * true_rank)), v(static_cast<size_t>(width * true_rank));
  for (double& x : u) x = normal(rng);
  for (double& x : v) x = normal(rng) / std::sqrt(static_cast<double>(true_rank));
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(1e4, -2.0 * i / head_dim));
  // Groups: prompt pages 0..36, then the factors, then the rebuilt pages.
  const int basis = cuda::shadowkv_basis_groups(page_size, head_dim, rank);
  const int a_groups = (prompt_pages + cuda::shadowkv_pages_per_factor_group(kv, head_dim, rank) - 1) /
                       cuda::shadowkv_pages_per_factor_group(kv, head_dim, rank);
  const int rebuilt = 37, groups = prompt_pages + basis + a_groups + rebuilt;
  std::vector<uint16_t> pool(static_cast<size_t>(groups) * kv * page_elems, 0xffff);
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < kv; ++h) {
      std::vector<double> x(head_dim);
      for (int d = 0; d < head_dim; ++d) {
        double sum = 1e-3 * normal(rng);
        for (int j = 0; j < true_rank; ++j) sum += u[static_cast<size_t>(t) * true_rank + j] * v[static_cast<size_t>(h * head_dim + d) * true_rank + j];
        x[d] = sum;
      }
      for (int i = 0; i < head_dim / 2; ++i) {
        const int a = neox ? i : 2 * i, b = neox ? i + head_dim / 2 : 2 * i + 1;
        const double angle = static_cast<double>(t) * inv_freq[i];
        const double x0 = x[a], x1 = x[b];
        x[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
        x[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
      }
      const size_t page = static_cast<size_t>(t / page_size) * kv + h;
      for (int d = 0; d < head_dim; ++d)
        pool[page * page_elems + static_cast<size_t>(t % page_size) * head_dim + d] = f32_to_bf16(static_cast<float>(x[d]));
    }
  }
  std::vector<int32_t> prompt_ids(size_t{prompt_pages} * kv), factor_dir(basis + a_groups);
  std::iota(prompt_ids.begin(), prompt_ids.end(), 0);
  std::iota(factor_dir.begin(), factor_dir.end(), prompt_pages);
  std::shuffle(factor_dir.begin(), factor_dir.end(), rng);
  // Rebuilt: per KV head, `rebuilt` prompt pages into the last groups' pages.
  std::vector<int32_t> logical, pages, offsets{0, rebuilt}, counts{rebuilt, rebuilt}, factor_offsets{0};
  for (int h = 0; h < kv; ++h)
    for (int j = 0; j < rebuilt; ++j) {
      logical.push_back(std::uniform_int_distribution<int>(0, prompt_pages - 1)(rng));
      pages.push_back((prompt_pages + basis + a_groups + j) * kv + h);
    }
  DeviceArray<uint16_t> d_pool(pool);
  DeviceArray<int32_t> d_prompt(prompt_ids), d_dir(factor_dir), d_logical(logical), d_pages(pages), d_offsets(offsets),
      d_counts(counts), d_factor_offsets(factor_offsets);
  DeviceArray<float> d_freq(inv_freq);
  cuda::ShadowKvUnrotateParams keys;
  keys.kv_pool = as_bf16(d_pool.get());
  keys.pages = d_prompt.get();
  keys.num_pages = prompt_pages;
  keys.num_kv_heads = kv;
  keys.head_dim = head_dim;
  keys.page_size = page_size;
  keys.inv_freq = d_freq.get();
  keys.neox = neox;
  cuda::ShadowKvStoreParams store;
  store.kv_pool = as_bf16(d_pool.get());
  store.basis_groups = d_dir.get();
  store.factor_groups = d_dir.get() + basis;
  store.num_kv_heads = kv;
  store.head_dim = head_dim;
  store.page_size = page_size;
  store.rank = rank;
  ShadowKvFactorizer factorizer(0);
  const std::vector<ShadowKvFactorizer::Layer> layers{{keys, store}};
  factorizer.factorize(layers, nullptr);
  cuda::ShadowKvRebuildParams p;
  p.kv_pool = as_bf16(d_pool.get());
  p.pages = d_pages.get();
  p.logical = d_logical.get();
  p.offsets = d_offsets.get();
  p.counts = d_counts.get();
  p.factor_dir = d_dir.get();
  p.factor_offsets = d_factor_offsets.get();
  p.basis_groups = basis;
  p.max_count = rebuilt;
  p.num_seqs = 1;
  p.num_kv_heads = kv;
  p.head_dim = head_dim;
  p.page_size = page_size;
  p.rank = rank;
  p.inv_freq = d_freq.get();
  p.neox = neox;
  if (cuda::shadowkv_rebuild_keys(p, nullptr) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return INFINITY;
  const std::vector<uint16_t> got = d_pool.download();
  double worst = 0.0;
  values_kept = true;
  for (int h = 0; h < kv; ++h)
    for (int j = 0; j < rebuilt; ++j) {
      const size_t i = static_cast<size_t>(h) * rebuilt + j;
      const uint16_t* out = got.data() + static_cast<size_t>(pages[i]) * page_elems;
      const uint16_t* ref = pool.data() + (static_cast<size_t>(logical[i]) * kv + h) * page_elems;
      double err = 0.0, norm = 0.0;
      for (int e = 0; e < page_size * head_dim; ++e) {
        const double d = double{bf16_to_f32(out[e])} - bf16_to_f32(ref[e]);
        err += d * d;
        norm += double{bf16_to_f32(ref[e])} * bf16_to_f32(ref[e]);
      }
      worst = std::max(worst, std::sqrt(err / norm));
      for (int e = page_size * head_dim; e < 2 * page_size * head_dim; ++e) values_kept &= is_poison(out[e]);
    }
  return worst;
}

TEST_F(GpuShadowKv, FactorsRebuildTheKeysOfALowRankPrompt) {
  for (bool neox : {true, false})
    for (int head_dim : {64, 128})
      for (int page_size : {8, 16}) {
        bool values_kept = false;
        const double exact = rebuild_error(rng_, head_dim, page_size, neox, 16, 16, values_kept);
        EXPECT_LE(exact, 2e-2) << "neox " << neox << " hd " << head_dim << " ps " << page_size;
        EXPECT_TRUE(values_kept) << "the rebuild wrote outside the keys";
        const double truncated = rebuild_error(rng_, head_dim, page_size, neox, 16, 8, values_kept);
        EXPECT_GT(truncated, 0.2) << "half the rank rebuilt the keys: is the rank used?";
      }
}

}  // namespace
}  // namespace spin
