// Seer's training-free gate on the GPU (kernels/cuda/seer_gate.h), on fresh random inputs each run
// (seed printed):
//  * Index: the pages of two sequences (one past 2^20 tokens) folded as the engine does, prompts
//    in runs per block then decode steps page by page; each entry against double: the block's sum
//    so far of the keys turned back by their positions, or at its last page the block's mean
//    turned to its centre; error <= 1e-5 of the sums of |terms| (fp32 sums of <= 512 terms with
//    fp32 cos/sin); entries of no page keep their poison; value rows (far outside the keys'
//    range) never leak in. Both RoPE pair layouts, 1..8 pages a block.
//  * Score: each candidate page gets its block's score (mean key of the block's pages below `end`
//    turned to the block centre, max over the group's heads; +inf for the block being decoded),
//    from the entries an Index makes of random page sums, against a double recomputation from
//    those sums, error <= 1e-4 of max_h sum_d |q_d * key_d|; slots past the candidates keep their
//    poison. Warps of one block and of four (pinned; the trained and CPU tests pin both too).
//  * Trained Index: runs of a block's pages (the prompt's, head-major) then single pages (decode
//    steps); each complete block's key (pooled keys turned back, times k_gate, turned to the block
//    start) and the last partial block's running max, min and sum against double, relative to the
//    sums of |terms| (<= 1e-4 for the key, 1e-5 for the pools); the other pages' entries keep
//    their poison; decode rows with no page write nothing.
//  * Gate queries against double (<= 1e-5 of the sum of |terms|); trained Score: each candidate
//    page gets gate query · its block's key (the entry of the block's first page), <= 1e-5 of
//    sum_d |gq_d key_d|; +inf for the block being decoded; slots past the candidates keep poison.
//  * Index + Score + select_top_pages against the CPU algorithm itself (sparse/seer.cpp, both
//    gates) given the same pre-RoPE keys: the same pages per KV head, except where the two blocks
//    that swap places score within 1e-5 of each other (relative to what rounding can move) in
//    double.
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
#include "sparse/seer_gate.h"

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

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = f32_to_bf16(x[i]);
  return out;
}

// The trained gate's compressed key of a block in double: pooled [max | min | mean] of `rows`
// (pre-RoPE key rows, head_dim each) times k_gate, turned to `pos` and scaled by `mscale` (the
// CPU's RoPE). magnitude[d]: the largest |key| the same sums could give (sum of |terms|, the pair's).
std::vector<double> reference_trained_key(const std::vector<std::vector<double>>& rows, const float* k_gate,
                                          const RopeTable& rope, double pos, double mscale,
                                          std::vector<double>* magnitude) {
  const auto hd = static_cast<int>(rows.front().size());
  std::vector<double> pooled(3 * size_t(hd), 0.0);
  for (int d = 0; d < hd; ++d) {
    pooled[d] = -std::numeric_limits<double>::infinity();
    pooled[hd + d] = std::numeric_limits<double>::infinity();
  }
  for (const std::vector<double>& x : rows)
    for (int d = 0; d < hd; ++d) {
      pooled[d] = std::max(pooled[d], x[d]);
      pooled[hd + d] = std::min(pooled[hd + d], x[d]);
      pooled[2 * hd + d] += x[d] / double(rows.size());
    }
  std::vector<double> key(hd, 0.0), m(hd, 0.0);
  for (int i = 0; i < 3 * hd; ++i)
    for (int d = 0; d < hd; ++d) {
      key[d] += pooled[i] * k_gate[size_t(i) * hd + d];
      m[d] += std::abs(pooled[i] * k_gate[size_t(i) * hd + d]);
    }
  turn(key, rope, pos, 1.0);
  for (double& x : key) x *= mscale;
  magnitude->assign(hd, 0.0);
  for (int i = 0; i < hd / 2; ++i) {
    const int a = pair_a(i, rope.neox), b = pair_b(i, hd, rope.neox);
    (*magnitude)[a] = (*magnitude)[b] = mscale * (m[a] + m[b]);
  }
  return key;
}

// The gate query of KV head h in double: the group's query rows `q_group` times q_gate.
std::vector<double> reference_gate_query(const std::vector<double>& q_group, const float* q_gate, int head_dim,
                                         std::vector<double>* magnitude) {
  std::vector<double> gq(head_dim, 0.0);
  magnitude->assign(head_dim, 0.0);
  for (size_t i = 0; i < q_group.size(); ++i)
    for (int d = 0; d < head_dim; ++d) {
      gq[d] += q_group[i] * q_gate[i * head_dim + d];
      (*magnitude)[d] += std::abs(q_group[i] * q_gate[i * head_dim + d]);
    }
  return gq;
}

