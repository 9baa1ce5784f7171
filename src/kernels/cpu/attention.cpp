#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/ops.h"

namespace spin::cpu {

void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t n_keys,
                  int64_t kv_stride, int64_t head_dim, float scale, float* out, float* scores) {
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* kt = k + t * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kt[d];
      scores[h * n_keys + t] = dot * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) softmax(scores + h * n_keys, n_keys);
  std::memset(out, 0, sizeof(float) * group * head_dim);
  for (int64_t t = 0; t < n_keys; ++t) {
    const float* vt = v + t * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * n_keys + t];
      float* oh = out + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vt[d];
    }
  }
}

}  // namespace spin::cpu
