// `retroinfer` (Chen et al., 2025). Partition = cluster of tokens (~16 on average).
//  - Index per (layer, KV head): keys (RoPE applied) are mean-centred per segment (one segment
//    per `retroinfer_segment_tokens`, 8K) and clustered by k-means with inner-product assignment,
//    10 iterations, one cluster per `retroinfer_cluster_tokens` (16) tokens; initial centroids are
//    evenly spaced tokens of the segment (deterministic). Kept per cluster: centroid (the mean
//    key, centring undone), value sum, size, token list; per token its cluster. Clusters are
//    numbered by segment, then by k-means index (empty ones dropped). Pages filled during decode
//    wait unclustered (always attended, reported as outliers); when a page completes and at least
//    `retroinfer_recluster_tokens` (1024) tokens of complete pages wait before it, those form a
//    new segment (the page that just completed waits for the next one: its keys of every layer
//    exist only once the step has run, which is when the CUDA store clusters).
//  - Clusters on the page substrate: a cluster is a list of token positions; retrieving it means
//    retrieving the pages that hold those tokens. Select scores clusters by softmax(q·centroid·s)
//    summed over the GQA group, and a page by the attention its tokens are estimated to take: each
//    token its cluster's score over the cluster's size. The exact zone is the budget's pages of
//    highest score (ties: the lower page); every token of a retrieved page is attended exactly.
//    The estimation zone is the `retroinfer_estimate_fraction` (23.2%) of the clusters, the best
//    of those with a token that no attended page holds (ties: the lower cluster).
//  - Attention (own): exact softmax over the attended pages (4 sinks → the first page, 64 recent
//    tokens, selected pages) plus, for each estimation cluster, its tokens that no attended page
//    holds, as one term: weight |c'|·exp(q·centroid·s), value sum Σ_{t∈c'} v_t (cluster value sum
//    minus the values of its attended tokens, read from the fetched pages). A budget covering the
//    context leaves no cluster to estimate, so it is exact.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/error.h"
#include "kernels/cpu/ops.h"
#include "sparse/algorithm.h"

namespace spin::sparse {
namespace {

class RetroInferAlgorithm final : public SparseAlgorithm {
 public:
  explicit RetroInferAlgorithm(const AlgorithmContext& context)
      : head_dim_(static_cast<uint32_t>(context.shape.head_dim)),
        num_kv_heads_(static_cast<uint32_t>(context.shape.n_kv_heads)),
        page_size_(context.layout.page_size),
        segment_tokens_(context.settings->retroinfer_segment_tokens),
        cluster_tokens_(context.settings->retroinfer_cluster_tokens),
        recluster_tokens_(context.settings->retroinfer_recluster_tokens),
        estimate_fraction_(context.settings->retroinfer_estimate_fraction),
        streams_(static_cast<size_t>(context.shape.n_layers * context.shape.n_kv_heads)) {
    SPIN_CHECK(segment_tokens_ >= page_size_ && cluster_tokens_ > 0 && recluster_tokens_ > 0,
               "retroinfer: segment ({}), cluster ({}) and re-cluster ({}) sizes must be > 0 and "
               "the segment at least a page",
               segment_tokens_, cluster_tokens_, recluster_tokens_);
    SPIN_CHECK(estimate_fraction_ >= 0.0 && estimate_fraction_ <= 1.0,
               "retroinfer: estimate fraction {} is outside [0, 1]", estimate_fraction_);
  }

  AlgorithmTraits traits() const override {
    // Decode pages wait unclustered (selected outside the budget) until they make up a
    // re-clustering segment: fewer than recluster_tokens_ worth of pages at any step.
    return {.placement = Placement::Offload,
            .max_unbudgeted_pages = (recluster_tokens_ + page_size_ - 1) / page_size_,
            .sink_tokens = 4,
            .window_tokens = 64};
  }