// The trained gate's score of block `block` for KV head h of layer `layer`, in double, from the
// pre-RoPE key rows `pre_row(page, token)` of all its pages. *magnitude bounds what rounding in
// the key and the gate query can move it by, in units of their relative error.
template <typename PreRow>
double reference_trained_score(const PreRow& pre_row, const std::vector<double>& q_group, const sparse::SeerGate& gate,
                               int layer, int h, int page_size, int block_pages, int block, const RopeTable& rope,
                               double* magnitude) {
  const int hd = static_cast<int>(gate.head_dim);
  std::vector<std::vector<double>> rows;
  for (int pg = block * block_pages; pg < (block + 1) * block_pages; ++pg)
    for (int t = 0; t < page_size; ++t) rows.emplace_back(pre_row(pg, t), pre_row(pg, t) + hd);
  std::vector<double> key_m, q_m;
  const std::vector<double> key = reference_trained_key(rows, gate.k_gate(layer, h), rope,
                                                        double(int64_t{block} * block_pages * page_size), rope.mscale,
                                                        &key_m);
  const std::vector<double> gq = reference_gate_query(q_group, gate.q_gate(layer, h), hd, &q_m);
  double score = 0.0;
  *magnitude = 0.0;
  for (int d = 0; d < hd; ++d) {
    score += gq[d] * key[d];
    *magnitude += std::abs(gq[d]) * key_m[d] + std::abs(key[d]) * q_m[d];
  }
  return score;
}

