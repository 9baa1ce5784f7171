// RetroInfer on the GPU (kernels/cuda/retroinfer.h) against plain C++ recomputations of its
// definitions in double, on fresh random inputs each run (seed printed). Records are written and
// read on the host at the offsets retroinfer.h documents (retroinfer_values_at, _record_bytes);
// outputs are poisoned (NaN / -1) before each run.
//  * Cluster: keys around planted centres (norm 8..10, noise 0.05; the k-means seeds j n / k on
//    distinct centres), clustered by five jobs over two KV heads and two sequences: a head in two
//    segments (8 and 5 pages), a head of 13 pages read from the host pool (negative ids), 5 pages
//    mixing both pools whose sequence's first summary group holds pages being read, and 5 pages of
//    one repeated key (its mean is exact in fp32, so every centred key is 0 and every dot product
//    ties: all tokens must go to cluster 0, the rest stay empty). The reference is k-means as
//    documented, in double on the same bf16 keys (centred keys, seeds the centred keys of tokens
//    j n / k, 10 rounds, inner-product argmax with ties to the lower cluster, an empty cluster
//    keeps its centroid), its dot products, as the GPU's, over the centred keys and centroids
//    rounded to bf16. Keys are redrawn until every assignment of every round wins by >= 2e-3 |x|
//    max|c| (the GPU's fp32 sums of the same products err by < 1e-5 of that, and the rare element
//    that its fp32 mean rounds to the neighbouring bf16 moves a dot product by < 5e-4 of it), so
//    the GPU cannot decide one differently and, for the first job, until a cluster ends
//    empty within its k. Checked: each token's cluster slot is exactly first_page * slots + its
//    reference cluster; each slot's size (0 for empty slots and for slots past k); a non-empty
//    slot's member entries lie in its segment's and list exactly its tokens, ascending, every entry
//    in one slot; value sums within 1e-4 of the sum of |values| (fp32 sums of bf16 values);
//    centroids (bf16) within 1e-2 relative + 1e-4 of the mean stored key; every pool byte outside
//    the jobs' records, and the host pool, unchanged. head_dim 64/128, page size 8/16.
//  * Score: records written here (slots with no token are empty; their centroids are large, so
//    one entering a softmax shows), 2 sequences x 2 KV heads, group 1..4, page sizes 8..64 (1, 2
//    and 4 slots a page), one sequence with more than 256 slots. Totals against the per-head
//    softmax over the non-empty slots of q . centroid * scale in double, summed over the group
//    (0 for an empty slot): within 1e-3 relative + 1e-6 (fp32 dots and __expf). Page scores: the
//    sum over the page's tokens, in order, of the kernel's own total of their cluster over its size
//    (within 1e-5 relative: the same fp32 operations), +inf for a candidate at or past
//    clustered_pages; entries past the candidates keep their poison.
//  * Zone: records written here, retroinfer_score run (it clears the zone's scratch and counts the
//    non-empty slots), then totals with few distinct values (many ties) put in place, selected pages
//    given; sink and window pages' tokens have clusters of their own, which must never be flagged.
//    zone_scores (for slots < clustered_pages * slots) are the totals, bit for bit, of clusters
//    with a token on a clustered candidate page not selected and NaN for the others; zone_counts
//    min(ceil(fraction * non-empty slots), flagged); an item selecting every candidate has none.
//    Then select_top_pages over [0, clustered_pages * slots) picks exactly the host's top flagged
//    clusters (highest total, ties to the lower slot), ascending. Fractions 0, 0.232 and 1.
//  * Estimate: records (members, sizes, value sums equal to the fp32 sums of the members' values,
//    centroids), a pool holding only the attended pages' values (unlisted pages hold NaN), the
//    decode list (sinks, selected, window), random out (bf16) and lse. Expected per query head in
//    double: exp(lse) * out plus, per zone cluster with m > 0 members on no attended page, weight
//    m * exp(scale * q . centroid) and value (value sum - attended members' values) / m,
//    normalised. Within 1e-2 relative + 1e-3 (bf16 output; values are O(1)). Zones include a
//    cluster wholly on a sink page (contributes nothing), one wholly on a page left out, one of
//    hundreds of members on selected and left-out pages, and clusters with members on selected and
//    window pages; one sequence's zones hold hundreds of clusters (dozens a warp); an
//    item with no zone cluster keeps its output bit for bit. head_dim 64/128, page size 8/32,
//    group 1/3/8.
//  * Parameters: each kernel rejects a bad head_dim, page size, slots or records_per_page, group,
//    fraction and each null pointer with cudaErrorInvalidValue; nothing to do is a success.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "base/half.h"
#include "kernels/cuda/retroinfer.h"
#include "kernels/cuda/sparse_select.h"

namespace spin {
namespace {

constexpr uint16_t kPoisonBf16 = 0xffff;  // DeviceArray's 0xFF bytes
constexpr uint32_t kPoisonF32 = 0xffffffffu;
constexpr int32_t kPoisonI32 = -1;
constexpr int kMaxReported = 8;  // mismatches printed per check
constexpr int kClusterTokens = 16;
constexpr int kIterations = 10;
constexpr double kMargin = 2e-3;  // an assignment's lead, relative to |x| max|c|

__nv_bfloat16* as_bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// Counts mismatches; report(ok) is true for the first kMaxReported ones, to print them.
class Mismatches {
 public:
  bool report(bool ok) { return !ok && count_++ < kMaxReported; }
  int count() const { return count_; }

 private:
  int count_ = 0;
};

// A layer's records: KV heads, shapes, and what retroinfer.h derives from them.
struct Layout {
  int num_kv_heads;
  int head_dim;
  int page_size;
  int slots;
  int records_per_page;

  Layout(int heads, int hd, int ps)
      : num_kv_heads(heads),
        head_dim(hd),
        page_size(ps),
        slots(cuda::retroinfer_slots_per_page(ps, kClusterTokens)),
        records_per_page(cuda::retroinfer_records_per_page(ps, hd, slots)) {}
  size_t page_elems() const { return size_t{2} * page_size * head_dim; }
  size_t page_bytes() const { return page_elems() * sizeof(uint16_t); }
  size_t record_bytes() const { return static_cast<size_t>(cuda::retroinfer_record_bytes(page_size, head_dim, slots)); }
  size_t values_at() const { return static_cast<size_t>(cuda::retroinfer_values_at(page_size, slots)); }
  int groups_for(int pages) const { return (pages + records_per_page - 1) / records_per_page; }
  cuda::RetroInferRecords device(uint16_t* pool) const {
    cuda::RetroInferRecords r;
    r.kv_pool = as_bf16(pool);
    r.num_kv_heads = num_kv_heads;
    r.head_dim = head_dim;
    r.page_size = page_size;
    r.slots = slots;
    r.records_per_page = records_per_page;
    return r;
  }
};

// The records of one (sequence, KV head) in a host copy of a layer's pool, as retroinfer.h lays
// them out: logical page p's record sits in group dir[p / records_per_page] (pool page
// group * num_kv_heads + head) at (p % records_per_page) * record_bytes. Indexed as the kernels
// index them: token or member entry i is field i % page_size of page i / page_size's record,
// cluster slot c field c % slots of page c / slots's record. Fields are read and written with
// memcpy (they are bytes of a bf16 pool).
class HeadRecords {
 public:
  HeadRecords(std::vector<uint16_t>& pool, const Layout& layout, const int32_t* dir, int head)
      : bytes_(reinterpret_cast<unsigned char*>(pool.data())), l_(layout), dir_(dir), head_(head) {}

  size_t record_at(int64_t page) const {
    const size_t pool_page = static_cast<size_t>(dir_[page / l_.records_per_page]) * l_.num_kv_heads + head_;
    return pool_page * l_.page_bytes() + static_cast<size_t>(page % l_.records_per_page) * l_.record_bytes();
  }

  int32_t cluster(int64_t token) const { return get<int32_t>(int_field(token, l_.page_size, 0)); }
  int32_t member(int64_t entry) const { return get<int32_t>(int_field(entry, l_.page_size, l_.page_size)); }
  int32_t start(int64_t slot) const { return get<int32_t>(int_field(slot, l_.slots, 2 * l_.page_size)); }
  int32_t size(int64_t slot) const { return get<int32_t>(int_field(slot, l_.slots, 2 * l_.page_size + l_.slots)); }
  float value_sum(int64_t slot, int d) const { return get<float>(value_at(slot, d)); }
  float centroid(int64_t slot, int d) const { return bf16_to_f32(get<uint16_t>(centroid_at(slot, d))); }

