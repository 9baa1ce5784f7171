#pragma once
// Overflow-safe size arithmetic for everything read from untrusted files.
#include <cstdint>

#include "base/error.h"

namespace spin {

inline uint64_t checked_mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail("size overflow computing {}", what);
  return r;
}

inline uint64_t checked_add(uint64_t a, uint64_t b, const char* what) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail("size overflow computing {}", what);
  return r;
}

}  // namespace spin
