// Seer's training-free gate on the GPU (kernels/cuda/seer_gate.h), on fresh random inputs each run
// (seed printed):
//  * Index: each listed page's key rows turned back by their positions and summed, against a
//    double recomputation; relative error <= 1e-5 of sum_t |k_t| per pair (fp32 sums of <= 64
//    terms with fp32 cos/sin); entries not listed keep their poison; value rows (far outside the
//    keys' range) never leak in. Positions up to 2^20 tokens, both RoPE pair layouts.
//  * Score: each candidate page gets its block's score (mean key of the block's pages below `end`
//    turned to the block centre, max over the group's heads; +inf for the block being decoded),
//    against a double recomputation, error <= 1e-4 of max_h sum_d |q_d * key_d|; slots past the
//    candidates keep their poison.
//  * Index + Score + select_top_pages against the CPU algorithm itself (sparse/seer.cpp, its
//    training-free gate) given the same pre-RoPE keys: the same pages per KV head, except where
//    the two blocks that swap places score within 1e-5 of each other in double.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/seer_gate.h"
#include "kernels/cuda/sparse_select.h"
#include "model/rope.h"
#include "sparse/algorithm.h"

namespace spin {
namespace {

using cuda::kSummaryChunkPages;

constexpr uint16_t kPoisonBf16 = 0xffff;
constexpr uint32_t kPoisonF32 = 0xffffffffu;
constexpr int kMaxReported = 8;

__nv_bfloat16* as_bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// A RoPE table like a model's (base 1e6), with an attention scaling that the scores must carry once.
RopeTable test_rope(int head_dim, bool neox) {
  RopeTable r;
  for (int i = 0; i < head_dim / 2; ++i) r.inv_freq.push_back(static_cast<float>(std::pow(1e6, -2.0 * i / head_dim)));
  r.mscale = 1.25f;
  r.neox = neox;
  return r;
}

int pair_a(int i, bool neox) { return neox ? i : 2 * i; }
int pair_b(int i, int head_dim, bool neox) { return neox ? i + head_dim / 2 : 2 * i + 1; }

// x turned by `sign` * pos * inv_freq, in double.
void turn(std::vector<double>& x, const RopeTable& rope, double pos, double sign) {
  const int hd = static_cast<int>(x.size());
  for (int i = 0; i < hd / 2; ++i) {
    const double angle = pos * static_cast<double>(rope.inv_freq[i]);
    const double c = std::cos(angle), s = sign * std::sin(angle);
    const int a = pair_a(i, rope.neox), b = pair_b(i, hd, rope.neox);
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

class GpuSeerGate : public SeededGpuTest<std::mt19937> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  float normal(float sigma) { return std::normal_distribution<float>(0.0f, sigma)(rng_); }
};

TEST_F(GpuSeerGate, IndexSumsKeysTurnedBackToPositionZero) {
  for (bool neox : {true, false})
    for (int head_dim : {64, 128})
      for (int page_size : {8, 16, 64}) {
        const RopeTable rope = test_rope(head_dim, neox);
        const int pool_pages = 29, num_entries = 53, listed = 41;
        const size_t page_elems = size_t{2} * page_size * head_dim;
        std::vector<uint16_t> pool(pool_pages * page_elems);
        for (size_t e = 0; e < pool.size(); ++e)
          pool[e] = (e % page_elems) >= page_elems / 2 ? f32_to_bf16(chance(0.5) ? 1e4f : -1e4f)
                                                        : f32_to_bf16(normal(2.0f));
        std::vector<int32_t> src(listed), dst(num_entries), logical(listed);
        for (int32_t& s : src) s = chance(0.15) ? -1 : uniform(0, pool_pages - 1);
        std::iota(dst.begin(), dst.end(), 0);
        std::shuffle(dst.begin(), dst.end(), rng_);
        dst.resize(listed);
        for (int32_t& l : logical) l = chance(0.3) ? uniform(0, 8) : uniform(0, (1 << 20) / page_size);

        DeviceArray<uint16_t> d_pool(pool), d_summaries(size_t{num_entries} * 2 * head_dim);
        DeviceArray<int32_t> d_src(src), d_dst(dst), d_logical(logical);
        DeviceArray<float> d_freq(rope.inv_freq);
        for (cudaError_t st : {d_pool.status(), d_summaries.status(), d_src.status(), d_dst.status(),
                               d_logical.status(), d_freq.status()})
          CUDA_OK(st);
        cuda::SeerIndexParams p;
        p.kv_pool = as_bf16(d_pool.get());
        p.src_pages = d_src.get();
        p.dst_entries = d_dst.get();
        p.logical_pages = d_logical.get();
        p.num_pages = listed;
        p.head_dim = head_dim;
        p.page_size = page_size;
        p.inv_freq = d_freq.get();
        p.neox = neox;
        p.summaries = as_bf16(d_summaries.get());
        CUDA_OK(cuda::seer_index_pages(p, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got_bits = d_summaries.download();

        std::vector<bool> written(num_entries, false);
        int bad = 0;
        const auto report = [&](const std::string& what) {
          if (bad++ < kMaxReported)
            ADD_FAILURE() << "neox " << neox << " head_dim " << head_dim << " page_size " << page_size << ": "
                          << what;
        };
        for (int i = 0; i < listed; ++i) {
          if (src[i] < 0) continue;
          written[dst[i]] = true;
          std::vector<double> sum(head_dim, 0.0), magnitude(head_dim, 0.0);
          for (int t = 0; t < page_size; ++t) {
            std::vector<double> k(head_dim);
            for (int d = 0; d < head_dim; ++d) {
              k[d] = bf16_to_f32(pool[src[i] * page_elems + size_t(t) * head_dim + d]);
            }
            for (int j = 0; j < head_dim / 2; ++j) {
              const double m = std::abs(k[pair_a(j, neox)]) + std::abs(k[pair_b(j, head_dim, neox)]);
              magnitude[pair_a(j, neox)] += m;
              magnitude[pair_b(j, head_dim, neox)] += m;
            }
            turn(k, rope, double(int64_t{logical[i]} * page_size + t), -1.0);
            for (int d = 0; d < head_dim; ++d) sum[d] += k[d];
          }
          const auto* got = reinterpret_cast<const float*>(got_bits.data() + size_t(dst[i]) * 2 * head_dim);
          for (int d = 0; d < head_dim; ++d)
            if (!(std::abs(got[d] - sum[d]) <= 1e-5 * magnitude[d]))
              report("entry " + std::to_string(dst[i]) + " dim " + std::to_string(d) + ": got " +
                     std::to_string(got[d]) + " expected " + std::to_string(sum[d]));
        }
        for (int e = 0; e < num_entries; ++e) {
          if (written[e]) continue;
          for (int x = 0; x < 2 * head_dim; ++x)
            if (got_bits[size_t(e) * 2 * head_dim + x] != kPoisonBf16) {
              report("entry " + std::to_string(e) + " not listed was written");
              break;
            }
        }
        EXPECT_EQ(bad, 0);
      }
}

// The reference block score of seer_gate.h, in double, from per-page sums `sum(page)`.
template <typename PageSum>
double reference_block_score(const PageSum& sum, const std::vector<double>& q_group, int group, int head_dim,
                             int page_size, int block_pages, int block, int end, const RopeTable& rope,
                             double* magnitude) {
  const int p0 = block * block_pages, p1 = std::min(end, p0 + block_pages);
  std::vector<double> key(head_dim, 0.0);
  for (int pg = p0; pg < p1; ++pg) {
    const std::vector<double> s = sum(pg);
    for (int d = 0; d < head_dim; ++d) key[d] += s[d];
  }
  for (double& x : key) x /= double((p1 - p0) * page_size);
  const int64_t block_tokens = int64_t{block_pages} * page_size;
  turn(key, rope, double(block * block_tokens + block_tokens / 2), 1.0);
  double best = -std::numeric_limits<double>::infinity();
  *magnitude = 0.0;
  for (int g = 0; g < group; ++g) {
    double dot = 0.0, m = 0.0;
    for (int d = 0; d < head_dim; ++d) {
      dot += q_group[size_t(g) * head_dim + d] * key[d];
      m += std::abs(q_group[size_t(g) * head_dim + d] * key[d]);
    }
    best = std::max(best, dot);
    *magnitude = std::max(*magnitude, m);
  }
  return best;
}

TEST_F(GpuSeerGate, ScoreIsTheBlockMeanKeyAtItsCentreAgainstTheGroup) {
  const int page_size = 16;
  for (bool neox : {true, false})
    for (int head_dim : {64, 128})
      for (int group : {1, 3, 4, 8})
        for (int block_pages : {1, 3, 4, 8}) {
          const RopeTable rope = test_rope(head_dim, neox);
          const int nkv = uniform(1, 3);
          // A range from page 0, an empty one, one starting mid-block past page 2000 that crosses
          // chunks, and one whose last block is the one being decoded (no window).
          const int f2 = uniform(2000, 2100), n2 = uniform(100, 600);
          const int f4 = uniform(0, 30), e4 = f4 + uniform(5, 300);
          const std::vector<int32_t> first = {0, 40, f2, f4};
          const std::vector<int32_t> end = {uniform(1, 700), 40, f2 + n2, e4};
          const std::vector<int32_t> current = {end[0] + uniform(0, 9), 44, f2 + n2 + 2, e4};
          const int num_seqs = 4;
          const int max_candidates = std::max({end[0], n2, e4 - f4}) + uniform(0, 9);
          std::vector<int32_t> dir_offsets(num_seqs);
          int total_chunks = 0;
          for (int s = 0; s < num_seqs; ++s) {
            dir_offsets[s] = total_chunks;
            total_chunks += (end[s] + kSummaryChunkPages - 1) / kSummaryChunkPages;
          }
          std::vector<int32_t> dir(total_chunks);
          std::iota(dir.begin(), dir.end(), 0);
          std::shuffle(dir.begin(), dir.end(), rng_);
          const size_t entries = size_t(total_chunks) * nkv * kSummaryChunkPages;
          std::vector<float> sums(entries * head_dim);
          for (float& x : sums) x = normal(4.0f);
          std::vector<uint16_t> q(size_t(num_seqs) * nkv * group * head_dim);
          for (uint16_t& x : q) x = f32_to_bf16(normal(1.0f));

          DeviceArray<float> d_sums(sums), d_freq(rope.inv_freq);
          DeviceArray<float> d_scores(size_t(num_seqs) * nkv * max_candidates);
          DeviceArray<uint16_t> d_q(q);
          DeviceArray<int32_t> d_dir(dir), d_offsets(dir_offsets), d_first(first), d_end(end), d_current(current);
          for (cudaError_t st : {d_sums.status(), d_freq.status(), d_scores.status(), d_q.status(), d_dir.status(),
                                 d_offsets.status(), d_first.status(), d_end.status(), d_current.status()})
            CUDA_OK(st);
          cuda::SeerScoreParams p;
          p.q = as_bf16(d_q.get());
          p.summaries = reinterpret_cast<const __nv_bfloat16*>(d_sums.get());
          p.summary_dir = d_dir.get();
          p.dir_offsets = d_offsets.get();
          p.first_candidate = d_first.get();
          p.end_candidate = d_end.get();
          p.current_page = d_current.get();
          p.num_seqs = num_seqs;
          p.num_kv_heads = nkv;
          p.group = group;
          p.head_dim = head_dim;
          p.page_size = page_size;
          p.block_pages = block_pages;
          p.inv_freq = d_freq.get();
          p.neox = neox;
          p.max_candidates = max_candidates;
          p.scores = d_scores.get();
          CUDA_OK(cuda::seer_score_pages(p, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const std::vector<float> got = d_scores.download();

          int bad = 0;
          for (int s = 0; s < num_seqs; ++s)
            for (int h = 0; h < nkv; ++h) {
              const int item = s * nkv + h;
              const auto page_sum = [&](int pg) {
                const size_t entry =
                    (size_t(dir[dir_offsets[s] + pg / kSummaryChunkPages]) * nkv + h) * kSummaryChunkPages +
                    pg % kSummaryChunkPages;
                return std::vector<double>(sums.begin() + entry * head_dim, sums.begin() + (entry + 1) * head_dim);
              };
              std::vector<double> qg(size_t(group) * head_dim);
              for (size_t x = 0; x < qg.size(); ++x) qg[x] = bf16_to_f32(q[size_t(item) * group * head_dim + x]);
              const float* row = got.data() + size_t(item) * max_candidates;
              for (int j = 0; j < max_candidates; ++j) {
                const int pg = first[s] + j;
                std::string problem;
                if (pg >= end[s]) {
                  if (f32_to_bits(row[j]) != kPoisonF32) problem = "past the candidates was written";
                } else if (pg / block_pages == current[s] / block_pages) {
                  if (!(std::isinf(row[j]) && row[j] > 0)) problem = "in the decoded block is not +inf";
                } else {
                  double magnitude = 0.0;
                  const double expect = reference_block_score(page_sum, qg, group, head_dim, page_size, block_pages,
                                                              pg / block_pages, end[s], rope, &magnitude);
                  if (!(std::abs(row[j] - expect) <= 1e-4 * magnitude))
                    problem = "got " + std::to_string(row[j]) + " expected " + std::to_string(expect);
                }
                if (!problem.empty() && bad++ < kMaxReported)
                  ADD_FAILURE() << "neox " << neox << " hd " << head_dim << " group " << group << " block "
                                << block_pages << " seq " << s << " head " << h << " page " << pg << ": " << problem;
              }
            }
          EXPECT_EQ(bad, 0);
        }
}

// The GPU's Index, Score and top-k against SeerAlgorithm on the CPU, for one layer.
TEST_F(GpuSeerGate, SelectsThePagesTheCpuAlgorithmSelects) {
  const int head_dim = 128, page_size = 16, nkv = 2, group = 4;
  const sparse::SparseSettings settings{.algorithm = "seer"};
  const int block_pages = static_cast<int>(settings.seer_block_tokens) / page_size;
  for (bool neox : {true, false})
    for (int round = 0; round < 3; ++round) {
      const RopeTable rope = test_rope(head_dim, neox);
      const int pages = uniform(60, 400);  // complete pages; the token being decoded opens the next
      const int first = 1, window = round == 2 ? 0 : 3;
      const int end = pages - window, current = pages;
      const int budget = uniform(4, 40);
      // Stored keys: bf16 of mscale * R(t) k_pre; the CPU gets them turned back (the GPU's input).
      const size_t page_elems = size_t{2} * page_size * head_dim;
      std::vector<uint16_t> pool(size_t(pages) * nkv * page_elems, f32_to_bf16(0.0f));
      std::vector<float> pre(size_t(pages) * nkv * page_size * head_dim);
      for (int pg = 0; pg < pages; ++pg)
        for (int h = 0; h < nkv; ++h) {
          // Blocks of similar keys, as in real attention (a block's mean is then informative).
          std::vector<float> centre(head_dim);
          for (float& x : centre) x = normal(1.0f);
          for (int t = 0; t < page_size; ++t) {
            std::vector<double> k(head_dim);
            for (int d = 0; d < head_dim; ++d) k[d] = centre[d] + normal(0.5f);
            const double pos = double(int64_t{pg} * page_size + t);
            turn(k, rope, pos, 1.0);
            std::vector<double> back(head_dim);
            for (int d = 0; d < head_dim; ++d) {
              const uint16_t stored = f32_to_bf16(static_cast<float>(k[d] * rope.mscale));
              pool[(size_t(pg) * nkv + h) * page_elems + size_t(t) * head_dim + d] = stored;
              back[d] = bf16_to_f32(stored) / rope.mscale;
            }
            turn(back, rope, pos, -1.0);
            for (int d = 0; d < head_dim; ++d)
              pre[((size_t(pg) * nkv + h) * page_size + t) * head_dim + d] = static_cast<float>(back[d]);
          }
        }
      std::vector<uint16_t> q(size_t(nkv) * group * head_dim);
      for (uint16_t& x : q) x = f32_to_bf16(normal(1.0f));
      std::vector<float> q_f32(q.size());
      for (size_t i = 0; i < q.size(); ++i) q_f32[i] = bf16_to_f32(q[i]);

      // CPU: the algorithm itself.
      const AttentionShape shape{.n_layers = 1, .n_heads = nkv * group, .n_kv_heads = nkv, .head_dim = head_dim};
      const kv::KvLayout layout{1, nkv, head_dim, page_size, kv::ElemType::F32};
      auto cpu = sparse::AlgorithmRegistry::global().create("seer", sparse::AlgorithmContext{shape, layout, &settings});
      sparse::IndexInput in;
      in.first_page = 0;
      in.end_page = static_cast<uint32_t>(pages);
      in.page_keys_pre_rope = [&](uint32_t h, uint32_t pg) {
        return pre.data() + (size_t(pg) * nkv + h) * page_size * head_dim;
      };
      in.page_keys = in.page_keys_pre_rope;
      in.rope = &rope;
      cpu->index(in);
      sparse::SelectQuery query;
      query.q = q_f32.data();
      query.num_kv_heads = nkv;
      query.group = group;
      query.context_tokens = static_cast<uint32_t>(current * page_size + 1);
      query.first_candidate = first;
      query.end_candidate = static_cast<uint32_t>(end);
      query.budget_pages = static_cast<uint32_t>(budget);
      query.rope = &rope;
      kv::LayerSelection cpu_pages;
      sparse::StepBudget step;
      cpu->select(query, cpu_pages, step);

      // GPU: one summary chunk per 64 pages, entries (chunk * nkv + h) * 64 + pg % 64.
      const int chunks = (pages + kSummaryChunkPages - 1) / kSummaryChunkPages;
      std::vector<int32_t> src, dst, logical, dir(chunks);
      std::iota(dir.begin(), dir.end(), 0);
      for (int pg = 0; pg < pages; ++pg)
        for (int h = 0; h < nkv; ++h) {
          src.push_back(pg * nkv + h);
          dst.push_back((pg / kSummaryChunkPages * nkv + h) * kSummaryChunkPages + pg % kSummaryChunkPages);
          logical.push_back(pg);
        }
      const std::vector<int32_t> zero = {0}, firsts = {first}, ends = {end}, currents = {current};
      const std::vector<int32_t> counts(nkv, std::min(budget, end - first));
      std::vector<int32_t> out_offsets(nkv);
      for (int h = 0; h < nkv; ++h) out_offsets[h] = h * counts[0];
      DeviceArray<uint16_t> d_pool(pool), d_q(q), d_summaries(size_t(chunks) * nkv * kSummaryChunkPages * 2 * head_dim);
      DeviceArray<int32_t> d_src(src), d_dst(dst), d_logical(logical), d_dir(dir), d_zero(zero), d_first(firsts),
          d_end(ends), d_current(currents), d_counts(counts), d_out_offsets(out_offsets), d_out(size_t(nkv) * counts[0]);
      DeviceArray<float> d_freq(rope.inv_freq), d_scores(size_t(nkv) * (end - first));
      for (cudaError_t st : {d_pool.status(), d_q.status(), d_summaries.status(), d_src.status(), d_out.status(),
                             d_freq.status(), d_scores.status()})
        CUDA_OK(st);
      cuda::SeerIndexParams ip;
      ip.kv_pool = as_bf16(d_pool.get());
      ip.src_pages = d_src.get();
      ip.dst_entries = d_dst.get();
      ip.logical_pages = d_logical.get();
      ip.num_pages = static_cast<int>(src.size());
      ip.head_dim = head_dim;
      ip.page_size = page_size;
      ip.inv_freq = d_freq.get();
      ip.neox = neox;
      ip.summaries = as_bf16(d_summaries.get());
      CUDA_OK(cuda::seer_index_pages(ip, nullptr));
      cuda::SeerScoreParams sp;
      sp.q = as_bf16(d_q.get());
      sp.summaries = as_bf16(d_summaries.get());
      sp.summary_dir = d_dir.get();
      sp.dir_offsets = d_zero.get();
      sp.first_candidate = d_first.get();
      sp.end_candidate = d_end.get();
      sp.current_page = d_current.get();
      sp.num_seqs = 1;
      sp.num_kv_heads = nkv;
      sp.group = group;
      sp.head_dim = head_dim;
      sp.page_size = page_size;
      sp.block_pages = block_pages;
      sp.inv_freq = d_freq.get();
      sp.neox = neox;
      sp.max_candidates = end - first;
      sp.scores = d_scores.get();
      CUDA_OK(cuda::seer_score_pages(sp, nullptr));
      cuda::SelectTopParams tp;
      tp.scores = d_scores.get();
      tp.max_candidates = end - first;
      tp.first_candidate = d_first.get();
      tp.end_candidate = d_end.get();
      tp.counts = d_counts.get();
      tp.out_offsets = d_out_offsets.get();
      tp.num_seqs = 1;
      tp.num_kv_heads = nkv;
      tp.out_pages = d_out.get();
      CUDA_OK(cuda::select_top_pages(tp, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<int32_t> gpu_pages = d_out.download();

      for (int h = 0; h < nkv; ++h) {
        std::vector<int32_t> want(cpu_pages.head(h).begin(), cpu_pages.head(h).end());
        std::sort(want.begin(), want.end());
        const std::vector<int32_t> got(gpu_pages.begin() + out_offsets[h], gpu_pages.begin() + out_offsets[h] + counts[h]);
        if (got == want) continue;
        // Allowed only as a near-tie: every block one side has and the other lacks scores within
        // 1e-5 (relative to the largest score magnitude) of a block the other side has instead.
        std::vector<double> qg(size_t(group) * head_dim);
        for (size_t x = 0; x < qg.size(); ++x) qg[x] = q_f32[size_t(h) * group * head_dim + x];
        const auto page_sum = [&](int pg) {
          std::vector<double> s(head_dim, 0.0);
          for (int t = 0; t < page_size; ++t)
            for (int d = 0; d < head_dim; ++d) s[d] += pre[((size_t(pg) * nkv + h) * page_size + t) * head_dim + d];
          return s;
        };
        std::vector<int32_t> only;
        std::set_symmetric_difference(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(only));
        std::vector<double> block_scores;
        double magnitude = 0.0;
        for (int32_t pg : only) {
          double m = 0.0;
          block_scores.push_back(reference_block_score(page_sum, qg, group, head_dim, page_size, block_pages,
                                                       pg / block_pages, end, rope, &m));
          magnitude = std::max(magnitude, m);
        }
        const auto [lo, hi] = std::minmax_element(block_scores.begin(), block_scores.end());
        EXPECT_LE(*hi - *lo, 1e-5 * magnitude)
            << "neox " << neox << " round " << round << " head " << h << ": the GPU and the CPU chose different "
            << only.size() << " pages whose blocks score " << *lo << " .. " << *hi;
      }
    }
}

}  // namespace
}  // namespace spin