  void set_cluster(int64_t token, int32_t v) { set(int_field(token, l_.page_size, 0), v); }
  void set_member(int64_t entry, int32_t v) { set(int_field(entry, l_.page_size, l_.page_size), v); }
  void set_start(int64_t slot, int32_t v) { set(int_field(slot, l_.slots, 2 * l_.page_size), v); }
  void set_size(int64_t slot, int32_t v) { set(int_field(slot, l_.slots, 2 * l_.page_size + l_.slots), v); }
  void set_value_sum(int64_t slot, int d, float v) { set(value_at(slot, d), v); }
  void set_centroid(int64_t slot, int d, uint16_t bf16) { set(centroid_at(slot, d), bf16); }

 private:
  // The byte of int32 `index % per_record` of the array at int32 `first` of record index / per_record.
  size_t int_field(int64_t index, int per_record, int first) const {
    return record_at(index / per_record) + sizeof(int32_t) * static_cast<size_t>(first + index % per_record);
  }
  size_t value_at(int64_t slot, int d) const {
    return record_at(slot / l_.slots) + l_.values_at() +
           sizeof(float) * (static_cast<size_t>(slot % l_.slots) * l_.head_dim + d);
  }
  size_t centroid_at(int64_t slot, int d) const {
    return record_at(slot / l_.slots) + l_.values_at() + sizeof(float) * l_.slots * l_.head_dim +
           sizeof(uint16_t) * (static_cast<size_t>(slot % l_.slots) * l_.head_dim + d);
  }
  template <typename T>
  T get(size_t at) const {
    T v;
    std::memcpy(&v, bytes_ + at, sizeof v);
    return v;
  }
  template <typename T>
  void set(size_t at, T v) {
    std::memcpy(bytes_ + at, &v, sizeof v);
  }

  unsigned char* bytes_;
  Layout l_;
  const int32_t* dir_;
  int head_;
};

// Writes a (sequence, KV head)'s clusters as one segment over tokens [0, cluster_of.size()): each
// token's slot, the member entries in slot order (each slot's tokens ascending), and the start and
// size of every slot in [0, num_slots) (start 0 for an empty one). Returns each slot's tokens.
std::vector<std::vector<int32_t>> write_clusters(HeadRecords& rec, const std::vector<int32_t>& cluster_of,
                                                 int num_slots) {
  std::vector<std::vector<int32_t>> members(num_slots);
  for (size_t t = 0; t < cluster_of.size(); ++t) {
    rec.set_cluster(static_cast<int64_t>(t), cluster_of[t]);
    members[cluster_of[t]].push_back(static_cast<int32_t>(t));
  }
  int32_t entry = 0;
  for (int c = 0; c < num_slots; ++c) {
    rec.set_start(c, members[c].empty() ? 0 : entry);
    rec.set_size(c, static_cast<int32_t>(members[c].size()));
    for (int32_t t : members[c]) rec.set_member(entry++, t);
  }
  return members;
}

// k-means as retroinfer.h documents it, in double on the stored (bf16) keys of one segment.
struct KMeans {
  int k = 0;
  std::vector<int> assign;  // per token, its cluster after the last round
  std::vector<int> sizes;   // per cluster
  bool clear = true;        // every assignment of every round led by >= kMargin |x| max|c|
  int empty_clusters() const { return static_cast<int>(std::count(sizes.begin(), sizes.end(), 0)); }
};

KMeans reference_kmeans(const std::vector<uint16_t>& keys, int n, int head_dim) {
  KMeans r;
  r.k = std::max(1, n / kClusterTokens);
  const int k = r.k, hd = head_dim;
  std::vector<double> mean(hd, 0.0), x(static_cast<size_t>(n) * hd), c(static_cast<size_t>(k) * hd);
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < hd; ++d) mean[d] += bf16_to_f32(keys[static_cast<size_t>(t) * hd + d]);
  for (double& m : mean) m /= n;
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < hd; ++d)
      x[static_cast<size_t>(t) * hd + d] = bf16_to_f32(keys[static_cast<size_t>(t) * hd + d]) - mean[d];
  for (int j = 0; j < k; ++j) {
    const auto t = static_cast<size_t>(int64_t{j} * n / k);
    std::copy_n(x.begin() + static_cast<std::ptrdiff_t>(t * hd), hd, c.begin() + static_cast<std::ptrdiff_t>(j) * hd);
  }
  r.assign.assign(n, 0);
  for (int round = 0; round < kIterations; ++round) {
    double c_norm = 0.0;
    for (int j = 0; j < k; ++j) {
      double sq = 0.0;
      for (int d = 0; d < hd; ++d) sq += c[static_cast<size_t>(j) * hd + d] * c[static_cast<size_t>(j) * hd + d];
      c_norm = std::max(c_norm, std::sqrt(sq));
    }
    std::vector<double> c16(c.size());
    for (size_t i = 0; i < c.size(); ++i) c16[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(c[i])));
    for (int t = 0; t < n; ++t) {
      const double* xt = x.data() + static_cast<size_t>(t) * hd;
      double best = -INFINITY, second = -INFINITY, x_sq = 0.0;
      int best_j = 0;
      for (int d = 0; d < hd; ++d) x_sq += xt[d] * xt[d];
      for (int j = 0; j < k; ++j) {
        double dot = 0.0;
        for (int d = 0; d < hd; ++d)
          dot += double{bf16_to_f32(f32_to_bf16(static_cast<float>(xt[d])))} * c16[static_cast<size_t>(j) * hd + d];
        if (dot > best) {  // strictly: a tie keeps the lower cluster
          second = best;
          best = dot;
          best_j = j;
        } else if (dot > second) {
          second = dot;
        }
      }
      r.assign[t] = best_j;
      if (k > 1 && best - second < kMargin * std::sqrt(x_sq) * c_norm) r.clear = false;
    }
    std::vector<double> sums(static_cast<size_t>(k) * hd, 0.0);
    r.sizes.assign(k, 0);
    for (int t = 0; t < n; ++t) {
      ++r.sizes[r.assign[t]];
      for (int d = 0; d < hd; ++d)
        sums[static_cast<size_t>(r.assign[t]) * hd + d] += x[static_cast<size_t>(t) * hd + d];
    }
    for (int j = 0; j < k; ++j) {
      if (r.sizes[j] == 0) continue;  // an empty cluster keeps its centroid
      for (int d = 0; d < hd; ++d)
        c[static_cast<size_t>(j) * hd + d] = sums[static_cast<size_t>(j) * hd + d] / r.sizes[j];
    }
  }
  return r;
}

class GpuRetroInfer : public SeededGpuTest<std::mt19937> {
 protected:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  double uniform_real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  float normal(float sigma) { return std::normal_distribution<float>(0.0f, sigma)(rng_); }
  uint16_t random_bf16(float sigma) { return f32_to_bf16(normal(sigma)); }
  int32_t pick(const std::vector<int32_t>& from) { return from[uniform(0, static_cast<int>(from.size()) - 1)]; }
  std::vector<int32_t> shuffled(int n) {
    std::vector<int32_t> v(n);
    std::iota(v.begin(), v.end(), 0);
    std::shuffle(v.begin(), v.end(), rng_);
    return v;
  }

  // Each of `tokens` tokens in one of about 3/4 of `num_slots` slots (the rest stay empty).
  std::vector<int32_t> random_clusters(int tokens, int num_slots) {
    std::vector<int32_t> live;
    for (int c = 0; c < num_slots; ++c)
      if (chance(0.75)) live.push_back(c);
    if (live.empty()) live.push_back(0);
    std::vector<int32_t> cluster_of(tokens);
    for (int32_t& c : cluster_of) c = pick(live);
    return cluster_of;
  }

