#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace spin {

namespace {

// Dimension index whose wavelength completes `rotations` turns over `max_position` tokens.
double yarn_correction_dim(double rotations, double dim, double base, double max_position) {
  return dim * std::log(max_position / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

RopeTable make_rope_table(const RopeConfig& rope, int64_t head_dim) {
  RopeTable table;
  table.neox = rope.neox;
  const int64_t half = head_dim / 2;
  const double base = rope.theta;
  const double dim = static_cast<double>(head_dim);
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i) inv[i] = std::pow(base, -2.0 * static_cast<double>(i) / dim);

  switch (rope.scaling) {
    case RopeScaling::None:
      break;
    case RopeScaling::Linear:
      for (double& f : inv) f /= rope.factor;
      break;
    case RopeScaling::Llama3: {
      // Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
      const double orig = rope.original_max_position;
      const double low_wavelen = orig / rope.low_freq_factor;
      const double high_wavelen = orig / rope.high_freq_factor;
      for (double& f : inv) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f /= rope.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (orig / wavelen - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
          f = (1.0 - smooth) * f / rope.factor + smooth * f;
        }
      }
      break;
    }
    case RopeScaling::Yarn: {
      const double orig = rope.original_max_position;
      double low = std::floor(yarn_correction_dim(rope.yarn_beta_fast, dim, base, orig));
      double high = std::ceil(yarn_correction_dim(rope.yarn_beta_slow, dim, base, orig));
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation_weight = 1.0 - ramp;
        inv[i] = inv[i] / rope.factor * (1.0 - extrapolation_weight) + inv[i] * extrapolation_weight;
      }
      table.mscale = rope.yarn_attn_factor > 0.0f
                         ? rope.yarn_attn_factor
                         : (rope.factor <= 1.0f ? 1.0f
                                                : static_cast<float>(0.1 * std::log(rope.factor) + 1.0));
      break;
    }
  }
  table.inv_freq.assign(inv.begin(), inv.end());
  return table;
}

}  // namespace spin
