// `shadowkv` (Sun et al., 2024). Partition = chunk = one page (8 tokens by the paper; the store's
// page size here, so run it on a store with page_size 8).
//  - Index at prefill, per layer: the pre-RoPE keys of all KV heads side by side ([T, n_kv·hd],
//    as the paper factorises a layer's keys) get a rank-r SVD, K ≈ A·Vᵀ, through the eigenvectors
//    of KᵀK (LAPACK dsyev in double). A [T, r] and V [n_kv·hd, r] are the device-tier factors.
//    Landmark = mean post-RoPE key of each chunk; per KV head the `outliers` chunks whose keys
//    have the lowest minimum cosine similarity to their landmark are always selected (exact keys).
//    They are picked among the prompt chunks outside the sinks and the first decode step's window
//    (as the paper's code, which leaves those out of the landmarks' range), so every outlier stays
//    a candidate and each step keeps the same number of them.
//    Pages filled during decode keep their exact keys: the factors describe the prompt's keys
//    only (as in the paper, where generated tokens stay in full precision on the GPU); they get
//    landmarks and compete for the budget like prompt chunks.
//  - Select per KV head: softmax(q·landmarks/√d) over the candidates for each query head, max
//    over the GQA group; outlier chunks always, then the top chunks within the budget.
//  - Attention: exact keys for sinks, window, outliers and decode chunks; keys of the other
//    selected (prompt) chunks rebuilt from the factors, RoPE applied at their positions; values
//    from the fetched pages.
// Rank: the paper uses 160 of Llama-3-8B's 1024 key dims per layer (8 KV heads × 128), i.e.
// 15.6%. For another model r = min(160, ceil(0.15625·n_kv·hd) rounded up to a multiple of 8):
// SmolLM2-135M (3 × 64 = 192 dims) gets r = 32. `SparseSettings::shadowkv_rank` overrides it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/paged_attention.h"
#include "model/rope.h"
#include "sparse/algorithm.h"

extern "C" void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda,
                       double* w, double* work, const int* lwork, int* info);

namespace spin::sparse {
namespace {

// Top `rank` eigenvectors (largest eigenvalue first) of the symmetric n×n matrix `gram`
// (row-major), as columns of an n×rank row-major matrix.
std::vector<double> top_eigenvectors(std::vector<double> gram, int n, int rank) {
  std::vector<double> values(static_cast<size_t>(n));
  int info = 0, lwork = -1;
  double query = 0.0;
  dsyev_("V", "U", &n, gram.data(), &n, values.data(), &query, &lwork, &info);
  lwork = static_cast<int>(query);
  std::vector<double> work(static_cast<size_t>(std::max(lwork, 1)));
  dsyev_("V", "U", &n, gram.data(), &n, values.data(), work.data(), &lwork, &info);
  SPIN_CHECK(info == 0, "shadowkv: the key SVD did not converge (LAPACK dsyev info {})", info);
  // Column-major eigenvectors in ascending eigenvalue order: column j at gram[j*n ..].
  std::vector<double> out(static_cast<size_t>(n) * rank);
  for (int j = 0; j < rank; ++j) {
    const double* column = gram.data() + static_cast<size_t>(n - 1 - j) * n;
    for (int i = 0; i < n; ++i) out[static_cast<size_t>(i) * rank + j] = column[i];
  }
  return out;
}

class ShadowKvAlgorithm final : public SparseAlgorithm {
 public:
  explicit ShadowKvAlgorithm(const AlgorithmContext& context)
      : head_dim_(static_cast<uint32_t>(context.shape.head_dim)),
        num_kv_heads_(static_cast<uint32_t>(context.shape.n_kv_heads)),
        page_size_(context.layout.page_size),
        outliers_(context.settings->shadowkv_outliers),
        layers_(static_cast<size_t>(context.shape.n_layers)),
        rank_(shadowkv_rank(*context.settings, context.shape)) {
    const uint32_t width = num_kv_heads_ * head_dim_;
    SPIN_CHECK(rank_ <= width, "shadowkv: rank {} exceeds the {} key dimensions of a layer", rank_,
               width);
  }

