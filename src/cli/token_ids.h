#pragma once
// Token ids given on the command line as "1,2,3".
#include <cstdint>
#include <string>
#include <vector>

namespace spin::cli {

// Throws spin::Error naming `flag` for anything but comma-separated non-negative 32-bit integers.
std::vector<int32_t> parse_token_ids(const std::string& list, const std::string& flag);

}  // namespace spin::cli
