#pragma once
// Writes float32 arrays as .npy (format 1.0) so tests and users can load them with numpy.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace spin::cli {

void write_npy(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape);

}  // namespace spin::cli
