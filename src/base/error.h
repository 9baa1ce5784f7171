#pragma once
// Errors that reach the user: bad files, bad flags, bad requests. Every one carries a message
// that says what was wrong and where; callers at the edge (CLI, server) print it and exit/return.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace spin {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace spin

#define SPIN_CHECK(cond, ...)      \
  do {                             \
    if (!(cond)) {                 \
      ::spin::fail(__VA_ARGS__);   \
    }                              \
  } while (0)
