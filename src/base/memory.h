#pragma once
// How much memory this process may use, so loaders can refuse a model that cannot fit instead
// of being killed half-way through allocating it.
#include <cstdint>

namespace spin {

// The machine's physical memory, or a smaller cgroup limit.
uint64_t usable_memory_bytes();

}  // namespace spin
