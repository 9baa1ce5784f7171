#pragma once
// Kernels specialised on the GQA group (query heads per KV head, 1..8) take it as a template
// argument; with_group turns the runtime size into one.
#include <type_traits>

namespace spin::cuda {

// Calls f(std::integral_constant<int, G>{}) with G = group for 1..7 and 8 otherwise (callers check
// 1 <= group <= 8 first).
template <typename F>
void with_group(int group, F&& f) {
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace spin::cuda