  void index(const IndexInput& in) override {
    const uint32_t segment_pages = std::max(1u, segment_tokens_ / page_size_);
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      Stream& s = stream(in.layer, g);
      SPIN_CHECK(s.pages == in.first_page, "retroinfer: page {} of layer {} indexed out of order",
                 in.first_page, in.layer);
      for (uint32_t p = in.first_page; p < in.end_page; ++p) {
        const float* k = in.page_keys(g, p);
        const float* v = in.page_values(g, p);
        s.keys.insert(s.keys.end(), k, k + size_t{page_size_} * head_dim_);
        s.values.insert(s.values.end(), v, v + size_t{page_size_} * head_dim_);
      }
      s.pages = in.end_page;
      // The prompt is clustered whole; decode pages once enough wait before the new ones.
      const uint32_t end = in.prompt ? s.pages : in.first_page;
      if (in.prompt || (end - s.clustered_pages) * page_size_ >= recluster_tokens_) {
        while (s.clustered_pages < end) {
          const uint32_t segment_end = std::min(end, s.clustered_pages + segment_pages);
          cluster_segment(s, s.clustered_pages, segment_end);
          s.clustered_pages = segment_end;
        }
        // Clustered pages live on in their cluster summaries only.
        const size_t drop = size_t{s.clustered_pages - s.buffered_from} * page_size_ * head_dim_;
        s.keys.erase(s.keys.begin(), s.keys.begin() + static_cast<std::ptrdiff_t>(drop));
        s.values.erase(s.values.begin(), s.values.begin() + static_cast<std::ptrdiff_t>(drop));
        s.buffered_from = s.clustered_pages;
      }
    }
  }

  void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget& budget) override {
    const uint32_t first = query.first_candidate, end = query.end_candidate;
    selected_layer_ = query.layer;
    unbudgeted_.assign(query.num_kv_heads, 0);
    estimated_.assign(query.num_kv_heads, {});
    std::vector<uint32_t> chosen, order;
    std::vector<float> page_score;
    std::vector<uint8_t> missing;
    for (uint32_t g = 0; g < query.num_kv_heads; ++g) {
      const Stream& s = stream(query.layer, g);
      SPIN_CHECK(first >= end || end <= s.pages, "retroinfer: page {} of layer {} selected before it was indexed",
                 end - 1, query.layer);
      const auto n_clusters = static_cast<uint32_t>(s.sizes.size());
      const std::vector<float> total = cluster_totals(query, g);
      page_mark_.assign(s.pages, 0);
      chosen.clear();
      // Unclustered decode pages: always attended, outside the budget.
      const uint32_t clustered_end = std::clamp(s.clustered_pages, first, end);
      for (uint32_t p = clustered_end; p < end; ++p) chosen.push_back(p);
      unbudgeted_[g] = static_cast<uint32_t>(chosen.size());
      // Exact zone: the clustered candidates of most estimated attention.
      const uint32_t n = clustered_end - first;
      page_score.assign(n, 0.0f);
      for (uint32_t i = 0; i < n; ++i) {
        float mass = 0.0f;
        for (uint32_t t = (first + i) * page_size_; t < (first + i + 1) * page_size_; ++t) {
          const uint32_t c = s.cluster_of[t];
          mass += total[c] / static_cast<float>(s.sizes[c]);
        }
        page_score[i] = mass;
      }
      order.resize(n);
      std::iota(order.begin(), order.end(), 0u);
      keep_top(order, std::min(n, query.budget_pages), [&](uint32_t i) { return page_score[i]; });
      for (uint32_t i : order) chosen.push_back(first + i);
      for (uint32_t p : chosen) page_mark_[p] = 1;
      // Estimation zone: the best clusters with a token on a clustered candidate left out.
      missing.assign(n_clusters, 0);
      for (uint32_t p = first; p < clustered_end; ++p) {
        if (page_mark_[p]) continue;
        for (uint32_t t = p * page_size_; t < (p + 1) * page_size_; ++t) missing[s.cluster_of[t]] = 1;
      }
      std::vector<uint32_t>& zone = estimated_[g];
      for (uint32_t c = 0; c < n_clusters; ++c) {
        if (missing[c]) zone.push_back(c);
      }
      keep_top(zone, std::min<size_t>(zone.size(), static_cast<size_t>(std::ceil(estimate_fraction_ * n_clusters))),
               [&](uint32_t c) { return total[c]; });
      for (uint32_t c : zone) {
        for (uint32_t t : s.tokens[c]) budget.estimated_tokens += !attended(t / page_size_, first, end);
      }
      std::sort(chosen.begin(), chosen.end());
      out.add_head(chosen);
    }
  }