class GpuSeerGate : public SeededGpuTest<std::mt19937> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  float normal(float sigma) { return std::normal_distribution<float>(0.0f, sigma)(rng_); }

  // Trained gate weights (bf16 values, as the GPU keeps them; each output has an input row's spread).
  std::shared_ptr<const sparse::SeerGate> random_gate(int layers, int nkv, int group, int head_dim) {
    auto gate = std::make_shared<sparse::SeerGate>();
    gate->n_layers = uint32_t(layers);
    gate->n_kv_heads = uint32_t(nkv);
    gate->group = uint32_t(group);
    gate->head_dim = uint32_t(head_dim);
    gate->k.resize(size_t(layers) * nkv * 3 * head_dim * head_dim);
    gate->q.resize(size_t(layers) * nkv * group * head_dim * head_dim);
    for (float& x : gate->k) x = bf16_to_f32(f32_to_bf16(normal(1.0f / std::sqrt(3.0f * head_dim))));
    for (float& x : gate->q) x = bf16_to_f32(f32_to_bf16(normal(1.0f / std::sqrt(float(group * head_dim)))));
    return gate;
  }

  void expect_the_cpu_selection(bool trained);

  // The pages of two sequences as an Index folds them in the engine: each prompt's complete pages
  // (a run per block and KV head, head-major; its last block partial), then decode steps that
  // complete one page per (sequence, KV head) until `pages`. Sequence 1 starts past 2^20 tokens,
  // so its angles are large. Keys are N(0, 2); value rows +-1e4, far outside them, so a leak shows.
  struct FoldLayout {
    static constexpr int kSeqs = 2, kKvHeads = 2;
    int head_dim = 0, page_size = 0, block_pages = 0;
    std::vector<int> pages, prompt, first_page;  // first_page: logical page of page 0, a chunk's start
    std::vector<uint16_t> pool;
    std::vector<int32_t> pool_ids;  // (seq, page, head) -> pool page
    std::vector<std::vector<int32_t>> dir;
    int chunks = 0;
    size_t page_elems() const { return size_t{2} * page_size * head_dim; }
    int32_t pool_page(int s, int pg, int h) const { return pool_ids[((s ? pages[0] : 0) + pg) * kKvHeads + h]; }
    int32_t entry(int s, int h, int pg) const {
      return (dir[s][pg / kSummaryChunkPages] * kKvHeads + h) * kSummaryChunkPages + pg % kSummaryChunkPages;
    }
    size_t entries() const { return size_t(chunks) * kKvHeads * kSummaryChunkPages; }
    int64_t position(int s, int pg, int t) const { return (int64_t{first_page[s]} + pg) * page_size + t; }
    std::string name(const RopeTable& rope) const {
      return "neox " + std::to_string(rope.neox) + " head_dim " + std::to_string(head_dim) + " page_size " +
             std::to_string(page_size) + " block_pages " + std::to_string(block_pages);
    }
    // Key row t of page pg, turned back to position 0 in double; adds each pair's |k_a| + |k_b| to
    // *magnitude (both of its dimensions) when given.
    std::vector<double> turned_back(int s, int h, int pg, int t, const RopeTable& rope,
                                    std::vector<double>* magnitude) const {
      std::vector<double> k(head_dim);
      for (int d = 0; d < head_dim; ++d)
        k[d] = bf16_to_f32(pool[size_t(pool_page(s, pg, h)) * page_elems() + size_t(t) * head_dim + d]);
      if (magnitude)
        for (int i = 0; i < head_dim / 2; ++i) {
          const int a = pair_a(i, rope.neox), b = pair_b(i, head_dim, rope.neox);
          const double m = std::abs(k[a]) + std::abs(k[b]);
          (*magnitude)[a] += m;
          (*magnitude)[b] += m;
        }
      turn(k, rope, double(position(s, pg, t)), -1.0);
      return k;
    }
  };
  FoldLayout fold_layout(int head_dim, int page_size, int block_pages) {
    FoldLayout l;
    l.head_dim = head_dim;
    l.page_size = page_size;
    l.block_pages = block_pages;
    l.pages = {uniform(30, 90), uniform(200, 400)};
    l.first_page = {0, ((1 << 20) / page_size / kSummaryChunkPages + uniform(0, 3)) * kSummaryChunkPages};
    for (int s = 0; s < FoldLayout::kSeqs; ++s) {
      int prompt;
      do prompt = uniform(block_pages + 1, l.pages[s] - 2);
      while (block_pages > 1 && prompt % block_pages == 0);  // a partial last block, where one can be
      l.prompt.push_back(prompt);
    }
    const int pool_pages = (l.pages[0] + l.pages[1]) * FoldLayout::kKvHeads;
    l.pool.resize(pool_pages * l.page_elems());
    for (size_t e = 0; e < l.pool.size(); ++e)
      l.pool[e] = (e % l.page_elems()) >= l.page_elems() / 2 ? f32_to_bf16(chance(0.5) ? 1e4f : -1e4f)
                                                            : f32_to_bf16(normal(2.0f));
    l.pool_ids.resize(pool_pages);
    std::iota(l.pool_ids.begin(), l.pool_ids.end(), 0);
    std::shuffle(l.pool_ids.begin(), l.pool_ids.end(), rng_);
    l.dir.resize(FoldLayout::kSeqs);
    for (int s = 0; s < FoldLayout::kSeqs; ++s)
      for (int c = 0; c < (l.pages[s] + kSummaryChunkPages - 1) / kSummaryChunkPages; ++c) l.dir[s].push_back(l.chunks++);
    std::vector<int32_t> order(l.chunks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng_);
    for (auto& d : l.dir)
      for (int32_t& c : d) c = order[c];
    return l;
  }
  // Folds the layout's pages with `index` (which launches an Index on p; fold sets p's pool,
  // shape, RoPE, summaries and lists): the prompts, then the decode steps (rows that complete no
  // page pass -1), and downloads the summaries' bf16 words to *summaries.
  template <typename Index>
  void fold(const FoldLayout& l, const RopeTable& rope, cuda::SeerIndexParams& p, Index index,
            std::vector<uint16_t>* summaries) {
    DeviceArray<uint16_t> d_pool(l.pool), d_summaries(l.entries() * 2 * l.head_dim);
    DeviceArray<float> d_freq(rope.inv_freq);
    for (cudaError_t st : {d_pool.status(), d_summaries.status(), d_freq.status()}) CUDA_OK(st);
    p.kv_pool = as_bf16(d_pool.get());
    p.head_dim = l.head_dim;
    p.page_size = l.page_size;
    p.block_pages = l.block_pages;
    p.inv_freq = d_freq.get();
    p.neox = rope.neox;
    p.summaries = as_bf16(d_summaries.get());
    const auto run = [&](const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                         const std::vector<int32_t>& logical, const std::vector<int32_t>* runs) {
      DeviceArray<int32_t> d_src(src), d_dst(dst), d_logical(logical), d_runs(runs ? *runs : src);
      for (cudaError_t st : {d_src.status(), d_dst.status(), d_logical.status(), d_runs.status()}) CUDA_OK(st);
      p.src_pages = d_src.get();
      p.dst_entries = d_dst.get();
      p.logical_pages = d_logical.get();
      p.run_offsets = runs ? d_runs.get() : nullptr;
      p.num_runs = runs ? static_cast<int>(runs->size()) - 1 : static_cast<int>(src.size());
      CUDA_OK(index());
      CUDA_OK(cudaDeviceSynchronize());
    };
    {
      std::vector<int32_t> src, dst, logical, runs;
      for (int s = 0; s < FoldLayout::kSeqs; ++s)
        for (int h = 0; h < FoldLayout::kKvHeads; ++h)
          for (int pg = 0; pg < l.prompt[s]; ++pg) {
            if (pg % l.block_pages == 0) runs.push_back(static_cast<int32_t>(src.size()));
            src.push_back(l.pool_page(s, pg, h));
            dst.push_back(l.entry(s, h, pg));
            logical.push_back(l.first_page[s] + pg);
          }
      runs.push_back(static_cast<int32_t>(src.size()));
      run(src, dst, logical, &runs);
    }
    for (int pg = std::min(l.prompt[0], l.prompt[1]); pg < std::max(l.pages[0], l.pages[1]); ++pg) {
      std::vector<int32_t> src, dst, logical;
      for (int s = 0; s < FoldLayout::kSeqs; ++s)
        for (int h = 0; h < FoldLayout::kKvHeads; ++h) {
          const bool folds = pg >= l.prompt[s] && pg < l.pages[s];
          src.push_back(folds ? l.pool_page(s, pg, h) : -1);
          dst.push_back(folds ? l.entry(s, h, pg) : 0);
          logical.push_back(folds ? l.first_page[s] + pg : 0);
        }
      run(src, dst, logical, nullptr);
    }
    *summaries = d_summaries.download();
  }
  // Dimension d of entry e of summaries whose entries hold head_dim fp32 values, as fold returns them.
  static float entry_value(const std::vector<uint16_t>& bits, int head_dim, int64_t e, int d) {
    const size_t at = (size_t(e) * head_dim + d) * 2;
    return bits_to_f32(uint32_t{bits[at]} | uint32_t{bits[at + 1]} << 16);
  }

  // Candidate ranges of four sequences for the score tests: one from page 0, an empty one, one
  // starting mid-block past page 2000 that crosses chunks, and one whose last block is the one
  // being decoded (no window); their summary chunks in shuffled order.
  struct ScoreLayout {
    static constexpr int kSeqs = 4;
    std::vector<int32_t> first, end, current, dir_offsets, dir;
    int max_candidates = 0;
    // Summary entry of page pg of KV head h of sequence s (sparse_select.h), of nkv KV heads.
    size_t entry(int s, int h, int pg, int nkv) const {
      return (size_t(dir[dir_offsets[s] + pg / kSummaryChunkPages]) * nkv + h) * kSummaryChunkPages +
             pg % kSummaryChunkPages;
    }
    size_t entries(int nkv) const { return dir.size() * nkv * kSummaryChunkPages; }
  };
  ScoreLayout score_layout() {
    ScoreLayout l;
    const int f2 = uniform(2000, 2100), n2 = uniform(100, 600);
    const int f4 = uniform(0, 30), e4 = f4 + uniform(5, 300);
    l.first = {0, 40, f2, f4};
    l.end = {uniform(1, 700), 40, f2 + n2, e4};
    l.current = {l.end[0] + uniform(0, 9), 44, f2 + n2 + 2, e4};
    l.max_candidates = std::max({l.end[0], n2, e4 - f4}) + uniform(0, 9);
    int chunks = 0;
    for (int s = 0; s < ScoreLayout::kSeqs; ++s) {
      l.dir_offsets.push_back(chunks);
      chunks += (l.end[s] + kSummaryChunkPages - 1) / kSummaryChunkPages;
    }
    l.dir.resize(chunks);
    std::iota(l.dir.begin(), l.dir.end(), 0);
    std::shuffle(l.dir.begin(), l.dir.end(), rng_);
    return l;
  }
  // A layout's tables on the device, wired into score parameters.
  struct DeviceScoreLayout {
    DeviceArray<int32_t> dir, offsets, first, end, current;
    explicit DeviceScoreLayout(const ScoreLayout& l)
        : dir(l.dir), offsets(l.dir_offsets), first(l.first), end(l.end), current(l.current) {}
    void wire(cuda::SeerScoreParams& p, int nkv, int max_candidates) const {
      for (cudaError_t st : {dir.status(), offsets.status(), first.status(), end.status(), current.status()})
        CUDA_OK(st);
      p.summary_dir = dir.get();
      p.dir_offsets = offsets.get();
      p.first_candidate = first.get();
      p.end_candidate = end.get();
      p.current_page = current.get();
      p.num_seqs = ScoreLayout::kSeqs;
      p.num_kv_heads = nkv;
      p.max_candidates = max_candidates;
    }
  };
};

