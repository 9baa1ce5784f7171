#include "base/memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>

namespace spin {

uint64_t usable_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  uint64_t bytes = (pages > 0 && page_size > 0)
                       ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size)
                       : std::numeric_limits<uint64_t>::max();
  for (const char* limit_file :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(limit_file);
    uint64_t limit = 0;
    if (in >> limit && limit > 0) bytes = std::min(bytes, limit);
  }
  return bytes;
}

}  // namespace spin
