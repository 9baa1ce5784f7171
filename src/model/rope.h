#pragma once
// Per-pair RoPE frequencies and the YaRN magnitude scale, derived once from the config.
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace spin {

struct RopeTable {
  std::vector<float> inv_freq;  // head_dim / 2 entries
  float mscale = 1.0f;          // multiplies cos and sin (YaRN attention scaling)
  bool neox = true;
};

RopeTable make_rope_table(const RopeConfig& rope, int64_t head_dim);

}  // namespace spin