  AlgorithmTraits traits() const override {
    return {.placement = Placement::Offload,
            .max_unbudgeted_pages = outliers_,  // outlier chunks are selected outside the budget
            .pre_rope_keys = true,
            .window_tokens = 4 * page_size_};  // 4 recent chunks
  }

  void index(const IndexInput& in) override {
    Layer& L = layers_[in.layer];
    const uint32_t width = num_kv_heads_ * head_dim_;
    SPIN_CHECK(L.pages == in.first_page, "shadowkv: page {} of layer {} indexed out of order",
               in.first_page, in.layer);
    const uint32_t new_pages = in.end_page - in.first_page;
    const size_t new_tokens = size_t{new_pages} * page_size_;
    // Only the prompt (the pages indexed when prefill ends) is factorised. Projecting later keys
    // on the prompt's basis would rebuild them from a subspace fitted without them: the error
    // then grows with every generated chunk, and those recent chunks draw the most attention.
    // A prompt shorter than a chunk has no prompt Index: nothing is factorised.
    if (in.prompt && L.basis.empty()) {
      // Pre-RoPE keys of the prompt, [token][kv_head·hd].
      std::vector<float> keys(new_tokens * width);
      for (uint32_t g = 0; g < num_kv_heads_; ++g) {
        for (uint32_t p = 0; p < new_pages; ++p) {
          const float* k = in.page_keys_pre_rope(g, in.first_page + p);
          for (uint32_t t = 0; t < page_size_; ++t) {
            std::copy(k + size_t{t} * head_dim_, k + size_t{t + 1} * head_dim_,
                      keys.data() + (size_t{p} * page_size_ + t) * width + size_t{g} * head_dim_);
          }
        }
      }
      // KᵀK in double, then its top eigenvectors are K's right singular vectors.
      std::vector<double> gram(size_t{width} * width, 0.0);
      for (size_t t = 0; t < new_tokens; ++t) {
        const float* row = keys.data() + t * width;
        for (uint32_t i = 0; i < width; ++i) {
          const double ri = row[i];
          double* g = gram.data() + size_t{i} * width;
          for (uint32_t j = i; j < width; ++j) g[j] += ri * row[j];
        }
      }
      for (uint32_t i = 0; i < width; ++i)
        for (uint32_t j = 0; j < i; ++j) gram[size_t{i} * width + j] = gram[size_t{j} * width + i];
      L.basis = top_eigenvectors(std::move(gram), static_cast<int>(width), static_cast<int>(rank_));
      // A = K·V (double accumulation; stored in double so that a full-rank factorisation
      // reproduces the keys to rounding).
      L.coeffs.assign(new_tokens * rank_, 0.0);
      for (size_t t = 0; t < new_tokens; ++t) {
        const float* row = keys.data() + t * width;
        double* a = L.coeffs.data() + t * rank_;
        for (uint32_t i = 0; i < width; ++i) {
          const double* v = L.basis.data() + size_t{i} * rank_;
          for (uint32_t j = 0; j < rank_; ++j) a[j] += row[i] * v[j];
        }
      }
      L.factored_pages = in.end_page;
    }
    // Landmarks (mean post-RoPE key per chunk) and each chunk's minimum cosine to it.
    L.landmarks.resize(num_kv_heads_);
    std::vector<std::pair<float, uint32_t>> min_cos;
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      std::vector<float>& lm = L.landmarks[g];
      min_cos.clear();
      for (uint32_t p = in.first_page; p < in.end_page; ++p) {
        const float* k = in.page_keys(g, p);
        const size_t off = lm.size();
        lm.resize(off + head_dim_, 0.0f);
        float* mean = lm.data() + off;
        for (uint32_t t = 0; t < page_size_; ++t)
          for (uint32_t d = 0; d < head_dim_; ++d) mean[d] += k[size_t{t} * head_dim_ + d];
        for (uint32_t d = 0; d < head_dim_; ++d) mean[d] /= static_cast<float>(page_size_);
        double worst = std::numeric_limits<double>::infinity();
        for (uint32_t t = 0; t < page_size_; ++t) worst = std::min(worst, cosine(k + size_t{t} * head_dim_, mean));
        min_cos.emplace_back(static_cast<float>(worst), p);
      }
      // Outliers come from the prompt only: decode pages sit in the window when they are new.
      L.outlier.resize(num_kv_heads_);
      L.outlier[g].resize(in.end_page, 0);
      if (in.prompt) {
        std::erase_if(min_cos, [&](const auto& c) {
          return c.second < in.first_candidate || c.second >= in.end_candidate;
        });
        const size_t keep = std::min<size_t>(outliers_, min_cos.size());
        std::partial_sort(min_cos.begin(), min_cos.begin() + static_cast<std::ptrdiff_t>(keep),
                          min_cos.end());
        for (size_t i = 0; i < keep; ++i) L.outlier[g][min_cos[i].second] = 1;
      }
    }
    L.pages = in.end_page;
  }