  // n keys around planted centres (norm 8..10, noise 0.05), the k-means seeds (tokens j n / k) on
  // distinct centres, the other tokens on random ones. With `leave_empty`, seed 0 is alone on its
  // centre, half of seed 1's: it and its cluster's every token prefer cluster 1 (in centred keys,
  // x0 . (x1 - x0) > 0 while the mean's component along them is below |x0|), so cluster 0 ends
  // empty.
  std::vector<uint16_t> planted_keys(int n, int head_dim, bool leave_empty) {
    const int k = std::max(1, n / kClusterTokens);
    const int num_centres = leave_empty ? k : std::max(16, k);
    std::vector<std::vector<float>> centres(num_centres, std::vector<float>(head_dim));
    for (std::vector<float>& centre : centres) {
      double sq = 0.0;
      for (float& v : centre) {
        v = normal(1.0f);
        sq += double{v} * v;
      }
      const double norm = uniform_real(8.0, 10.0) / std::sqrt(sq);
      for (float& v : centre) v = static_cast<float>(v * norm);
    }
    if (leave_empty)
      for (int d = 0; d < head_dim; ++d) centres[0][d] = centres[1][d] / 2.0f;
    std::vector<int> label(n);
    for (int& l : label) l = uniform(leave_empty ? 1 : 0, num_centres - 1);
    for (int j = 0; j < k; ++j) label[int64_t{j} * n / k] = j;
    std::vector<uint16_t> keys(static_cast<size_t>(n) * head_dim);
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < head_dim; ++d)
        keys[static_cast<size_t>(t) * head_dim + d] = f32_to_bf16(centres[label[t]][d] + normal(0.05f));
    return keys;
  }
};

// --- Index ----------------------------------------------------------------------------------------