  uint32_t unbudgeted_pages(uint32_t kv_head) const override { return unbudgeted_.at(kv_head); }

  void attend(const AttendInput& in, float* out) override {
    if (in.layer != selected_layer_) return attend_pages(in, out);  // a dense layer
    const uint32_t hd = head_dim_, ps = in.page_size;
    const uint32_t group = static_cast<uint32_t>(in.shape.n_heads / in.shape.n_kv_heads);
    const uint32_t last_page = (in.context_tokens - 1) / ps;
    std::vector<double> logits, acc(hd);
    std::vector<float> est_value(hd);
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      const Stream& s = stream(in.layer, g);
      const auto logical = in.pages->head(g);
      const uint32_t offset = in.pages->offsets[g];
      // Logical page -> index in the attended list.
      slot_.assign(size_t{last_page} + 1, kNone);
      for (uint32_t i = 0; i < logical.size(); ++i) slot_[logical[i]] = i;
      // Estimation terms: (log weight without the query, remaining value sum).
      struct Estimate {
        uint32_t cluster;
        double log_size;
        std::vector<float> value_sum;
      };
      std::vector<Estimate> estimates;
      for (uint32_t c : estimated_[g]) {
        Estimate e{c, 0.0, std::vector<float>(s.value_sums.begin() + size_t{c} * hd,
                                              s.value_sums.begin() + size_t{c + 1} * hd)};
        uint32_t size = s.sizes[c];
        for (uint32_t t : s.tokens[c]) {
          const uint32_t p = t / ps;
          if (p > last_page || slot_[p] == kNone) continue;
          const float* v = in.memory->values(in.device_pages[offset + slot_[p]]) + size_t{t % ps} * hd;
          for (uint32_t d = 0; d < hd; ++d) e.value_sum[d] -= v[d];
          --size;
        }
        if (size == 0) continue;
        e.log_size = std::log(static_cast<double>(size));
        estimates.push_back(std::move(e));
      }
      for (uint32_t h = g * group; h < (g + 1) * group; ++h) {
        const float* q = in.q + size_t{h} * hd;
        logits.clear();
        double best = -std::numeric_limits<double>::infinity();
        for (uint32_t i = 0; i < logical.size(); ++i) {
          const float* k = in.memory->keys(in.device_pages[offset + i]);
          const uint32_t n = logical[i] == last_page ? in.context_tokens - last_page * ps : ps;
          for (uint32_t t = 0; t < n; ++t) {
            double dot = 0.0;
            for (uint32_t d = 0; d < hd; ++d) dot += double{q[d]} * k[size_t{t} * hd + d];
            logits.push_back(dot * in.shape.scale);
            best = std::max(best, logits.back());
          }
        }
        const size_t exact = logits.size();
        for (const Estimate& e : estimates) {
          const float* c = s.centroids.data() + size_t{e.cluster} * hd;
          double dot = 0.0;
          for (uint32_t d = 0; d < hd; ++d) dot += double{q[d]} * c[d];
          logits.push_back(dot * in.shape.scale);
          best = std::max(best, logits.back() + e.log_size);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0.0;
        size_t j = 0;
        for (uint32_t i = 0; i < logical.size(); ++i) {
          const float* v = in.memory->values(in.device_pages[offset + i]);
          const uint32_t n = logical[i] == last_page ? in.context_tokens - last_page * ps : ps;
          for (uint32_t t = 0; t < n; ++t, ++j) {
            const double w = std::exp(logits[j] - best);
            denom += w;
            for (uint32_t d = 0; d < hd; ++d) acc[d] += w * v[size_t{t} * hd + d];
          }
        }
        for (size_t e = 0; e < estimates.size(); ++e) {
          const double w = std::exp(logits[exact + e] - best);  // per token of the cluster
          denom += w * std::exp(estimates[e].log_size);
          for (uint32_t d = 0; d < hd; ++d) acc[d] += w * estimates[e].value_sum[d];
        }
        float* o = out + size_t{h} * hd;
        for (uint32_t d = 0; d < hd; ++d) o[d] = static_cast<float>(acc[d] / denom);
      }
    }
  }

