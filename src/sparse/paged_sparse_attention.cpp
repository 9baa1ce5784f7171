#include "sparse/paged_sparse_attention.h"

#include <algorithm>

#include "base/error.h"
#include "kernels/cpu/attention.h"

namespace spin::sparse {

// Device-tier pages as float pointers: K rows, then V rows.
class PagedSparseAttention::DevicePages final : public PageReader {
 public:
  explicit DevicePages(const kv::HostPageMemory& memory) : memory_(memory) {}
  const float* keys(kv::PageId page) const override {
    return reinterpret_cast<const float*>(memory_.page_data(kv::Tier::Device, page));
  }
  const float* values(kv::PageId page) const override {
    const kv::KvLayout& L = memory_.layout();
    return keys(page) + size_t{L.page_size} * L.head_dim;
  }

 private:
  const kv::HostPageMemory& memory_;
};

namespace {

kv::KvLayout checked_layout(const kv::KvManager& kv, const kv::HostPageMemory& memory,
                            const AttentionShape& shape) {
  const kv::KvLayout& L = kv.config().layout;
  SPIN_CHECK(L.elem == kv::ElemType::F32 && memory.layout().elem == kv::ElemType::F32 &&
                 memory.layout().page_bytes() == L.page_bytes(),
             "paged sparse attention on the CPU needs fp32 pages of the KV manager's layout");
  SPIN_CHECK(shape.n_layers == L.num_layers && shape.n_kv_heads == L.num_kv_heads &&
                 shape.head_dim == L.head_dim,
             "model attention ({} layers, {} KV heads, head_dim {}) does not match the KV store "
             "({}, {}, {})",
             shape.n_layers, shape.n_kv_heads, shape.head_dim, L.num_layers, L.num_kv_heads,
             L.head_dim);
  SPIN_CHECK(shape.n_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
             "{} query heads do not split into groups over {} KV heads", shape.n_heads,
             shape.n_kv_heads);
  return L;
}

// Tokens in logical pages [first, end) when `tokens` are stored.
uint64_t tokens_in(uint32_t first, uint32_t end, uint32_t page_size, uint32_t tokens) {
  const auto upto = [&](uint32_t page) { return std::min<uint64_t>(uint64_t{page} * page_size, tokens); };
  return end > first ? upto(end) - upto(first) : 0;
}

}  // namespace

PagedSparseAttention::PagedSparseAttention(kv::KvManager& kv, const kv::HostPageMemory& memory,
                                           const AttentionShape& shape,
                                           const SparseSettings& settings,
                                           const AlgorithmRegistry& registry)
    : kv_(kv), memory_(memory), shape_(shape) {
  const kv::KvLayout layout = checked_layout(kv, memory, shape);
  algorithm_ = registry.create(settings.algorithm, AlgorithmContext{shape, layout, &settings});
  settings_ = resolve_settings(settings, algorithm_->traits(), shape, kv.config());
  reader_ = std::make_unique<DevicePages>(memory);
  if (settings_.traits.pre_rope_keys) {
    pre_rope_.resize(static_cast<size_t>(shape.n_layers * shape.n_kv_heads));
    pre_rope_first_page_.assign(static_cast<size_t>(shape.n_layers), 0);
  }
  request_ = kv_.create_request();
}

PagedSparseAttention::~PagedSparseAttention() { kv_.release(request_); }

void PagedSparseAttention::forward(int64_t layer, int64_t pos0, int64_t n,
                                   const AttentionTokens& tokens, float* out) {
  store_tokens(static_cast<uint32_t>(layer), pos0, n, tokens);
  if (prefill_done_) {
    decode_attention(static_cast<uint32_t>(layer), static_cast<uint32_t>(pos0), tokens.q, out);
  } else {
    prefill_attention(static_cast<uint32_t>(layer), static_cast<uint32_t>(pos0),
                      static_cast<uint32_t>(n), tokens.q, out);
  }
  if (layer == shape_.n_layers - 1) length_ = pos0 + n;
}

void PagedSparseAttention::store_prefill(int64_t layer, int64_t pos0, int64_t n,
                                         const AttentionTokens& tokens) {
  SPIN_CHECK(!prefill_done_, "paged attention: store_prefill after the prefill ended");
  store_tokens(static_cast<uint32_t>(layer), pos0, n, tokens);
  if (layer == shape_.n_layers - 1) length_ = pos0 + n;
}

void PagedSparseAttention::store_tokens(uint32_t layer, int64_t pos0, int64_t n,
                                        const AttentionTokens& tokens) {
  SPIN_CHECK(layer < shape_.n_layers && n > 0 && pos0 >= 0,
             "paged attention: bad call (layer {}, position {}, {} tokens)", layer, pos0, n);
  const uint32_t l = layer;
  if (layer == 0) {
    SPIN_CHECK(pos0 == length_, "paged attention: write at position {} but {} tokens are stored",
               pos0, length_);
    if (n == 1 && length_ > 0 && !prefill_done_) finish_prefill();
    SPIN_CHECK(!prefill_done_ || n == 1,
               "paged attention: {} tokens in one call after prefill; decode takes one", n);
    SPIN_CHECK(pos0 + n <= kv_.config().max_context,
               "paged attention: {} tokens exceed the KV store's max_context {}", pos0 + n,
               kv_.config().max_context);
    kv_.reserve_tokens(request_, static_cast<uint32_t>(n));
    if (prefill_done_) {
      ++step_;
      const auto tokens_in_context = static_cast<uint32_t>(pos0 + 1);
      last_step_ = StepBudget{
          .context_tokens = tokens_in_context,
          .budget_tokens = settings_.budget_pages(tokens_in_context) * settings_.page_size};
    }
  } else {
    SPIN_CHECK(pos0 + n == kv_.num_tokens(request_),
               "paged attention: layer {} got positions {}..{} but layer 0 stored {} tokens", layer,
               pos0, pos0 + n - 1, kv_.num_tokens(request_));
  }
  kv_.write_tokens(request_, l, static_cast<uint32_t>(pos0), static_cast<uint32_t>(n), tokens.k,
                   tokens.v);
  if (tokens.rope != nullptr) rope_ = tokens.rope;
  if (settings_.traits.pre_rope_keys && l >= settings_.first_dense_layers) {
    SPIN_CHECK(tokens.k_pre_rope != nullptr,
               "sparse algorithm '{}' needs the keys before RoPE, which the caller did not pass",
               settings_.algorithm);
    keep_pre_rope_keys(l, static_cast<uint32_t>(pos0), static_cast<uint32_t>(n), tokens.k_pre_rope);
  }
}

void PagedSparseAttention::finish_prefill() {
  SPIN_CHECK(!prefill_done_, "paged attention: prefill already finished");
  SPIN_CHECK(kv_.num_tokens(request_) == length_,
             "paged attention: prefill ends between layers of a forward pass");
  const uint32_t complete = static_cast<uint32_t>(length_) / settings_.page_size;
  const DecodeWindow first_step = settings_.decode_window(static_cast<uint32_t>(length_) / settings_.page_size);
  for (uint32_t l = settings_.first_dense_layers; l < shape_.n_layers; ++l) index_pages(l, 0, complete, first_step);
  if (settings_.traits.placement != Placement::Device) kv_.finish_prefill(request_);
  prefill_done_ = true;
}

void PagedSparseAttention::keep_pre_rope_keys(uint32_t layer, uint32_t pos0, uint32_t n,
                                              const float* k_pre_rope) {
  const auto n_kv = static_cast<uint32_t>(shape_.n_kv_heads);
  const auto hd = static_cast<size_t>(shape_.head_dim);
  const size_t first_token = size_t{pre_rope_first_page_[layer]} * settings_.page_size;
  for (uint32_t g = 0; g < n_kv; ++g) {
    std::vector<float>& rows = pre_rope_[size_t{layer} * n_kv + g];
    SPIN_CHECK(rows.size() == (pos0 - first_token) * hd,
               "paged attention: pre-RoPE keys of layer {} arrive out of order", layer);
    for (uint32_t i = 0; i < n; ++i) {
      const float* row = k_pre_rope + (size_t{i} * n_kv + g) * hd;
      rows.insert(rows.end(), row, row + hd);
    }
  }
}

void PagedSparseAttention::index_pages(uint32_t layer, uint32_t first_page, uint32_t end_page,
                                       std::optional<DecodeWindow> prompt) {
  if (layer < settings_.first_dense_layers || end_page <= first_page) return;
  const auto n_kv = static_cast<uint32_t>(shape_.n_kv_heads);
  const size_t page_floats = size_t{settings_.page_size} * shape_.head_dim;
  IndexInput in{.layer = layer,
                .first_page = first_page,
                .end_page = end_page,
                .page_keys =
                    [&](uint32_t kv_head, uint32_t page) {
                      const kv::PageId device = kv_.lookup(request_, layer, kv_head, page).device;
                      SPIN_CHECK(device != kv::kNoPage, "page {} to index is not on the device",
                                 page);
                      return reader_->keys(device);
                    },
                .page_keys_pre_rope = nullptr,
                .page_values =
                    [&](uint32_t kv_head, uint32_t page) {
                      const kv::PageId device = kv_.lookup(request_, layer, kv_head, page).device;
                      SPIN_CHECK(device != kv::kNoPage, "page {} to index is not on the device",
                                 page);
                      return reader_->values(device);
                    },
                .rope = rope_,
                .prompt = prompt.has_value(),
                .first_candidate = prompt ? prompt->sink_end : 0,
                .end_candidate = prompt ? std::min(prompt->window_start, end_page) : 0};
  if (settings_.traits.pre_rope_keys) {
    SPIN_CHECK(pre_rope_first_page_[layer] == first_page,
               "paged attention: pages of layer {} indexed out of order", layer);
    in.page_keys_pre_rope = [&](uint32_t kv_head, uint32_t page) {
      const std::vector<float>& rows = pre_rope_[size_t{layer} * n_kv + kv_head];
      const size_t at = (page - first_page) * page_floats;
      SPIN_CHECK(page >= first_page && at + page_floats <= rows.size(),
                 "pre-RoPE keys of page {} are not kept", page);
      return rows.data() + at;
    };
  }
  algorithm_->index(in);
  if (settings_.traits.pre_rope_keys) {
    for (uint32_t g = 0; g < n_kv; ++g) {
      std::vector<float>& rows = pre_rope_[size_t{layer} * n_kv + g];
      rows.erase(rows.begin(),
                 rows.begin() + static_cast<std::ptrdiff_t>((end_page - first_page) * page_floats));
    }
    pre_rope_first_page_[layer] = end_page;
  }
}

void PagedSparseAttention::prefill_attention(uint32_t layer, uint32_t pos0, uint32_t n,
                                             const float* q, float* out) {
  const uint32_t ps = settings_.page_size;
  const auto n_kv = static_cast<uint32_t>(shape_.n_kv_heads);
  const auto hd = static_cast<size_t>(shape_.head_dim);
  const uint32_t n_keys = pos0 + n;
  const uint32_t n_pages = (n_keys + ps - 1) / ps;
  // Each KV head's rows gathered from its pages (all on the device before offload) into one
  // contiguous block, K then V, for the blocked causal kernel: a copy of one layer's K/V of the
  // sequence, small next to the chunk's attention over it.
  std::vector<kv::PageId> pages(size_t{n_kv} * n_pages);
  for (uint32_t g = 0; g < n_kv; ++g) {
    for (uint32_t p = 0; p < n_pages; ++p)
      pages[size_t{g} * n_pages + p] = kv_.lookup(request_, layer, g, p).device;
  }
  std::vector<float> rows(size_t{n_kv} * 2 * n_keys * hd);
  std::vector<cpu::KvHeadRows> heads(n_kv);
  for (uint32_t g = 0; g < n_kv; ++g) {
    const float* k = rows.data() + size_t{g} * 2 * n_keys * hd;
    heads[g] = {k, k + size_t{n_keys} * hd, n_keys};
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (uint32_t g = 0; g < n_kv; ++g) {
    for (uint32_t p = 0; p < n_pages; ++p) {
      const kv::PageId page = pages[size_t{g} * n_pages + p];
      const size_t first = size_t{p} * ps;
      const size_t count = std::min<size_t>(ps, n_keys - first) * hd;
      float* k = rows.data() + size_t{g} * 2 * n_keys * hd;
      std::copy_n(reader_->keys(page), count, k + first * hd);
      std::copy_n(reader_->values(page), count, k + (n_keys + first) * hd);
    }
  }
  cpu::attend_causal(q, n, pos0, heads,
                     {shape_.n_heads, shape_.n_kv_heads, shape_.head_dim, shape_.scale}, out);
}

void PagedSparseAttention::decode_attention(uint32_t layer, uint32_t pos, const float* q,
                                            float* out) {
  const uint32_t ps = settings_.page_size;
  const uint32_t tokens = pos + 1;
  const uint32_t current = pos / ps;
  const auto n_kv = static_cast<uint32_t>(shape_.n_kv_heads);
  const bool dense_layer = layer < settings_.first_dense_layers;
  if (tokens % ps == 0) index_pages(layer, current, current + 1);

  const auto [sink_end, window_start] = settings_.decode_window(current);
  SelectQuery query{.layer = layer,
                    .q = q,
                    .num_kv_heads = n_kv,
                    .group = static_cast<uint32_t>(shape_.n_heads / shape_.n_kv_heads),
                    .context_tokens = tokens,
                    .first_candidate = sink_end,
                    .end_candidate = window_start,
                    .budget_pages = last_step_.budget_tokens / ps,
                    .rope = rope_};
  selected_.clear();
  StepBudget& budget = last_step_;
  if (dense_layer) {
    select_all(query, selected_);
    budget.dense_layer_tokens += uint64_t{tokens} * n_kv;
  } else {
    algorithm_->select(query, selected_, budget);
    SPIN_CHECK(selected_.num_heads() == n_kv, "sparse algorithm '{}' selected for {} KV heads, not {}",
               settings_.algorithm, selected_.num_heads(), n_kv);
    const uint64_t sink_tokens = tokens_in(0, sink_end, ps, tokens);
    const uint64_t window_tokens = tokens_in(window_start, current + 1, ps, tokens);
    for (uint32_t g = 0; g < n_kv; ++g) {
      const auto head = selected_.head(g);
      for (uint32_t p : head) {
        SPIN_CHECK(p >= sink_end && p < window_start,
                   "sparse algorithm '{}' selected page {} outside the candidates {}..{}",
                   settings_.algorithm, p, sink_end, window_start);
      }
      const uint32_t unbudgeted = algorithm_->unbudgeted_pages(g);
      SPIN_CHECK(unbudgeted <= head.size(), "sparse algorithm '{}' reports more unbudgeted pages "
                 "than it selected", settings_.algorithm);
      const auto selected_tokens = static_cast<uint32_t>((head.size() - unbudgeted) * ps);
      budget.selected_tokens += selected_tokens;
      budget.outlier_tokens += uint64_t{unbudgeted} * ps;
      budget.max_selected_per_head = std::max(budget.max_selected_per_head, selected_tokens);
      budget.sink_tokens += sink_tokens;
      budget.window_tokens += window_tokens;
      ++budget.sparse_heads;
      if (trace_ != nullptr) trace_->add(step_, trace_request_, layer, g, head);
    }
  }

  // Attended pages per KV head in ascending order: sinks, selected, window.
  attended_.clear();
  std::vector<uint32_t> pages;
  for (uint32_t g = 0; g < n_kv; ++g) {
    pages.clear();
    for (uint32_t p = 0; p < sink_end; ++p) pages.push_back(p);
    const auto head = selected_.head(g);
    const size_t first_selected = pages.size();
    pages.insert(pages.end(), head.begin(), head.end());
    std::sort(pages.begin() + static_cast<std::ptrdiff_t>(first_selected), pages.end());
    for (uint32_t p = window_start; p <= current; ++p) pages.push_back(p);
    attended_.add_head(pages);
  }
  kv_.retrieve(request_, layer, step_, attended_, device_pages_);
  algorithm_->attend(AttendInput{.shape = shape_,
                                 .page_size = ps,
                                 .layer = layer,
                                 .context_tokens = tokens,
                                 .q = q,
                                 .pages = &attended_,
                                 .device_pages = device_pages_,
                                 .memory = reader_.get(),
                                 .rope = rope_},
                     out);
  if (settings_.traits.placement == Placement::Stream) kv_.drop_layer(request_, layer);
}

}  // namespace spin::sparse