  void select(const SelectQuery& query, kv::LayerSelection& out, StepBudget&) override {
    const Layer& L = layers_[query.layer];
    // No candidates yet (sinks cover the context) is not an error, even before any Index.
    SPIN_CHECK(query.end_candidate <= query.first_candidate || query.end_candidate <= L.pages,
               "shadowkv: page {} of layer {} selected before it was indexed", query.end_candidate - 1, query.layer);
    const uint32_t first = query.first_candidate, n = query.end_candidate - first;
    unbudgeted_.assign(query.num_kv_heads, 0);
    rebuilt_.assign(query.num_kv_heads, {});
    selected_layer_ = query.layer;
    std::vector<float> scores(n), probs(n);
    std::vector<uint32_t> chosen, order;
    for (uint32_t g = 0; g < query.num_kv_heads; ++g) {
      chosen.clear();
      order.clear();
      for (uint32_t p = first; p < query.end_candidate; ++p) {
        if (L.outlier[g][p]) {
          chosen.push_back(p);
        } else {
          order.push_back(p);
        }
      }
      unbudgeted_[g] = static_cast<uint32_t>(chosen.size());
      const size_t keep = std::min<size_t>(query.budget_pages, order.size());
      if (keep < order.size()) {
        chunk_scores(query, g, scores, probs);
        keep_top(order, keep, [&](uint32_t p) { return scores[p - first]; });
      }
      for (uint32_t p : order)
        if (p < L.factored_pages) rebuilt_[g].push_back(p);
      std::sort(rebuilt_[g].begin(), rebuilt_[g].end());
      chosen.insert(chosen.end(), order.begin(), order.end());
      out.add_head(chosen);
    }
  }

  uint32_t unbudgeted_pages(uint32_t kv_head) const override { return unbudgeted_.at(kv_head); }

  // Per candidate chunk: max over the group of each query head's softmax(q·landmark/√d).
  void chunk_scores(const SelectQuery& query, uint32_t g, std::span<float> scores,
                    std::span<float> probs) const {
    const Layer& L = layers_[query.layer];
    const uint32_t first = query.first_candidate, n = query.end_candidate - first;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    std::fill(scores.begin(), scores.begin() + n, 0.0f);
    for (uint32_t h = g * query.group; h < (g + 1) * query.group; ++h) {
      const float* q = query.q + size_t{h} * head_dim_;
      for (uint32_t i = 0; i < n; ++i) {
        const float* lm = L.landmarks[g].data() + size_t{first + i} * head_dim_;
        float dot = 0.0f;
        for (uint32_t d = 0; d < head_dim_; ++d) dot += q[d] * lm[d];
        probs[i] = dot * scale;
      }
      cpu::softmax(probs.data(), n);
      for (uint32_t i = 0; i < n; ++i) scores[i] = std::max(scores[i], probs[i]);
    }
  }