  uint64_t summary_bytes() const override {
    uint64_t bytes = 0;
    for (const Stream& s : streams_) {
      bytes += (s.centroids.size() + s.value_sums.size()) * sizeof(float);
      bytes += s.sizes.size() * sizeof(uint32_t);
      for (const auto& t : s.tokens) bytes += t.size() * sizeof(uint32_t);
      bytes += s.cluster_of.size() * sizeof(uint32_t);
    }
    return bytes;
  }

 private:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

  struct Stream {
    uint32_t pages = 0;            // indexed pages
    uint32_t clustered_pages = 0;  // pages [0, clustered_pages) are in clusters
    uint32_t buffered_from = 0;    // first page held in keys/values below
    std::vector<float> keys, values;  // pages [buffered_from, pages) not yet summarised
    std::vector<float> centroids;     // [cluster][hd], centring undone
    std::vector<float> value_sums;    // [cluster][hd]
    std::vector<uint32_t> sizes;
    std::vector<std::vector<uint32_t>> tokens;  // ascending positions per cluster
    std::vector<uint32_t> cluster_of;           // per token of the clustered pages
  };

  Stream& stream(uint32_t layer, uint32_t g) { return streams_[size_t{layer} * num_kv_heads_ + g]; }
  const Stream& stream(uint32_t layer, uint32_t g) const {
    return streams_[size_t{layer} * num_kv_heads_ + g];
  }

  bool attended(uint32_t page, uint32_t first, uint32_t end) const {
    return page < first || page >= end || page_mark_[page];
  }

