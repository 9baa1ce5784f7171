#include "sparse/settings.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace spin::sparse {

uint32_t ResolvedSettings::budget_pages(uint32_t context_tokens) const {
  const double tokens = budget_fraction > 0.0 ? std::floor(budget_fraction * context_tokens)
                                              : static_cast<double>(budget_tokens);
  const auto pages = static_cast<uint32_t>(tokens / page_size);
  return std::max(pages, traits.min_selected_pages);
}

namespace {

uint32_t whole_pages(const char* what, uint32_t tokens, uint32_t page_size) {
  SPIN_CHECK(tokens % page_size == 0, "sparse settings: {} ({} tokens) must be a multiple of the "
             "page size {}", what, tokens, page_size);
  return tokens / page_size;
}

}  // namespace

DecodeWindow ResolvedSettings::decode_window(uint32_t current_page) const {
  const uint32_t sink_end = std::min(sink_pages, current_page + 1);
  return {sink_end, std::max(sink_end, current_page - std::min(current_page, window_pages))};
}

ResolvedSettings resolve_settings(const SparseSettings& settings, const AlgorithmTraits& traits,
                                  const AttentionShape& shape, const kv::KvConfig& store) {
  const kv::KvLayout& layout = store.layout;
  ResolvedSettings r;
  r.algorithm = settings.algorithm;
  r.traits = traits;
  r.page_size = layout.page_size;
  SPIN_CHECK(settings.page_size == 0 || settings.page_size == layout.page_size,
             "sparse settings: page size {} differs from the KV store's page size {}",
             settings.page_size, layout.page_size);
  SPIN_CHECK(std::isfinite(settings.budget_fraction) && settings.budget_fraction >= 0.0 &&
                 settings.budget_fraction <= 1.0,
             "sparse settings: budget fraction {} is outside (0, 1]", settings.budget_fraction);
  SPIN_CHECK(settings.budget_fraction > 0.0 || settings.budget_tokens > 0,
             "sparse settings: the token budget must be > 0 (tokens or a fraction of the context)");
  r.budget_tokens = settings.budget_tokens;
  r.budget_fraction = settings.budget_fraction;
  const auto pages_up = [&](uint32_t tokens) {
    return (tokens + layout.page_size - 1) / layout.page_size;
  };
  r.sink_pages = settings.sink_tokens
                     ? whole_pages("sink tokens", *settings.sink_tokens, layout.page_size)
                     : traits.sink_tokens ? pages_up(*traits.sink_tokens) : store.sink_pages;
  r.window_pages = settings.window_tokens
                       ? whole_pages("window tokens", *settings.window_tokens, layout.page_size)
                       : traits.window_tokens ? pages_up(*traits.window_tokens) : store.window_pages;
  r.first_dense_layers = settings.first_dense_layers.value_or(traits.first_dense_layers);
  SPIN_CHECK(r.first_dense_layers <= shape.n_layers,
             "sparse settings: {} first dense layers but the model has {} layers",
             r.first_dense_layers, shape.n_layers);
  return r;
}

}  // namespace spin::sparse