  void attend(const AttendInput& in, float* out) override {
    if (in.layer != selected_layer_) return attend_pages(in, out);  // a dense layer
    SPIN_CHECK(in.rope != nullptr, "shadowkv needs the model's RoPE to rebuild keys");
    const Layer& L = layers_[in.layer];
    const int64_t hd = in.shape.head_dim;
    const int64_t group = in.shape.n_heads / in.shape.n_kv_heads;
    const uint32_t ps = in.page_size;
    const uint32_t last_page = (in.context_tokens - 1) / ps;
    const uint32_t last_tokens = in.context_tokens - last_page * ps;
    for (uint32_t g = 0; g < num_kv_heads_; ++g) {
      const auto logical = in.pages->head(g);
      const uint32_t offset = in.pages->offsets[g];
      const std::vector<uint32_t>& rebuild = rebuilt_[g];
      rebuilt_keys_.resize(rebuild.size() * ps * hd);
      std::vector<cpu::KvPageView> views(logical.size());
      size_t r = 0;
      for (size_t i = 0; i < logical.size(); ++i) {
        const uint32_t p = logical[i];
        const kv::PageId page = in.device_pages[offset + i];
        const float* keys = in.memory->keys(page);
        if (r < rebuild.size() && rebuild[r] == p) {
          float* k = rebuilt_keys_.data() + r * ps * hd;
          for (uint32_t t = 0; t < ps; ++t) {
            const double* a = L.coeffs.data() + (size_t{p} * ps + t) * rank_;
            float* row = k + size_t{t} * hd;
            for (uint32_t d = 0; d < head_dim_; ++d) {
              const double* v = L.basis.data() + (size_t{g} * head_dim_ + d) * rank_;
              double sum = 0.0;
              for (uint32_t j = 0; j < rank_; ++j) sum += a[j] * v[j];
              row[d] = static_cast<float>(sum);
            }
            cpu::rope(row, 1, hd, int64_t{p} * ps + t, in.rope->inv_freq.data(), in.rope->mscale,
                      in.rope->neox);
          }
          keys = k;
          ++r;
        }
        views[i] = {keys, in.memory->values(page), p == last_page ? last_tokens : ps};
      }
      std::vector<float> scratch(cpu::paged_attention_scratch(group, ps));
      cpu::attend_group_pages(in.q + g * group * hd, group, views, hd, in.shape.scale,
                              out + g * group * hd, scratch.data());
    }
  }

  uint64_t summary_bytes() const override {
    // Stored as the device tier would hold them: fp32 factors and landmarks.
    uint64_t floats = 0;
    for (const Layer& L : layers_) {
      floats += L.basis.size() + L.coeffs.size();
      for (const auto& lm : L.landmarks) floats += lm.size();
    }
    return floats * sizeof(float);
  }

 private:
  struct Layer {
    uint32_t pages = 0;
    uint32_t factored_pages = 0;  // pages [0, factored_pages) have factors (the prompt)
    std::vector<double> basis;   // V: [n_kv·hd][rank]
    std::vector<double> coeffs;  // A: [token][rank], prompt tokens
    std::vector<std::vector<float>> landmarks;  // per KV head: [page][hd]
    std::vector<std::vector<uint8_t>> outlier;  // per KV head: per page, 1 if an outlier chunk
  };

  double cosine(const float* a, const float* b) const {
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (uint32_t d = 0; d < head_dim_; ++d) {
      ab += double{a[d]} * b[d];
      aa += double{a[d]} * a[d];
      bb += double{b[d]} * b[d];
    }
    return aa > 0.0 && bb > 0.0 ? ab / std::sqrt(aa * bb) : 1.0;
  }

  uint32_t head_dim_;
  uint32_t num_kv_heads_;
  uint32_t page_size_;
  uint32_t outliers_;
  std::vector<Layer> layers_;
  uint32_t rank_;
  // Latest select (one layer at a time): outliers and rebuilt chunks per KV head.
  uint32_t selected_layer_ = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> unbudgeted_;
  std::vector<std::vector<uint32_t>> rebuilt_;
  std::vector<float> rebuilt_keys_;
};

}  // namespace

uint32_t shadowkv_rank(const SparseSettings& settings, const AttentionShape& shape) {
  if (settings.shadowkv_rank != 0) return settings.shadowkv_rank;
  const auto width = static_cast<uint32_t>(shape.n_kv_heads * shape.head_dim);
  const uint32_t published = std::min<uint32_t>(160, (width * 5 + 31) / 32);
  return std::min(width, (published + 7) / 8 * 8);
}

void register_shadowkv(AlgorithmRegistry& registry) {
  registry.add("shadowkv", [](const AlgorithmContext& context) {
    return std::make_unique<ShadowKvAlgorithm>(context);
  });
}

}  // namespace spin::sparse