  // k-means over pages [first_page, end_page) of the stream (held in s.keys/s.values).
  void cluster_segment(Stream& s, uint32_t first_page, uint32_t end_page) {
    const uint32_t hd = head_dim_;
    const uint32_t n = (end_page - first_page) * page_size_;
    const uint32_t k = std::max(1u, n / cluster_tokens_);
    const size_t base = size_t{first_page - s.buffered_from} * page_size_;
    const float* keys = s.keys.data() + base * hd;
    const float* values = s.values.data() + base * hd;
    std::vector<float> mean(hd, 0.0f), x(size_t{n} * hd), c(size_t{k} * hd), scores(size_t{n} * k);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t d = 0; d < hd; ++d) mean[d] += keys[size_t{t} * hd + d];
    for (float& m : mean) m /= static_cast<float>(n);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t d = 0; d < hd; ++d) x[size_t{t} * hd + d] = keys[size_t{t} * hd + d] - mean[d];
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t t = static_cast<uint32_t>(uint64_t{j} * n / k);
      std::copy(x.begin() + size_t{t} * hd, x.begin() + size_t{t + 1} * hd, c.begin() + size_t{j} * hd);
    }
    std::vector<uint32_t> assign(n, 0), counts(k);
    for (int iter = 0; iter < 10; ++iter) {
      cpu::matmul_nt(x.data(), c.data(), scores.data(), n, k, hd);
      for (uint32_t t = 0; t < n; ++t) {
        const float* row = scores.data() + size_t{t} * k;
        assign[t] = static_cast<uint32_t>(std::max_element(row, row + k) - row);
      }
      std::vector<double> sums(size_t{k} * hd, 0.0);
      std::fill(counts.begin(), counts.end(), 0u);
      for (uint32_t t = 0; t < n; ++t) {
        ++counts[assign[t]];
        for (uint32_t d = 0; d < hd; ++d) sums[size_t{assign[t]} * hd + d] += x[size_t{t} * hd + d];
      }
      for (uint32_t j = 0; j < k; ++j) {
        if (counts[j] == 0) continue;  // an empty cluster keeps its centroid
        for (uint32_t d = 0; d < hd; ++d)
          c[size_t{j} * hd + d] = static_cast<float>(sums[size_t{j} * hd + d] / counts[j]);
      }
    }
    // Summaries of the non-empty clusters after the last assignment, numbered in k-means order.
    const uint32_t first_token = first_page * page_size_;
    std::vector<uint32_t> id(k, kNone);
    for (uint32_t j = 0; j < k; ++j) {
      if (counts[j] == 0) continue;
      id[j] = static_cast<uint32_t>(s.sizes.size());
      s.sizes.push_back(0);
      s.tokens.emplace_back();
      s.centroids.resize(s.centroids.size() + hd, 0.0f);
      s.value_sums.resize(s.value_sums.size() + hd, 0.0f);
    }
    s.cluster_of.resize(size_t{end_page} * page_size_);
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t cid = id[assign[t]];
      s.cluster_of[first_token + t] = cid;
      ++s.sizes[cid];
      s.tokens[cid].push_back(first_token + t);
      float* centroid = s.centroids.data() + size_t{cid} * hd;
      float* vsum = s.value_sums.data() + size_t{cid} * hd;
      for (uint32_t d = 0; d < hd; ++d) {
        centroid[d] += keys[size_t{t} * hd + d];
        vsum[d] += values[size_t{t} * hd + d];
      }
    }
    for (uint32_t j = 0; j < k; ++j) {
      if (id[j] == kNone) continue;
      float* centroid = s.centroids.data() + size_t{id[j]} * hd;
      for (uint32_t d = 0; d < hd; ++d) centroid[d] /= static_cast<float>(s.sizes[id[j]]);
    }
  }

  // Per cluster: softmax(q·centroid·scale) over the clusters, summed over the GQA group.
  std::vector<float> cluster_totals(const SelectQuery& query, uint32_t g) const {
    const Stream& s = stream(query.layer, g);
    const auto n = static_cast<uint32_t>(s.sizes.size());
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    std::vector<float> total(n, 0.0f), probs(n);
    for (uint32_t h = g * query.group; n > 0 && h < (g + 1) * query.group; ++h) {
      const float* q = query.q + size_t{h} * head_dim_;
      for (uint32_t c = 0; c < n; ++c) {
        const float* x = s.centroids.data() + size_t{c} * head_dim_;
        float dot = 0.0f;
        for (uint32_t d = 0; d < head_dim_; ++d) dot += q[d] * x[d];
        probs[c] = dot * scale;
      }
      cpu::softmax(probs.data(), n);
      for (uint32_t c = 0; c < n; ++c) total[c] += probs[c];
    }
    return total;
  }

  uint32_t head_dim_;
  uint32_t num_kv_heads_;
  uint32_t page_size_;
  uint32_t segment_tokens_;
  uint32_t cluster_tokens_;
  uint32_t recluster_tokens_;
  double estimate_fraction_;
  std::vector<Stream> streams_;
  // Latest select (one layer at a time).
  uint32_t selected_layer_ = kNone;
  std::vector<uint32_t> unbudgeted_;
  std::vector<std::vector<uint32_t>> estimated_;  // per KV head: estimation clusters
  std::vector<uint8_t> page_mark_;
  std::vector<uint32_t> slot_;
};

}  // namespace

void register_retroinfer(AlgorithmRegistry& registry) {
  registry.add("retroinfer", [](const AlgorithmContext& context) {
    return std::make_unique<RetroInferAlgorithm>(context);
  });
}

}  // namespace spin::sparse
