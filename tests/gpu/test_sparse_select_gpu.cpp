// GPU sparse Index/Select (kernels/cuda/sparse_select.h) against plain C++ recomputations of the
// definitions, on fresh random inputs each run (seed printed):
//  * Index: the min/max summary of each listed page's key rows, exact (value equality); entries
//    whose source is -1 and entries not listed keep their poison; value rows (set far outside the
//    keys' range) never leak into a summary.
//  * Score: max over the group's query heads of sum_d max(q_d * max_d, q_d * min_d), reference in
//    double, relative error <= 1e-4 of sum_d |q_d| * max(|max_d|, |min_d|) (fp32 accumulation of
//    exact bf16 products over <= 128 terms errs by < 1e-5 of that); scores past each item's
//    candidates keep their poison.
//  * Select: the top k by (score descending, page ascending), NaN below every number, -0 equal to
//    +0, exactly equal to a std::stable_sort of the candidates, written in ascending page order;
//    everything else in the output keeps its poison.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/sparse_select.h"

namespace spin {
namespace {

using cuda::kSummaryChunkPages;

constexpr uint16_t kPoisonBf16 = 0xffff;    // DeviceArray's 0xFF bytes
constexpr uint32_t kPoisonF32 = 0xffffffffu;
constexpr int32_t kPoisonI32 = -1;
constexpr int kMaxReported = 8;  // mismatches printed per check

__nv_bfloat16* as_bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

class GpuSparseSelect : public SeededGpuTest<std::mt19937> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  uint16_t random_bf16(float sigma) {
    return f32_to_bf16(std::normal_distribution<float>(0.0f, sigma)(rng_));
  }
};

// --- Index --------------------------------------------------------------------------------------

TEST_F(GpuSparseSelect, IndexIsExactMinMaxOfKeyRows) {
  for (int page_size : {8, 16, 64}) {
    for (int head_dim : {64, 128}) {
      const int pool_pages = 37;
      const int num_entries = 61;
      const int listed = 45;
      const size_t page_elems = size_t{2} * page_size * head_dim;
      std::vector<uint16_t> pool(pool_pages * page_elems);
      for (int pg = 0; pg < pool_pages; ++pg)
        for (size_t e = 0; e < page_elems; ++e) {
          const bool value_row = e >= page_elems / 2;
          // Values far outside the keys' range: a summary that read them would show it.
          pool[pg * page_elems + e] =
              value_row ? f32_to_bf16(chance(0.5) ? 1e4f : -1e4f) : random_bf16(2.0f);
        }
      std::vector<int32_t> src(listed), dst(num_entries);
      for (int32_t& s : src) s = chance(0.2) ? -1 : uniform(0, pool_pages - 1);
      std::iota(dst.begin(), dst.end(), 0);
      std::shuffle(dst.begin(), dst.end(), rng_);  // distinct destinations
      dst.resize(listed);

      DeviceArray<uint16_t> d_pool(pool);
      DeviceArray<int32_t> d_src(src), d_dst(dst);
      DeviceArray<uint16_t> d_summaries(size_t{num_entries} * 2 * head_dim);
      CUDA_OK(d_pool.status());
      CUDA_OK(d_src.status());
      CUDA_OK(d_dst.status());
      CUDA_OK(d_summaries.status());
      cuda::QuestIndexParams p;
      p.kv_pool = as_bf16(d_pool.get());
      p.src_pages = d_src.get();
      p.dst_entries = d_dst.get();
      p.num_pages = listed;
      p.head_dim = head_dim;
      p.page_size = page_size;
      p.summaries = as_bf16(d_summaries.get());
      CUDA_OK(cuda::quest_index_pages(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got = d_summaries.download();

      // Expected: poison everywhere, the min then max of the key rows where a page was listed.
      std::vector<uint16_t> expect(got.size(), kPoisonBf16);
      for (int i = 0; i < listed; ++i) {
        if (src[i] < 0) continue;
        const uint16_t* keys = pool.data() + src[i] * page_elems;
        uint16_t* lo = expect.data() + size_t(dst[i]) * 2 * head_dim;
        uint16_t* hi = lo + head_dim;
        for (int d = 0; d < head_dim; ++d) {
          lo[d] = hi[d] = keys[d];
          for (int t = 1; t < page_size; ++t) {
            const uint16_t k = keys[size_t(t) * head_dim + d];
            if (bf16_to_f32(k) < bf16_to_f32(lo[d])) lo[d] = k;
            if (bf16_to_f32(k) > bf16_to_f32(hi[d])) hi[d] = k;
          }
        }
      }
      int bad = 0;
      for (size_t e = 0; e < got.size(); ++e) {
        // Value equality for numbers (+0 and -0 may be either), bit equality for the poison.
        const bool ok = expect[e] == kPoisonBf16
                            ? got[e] == kPoisonBf16
                            : bf16_to_f32(got[e]) == bf16_to_f32(expect[e]);
        if (!ok && bad++ < kMaxReported)
          ADD_FAILURE() << "page_size " << page_size << " head_dim " << head_dim << " entry "
                        << e / (2 * head_dim) << (e % (2 * head_dim) < size_t(head_dim) ? " min" : " max")
                        << " dim " << e % head_dim << ": got 0x" << std::hex << got[e]
                        << " expected 0x" << expect[e] << std::dec;
      }
      EXPECT_EQ(bad, 0) << "mismatching bf16 values, page_size " << page_size << " head_dim "
                        << head_dim;
    }
  }
}

// --- Score --------------------------------------------------------------------------------------

struct ScoreCase {
  int head_dim = 128;
  int group = 1;
  int num_kv_heads = 2;
  std::vector<int32_t> first, end;  // candidate range per seq
  int max_candidates = 0;
};

class GpuQuestScore : public GpuSparseSelect {
 protected:
  void check(const ScoreCase& c) {
    const int num_seqs = static_cast<int>(c.first.size());
    const int hd = c.head_dim;
    const int nkv = c.num_kv_heads;
    // Each seq's directory covers the chunks of pages [0, end); chunk ids are shuffled across the
    // seqs so that a wrong directory lookup reads another seq's summaries.
    std::vector<int32_t> dir_offsets(num_seqs);
    int total_chunks = 0;
    for (int s = 0; s < num_seqs; ++s) {
      dir_offsets[s] = total_chunks;
      total_chunks += (c.end[s] + kSummaryChunkPages - 1) / kSummaryChunkPages;
    }
    std::vector<int32_t> summary_dir(total_chunks);
    std::iota(summary_dir.begin(), summary_dir.end(), 0);
    std::shuffle(summary_dir.begin(), summary_dir.end(), rng_);
    const size_t entries = size_t(std::max(total_chunks, 1)) * nkv * kSummaryChunkPages;
    std::vector<uint16_t> summaries(entries * 2 * hd);
    for (size_t e = 0; e < entries; ++e)
      for (int d = 0; d < hd; ++d) {
        // A summary has min <= max.
        uint16_t a = random_bf16(1.0f), b = random_bf16(1.0f);
        if (bf16_to_f32(a) > bf16_to_f32(b)) std::swap(a, b);
        summaries[e * 2 * hd + d] = a;
        summaries[e * 2 * hd + hd + d] = b;
      }
    std::vector<uint16_t> q(size_t(num_seqs) * nkv * c.group * hd);
    for (uint16_t& x : q) x = random_bf16(1.0f);

    DeviceArray<uint16_t> d_q(q), d_summaries(summaries);
    DeviceArray<int32_t> d_dir(summary_dir), d_dir_offsets(dir_offsets), d_first(c.first),
        d_end(c.end);
    DeviceArray<float> d_scores(size_t(num_seqs) * nkv * c.max_candidates);
    for (cudaError_t st : {d_q.status(), d_summaries.status(), d_dir.status(),
                           d_dir_offsets.status(), d_first.status(), d_end.status(),
                           d_scores.status()})
      CUDA_OK(st);
    cuda::QuestScoreParams p;
    p.q = as_bf16(d_q.get());
    p.summaries = as_bf16(d_summaries.get());
    p.summary_dir = d_dir.get();
    p.dir_offsets = d_dir_offsets.get();
    p.first_candidate = d_first.get();
    p.end_candidate = d_end.get();
    p.num_seqs = num_seqs;
    p.num_kv_heads = nkv;
    p.group = c.group;
    p.head_dim = hd;
    p.max_candidates = c.max_candidates;
    p.scores = d_scores.get();
    CUDA_OK(cuda::quest_score_pages(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = d_scores.download();

    int bad = 0;
    auto report = [&](const std::string& what) {
      if (bad++ < kMaxReported)
        ADD_FAILURE() << "head_dim " << hd << " group " << c.group << ": " << what;
    };
    for (int s = 0; s < num_seqs; ++s)
      for (int h = 0; h < nkv; ++h) {
        const int item = s * nkv + h;
        const float* row = got.data() + size_t(item) * c.max_candidates;
        const int count = c.end[s] - c.first[s];
        for (int j = 0; j < c.max_candidates; ++j) {
          if (j >= count) {
            if (f32_to_bits(row[j]) != kPoisonF32)
              report("seq " + std::to_string(s) + " head " + std::to_string(h) + " slot " +
                     std::to_string(j) + " past the candidates was written");
            continue;
          }
          const int page = c.first[s] + j;
          const int32_t chunk = summary_dir[dir_offsets[s] + page / kSummaryChunkPages];
          const size_t entry =
              (size_t(chunk) * nkv + h) * kSummaryChunkPages + page % kSummaryChunkPages;
          const uint16_t* lo = summaries.data() + entry * 2 * hd;
          const uint16_t* hi = lo + hd;
          double best = -std::numeric_limits<double>::infinity();
          double scale = 0.0;
          for (int g = 0; g < c.group; ++g) {
            const uint16_t* qh = q.data() + (size_t(item) * c.group + g) * hd;
            double bound = 0.0, magnitude = 0.0;
            for (int d = 0; d < hd; ++d) {
              const double qd = bf16_to_f32(qh[d]);
              const double up = qd * bf16_to_f32(hi[d]);
              const double down = qd * bf16_to_f32(lo[d]);
              bound += std::max(up, down);
              magnitude += std::max(std::abs(up), std::abs(down));
            }
            best = std::max(best, bound);
            scale = std::max(scale, magnitude);
          }
          const double err = std::abs(double(row[j]) - best);
          if (!(err <= 1e-4 * scale))
            report("seq " + std::to_string(s) + " head " + std::to_string(h) + " page " +
                   std::to_string(page) + ": got " + std::to_string(row[j]) + " expected " +
                   std::to_string(best) + " (scale " + std::to_string(scale) + ")");
        }
      }
    EXPECT_EQ(bad, 0) << "bad scores, head_dim " << hd << " group " << c.group;
  }
};

TEST_F(GpuQuestScore, MatchesBoundMaximisedOverGroup) {
  for (int hd : {64, 128})
    for (int group = 1; group <= 8; ++group) {
      ScoreCase c;
      c.head_dim = hd;
      c.group = group;
      c.num_kv_heads = uniform(1, 3);
      // A range from page 0, an empty one, one that starts mid-chunk and crosses chunks, a short one.
      const int a = uniform(1, 700), b = uniform(0, 200);
      const int f2 = uniform(1, 200), n2 = uniform(1, 600), f3 = uniform(0, 100);
      c.first = {0, b, f2, f3};
      c.end = {a, b, f2 + n2, f3 + uniform(1, 5)};
      c.max_candidates = std::max({a, n2, 5}) + uniform(0, 9);
      check(c);
    }
}

TEST_F(GpuQuestScore, ManyCandidatesAndItems) {
  ScoreCase c;
  c.head_dim = 128;
  c.group = uniform(4, 8);
  c.num_kv_heads = 4;
  c.first = {0, 17, 8192 - 300};
  c.end = {8192, 17 + 4000, 8192};
  c.max_candidates = 8192;
  check(c);
}

// --- Select -------------------------------------------------------------------------------------

// The reference: candidate j ranks above candidate i > j unless its score is lower or NaN while
// the other's is a number; the stable sort keeps equal scores (and NaNs) in page order.
std::vector<int32_t> reference_top(const float* scores, int n, int k, int32_t first) {
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const bool a_nan = std::isnan(scores[a]), b_nan = std::isnan(scores[b]);
    if (a_nan || b_nan) return !a_nan && b_nan;
    return scores[a] > scores[b];
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  for (int32_t& j : order) j += first;
  return order;
}

class GpuSelectTop : public GpuSparseSelect {
 protected:
  // Scores from a small pool of values (many exact ties), with NaN, both zeros and infinities.
  float random_score(const std::vector<float>& pool) {
    const int r = uniform(0, 99);
    if (r < 6) return std::numeric_limits<float>::quiet_NaN();
    if (r < 8) return r == 6 ? 0.0f : -0.0f;
    if (r == 8) return std::numeric_limits<float>::infinity();
    if (r == 9) return -std::numeric_limits<float>::infinity();
    return pool[uniform(0, static_cast<int>(pool.size()) - 1)];
  }

  // counts[i] = -1 means "pick one at random in [0, n]".
  // score() draws each candidate's score; by default random_score over a fresh pool.
  void check(const std::vector<int32_t>& first, const std::vector<int32_t>& end, int num_kv_heads,
             int max_candidates, std::vector<int32_t> counts, std::function<float()> score = {}) {
    const int num_seqs = static_cast<int>(first.size());
    const int items = num_seqs * num_kv_heads;
    std::vector<float> pool(uniform(1, 60));
    for (float& v : pool) v = std::normal_distribution<float>(0.0f, 10.0f)(rng_);
    if (!score) score = [&] { return random_score(pool); };
    std::vector<float> scores(size_t(items) * max_candidates);
    std::vector<int32_t> out_offsets(items);
    int32_t out_size = 0;
    for (int i = 0; i < items; ++i) {
      const int n = end[i / num_kv_heads] - first[i / num_kv_heads];
      float* row = scores.data() + size_t(i) * max_candidates;
      for (int j = 0; j < max_candidates; ++j)
        // Past the candidates: larger than any candidate, so reading them would show.
        row[j] = j < n ? score() : 1e30f;
      if (counts[i] < 0) counts[i] = uniform(0, n);
      out_offsets[i] = out_size;
      out_size += counts[i] + uniform(0, 3);  // gaps that must stay poisoned
    }

    DeviceArray<float> d_scores(scores);
    DeviceArray<int32_t> d_first(first), d_end(end), d_counts(counts), d_offsets(out_offsets);
    DeviceArray<int32_t> d_out(size_t(out_size) + 4);
    for (cudaError_t st : {d_scores.status(), d_first.status(), d_end.status(), d_counts.status(),
                           d_offsets.status(), d_out.status()})
      CUDA_OK(st);
    cuda::SelectTopParams p;
    p.scores = d_scores.get();
    p.max_candidates = max_candidates;
    p.first_candidate = d_first.get();
    p.end_candidate = d_end.get();
    p.counts = d_counts.get();
    p.out_offsets = d_offsets.get();
    p.num_seqs = num_seqs;
    p.num_kv_heads = num_kv_heads;
    p.out_pages = d_out.get();
    CUDA_OK(cuda::select_top_pages(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = d_out.download();

    std::vector<int32_t> expect(got.size(), kPoisonI32);
    for (int i = 0; i < items; ++i) {
      const int s = i / num_kv_heads;
      const std::vector<int32_t> top = reference_top(scores.data() + size_t(i) * max_candidates,
                                                     end[s] - first[s], counts[i], first[s]);
      std::copy(top.begin(), top.end(), expect.begin() + out_offsets[i]);
    }
    int bad = 0;
    for (size_t at = 0; at < got.size(); ++at) {
      if (got[at] == expect[at]) continue;
      if (bad++ >= kMaxReported) continue;
      const auto item = std::upper_bound(out_offsets.begin(), out_offsets.end(), int32_t(at)) -
                        out_offsets.begin() - 1;
      const int s = static_cast<int>(item) / num_kv_heads;
      std::ostringstream msg;
      msg << "item " << item << " (n " << end[s] - first[s] << ", k " << counts[item]
          << ") output " << at - out_offsets[item] << ": got " << got[at] << " expected "
          << expect[at];
      for (int32_t page : {got[at], expect[at]})
        if (page >= first[s] && page < end[s])
          msg << "; score of page " << page << " = "
              << scores[size_t(item) * max_candidates + (page - first[s])];
      ADD_FAILURE() << msg.str();
    }
    EXPECT_EQ(bad, 0) << "wrong output pages";
  }
};

TEST_F(GpuSelectTop, ExactTopKInPageOrder) {
  const int max_candidates = 8192 + uniform(0, 7);
  // A full range, an empty one, one at an offset, short ones (single tile, one candidate).
  const std::vector<int32_t> first = {0, 55, 1000, 7, 3};
  const std::vector<int32_t> end = {8192, 55, 1000 + uniform(1, 7000), 7 + uniform(1, 511), 4};
  const int nkv = 4;
  std::vector<int32_t> counts(first.size() * nkv, -1);
  for (size_t s = 0; s < first.size(); ++s) {
    const int n = end[s] - first[s];
    // Edge counts for three heads, random for the fourth.
    counts[s * nkv + 0] = 0;
    counts[s * nkv + 1] = n;
    counts[s * nkv + 2] = std::min(n, uniform(1, 2048));
  }
  for (int round = 0; round < 3; ++round) check(first, end, nkv, max_candidates, counts);
}

TEST_F(GpuSelectTop, ExactTopKForEveryHeldKeyCount) {
  // Candidate ranges of 1, 2, 4 and 8 keys per thread (held in registers) and past them (read
  // from memory on every pass).
  for (const int max_candidates :
       {uniform(3, 512), uniform(513, 1024), uniform(1025, 2048), uniform(2049, 4095), 4096, 4097, 8192}) {
    SCOPED_TRACE("max_candidates " + std::to_string(max_candidates));
    const std::vector<int32_t> first = {0, 3};
    const std::vector<int32_t> end = {max_candidates, 3 + uniform(0, max_candidates - 3)};
    const int nkv = 3;
    std::vector<int32_t> counts(first.size() * nkv, -1);
    counts[1] = std::max(0, end[0] - first[0] - 1);  // all but one
    for (int round = 0; round < 2; ++round) check(first, end, nkv, max_candidates, counts);
  }
}

TEST_F(GpuSelectTop, ExactTopKOverNarrowScoreRanges) {
  // Scores a few units in the last place apart, of one sign: their keys share all but their
  // lowest bits, so the radix descent starts low (its first pass may count bits of the shared
  // prefix again) and ties are many.
  for (const int spread_bits : {1, 3, 7, 9, 12, 20}) {
    SCOPED_TRACE("spread bits " + std::to_string(spread_bits));
    const int max_candidates = uniform(700, 4096);
    const std::vector<int32_t> first = {0, 9};
    const std::vector<int32_t> end = {max_candidates, 9 + uniform(100, max_candidates - 9)};
    const int nkv = 2;
    std::vector<int32_t> counts(first.size() * nkv, -1);
    const float base = uniform(0, 1) ? 3.75f : -1234.5f;
    const uint32_t base_bits = std::bit_cast<uint32_t>(base);
    check(first, end, nkv, max_candidates, counts, [&] {
      return std::bit_cast<float>(base_bits + static_cast<uint32_t>(uniform(0, (1 << spread_bits) - 1)));
    });
  }
}

TEST_F(GpuSelectTop, KNearCountAndAllTies) {
  // One value for every candidate (all ties), and NaN-only rows: the lowest pages win.
  for (float fill : {1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    const int n = uniform(600, 3000);
    const int max_candidates = n;
    std::vector<float> scores(size_t(3) * max_candidates, fill);
    std::vector<int32_t> first = {5}, end = {5 + n}, counts = {n - 1, 1, uniform(0, n)};
    std::vector<int32_t> offsets = {0, n, n + 2};
    DeviceArray<float> d_scores(scores);
    DeviceArray<int32_t> d_first(first), d_end(end), d_counts(counts), d_offsets(offsets);
    DeviceArray<int32_t> d_out(size_t(2 * n + 3));
    CUDA_OK(d_scores.status());
    CUDA_OK(d_out.status());
    cuda::SelectTopParams p;
    p.scores = d_scores.get();
    p.max_candidates = max_candidates;
    p.first_candidate = d_first.get();
    p.end_candidate = d_end.get();
    p.counts = d_counts.get();
    p.out_offsets = d_offsets.get();
    p.num_seqs = 1;
    p.num_kv_heads = 3;
    p.out_pages = d_out.get();
    CUDA_OK(cuda::select_top_pages(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = d_out.download();
    std::vector<int32_t> expect(got.size(), kPoisonI32);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < counts[i]; ++j) expect[offsets[i] + j] = 5 + j;
    const auto [got_at, expect_at] = std::mismatch(got.begin(), got.end(), expect.begin());
    EXPECT_TRUE(got_at == got.end())
        << "fill " << fill << " n " << n << " counts " << counts[0] << "/" << counts[1] << "/"
        << counts[2] << ": first mismatch at output " << got_at - got.begin() << ": got " << *got_at
        << " expected " << *expect_at;
  }
}

// --- Parameters -----------------------------------------------------------------------------

// Launches `launch` on a copy of `valid` with one change applied: one bad parameter at a time.
template <typename Params, typename Launch>
auto changed_launch(const Params& valid, Launch launch) {
  return [valid, launch](auto change) {
    Params p = valid;
    change(p);
    return launch(p, nullptr);
  };
}

TEST_F(GpuSparseSelect, RejectsBadParams) {
  DeviceArray<uint16_t> buf(4096);
  DeviceArray<int32_t> ints(64);
  CUDA_OK(buf.status());
  CUDA_OK(ints.status());
  __nv_bfloat16* bf = as_bf16(buf.get());
  int32_t* ip = ints.get();

  cuda::QuestIndexParams index;
  index.kv_pool = bf;
  index.src_pages = ip;
  index.dst_entries = ip;
  index.num_pages = 0;
  index.summaries = bf;
  EXPECT_EQ(cuda::quest_index_pages(index, nullptr), cudaSuccess);  // nothing to do
  cuda::QuestIndexParams one_page = index;
  one_page.num_pages = 1;
  const auto index_with = changed_launch(one_page, cuda::quest_index_pages);
  EXPECT_EQ(index_with([](auto& p) { p.num_pages = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(index_with([](auto& p) { p.head_dim = 96; }), cudaErrorInvalidValue);
  for (int ps : {0, 4, 12, 72, 128})
    EXPECT_EQ(index_with([&](auto& p) { p.page_size = ps; }), cudaErrorInvalidValue) << ps;
  EXPECT_EQ(index_with([](auto& p) { p.kv_pool = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(index_with([](auto& p) { p.src_pages = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(index_with([](auto& p) { p.dst_entries = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(index_with([](auto& p) { p.summaries = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(index_with([&](auto& p) { p.kv_pool = bf + 1; }), cudaErrorInvalidValue);  // 16-byte loads

  cuda::QuestScoreParams score;
  score.q = bf;
  score.summaries = bf;
  score.summary_dir = ip;
  score.dir_offsets = ip;
  score.first_candidate = ip;
  score.end_candidate = ip;
  score.num_seqs = 0;
  score.num_kv_heads = 1;
  score.max_candidates = 4;
  score.scores = reinterpret_cast<float*>(bf);
  EXPECT_EQ(cuda::quest_score_pages(score, nullptr), cudaSuccess);  // nothing to do
  cuda::QuestScoreParams one_seq = score;
  one_seq.num_seqs = 1;
  const auto score_with = changed_launch(one_seq, cuda::quest_score_pages);
  EXPECT_EQ(score_with([](auto& p) { p.num_seqs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.num_kv_heads = -2; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.max_candidates = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.group = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.group = 9; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.head_dim = 256; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.q = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.summaries = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.summary_dir = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.dir_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.first_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.end_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.scores = nullptr; }), cudaErrorInvalidValue);

  cuda::SelectTopParams select;
  select.scores = reinterpret_cast<const float*>(bf);
  select.max_candidates = 4;
  select.first_candidate = ip;
  select.end_candidate = ip;
  select.counts = ip;
  select.out_offsets = ip;
  select.num_seqs = 0;
  select.num_kv_heads = 1;
  select.out_pages = ip;
  EXPECT_EQ(cuda::select_top_pages(select, nullptr), cudaSuccess);  // nothing to do
  cuda::SelectTopParams one_row = select;
  one_row.num_seqs = 1;
  const auto select_with = changed_launch(one_row, cuda::select_top_pages);
  EXPECT_EQ(select_with([](auto& p) { p.num_seqs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.num_kv_heads = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.max_candidates = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.scores = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.first_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.end_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.counts = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.out_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(select_with([](auto& p) { p.out_pages = nullptr; }), cudaErrorInvalidValue);
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace spin