TEST_F(GpuSeerGate, IndexKeepsBlockSumsThenTheReadyBlockKey) {
  for (bool neox : {true, false})
    for (int head_dim : {64, 128})
      for (int page_size : {8, 16, 64})
        for (int block_pages : {1, 2, 4, 8}) {
          const RopeTable rope = test_rope(head_dim, neox);
          const FoldLayout l = fold_layout(head_dim, page_size, block_pages);
          cuda::SeerIndexParams p;
          std::vector<uint16_t> got_bits;
          fold(l, rope, p, [&] { return cuda::seer_index_pages(p, nullptr); }, &got_bits);
          const auto got = [&](int32_t e, int d) { return entry_value(got_bits, head_dim, e, d); };

          int bad = 0;
          const auto report = [&](const std::string& what) {
            if (bad++ < kMaxReported) ADD_FAILURE() << l.name(rope) << ": " << what;
          };
          std::vector<bool> written(l.entries(), false);
          for (int s = 0; s < FoldLayout::kSeqs; ++s)
            for (int h = 0; h < FoldLayout::kKvHeads; ++h) {
              std::vector<double> sum(head_dim), magnitude(head_dim);
              for (int pg = 0; pg < l.pages[s]; ++pg) {
                const int j = pg % block_pages;
                if (j == 0) std::fill(sum.begin(), sum.end(), 0.0), std::fill(magnitude.begin(), magnitude.end(), 0.0);
                for (int t = 0; t < page_size; ++t) {
                  const std::vector<double> k = l.turned_back(s, h, pg, t, rope, &magnitude);
                  for (int d = 0; d < head_dim; ++d) sum[d] += k[d];
                }
                std::vector<double> want = sum, tolerance = magnitude;
                const char* what = "block sum";
                if (j == block_pages - 1) {  // the block key: the mean, turned to the block's centre
                  const double tokens = double(block_pages) * page_size;
                  for (int d = 0; d < head_dim; ++d) want[d] /= tokens, tolerance[d] /= tokens;
                  turn(want, rope, double(l.position(s, pg - j, 0)) + tokens / 2, 1.0);
                  what = "block key";
                }
                const int32_t e = l.entry(s, h, pg);
                written[e] = true;
                for (int d = 0; d < head_dim; ++d)
                  if (!(std::abs(got(e, d) - want[d]) <= 1e-5 * tolerance[d]))
                    report("seq " + std::to_string(s) + " head " + std::to_string(h) + " page " + std::to_string(pg) +
                           " " + what + " dim " + std::to_string(d) + ": got " + std::to_string(got(e, d)) +
                           " expected " + std::to_string(want[d]));
              }
            }
          for (size_t e = 0; e < l.entries(); ++e) {
            if (written[e]) continue;
            for (int x = 0; x < 2 * head_dim; ++x)
              if (got_bits[e * 2 * head_dim + x] != kPoisonBf16) {
                report("entry " + std::to_string(e) + " of no page was written");
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
        for (int block_pages : {1, 2, 4, 8})
          for (int tile_blocks : {1, 4}) {
          const RopeTable rope = test_rope(head_dim, neox);
          const int nkv = uniform(1, 3);
          const ScoreLayout layout = score_layout();
          const std::vector<int32_t>&first = layout.first, &end = layout.end, &current = layout.current;
          const int num_seqs = ScoreLayout::kSeqs, max_candidates = layout.max_candidates;
          // Random page sums, and the entries an Index makes of them (seer_gate.h): the block's sum
          // so far, or, at its last page, the block key.
          std::vector<float> sums(layout.entries(nkv) * head_dim), entries(sums.size());
          for (float& x : sums) x = normal(4.0f);
          const int64_t block_tokens = int64_t{block_pages} * page_size;
          for (int s = 0; s < num_seqs; ++s)
            for (int h = 0; h < nkv; ++h) {
              const int pages = (end[s] + kSummaryChunkPages - 1) / kSummaryChunkPages * kSummaryChunkPages;
              std::vector<double> sum(head_dim);
              for (int pg = 0; pg < pages; ++pg) {
                const size_t e = layout.entry(s, h, pg, nkv);
                if (pg % block_pages == 0) std::fill(sum.begin(), sum.end(), 0.0);
                for (int d = 0; d < head_dim; ++d) sum[d] += sums[e * head_dim + d];
                std::vector<double> stored = sum;
                if (pg % block_pages == block_pages - 1) {
                  for (double& x : stored) x /= double(block_tokens);
                  turn(stored, rope, double(pg / block_pages * block_tokens + block_tokens / 2), 1.0);
                }
                for (int d = 0; d < head_dim; ++d) entries[e * head_dim + d] = static_cast<float>(stored[d]);
              }
            }
          std::vector<uint16_t> q(size_t(num_seqs) * nkv * group * head_dim);
          for (uint16_t& x : q) x = f32_to_bf16(normal(1.0f));

          DeviceArray<float> d_sums(entries), d_freq(rope.inv_freq);
          DeviceArray<float> d_scores(size_t(num_seqs) * nkv * max_candidates);
          DeviceArray<uint16_t> d_q(q);
          const DeviceScoreLayout d_layout(layout);
          for (cudaError_t st : {d_sums.status(), d_freq.status(), d_scores.status(), d_q.status()}) CUDA_OK(st);
          cuda::SeerScoreParams p;
          d_layout.wire(p, nkv, max_candidates);
          p.q = as_bf16(d_q.get());
          p.summaries = reinterpret_cast<const __nv_bfloat16*>(d_sums.get());
          p.group = group;
          p.head_dim = head_dim;
          p.page_size = page_size;
          p.block_pages = block_pages;
          p.inv_freq = d_freq.get();
          p.neox = neox;
          p.scores = d_scores.get();
          p.tile_blocks = tile_blocks;
          CUDA_OK(cuda::seer_score_pages(p, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const std::vector<float> got = d_scores.download();

          int bad = 0;
          for (int s = 0; s < num_seqs; ++s)
            for (int h = 0; h < nkv; ++h) {
              const int item = s * nkv + h;
              const auto page_sum = [&](int pg) {
                const size_t entry = layout.entry(s, h, pg, nkv);
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
                  ADD_FAILURE() << "neox " << neox << " hd " << head_dim << " group " << group << " tile " << tile_blocks << " block "
                                << block_pages << " seq " << s << " head " << h << " page " << pg << ": " << problem;
              }
            }
          EXPECT_EQ(bad, 0);
        }
}

TEST_F(GpuSeerGate, TrainedIndexFoldsBlocksIntoCompressedKeys) {
  for (bool neox : {true, false})
    for (int head_dim : {64, 128})
      for (int page_size : {8, 16})
        for (int block_pages : {4, 8}) {
          const RopeTable rope = test_rope(head_dim, neox);
          const FoldLayout l = fold_layout(head_dim, page_size, block_pages);
          const int nkv = FoldLayout::kKvHeads;
          const auto gate = random_gate(1, nkv, 1, head_dim);
          DeviceArray<uint16_t> d_k_gate(to_bf16(gate->k));
          CUDA_OK(d_k_gate.status());
          cuda::SeerTrainedIndexParams p;
          p.num_kv_heads = nkv;
          p.k_gate = as_bf16(d_k_gate.get());
          std::vector<uint16_t> got_bits;
          fold(l, rope, p, [&] { return cuda::seer_trained_index_pages(p, nullptr); }, &got_bits);
          const auto got = [&](int32_t e, int d) { return entry_value(got_bits, head_dim, e, d); };

          int bad = 0;
          const auto report = [&](const std::string& what) {
            if (bad++ < kMaxReported) ADD_FAILURE() << l.name(rope) << ": " << what;
          };
          for (int s = 0; s < FoldLayout::kSeqs; ++s)
            for (int h = 0; h < nkv; ++h)
              for (int b = 0; b * block_pages < l.pages[s]; ++b) {
                const int p0 = b * block_pages, p1 = std::min(l.pages[s], p0 + block_pages);
                std::vector<std::vector<double>> rows;  // turned back, in double
                std::vector<double> abs_max(head_dim, 0.0), abs_sum(head_dim, 0.0);
                for (int pg = p0; pg < p1; ++pg)
                  for (int t = 0; t < page_size; ++t) {
                    std::vector<double> m(head_dim, 0.0);
                    rows.push_back(l.turned_back(s, h, pg, t, rope, &m));
                    for (int d = 0; d < head_dim; ++d) abs_max[d] = std::max(abs_max[d], m[d]), abs_sum[d] += m[d];
                  }
                const auto entry = [&](int pg) { return l.entry(s, h, pg); };
                const std::string at = "seq " + std::to_string(s) + " head " + std::to_string(h) + " block " +
                                       std::to_string(b);
                if (p1 - p0 == block_pages) {
                  std::vector<double> magnitude;
                  const std::vector<double> key = reference_trained_key(
                      rows, gate->k_gate(0, h), rope, double(l.position(s, p0, 0)), 1.0, &magnitude);
                  for (int d = 0; d < head_dim; ++d)
                    if (!(std::abs(got(entry(p0), d) - key[d]) <= 1e-4 * magnitude[d]))
                      report(at + " key dim " + std::to_string(d) + ": got " + std::to_string(got(entry(p0), d)) +
                             " expected " + std::to_string(key[d]));
                } else {  // the running pools
                  for (int d = 0; d < head_dim; ++d) {
                    double hi = -1e300, lo = 1e300, sum = 0.0;
                    for (const auto& x : rows) hi = std::max(hi, x[d]), lo = std::min(lo, x[d]), sum += x[d];
                    const double want[3] = {hi, lo, sum}, tolerance[3] = {abs_max[d], abs_max[d], abs_sum[d]};
                    for (int k = 0; k < 3; ++k)
                      if (!(std::abs(got(entry(p0 + k), d) - want[k]) <= 1e-5 * tolerance[k]))
                        report(at + " pool " + std::to_string(k) + " dim " + std::to_string(d) + ": got " +
                               std::to_string(got(entry(p0 + k), d)) + " expected " + std::to_string(want[k]));
                  }
                }
                for (int pg = p0 + 3; pg < p0 + block_pages; ++pg)  // never written
                  for (int x = 0; x < 2 * head_dim; ++x)
                    if (got_bits[size_t(entry(pg)) * 2 * head_dim + x] != kPoisonBf16) {
                      report(at + " page " + std::to_string(pg) + "'s entry was written");
                      break;
                    }
              }
          EXPECT_EQ(bad, 0);
        }
}

TEST_F(GpuSeerGate, TrainedScoreIsTheGateQueryAgainstTheBlockKey) {
  for (int head_dim : {64, 128})
    for (int group : {1, 4, 5, 8}) {
      const int nkv = uniform(1, 3), num_seqs = ScoreLayout::kSeqs, block_pages = 4;
      const auto gate = random_gate(1, nkv, group, head_dim);
      const int items = num_seqs * nkv;
      std::vector<uint16_t> q(size_t(items) * group * head_dim);
      for (uint16_t& x : q) x = f32_to_bf16(normal(1.0f));
      DeviceArray<uint16_t> d_q(q), d_q_gate(to_bf16(gate->q));
      DeviceArray<float> d_gq(size_t(items) * head_dim);
      for (cudaError_t st : {d_q.status(), d_q_gate.status(), d_gq.status()}) CUDA_OK(st);
      cuda::SeerGateQueryParams gp;
      gp.q = as_bf16(d_q.get());
      gp.q_gate = as_bf16(d_q_gate.get());
      gp.num_items = items;
      gp.num_kv_heads = nkv;
      gp.group = group;
      gp.head_dim = head_dim;
      gp.out = d_gq.get();
      CUDA_OK(cuda::seer_gate_queries(gp, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> gq = d_gq.download();
      int bad = 0;
      for (int i = 0; i < items; ++i) {
        std::vector<double> qg(size_t(group) * head_dim), magnitude;
        for (size_t x = 0; x < qg.size(); ++x) qg[x] = bf16_to_f32(q[size_t(i) * qg.size() + x]);
        const std::vector<double> want = reference_gate_query(qg, gate->q_gate(0, i % nkv), head_dim, &magnitude);
        for (int d = 0; d < head_dim; ++d)
          if (!(std::abs(gq[size_t(i) * head_dim + d] - want[d]) <= 1e-5 * magnitude[d]) && bad++ < kMaxReported)
            ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << i << " dim " << d << ": got "
                          << gq[size_t(i) * head_dim + d] << " expected " << want[d];
      }

      // Scores over random block keys, at each block's first entry.
      const ScoreLayout layout = score_layout();
      const std::vector<int32_t>&first = layout.first, &end = layout.end, &current = layout.current;
      const int max_candidates = layout.max_candidates;
      std::vector<float> keys(layout.entries(nkv) * head_dim);
      for (float& x : keys) x = normal(3.0f);
      DeviceArray<float> d_keys(keys), d_scores(size_t(items) * max_candidates);
      const DeviceScoreLayout d_layout(layout);
      for (cudaError_t st : {d_keys.status(), d_scores.status()}) CUDA_OK(st);
      cuda::SeerScoreParams p;
      d_layout.wire(p, nkv, max_candidates);
      p.summaries = reinterpret_cast<const __nv_bfloat16*>(d_keys.get());
      p.group = group;
      p.head_dim = head_dim;
      p.block_pages = block_pages;
      p.scores = d_scores.get();
      p.gate_queries = d_gq.get();
      p.tile_blocks = group % 2 == 0 ? 4 : 1;  // both tile sizes over the groups
      CUDA_OK(cuda::seer_score_pages(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = d_scores.download();
      for (int s = 0; s < num_seqs; ++s)
        for (int h = 0; h < nkv; ++h) {
          const int item = s * nkv + h;
          for (int j = 0; j < max_candidates; ++j) {
            const int pg = first[s] + j;
            const float score = got[size_t(item) * max_candidates + j];
            std::string problem;
            if (pg >= end[s]) {
              if (f32_to_bits(score) != kPoisonF32) problem = "past the candidates was written";
            } else if (pg / block_pages == current[s] / block_pages) {
              if (!(std::isinf(score) && score > 0)) problem = "in the decoded block is not +inf";
            } else {
              const size_t e = layout.entry(s, h, pg / block_pages * block_pages, nkv);
              double want = 0.0, magnitude = 0.0;
              for (int d = 0; d < head_dim; ++d) {
                want += double(gq[size_t(item) * head_dim + d]) * keys[e * head_dim + d];
                magnitude += std::abs(double(gq[size_t(item) * head_dim + d]) * keys[e * head_dim + d]);
              }
              if (!(std::abs(score - want) <= 1e-5 * magnitude))
                problem = "got " + std::to_string(score) + " expected " + std::to_string(want);
            }
            if (!problem.empty() && bad++ < kMaxReported)
              ADD_FAILURE() << "hd " << head_dim << " group " << group << " tile " << p.tile_blocks << " seq " << s
                            << " head " << h << " page " << pg << ": " << problem;
          }
        }
      EXPECT_EQ(bad, 0);
    }
}

TEST_F(GpuSeerGate, KernelsRejectBadParameters) {
  DeviceArray<uint16_t> buffer(4096);
  DeviceArray<int32_t> ids(16);
  DeviceArray<float> floats(1024);
  cuda::SeerTrainedIndexParams ip;
  ip.kv_pool = ip.k_gate = as_bf16(buffer.get());
  ip.summaries = as_bf16(buffer.get());
  ip.src_pages = ip.dst_entries = ip.logical_pages = ids.get();
  ip.inv_freq = floats.get();
  ip.num_runs = 1;
  ip.num_kv_heads = 1;
  EXPECT_EQ(cuda::seer_trained_index_pages(ip, nullptr), cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  for (int block_pages : {1, 2, 6, 128}) {  // fewer than 3 pages, or not dividing a summary chunk
    cuda::SeerTrainedIndexParams bad = ip;
    bad.block_pages = block_pages;
    EXPECT_EQ(cuda::seer_trained_index_pages(bad, nullptr), cudaErrorInvalidValue) << block_pages;
  }
  cuda::SeerTrainedIndexParams no_gate = ip;
  no_gate.k_gate = nullptr;
  EXPECT_EQ(cuda::seer_trained_index_pages(no_gate, nullptr), cudaErrorInvalidValue);
  for (int block_pages : {0, 3, 128}) {  // the training-free Index: whole blocks within a summary chunk
    cuda::SeerIndexParams bad = ip;
    bad.block_pages = block_pages;
    EXPECT_EQ(cuda::seer_index_pages(bad, nullptr), cudaErrorInvalidValue) << block_pages;
  }
  cuda::SeerIndexParams one_page = ip;
  one_page.block_pages = 1;
  EXPECT_EQ(cuda::seer_index_pages(one_page, nullptr), cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  cuda::SeerGateQueryParams qp;
  qp.q = qp.q_gate = as_bf16(buffer.get());
  qp.out = floats.get();
  qp.num_items = 1;
  qp.num_kv_heads = 1;
  qp.group = 9;
  EXPECT_EQ(cuda::seer_gate_queries(qp, nullptr), cudaErrorInvalidValue);
  qp.group = 1;
  qp.head_dim = 96;
  EXPECT_EQ(cuda::seer_gate_queries(qp, nullptr), cudaErrorInvalidValue);
  cuda::SeerScoreParams sp;
  sp.summaries = as_bf16(buffer.get());
  sp.summary_dir = sp.dir_offsets = sp.first_candidate = sp.end_candidate = sp.current_page = ids.get();
  sp.scores = floats.get();
  sp.num_seqs = sp.num_kv_heads = 1;
  sp.max_candidates = 4;
  sp.gate_queries = floats.get() + 1;  // not 16-byte aligned
  EXPECT_EQ(cuda::seer_score_pages(sp, nullptr), cudaErrorInvalidValue);
  sp.gate_queries = floats.get();
  sp.block_pages = 3;  // blocks that straddle summary chunks
  EXPECT_EQ(cuda::seer_score_pages(sp, nullptr), cudaErrorInvalidValue);
  sp.block_pages = 4;
  sp.tile_blocks = 2;
  EXPECT_EQ(cuda::seer_score_pages(sp, nullptr), cudaErrorInvalidValue);
}

// The GPU's Index, Score and top-k against SeerAlgorithm on the CPU, for one layer, with the
// training-free gate or a trained one (bf16 weights, as the GPU keeps them).
void GpuSeerGate::expect_the_cpu_selection(bool trained) {
  const int head_dim = 128, page_size = 16, nkv = 2, group = 4;
  sparse::SparseSettings settings{.algorithm = "seer"};
  if (trained) settings.seer_gate = random_gate(1, nkv, group, head_dim);
  const sparse::SeerGate* gate = settings.seer_gate.get();
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
      // Head-major, a run per block, as the engine indexes a prompt.
      std::vector<int32_t> src, dst, logical, runs, dir(chunks);
      std::iota(dir.begin(), dir.end(), 0);
      for (int h = 0; h < nkv; ++h)
        for (int pg = 0; pg < pages; ++pg) {
          if (pg % block_pages == 0) runs.push_back(static_cast<int32_t>(src.size()));
          src.push_back(pg * nkv + h);
          dst.push_back((pg / kSummaryChunkPages * nkv + h) * kSummaryChunkPages + pg % kSummaryChunkPages);
          logical.push_back(pg);
        }
      runs.push_back(static_cast<int32_t>(src.size()));
      const std::vector<int32_t> zero = {0}, firsts = {first}, ends = {end}, currents = {current};
      const std::vector<int32_t> counts(nkv, std::min(budget, end - first));
      std::vector<int32_t> out_offsets(nkv);
      for (int h = 0; h < nkv; ++h) out_offsets[h] = h * counts[0];
      DeviceArray<uint16_t> d_pool(pool), d_q(q), d_summaries(size_t(chunks) * nkv * kSummaryChunkPages * 2 * head_dim);
      DeviceArray<int32_t> d_src(src), d_dst(dst), d_logical(logical), d_dir(dir), d_zero(zero), d_first(firsts),
          d_end(ends), d_current(currents), d_counts(counts), d_out_offsets(out_offsets), d_out(size_t(nkv) * counts[0]);
      DeviceArray<float> d_freq(rope.inv_freq), d_scores(size_t(nkv) * (end - first)),
          d_gate_queries(size_t(nkv) * head_dim);
      DeviceArray<int32_t> d_runs(runs);
      DeviceArray<uint16_t> d_k_gate(gate ? to_bf16(gate->k) : std::vector<uint16_t>{}),
          d_q_gate(gate ? to_bf16(gate->q) : std::vector<uint16_t>{});
      for (cudaError_t st : {d_pool.status(), d_q.status(), d_summaries.status(), d_src.status(), d_out.status(),
                             d_freq.status(), d_scores.status()})
        CUDA_OK(st);
      if (trained) {
        cuda::SeerTrainedIndexParams ip;
        ip.kv_pool = as_bf16(d_pool.get());
        ip.src_pages = d_src.get();
        ip.dst_entries = d_dst.get();
        ip.logical_pages = d_logical.get();
        ip.run_offsets = d_runs.get();
        ip.num_runs = static_cast<int>(runs.size()) - 1;
        ip.num_kv_heads = nkv;
        ip.head_dim = head_dim;
        ip.page_size = page_size;
        ip.block_pages = block_pages;
        ip.inv_freq = d_freq.get();
        ip.neox = neox;
        ip.k_gate = as_bf16(d_k_gate.get());
        ip.summaries = as_bf16(d_summaries.get());
        CUDA_OK(cuda::seer_trained_index_pages(ip, nullptr));
        cuda::SeerGateQueryParams gp;
        gp.q = as_bf16(d_q.get());
        gp.q_gate = as_bf16(d_q_gate.get());
        gp.num_items = nkv;
        gp.num_kv_heads = nkv;
        gp.group = group;
        gp.head_dim = head_dim;
        gp.out = d_gate_queries.get();
        CUDA_OK(cuda::seer_gate_queries(gp, nullptr));
      } else {
        cuda::SeerIndexParams ip;
        ip.kv_pool = as_bf16(d_pool.get());
        ip.src_pages = d_src.get();
        ip.dst_entries = d_dst.get();
        ip.logical_pages = d_logical.get();
        ip.run_offsets = d_runs.get();
        ip.num_runs = static_cast<int>(runs.size()) - 1;
        ip.head_dim = head_dim;
        ip.page_size = page_size;
        ip.block_pages = block_pages;
        ip.inv_freq = d_freq.get();
        ip.neox = neox;
        ip.summaries = as_bf16(d_summaries.get());
        CUDA_OK(cuda::seer_index_pages(ip, nullptr));
      }
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
      if (trained) sp.gate_queries = d_gate_queries.get();
      sp.tile_blocks = round == 1 ? 4 : 1;
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
          if (gate) {
            const auto pre_row = [&](int p, int t) {
              return pre.data() + ((size_t(p) * nkv + h) * page_size + t) * head_dim;
            };
            block_scores.push_back(reference_trained_score(pre_row, qg, *gate, 0, h, page_size, block_pages,
                                                           pg / block_pages, rope, &m));
          } else {
            block_scores.push_back(reference_block_score(page_sum, qg, group, head_dim, page_size, block_pages,
                                                         pg / block_pages, end, rope, &m));
          }
          magnitude = std::max(magnitude, m);
        }
        const auto [lo, hi] = std::minmax_element(block_scores.begin(), block_scores.end());
        EXPECT_LE(*hi - *lo, 1e-5 * magnitude)
            << "neox " << neox << " round " << round << " head " << h << ": the GPU and the CPU chose different "
            << only.size() << " pages whose blocks score " << *lo << " .. " << *hi;
      }
    }
}

TEST_F(GpuSeerGate, SelectsThePagesTheCpuAlgorithmSelects) { expect_the_cpu_selection(false); }

TEST_F(GpuSeerGate, TrainedGateSelectsThePagesTheCpuAlgorithmSelects) { expect_the_cpu_selection(true); }

}  // namespace
}  // namespace spin
