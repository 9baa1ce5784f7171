#include "cli/token_ids.h"

#include <cctype>
#include <climits>
#include <sstream>

#include "base/error.h"

namespace spin::cli {

std::vector<int32_t> parse_token_ids(const std::string& list, const std::string& flag) {
  std::vector<int32_t> ids;
  std::istringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    while (used > 0 && used < item.size() && std::isspace(static_cast<unsigned char>(item[used]))) ++used;
    SPIN_CHECK(used > 0 && used == item.size() && value >= 0 && value <= INT32_MAX,
               "{}: '{}' is not a token id (expected comma-separated integers)", flag, item);
    ids.push_back(static_cast<int32_t>(value));
  }
  SPIN_CHECK(!ids.empty(), "{} is empty", flag);
  return ids;
}

}  // namespace spin::cli
