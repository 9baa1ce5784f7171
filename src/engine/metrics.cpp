#include "engine/metrics.h"

#include <algorithm>

namespace spin {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size(), 0);
}

void Histogram::observe(double value) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (value <= bounds_[i]) ++counts_[i];
  }
  ++count_;
  sum_ += value;
}

std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1.0,   2.5,    5.0,   10.0, 30.0,  60.0, 120.0, 300.0, 600.0};
}

}  // namespace spin