TEST_F(GpuRetroInfer, ClusterFindsPlantedClustersAndWritesRecords) {
  constexpr int kHeads = 2, kPoolGroups = 40, kHostPages = 24;
  for (int head_dim : {64, 128})
    for (int page_size : {8, 16}) {
      const Layout layout(kHeads, head_dim, page_size);
      ASSERT_EQ(layout.slots, 1);
      ASSERT_GE(layout.records_per_page, 1);
      const size_t page_elems = layout.page_elems();
      std::vector<uint16_t> pool(size_t{kPoolGroups} * kHeads * page_elems), host(size_t{kHostPages} * page_elems);
      for (uint16_t& x : pool) x = random_bf16(1.0f);
      for (uint16_t& x : host) x = random_bf16(1.0f);

      // Sequence 0 (13 pages per KV head) has summary groups of its own. Its head 0 is clustered in
      // two segments, [0, 8) and [8, 13), on device pages; its head 1 in one, [0, 13), read from
      // the host pool. Sequence 1's head 0 has 5 pages on both pools, and its first group is the
      // one holding its first page, so its records take pages that are read; its head 1 has 5
      // pages of one repeated key.
      const std::vector<int32_t> group_order = shuffled(kPoolGroups);
      const int groups0 = layout.groups_for(13), groups1 = layout.groups_for(5);
      std::vector<int32_t> dir(group_order.begin(), group_order.begin() + groups0);
      std::vector<int32_t> free_pages;  // device pages outside sequence 0's groups
      for (int32_t page = 0; page < kPoolGroups * kHeads; ++page)
        if (std::find(dir.begin(), dir.end(), page / kHeads) == dir.end()) free_pages.push_back(page);
      std::shuffle(free_pages.begin(), free_pages.end(), rng_);
      const std::vector<int32_t> host_pages = shuffled(kHostPages);
      const auto on_host = [&](int i) { return ~host_pages[i]; };
      const auto dir1 = static_cast<int32_t>(dir.size());
      dir.push_back(free_pages[13] / kHeads);
      for (int i = groups0; static_cast<int>(dir.size()) < dir1 + groups1; ++i)
        if (group_order[i] != dir[dir1]) dir.push_back(group_order[i]);

      struct Job {
        int head;
        int first_page;
        int32_t dir_offset;
        std::vector<int32_t> ids;
      };
      std::vector<Job> jobs{
          {0, 0, 0, std::vector<int32_t>(free_pages.begin(), free_pages.begin() + 8)},
          {0, 8, 0, std::vector<int32_t>(free_pages.begin() + 8, free_pages.begin() + 13)},
          {1, 0, 0, {}},
          {0, 0, dir1, {free_pages[13], on_host(13), free_pages[14], on_host(14), free_pages[15]}},
          {1, 0, dir1, std::vector<int32_t>(free_pages.begin() + 16, free_pages.begin() + 21)},
      };
      const int kTiedJob = 4;
      for (int i = 0; i < 13; ++i) jobs[2].ids.push_back(on_host(i));

      // Keys (redrawn until the reference k-means is clear-cut; the first job's until it leaves a
      // cluster empty) and values, into their pages.
      const auto num_jobs = static_cast<int>(jobs.size());
      std::vector<KMeans> ref(num_jobs);
      std::vector<std::vector<uint16_t>> keys(num_jobs), values(num_jobs);
      for (int j = 0; j < num_jobs; ++j) {
        const int n = static_cast<int>(jobs[j].ids.size()) * page_size;
        const bool leave_empty = j == 0;
        for (int attempt = 0;; ++attempt) {
          ASSERT_LT(attempt, 100) << "no clear-cut k-means in 100 draws, job " << j;
          keys[j] = planted_keys(n, head_dim, leave_empty);
          if (j == kTiedJob)
            for (int t = 1; t < n; ++t)
              std::copy_n(keys[j].begin(), head_dim, keys[j].begin() + static_cast<std::ptrdiff_t>(t) * head_dim);
          ref[j] = reference_kmeans(keys[j], n, head_dim);
          if (ref[j].clear && (!leave_empty || ref[j].empty_clusters() > 0)) break;
        }
        if (j == kTiedJob) {
          ASSERT_EQ(ref[j].sizes[0], n) << "ties go to the lower cluster";
        }
        values[j].resize(static_cast<size_t>(n) * head_dim);
        for (uint16_t& v : values[j]) v = random_bf16(1.0f);
        for (int t = 0; t < n; ++t) {
          const int32_t id = jobs[j].ids[t / page_size];
          uint16_t* page = id >= 0 ? pool.data() + static_cast<size_t>(id) * page_elems
                                   : host.data() + static_cast<size_t>(~id) * page_elems;
          const size_t row = static_cast<size_t>(t) * head_dim;
          std::copy_n(keys[j].begin() + static_cast<std::ptrdiff_t>(row), head_dim,
                      page + static_cast<size_t>(t % page_size) * head_dim);
          std::copy_n(values[j].begin() + static_cast<std::ptrdiff_t>(row), head_dim,
                      page + static_cast<size_t>(page_size + t % page_size) * head_dim);
        }
      }

      std::vector<int32_t> page_ids, page_offsets{0}, first_page, heads, dir_offsets;
      for (const Job& job : jobs) {
        page_ids.insert(page_ids.end(), job.ids.begin(), job.ids.end());
        page_offsets.push_back(static_cast<int32_t>(page_ids.size()));
        first_page.push_back(job.first_page);
        heads.push_back(job.head);
        dir_offsets.push_back(job.dir_offset);
      }
      const int total_pages = page_offsets.back();
      DeviceArray<uint16_t> d_pool(pool), d_host(host);
      DeviceArray<int32_t> d_ids(page_ids), d_offsets(page_offsets), d_first(first_page), d_heads(heads), d_dir(dir),
          d_dir_offsets(dir_offsets);
      DeviceArray<unsigned char> d_scratch(
          cuda::retroinfer_cluster_scratch_bytes(total_pages, num_jobs, page_size, head_dim, layout.slots));
      for (cudaError_t st : {d_pool.status(), d_host.status(), d_ids.status(), d_offsets.status(), d_first.status(),
                             d_heads.status(), d_dir.status(), d_dir_offsets.status(), d_scratch.status()})
        CUDA_OK(st);
      cuda::RetroInferClusterParams p;
      p.records = layout.device(d_pool.get());
      p.host_pool = as_bf16(d_host.get());
      p.page_ids = d_ids.get();
      p.page_offsets = d_offsets.get();
      p.first_page = d_first.get();
      p.head = d_heads.get();
      p.dir = d_dir.get();
      p.dir_offsets = d_dir_offsets.get();
      p.num_jobs = num_jobs;
      p.total_pages = total_pages;
      p.cluster_tokens = kClusterTokens;
      p.iterations = kIterations;
      p.scratch = d_scratch.get();
      CUDA_OK(cuda::retroinfer_cluster(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> got = d_pool.download();
      EXPECT_TRUE(d_host.download() == host) << "hd " << head_dim << " ps " << page_size << ": the host pool changed";

      Mismatches bad;
      std::vector<bool> owned(got.size() * sizeof(uint16_t), false);  // bytes of the jobs' records
      for (int j = 0; j < num_jobs; ++j) {
        const Job& job = jobs[j];
        const KMeans& km = ref[j];
        const HeadRecords rec(got, layout, dir.data() + job.dir_offset, job.head);
        const int pages = static_cast<int>(job.ids.size()), n = pages * page_size;
        const int64_t first_token = int64_t{job.first_page} * page_size;
        const int64_t first_slot = int64_t{job.first_page} * layout.slots;
        for (int pg = 0; pg < pages; ++pg)
          std::fill_n(owned.begin() + static_cast<std::ptrdiff_t>(rec.record_at(job.first_page + pg)),
                      layout.record_bytes(), true);
        std::vector<std::vector<int32_t>> members(km.k);  // reference: positions ascending
        for (int t = 0; t < n; ++t) members[km.assign[t]].push_back(static_cast<int32_t>(first_token + t));
        for (int t = 0; t < n; ++t) {
          const int32_t c = rec.cluster(first_token + t);
          if (bad.report(c == first_slot + km.assign[t]))
            ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " token " << t
                          << ": cluster slot " << c << ", expected " << first_slot + km.assign[t];
        }
        std::vector<int> covered(n, 0);
        for (int c = 0; c < pages * layout.slots; ++c) {
          const int64_t slot = first_slot + c;
          const int expect_size = c < km.k ? static_cast<int>(members[c].size()) : 0;
          const int32_t size = rec.size(slot);
          if (bad.report(size == expect_size))
            ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " slot " << slot << ": size "
                          << size << ", expected " << expect_size << (c >= km.k ? " (past k)" : "");
          if (size != expect_size || size == 0) continue;
          const int32_t start = rec.start(slot);
          if (bad.report(start >= first_token && start + size <= first_token + n)) {
            ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " slot " << slot
                          << ": members [" << start << ", " << start + size << ") outside the segment's entries";
            continue;
          }
          if (start < first_token || start + size > first_token + n) continue;
          for (int m = 0; m < size; ++m) {
            ++covered[start - first_token + m];
            const int32_t t = rec.member(start + m);
            if (bad.report(t == members[c][m]))
              ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " slot " << slot
                            << " member " << m << ": token " << t << ", expected " << members[c][m];
          }
          for (int d = 0; d < head_dim; ++d) {
            double sum = 0.0, magnitude = 0.0, key = 0.0;
            for (int32_t t : members[c]) {
              const size_t at = static_cast<size_t>(t - first_token) * head_dim + d;
              sum += bf16_to_f32(values[j][at]);
              magnitude += std::abs(bf16_to_f32(values[j][at]));
              key += bf16_to_f32(keys[j][at]);
            }
            key /= size;
            const float vs = rec.value_sum(slot, d), centroid = rec.centroid(slot, d);
            if (bad.report(std::abs(vs - sum) <= 1e-4 * magnitude))
              ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " slot " << slot << " dim "
                            << d << ": value sum " << vs << ", expected " << sum;
            if (bad.report(std::abs(centroid - key) <= 1e-2 * std::abs(key) + 1e-4))
              ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << " slot " << slot << " dim "
                            << d << ": centroid " << centroid << ", expected " << key;
          }
        }
        for (int e = 0; e < n; ++e)
          if (bad.report(covered[e] == 1))
            ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " job " << j << ": member entry "
                          << first_token + e << " is in " << covered[e] << " slots' ranges";
      }
      // Outside the jobs' records, nothing changes.
      const auto* before = reinterpret_cast<const unsigned char*>(pool.data());
      const auto* after = reinterpret_cast<const unsigned char*>(got.data());
      for (size_t b = 0; b < owned.size(); ++b)
        if (!owned[b] && bad.report(before[b] == after[b]))
          ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << ": byte " << b << " of pool page "
                        << b / layout.page_bytes() << " changed outside the records";
      EXPECT_EQ(bad.count(), 0) << "hd " << head_dim << " ps " << page_size;
    }
}

// --- Select: scores -----------------------------------------------------------------------------

TEST_F(GpuRetroInfer, ScoresAreSummedSoftmaxOverClustersAndPagesTheirTokensEstimatedShare) {
  constexpr int kHeads = 2, kSeqs = 2, kItems = kSeqs * kHeads;
  for (int head_dim : {64, 128})
    for (int group = 1; group <= 4; ++group) {
      const int page_size = 8 << (group - 1);  // 8, 16, 32, 64: 1, 1, 2, 4 slots a page
      const Layout layout(kHeads, head_dim, page_size);
      const int slots = layout.slots;
      // Sequence 0: more than 256 slots (two blocks of the softmax), candidates from page 1 to 3
      // past its clustered pages. Sequence 1: a few clustered pages, all of them candidates.
      const int clustered0 = (uniform(260, 420) + slots - 1) / slots, clustered1 = uniform(3, 12);
      const std::vector<int32_t> clustered{clustered0, clustered1}, first{1, 0}, end{clustered0 + 3, clustered1};
      const std::vector<int32_t> dir_offsets{0, layout.groups_for(clustered0)};
      const std::vector<int32_t> dir = shuffled(dir_offsets[1] + layout.groups_for(clustered1));
      std::vector<uint16_t> pool(dir.size() * kHeads * layout.page_elems(), kPoisonBf16);
      std::vector<std::vector<int32_t>> cluster_of(kItems);
      std::vector<std::vector<bool>> empty(kItems);
      std::vector<std::vector<size_t>> sizes(kItems);
      for (int item = 0; item < kItems; ++item) {
        const int s = item / kHeads;
        HeadRecords rec(pool, layout, dir.data() + dir_offsets[s], item % kHeads);
        const int num_slots = clustered[s] * slots;
        cluster_of[item] = random_clusters(clustered[s] * page_size, num_slots);
        const std::vector<std::vector<int32_t>> members = write_clusters(rec, cluster_of[item], num_slots);
        for (int c = 0; c < num_slots; ++c) {
          empty[item].push_back(members[c].empty());
          sizes[item].push_back(members[c].size());
          for (int d = 0; d < head_dim; ++d)
            rec.set_centroid(c, d, members[c].empty() ? f32_to_bf16(50.0f) : random_bf16(1.0f));
        }
      }
      const int max_clusters = std::max(clustered0, clustered1) * slots + uniform(0, 40);
      const int max_candidates = std::max(end[0] - first[0], end[1] - first[1]) + uniform(1, 9);
      std::vector<uint16_t> q(static_cast<size_t>(kItems) * group * head_dim);
      for (uint16_t& x : q) x = random_bf16(2.0f);
      const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

      DeviceArray<uint16_t> d_pool(pool), d_q(q);
      DeviceArray<int32_t> d_dir(dir), d_dir_offsets(dir_offsets), d_clustered(clustered), d_first(first), d_end(end);
      DeviceArray<float> d_logits(static_cast<size_t>(cuda::retroinfer_score_scratch(kItems, group, max_clusters))),
          d_totals(static_cast<size_t>(kItems) * max_clusters),
          d_page_scores(static_cast<size_t>(kItems) * max_candidates);
      for (cudaError_t st : {d_pool.status(), d_q.status(), d_dir.status(), d_dir_offsets.status(),
                             d_clustered.status(), d_first.status(), d_end.status(), d_logits.status(),
                             d_totals.status(), d_page_scores.status()})
        CUDA_OK(st);
      cuda::RetroInferSelectParams p;
      p.records = layout.device(d_pool.get());
      p.q = as_bf16(d_q.get());
      p.dir = d_dir.get();
      p.dir_offsets = d_dir_offsets.get();
      p.clustered_pages = d_clustered.get();
      p.first_candidate = d_first.get();
      p.end_candidate = d_end.get();
      p.num_seqs = kSeqs;
      p.group = group;
      p.scale = scale;
      p.max_clusters = max_clusters;
      p.max_candidates = max_candidates;
      p.logits = d_logits.get();
      p.totals = d_totals.get();
      p.page_scores = d_page_scores.get();
      DeviceArray<uint8_t> d_flags(static_cast<size_t>(kItems) * max_clusters);
      DeviceArray<int32_t> d_tallies(static_cast<size_t>(kItems) * 2);
      CUDA_OK(d_flags.status());
      CUDA_OK(d_tallies.status());
      p.zone_flags = d_flags.get();
      p.zone_tallies = d_tallies.get();
      CUDA_OK(cuda::retroinfer_score(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> totals = d_totals.download(), page_scores = d_page_scores.download();

      Mismatches bad;
      for (int item = 0; item < kItems; ++item) {
        const int s = item / kHeads;
        const HeadRecords rec(pool, layout, dir.data() + dir_offsets[s], item % kHeads);
        const int num_slots = clustered[s] * slots;
        std::vector<double> expect(num_slots, 0.0);
        for (int g = 0; g < group; ++g) {
          const uint16_t* qh = q.data() + (static_cast<size_t>(item) * group + g) * head_dim;
          std::vector<double> logit(num_slots, -INFINITY);
          double top = -INFINITY, sum = 0.0;
          for (int c = 0; c < num_slots; ++c) {
            if (empty[item][c]) continue;
            double dot = 0.0;
            for (int d = 0; d < head_dim; ++d) dot += double{bf16_to_f32(qh[d])} * rec.centroid(c, d);
            logit[c] = dot * scale;
            top = std::max(top, logit[c]);
          }
          for (int c = 0; c < num_slots; ++c)
            if (!empty[item][c]) sum += std::exp(logit[c] - top);
          for (int c = 0; c < num_slots; ++c)
            if (!empty[item][c]) expect[c] += std::exp(logit[c] - top) / sum;
        }
        const float* got = totals.data() + static_cast<size_t>(item) * max_clusters;
        for (int c = 0; c < num_slots; ++c)
          if (bad.report(std::abs(got[c] - expect[c]) <= 1e-3 * expect[c] + 1e-6))
            ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << item << " slot " << c
                          << (empty[item][c] ? " (empty)" : "") << ": total " << got[c] << ", expected " << expect[c];
        const float* scores = page_scores.data() + static_cast<size_t>(item) * max_candidates;
        for (int j = 0; j < max_candidates; ++j) {
          const int page = first[s] + j;
          if (page >= end[s]) {
            if (bad.report(f32_to_bits(scores[j]) == kPoisonF32))
              ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << item << ": score " << j
                            << " past the candidates was written";
          } else if (page >= clustered[s]) {
            if (bad.report(std::isinf(scores[j]) && scores[j] > 0))
              ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << item << " page " << page
                            << " (unclustered): score " << scores[j] << ", expected +inf";
          } else {
            float want = 0.0f;
            for (int t = page * page_size; t < (page + 1) * page_size; ++t) {
              const int32_t c = cluster_of[item][t];
              want += got[c] / static_cast<float>(sizes[item][c]);
            }
            if (bad.report(std::abs(scores[j] - want) <= 1e-5f * std::abs(want)))
              ADD_FAILURE() << "hd " << head_dim << " group " << group << " item " << item << " page " << page
                            << ": score " << scores[j] << ", expected its tokens' share " << want;
          }
        }
      }
      EXPECT_EQ(bad.count(), 0) << "hd " << head_dim << " group " << group;
    }
}

// --- Select: estimation zone --------------------------------------------------------------------

TEST_F(GpuRetroInfer, ZoneTakesClustersWithATokenLeftOut) {
  constexpr int kHeads = 2, kSeqs = 2, kItems = kSeqs * kHeads;
  for (int page_size : {8, 32})
    for (double fraction : {0.0, 0.232, 1.0}) {
      const int head_dim = page_size == 8 ? 128 : 64;
      const Layout layout(kHeads, head_dim, page_size);
      const int slots = layout.slots;
      // Sequence 0: sink page 0, candidates 1..41 of which 40 and 41 are unclustered (always
      // selected). Sequence 1: sink page 0, candidates 1..9, clustered window pages 10 and 11; its
      // head 0 selects no page, its head 1 every candidate (no zone candidate).
      const std::vector<int32_t> clustered{40, 12}, first{1, 1}, end{42, 10};
      const std::vector<int32_t> dir_offsets{0, layout.groups_for(clustered[0])};
      const std::vector<int32_t> dir = shuffled(dir_offsets[1] + layout.groups_for(clustered[1]));
      std::vector<uint16_t> pool(dir.size() * kHeads * layout.page_elems(), kPoisonBf16);
      const int max_clusters = clustered[0] * slots + uniform(0, 20);
      const int max_candidates = end[0] - first[0] + uniform(1, 9);
      std::vector<float> score_values(uniform(2, 6));  // few values: many ties
      for (float& v : score_values) v = static_cast<float>(uniform_real(0.0, 1.0));
      std::vector<float> totals(static_cast<size_t>(kItems) * max_clusters, 1e30f);
      std::vector<std::vector<int32_t>> cluster_of(kItems), selected(kItems);
      std::vector<int> non_empty(kItems, 0);
      for (int item = 0; item < kItems; ++item) {
        const int s = item / kHeads, h = item % kHeads;
        const int num_slots = clustered[s] * slots;
        // Tokens on sink and window pages are in slots of their own (c % 4 == 0).
        std::vector<int32_t> inside, outside;
        for (int c = 0; c < num_slots; ++c)
          if (chance(0.8)) (c % 4 == 0 ? outside : inside).push_back(c);
        if (inside.empty()) inside.push_back(1);
        if (outside.empty()) outside.push_back(0);
        cluster_of[item].resize(static_cast<size_t>(clustered[s]) * page_size);
        for (size_t t = 0; t < cluster_of[item].size(); ++t) {
          const auto page = static_cast<int>(t / page_size);
          cluster_of[item][t] = pick(page < first[s] || page >= end[s] ? outside : inside);
        }
        HeadRecords rec(pool, layout, dir.data() + dir_offsets[s], h);
        const std::vector<std::vector<int32_t>> members = write_clusters(rec, cluster_of[item], num_slots);
        for (int c = 0; c < num_slots; ++c) {
          non_empty[item] += !members[c].empty();
          const float value = score_values[uniform(0, static_cast<int>(score_values.size()) - 1)];
          totals[static_cast<size_t>(item) * max_clusters + c] = members[c].empty() ? 0.0f : value;
        }
        for (int page = first[s]; page < end[s]; ++page)
          if (page >= clustered[s] || (s == 0 ? chance(0.5) : h == 1)) selected[item].push_back(page);
      }
      std::vector<int32_t> flat, offsets, counts;
      for (const std::vector<int32_t>& sel : selected) {
        offsets.push_back(static_cast<int32_t>(flat.size()));
        counts.push_back(static_cast<int32_t>(sel.size()));
        flat.insert(flat.end(), sel.begin(), sel.end());
      }

      constexpr int kGroup = 2;
      std::vector<uint16_t> q(static_cast<size_t>(kItems) * kGroup * head_dim);
      for (uint16_t& x : q) x = random_bf16(1.0f);
      DeviceArray<uint16_t> d_pool(pool), d_q(q);
      DeviceArray<int32_t> d_dir(dir), d_dir_offsets(dir_offsets), d_clustered(clustered), d_first(first), d_end(end),
          d_selected(flat), d_offsets(offsets), d_counts(counts), d_zone_counts(kItems), d_tallies(kItems * 2);
      DeviceArray<float> d_totals(totals), d_zone_scores(static_cast<size_t>(kItems) * max_clusters),
          d_logits(static_cast<size_t>(cuda::retroinfer_score_scratch(kItems, kGroup, max_clusters))),
          d_page_scores(static_cast<size_t>(kItems) * max_candidates);
      DeviceArray<uint8_t> d_flags(static_cast<size_t>(kItems) * max_clusters);
      for (cudaError_t st : {d_pool.status(), d_q.status(), d_dir.status(), d_dir_offsets.status(),
                             d_clustered.status(), d_first.status(), d_end.status(), d_selected.status(),
                             d_offsets.status(), d_counts.status(), d_zone_counts.status(), d_tallies.status(),
                             d_totals.status(), d_zone_scores.status(), d_logits.status(), d_page_scores.status(),
                             d_flags.status()})
        CUDA_OK(st);
      cuda::RetroInferSelectParams p;
      p.records = layout.device(d_pool.get());
      p.dir = d_dir.get();
      p.dir_offsets = d_dir_offsets.get();
      p.clustered_pages = d_clustered.get();
      p.first_candidate = d_first.get();
      p.end_candidate = d_end.get();
      p.num_seqs = kSeqs;
      p.max_clusters = max_clusters;
      p.max_candidates = max_candidates;
      p.totals = d_totals.get();
      p.selected = d_selected.get();
      p.selected_offsets = d_offsets.get();
      p.selected_counts = d_counts.get();
      p.estimate_fraction = fraction;
      p.zone_flags = d_flags.get();
      p.zone_tallies = d_tallies.get();
      p.zone_scores = d_zone_scores.get();
      p.zone_counts = d_zone_counts.get();
      // The step's order: the scores (which clear the zone's scratch), then the zone over the
      // totals written here.
      p.q = as_bf16(d_q.get());
      p.group = kGroup;
      p.logits = d_logits.get();
      p.page_scores = d_page_scores.get();
      CUDA_OK(cuda::retroinfer_score(p, nullptr));
      CUDA_OK(cudaMemcpy(d_totals.get(), totals.data(), totals.size() * sizeof(float), cudaMemcpyHostToDevice));
      CUDA_OK(cuda::retroinfer_zone(p, nullptr));

      // The zone's clusters, as the decode step picks them: over slots [0, clustered * slots).
      const std::vector<int32_t> zeros(kSeqs, 0), slot_end{clustered[0] * slots, clustered[1] * slots};
      std::vector<int32_t> out_offsets;
      int out_size = 0;
      for (int item = 0; item < kItems; ++item) {
        out_offsets.push_back(out_size);
        out_size += slot_end[item / kHeads] + 2;  // gaps that must keep their poison
      }
      DeviceArray<int32_t> d_zeros(zeros), d_slot_end(slot_end), d_out_offsets(out_offsets), d_out(out_size);
      for (cudaError_t st : {d_zeros.status(), d_slot_end.status(), d_out_offsets.status(), d_out.status()})
        CUDA_OK(st);
      cuda::SelectTopParams top;
      top.scores = d_zone_scores.get();
      top.max_candidates = max_clusters;
      top.first_candidate = d_zeros.get();
      top.end_candidate = d_slot_end.get();
      top.counts = d_zone_counts.get();
      top.out_offsets = d_out_offsets.get();
      top.num_seqs = kSeqs;
      top.num_kv_heads = kHeads;
      top.out_pages = d_out.get();
      CUDA_OK(cuda::select_top_pages(top, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> zone_scores = d_zone_scores.download();
      const std::vector<int32_t> zone_counts = d_zone_counts.download(), chosen = d_out.download();

      Mismatches bad;
      for (int item = 0; item < kItems; ++item) {
        const int s = item / kHeads;
        const int num_slots = clustered[s] * slots;
        const float* total = totals.data() + static_cast<size_t>(item) * max_clusters;
        std::vector<bool> flagged(num_slots, false);
        for (int page = first[s]; page < std::min(end[s], clustered[s]); ++page) {
          if (std::binary_search(selected[item].begin(), selected[item].end(), page)) continue;
          for (int t = page * page_size; t < (page + 1) * page_size; ++t) flagged[cluster_of[item][t]] = true;
        }
        std::vector<int32_t> zone;
        for (int c = 0; c < num_slots; ++c)
          if (flagged[c]) zone.push_back(c);
        const int expect_count =
            std::min(static_cast<int>(std::ceil(fraction * non_empty[item])), static_cast<int>(zone.size()));
        if (bad.report(zone_counts[item] == expect_count))
          ADD_FAILURE() << "ps " << page_size << " fraction " << fraction << " item " << item << ": zone count "
                        << zone_counts[item] << ", expected " << expect_count << " (" << non_empty[item]
                        << " non-empty slots, " << zone.size() << " flagged)";
        for (int c = 0; c < num_slots; ++c) {
          const float got = zone_scores[static_cast<size_t>(item) * max_clusters + c];
          const bool ok = flagged[c] ? f32_to_bits(got) == f32_to_bits(total[c]) : std::isnan(got);
          if (bad.report(ok))
            ADD_FAILURE() << "ps " << page_size << " fraction " << fraction << " item " << item << " slot " << c
                          << ": zone score " << got << ", expected " << (flagged[c] ? total[c] : NAN);
        }
        // The host's top: highest total first, ties to the lower slot; then ascending.
        std::stable_sort(zone.begin(), zone.end(), [&](int32_t a, int32_t b) { return total[a] > total[b]; });
        zone.resize(static_cast<size_t>(std::max(expect_count, 0)));
        std::sort(zone.begin(), zone.end());
        const int next = item + 1 < kItems ? out_offsets[item + 1] : out_size;
        for (int at = out_offsets[item]; at < next; ++at) {
          const size_t i = static_cast<size_t>(at - out_offsets[item]);
          const int32_t want = i < zone.size() ? zone[i] : kPoisonI32;
          if (bad.report(chosen[at] == want))
            ADD_FAILURE() << "ps " << page_size << " fraction " << fraction << " item " << item << " zone cluster "
                          << i << ": " << chosen[at] << ", expected " << want;
        }
      }
      EXPECT_EQ(bad.count(), 0) << "ps " << page_size << " fraction " << fraction;
    }
}

// --- Estimate -----------------------------------------------------------------------------------

TEST_F(GpuRetroInfer, EstimateMergesClusterTermsIntoTheAttentionOutput) {
  constexpr int kHeads = 2, kSeqs = 2, kItems = kSeqs * kHeads;
  for (int head_dim : {64, 128})
    for (int page_size : {8, 32})
      for (int group : {1, 3, 8}) {
        const Layout layout(kHeads, head_dim, page_size);
        const int slots = layout.slots;
        const size_t page_elems = layout.page_elems();
        // Sequence 0: 601 pages, sink page 0, candidates 1..597, clustered pages 0..599 (598 and 599
        // in the window): zones of hundreds of clusters. Sequence 1: 13
        // pages, sink pages 0 and 1, candidates 2..11 of which 10 and 11 are unclustered (always
        // selected). The candidate page `first` is never selected.
        const std::vector<int32_t> pages{601, 13}, clustered{600, 10}, first{1, 2}, end{598, 12};
        const std::vector<int32_t> dir_offsets{0, layout.groups_for(clustered[0])};
        const int record_groups = dir_offsets[1] + layout.groups_for(clustered[1]);
        const std::vector<int32_t> dir = shuffled(record_groups);

        // Per item: the attended pages, in the attention list's order (sinks, selected, window).
        std::vector<std::vector<int32_t>> selected(kItems), list(kItems);
        std::vector<std::vector<bool>> attended(kItems);
        int listed = 0;
        for (int item = 0; item < kItems; ++item) {
          const int s = item / kHeads;
          for (int page = first[s] + 1; page < end[s]; ++page)
            if (page >= clustered[s] || chance(0.4)) selected[item].push_back(page);
          for (int page = 0; page < first[s]; ++page) list[item].push_back(page);
          list[item].insert(list[item].end(), selected[item].begin(), selected[item].end());
          for (int page = end[s]; page < pages[s]; ++page) list[item].push_back(page);
          attended[item].assign(pages[s], false);
          for (int32_t page : list[item]) attended[item][page] = true;
          listed += static_cast<int>(list[item].size());
        }
        // The pool: the record groups, then one page per listed page (values only: keys and every
        // other page NaN).
        const int record_pages = record_groups * kHeads;
        std::vector<uint16_t> pool((static_cast<size_t>(record_pages) + listed + 4) * page_elems, kPoisonBf16);
        std::vector<int32_t> kv_pages(listed);
        std::iota(kv_pages.begin(), kv_pages.end(), record_pages);
        std::shuffle(kv_pages.begin(), kv_pages.end(), rng_);
        std::vector<std::vector<uint16_t>> values(kItems);
        std::vector<int32_t> decode_pages, decode_offsets;
        for (int item = 0; item < kItems; ++item) {
          const int s = item / kHeads;
          values[item].resize(static_cast<size_t>(pages[s]) * page_size * head_dim);
          for (uint16_t& v : values[item]) v = random_bf16(1.0f);
          decode_offsets.push_back(static_cast<int32_t>(decode_pages.size()));
          for (int32_t page : list[item]) {
            const int32_t id = kv_pages[decode_pages.size()];
            decode_pages.push_back(id);
            const size_t rows = static_cast<size_t>(page_size) * head_dim;
            std::copy_n(values[item].begin() + static_cast<std::ptrdiff_t>(page * rows), rows,
                        pool.begin() + static_cast<std::ptrdiff_t>(id * page_elems + rows));
          }
        }
        // Clusters: slot 0 holds sink page 0's tokens (wholly attended), slot 1 those of page
        // `first` (none attended); in sequence 0, slot 2 those of pages first + 1 .. 40 (hundreds of
        // members, selected and left out: more than a round of the member scan); the other tokens
        // are drawn among slots 3.. (members on selected, window and left-out pages alike). Zones:
        // slots 0, 1, 2 and random others; none for the last item.
        std::vector<std::vector<std::vector<int32_t>>> members(kItems);
        std::vector<std::vector<int32_t>> zone(kItems);
        for (int item = 0; item < kItems; ++item) {
          const int s = item / kHeads;
          const int num_slots = clustered[s] * slots;
          std::vector<int32_t> live;
          for (int c = 3; c < num_slots; ++c)
            if (chance(0.75)) live.push_back(c);
          if (live.empty()) live.push_back(3);
          std::vector<int32_t> cluster_of(static_cast<size_t>(clustered[s]) * page_size);
          for (size_t t = 0; t < cluster_of.size(); ++t) {
            const auto page = static_cast<int>(t / page_size);
            cluster_of[t] = page == 0 ? 0 : page == first[s] ? 1 : s == 0 && page <= 40 ? 2 : pick(live);
          }
          HeadRecords rec(pool, layout, dir.data() + dir_offsets[s], item % kHeads);
          members[item] = write_clusters(rec, cluster_of, num_slots);
          for (int c = 0; c < num_slots; ++c) {
            for (int d = 0; d < head_dim; ++d) {
              float sum = 0.0f;
              for (int32_t t : members[item][c])
                sum += bf16_to_f32(values[item][static_cast<size_t>(t) * head_dim + d]);
              rec.set_value_sum(c, d, sum);
              rec.set_centroid(c, d, random_bf16(1.0f));
            }
            if (item < kItems - 1 && !members[item][c].empty() && (c < 3 || chance(0.5))) zone[item].push_back(c);
          }
        }
        std::vector<int32_t> selected_flat, selected_offsets, selected_counts, zone_flat, zone_offsets, zone_counts;
        for (int item = 0; item < kItems; ++item) {
          selected_offsets.push_back(static_cast<int32_t>(selected_flat.size()));
          selected_counts.push_back(static_cast<int32_t>(selected[item].size()));
          selected_flat.insert(selected_flat.end(), selected[item].begin(), selected[item].end());
          zone_offsets.push_back(static_cast<int32_t>(zone_flat.size()));
          zone_counts.push_back(static_cast<int32_t>(zone[item].size()));
          zone_flat.insert(zone_flat.end(), zone[item].begin(), zone[item].end());
        }
        const size_t rows = static_cast<size_t>(kItems) * group;
        std::vector<uint16_t> q(rows * head_dim), out(rows * head_dim);
        std::vector<float> lse(rows);
        for (uint16_t& x : q) x = random_bf16(1.0f);
        for (uint16_t& x : out) x = random_bf16(0.5f);
        for (float& x : lse) x = static_cast<float>(uniform_real(-1.0, 2.0));
        const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

        DeviceArray<uint16_t> d_pool(pool), d_q(q), d_out(out);
        DeviceArray<float> d_lse(lse);
        DeviceArray<int32_t> d_dir(dir), d_dir_offsets(dir_offsets), d_first(first), d_end(end),
            d_selected(selected_flat), d_selected_offsets(selected_offsets), d_selected_counts(selected_counts),
            d_zone(zone_flat), d_zone_offsets(zone_offsets), d_zone_counts(zone_counts), d_decode(decode_pages),
            d_decode_offsets(decode_offsets);
        for (cudaError_t st : {d_pool.status(), d_q.status(), d_out.status(), d_lse.status(), d_dir.status(),
                               d_dir_offsets.status(), d_first.status(), d_end.status(), d_selected.status(),
                               d_selected_offsets.status(), d_selected_counts.status(), d_zone.status(),
                               d_zone_offsets.status(), d_zone_counts.status(), d_decode.status(),
                               d_decode_offsets.status()})
          CUDA_OK(st);
        cuda::RetroInferEstimateParams p;
        p.records = layout.device(d_pool.get());
        p.q = as_bf16(d_q.get());
        p.dir = d_dir.get();
        p.dir_offsets = d_dir_offsets.get();
        p.first_candidate = d_first.get();
        p.end_candidate = d_end.get();
        p.selected = d_selected.get();
        p.selected_offsets = d_selected_offsets.get();
        p.selected_counts = d_selected_counts.get();
        p.zone = d_zone.get();
        p.zone_offsets = d_zone_offsets.get();
        p.zone_counts = d_zone_counts.get();
        p.decode_pages = d_decode.get();
        p.decode_offsets = d_decode_offsets.get();
        p.num_seqs = kSeqs;
        p.group = group;
        p.scale = scale;
        p.lse = d_lse.get();
        p.out = as_bf16(d_out.get());
        // One split (sequence 0's zones, of hundreds of clusters, give each of its 8 warps dozens)
        // or several (sequence 1's few clusters leave splits with none).
        p.splits = chance(0.5) ? 1 : uniform(2, 5);
        // The selected pages' rank table covers every item, or only sequence 1's candidates (sequence
        // 0's are then searched in its list).
        p.max_candidates = chance(0.5) ? std::max(end[0] - first[0], end[1] - first[1]) + uniform(0, 40)
                                       : end[1] - first[1];
        DeviceArray<float> d_partials(
            static_cast<size_t>(cuda::retroinfer_estimate_scratch(kItems, group, head_dim, p.splits)));
        CUDA_OK(d_partials.status());
        p.partials = d_partials.get();
        CUDA_OK(cuda::retroinfer_estimate(p, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got = d_out.download();

        Mismatches bad;
        double moved = 0.0;  // the largest change the estimation makes: the test must see it
        for (int item = 0; item < kItems; ++item) {
          const int s = item / kHeads;
          const HeadRecords rec(pool, layout, dir.data() + dir_offsets[s], item % kHeads);
          for (int g = 0; g < group; ++g) {
            const size_t row = static_cast<size_t>(item) * group + g;
            const uint16_t* qh = q.data() + row * head_dim;
            std::vector<double> num(head_dim);
            double den = std::exp(double{lse[row]});
            for (int d = 0; d < head_dim; ++d) num[d] = den * bf16_to_f32(out[row * head_dim + d]);
            for (int32_t c : zone[item]) {
              std::vector<double> rest(head_dim);
              for (int d = 0; d < head_dim; ++d) rest[d] = rec.value_sum(c, d);
              int m = 0;
              for (int32_t t : members[item][c]) {
                if (!attended[item][t / page_size]) {
                  ++m;
                  continue;
                }
                for (int d = 0; d < head_dim; ++d)
                  rest[d] -= bf16_to_f32(values[item][static_cast<size_t>(t) * head_dim + d]);
              }
              if (m == 0) continue;
              double dot = 0.0;
              for (int d = 0; d < head_dim; ++d) dot += double{bf16_to_f32(qh[d])} * rec.centroid(c, d);
              const double w = m * std::exp(dot * scale);
              for (int d = 0; d < head_dim; ++d) num[d] += w * rest[d] / m;
              den += w;
            }
            for (int d = 0; d < head_dim; ++d) {
              const size_t at = row * head_dim + d;
              if (zone[item].empty()) {
                if (bad.report(got[at] == out[at]))
                  ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " group " << group << " item " << item
                                << " (no zone) head " << g << " dim " << d << ": output changed from "
                                << bf16_to_f32(out[at]) << " to " << bf16_to_f32(got[at]);
                continue;
              }
              const double expect = num[d] / den, value = bf16_to_f32(got[at]);
              moved = std::max(moved, std::abs(expect - bf16_to_f32(out[at])));
              if (bad.report(std::abs(value - expect) <= 1e-2 * std::abs(expect) + 1e-3))
                ADD_FAILURE() << "hd " << head_dim << " ps " << page_size << " group " << group << " item " << item
                              << " head " << g << " dim " << d << ": " << value << ", expected " << expect
                              << " (attention alone " << bf16_to_f32(out[at]) << ")";
            }
          }
        }
        EXPECT_GT(moved, 0.05) << "the estimation barely moves the output: the test would not see it";
        EXPECT_EQ(bad.count(), 0) << "hd " << head_dim << " ps " << page_size << " group " << group;
      }
}

// --- Parameters ---------------------------------------------------------------------------------

// Launches `launch` on a copy of `valid` with one change applied: one bad parameter at a time.
template <typename Params, typename Launch>
auto changed_launch(const Params& valid, Launch launch) {
  return [valid, launch](auto change) {
    Params p = valid;
    change(p);
    return launch(p, nullptr);
  };
}

TEST_F(GpuRetroInfer, RejectsBadParams) {
  // Zeroed buffers behind every pointer: a launch that should have been refused reads zeros.
  DeviceArray<uint16_t> buf(std::vector<uint16_t>(size_t{1} << 16, 0));
  DeviceArray<int32_t> ints(std::vector<int32_t>(256, 0));
  CUDA_OK(buf.status());
  CUDA_OK(ints.status());
  __nv_bfloat16* bf = as_bf16(buf.get());
  int32_t* ip = ints.get();
  float* fp = reinterpret_cast<float*>(buf.get());
  const Layout layout(1, 128, 16);
  const cuda::RetroInferRecords records = layout.device(buf.get());
  // Bad records, for every kernel.
  const auto bad_records = [&](auto with) {
    EXPECT_EQ(with([](auto& p) { p.records.kv_pool = nullptr; }), cudaErrorInvalidValue);
    EXPECT_EQ(with([](auto& p) { p.records.kv_pool += 1; }), cudaErrorInvalidValue);  // not 16-byte aligned
    EXPECT_EQ(with([](auto& p) { p.records.num_kv_heads = 0; }), cudaErrorInvalidValue);
    for (int hd : {0, 32, 96, 256})
      EXPECT_EQ(with([&](auto& p) { p.records.head_dim = hd; }), cudaErrorInvalidValue) << "head_dim " << hd;
    for (int ps : {0, 4, 12, 72, 128})
      EXPECT_EQ(with([&](auto& p) { p.records.page_size = ps; }), cudaErrorInvalidValue) << "page_size " << ps;
    EXPECT_EQ(with([](auto& p) { p.records.slots = 0; }), cudaErrorInvalidValue);
    EXPECT_EQ(with([](auto& p) { p.records.records_per_page = 0; }), cudaErrorInvalidValue);
    EXPECT_EQ(with([&](auto& p) { p.records.records_per_page = layout.records_per_page + 1; }), cudaErrorInvalidValue);
  };

  cuda::RetroInferClusterParams cluster;
  cluster.records = records;
  cluster.host_pool = bf;
  cluster.page_ids = ip;
  cluster.page_offsets = ip;
  cluster.first_page = ip;
  cluster.head = ip;
  cluster.dir = ip;
  cluster.dir_offsets = ip;
  cluster.num_jobs = 0;
  cluster.scratch = buf.get();
  EXPECT_EQ(cuda::retroinfer_cluster(cluster, nullptr), cudaSuccess);  // nothing to do
  cuda::RetroInferClusterParams one_job = cluster;
  one_job.num_jobs = 1;
  one_job.total_pages = 1;
  const auto cluster_with = changed_launch(one_job, cuda::retroinfer_cluster);
  bad_records(cluster_with);
  EXPECT_EQ(cluster_with([](auto& p) { p.num_jobs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.num_jobs = 65536; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.total_pages = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.cluster_tokens = 0; }), cudaErrorInvalidValue);
  // 8-token clusters need 2 slots a 16-token page: k would outgrow the segment's slots.
  EXPECT_EQ(cluster_with([](auto& p) { p.cluster_tokens = 8; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.iterations = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.page_ids = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.page_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.first_page = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.head = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.dir = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.dir_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(cluster_with([](auto& p) { p.scratch = nullptr; }), cudaErrorInvalidValue);

  cuda::RetroInferSelectParams select;
  select.records = records;
  select.q = bf;
  select.dir = ip;
  select.dir_offsets = ip;
  select.clustered_pages = ip;
  select.first_candidate = ip;
  select.end_candidate = ip;
  select.num_seqs = 0;
  select.max_clusters = 4;
  select.max_candidates = 4;
  select.logits = fp;
  select.totals = fp;
  select.page_scores = fp;
  select.selected = ip;
  select.selected_offsets = ip;
  select.selected_counts = ip;
  select.estimate_fraction = 0.5;
  select.zone_flags = reinterpret_cast<uint8_t*>(buf.get());
  select.zone_tallies = ip;
  select.zone_scores = fp;
  select.zone_counts = ip;
  EXPECT_EQ(cuda::retroinfer_score(select, nullptr), cudaSuccess);  // nothing to do
  EXPECT_EQ(cuda::retroinfer_zone(select, nullptr), cudaSuccess);
  cuda::RetroInferSelectParams one_seq = select;
  one_seq.num_seqs = 1;
  const auto score_with = changed_launch(one_seq, cuda::retroinfer_score);
  bad_records(score_with);
  EXPECT_EQ(score_with([](auto& p) { p.num_seqs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.num_seqs = 65536; }), cudaErrorInvalidValue);  // items past the grid
  EXPECT_EQ(score_with([](auto& p) { p.group = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.group = 9; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.max_clusters = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.max_candidates = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.q = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.dir = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.dir_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.clustered_pages = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.first_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.end_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.logits = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.totals = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.page_scores = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.zone_flags = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(score_with([](auto& p) { p.zone_tallies = nullptr; }), cudaErrorInvalidValue);

  const auto zone_with = changed_launch(one_seq, cuda::retroinfer_zone);
  bad_records(zone_with);
  EXPECT_EQ(zone_with([](auto& p) { p.num_seqs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.max_clusters = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.max_candidates = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.num_seqs = 65536; }), cudaErrorInvalidValue);  // items past the grid
  for (double f : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()})
    EXPECT_EQ(zone_with([&](auto& p) { p.estimate_fraction = f; }), cudaErrorInvalidValue) << "fraction " << f;
  EXPECT_EQ(zone_with([](auto& p) { p.dir = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.dir_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.clustered_pages = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.first_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.end_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.totals = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.selected = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.selected_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.selected_counts = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.zone_flags = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.zone_tallies = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.zone_scores = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(zone_with([](auto& p) { p.zone_counts = nullptr; }), cudaErrorInvalidValue);

  cuda::RetroInferEstimateParams estimate;
  estimate.records = records;
  estimate.q = bf;
  estimate.dir = ip;
  estimate.dir_offsets = ip;
  estimate.first_candidate = ip;
  estimate.end_candidate = ip;
  estimate.selected = ip;
  estimate.selected_offsets = ip;
  estimate.selected_counts = ip;
  estimate.zone = ip;
  estimate.zone_offsets = ip;
  estimate.zone_counts = ip;
  estimate.decode_pages = ip;
  estimate.decode_offsets = ip;
  estimate.num_seqs = 0;
  estimate.lse = fp;
  estimate.out = bf;
  estimate.splits = 1;
  estimate.partials = fp;
  EXPECT_EQ(cuda::retroinfer_estimate(estimate, nullptr), cudaSuccess);  // nothing to do
  cuda::RetroInferEstimateParams one_item = estimate;
  one_item.num_seqs = 1;
  const auto estimate_with = changed_launch(one_item, cuda::retroinfer_estimate);
  bad_records(estimate_with);
  EXPECT_EQ(estimate_with([](auto& p) { p.num_seqs = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.group = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.group = 9; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.q = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.dir = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.dir_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.first_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.end_candidate = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.selected = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.selected_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.selected_counts = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.zone = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.zone_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.zone_counts = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.decode_pages = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.decode_offsets = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.lse = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.out = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.partials = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.splits = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(estimate_with([](auto& p) { p.max_candidates = -1; }), cudaErrorInvalidValue);
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace spin
