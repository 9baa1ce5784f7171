#include "kernels/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "base/error.h"

namespace spin::cpu {

void attend_group_pages(const float* q, int64_t group, std::span<const KvPageView> pages,
                        int64_t head_dim, float scale, float* out, float* scratch) {
  int64_t max_tokens = 0;
  for (const KvPageView& p : pages) max_tokens = std::max(max_tokens, p.n_tokens);
  SPIN_CHECK(max_tokens > 0, "paged attention over no keys");
  // scratch: per head the running max and sum, then one page of scores per head.
  float* running_max = scratch;
  float* running_sum = scratch + group;
  float* scores = scratch + 2 * group;
  std::fill(running_max, running_max + group, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + group, 0.0f);
  std::memset(out, 0, sizeof(float) * group * head_dim);

  for (const KvPageView& page : pages) {
    const int64_t n = page.n_tokens;
    if (n == 0) continue;
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = page.k + t * head_dim;
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = q + h * head_dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kt[d];
        scores[h * n + t] = dot * scale;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* s = scores + h * n;
      const float page_max = *std::max_element(s, s + n);
      const float new_max = std::max(running_max[h], page_max);
      // Rescale what was accumulated under the old maximum (exp(-inf) = 0 on the first page).
      const float rescale = std::exp(running_max[h] - new_max);
      float* oh = out + h * head_dim;
      if (rescale != 1.0f) {
        for (int64_t d = 0; d < head_dim; ++d) oh[d] *= rescale;
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - new_max);
        sum += s[t];
      }
      running_sum[h] = running_sum[h] * rescale + sum;
      running_max[h] = new_max;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = page.v + t * head_dim;
      for (int64_t h = 0; h < group; ++h) {
        const float p = scores[h * n + t];
        float* oh = out + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vt[d];
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = 1.0f / running_sum[h];
    float* oh = out + h * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) oh[d] *= inv;
  }
}

}  // namespace spin::cpu
