#pragma once
// Shared by the tests of file readers: a scratch directory removed on scope exit, and a check
// that a call fails with a spin::Error whose message names what was wrong.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "base/error.h"

namespace spin {

inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(message.find(f), std::string::npos) << "message '" << message << "' lacks '" << f << "'";
    }
    return;
  }
  ADD_FAILURE() << "no spin::Error thrown (expected one mentioning '" << fragments.at(0) << "')";
}

// Under $SPIN_TEST_TMP (the build's tests/tmp) when set, else the system's temporary directory.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "spin_test_") {
    const char* base = std::getenv("SPIN_TEST_TMP");
    const std::filesystem::path root = base ? std::filesystem::path(base) : std::filesystem::temp_directory_path();
    std::filesystem::create_directories(root);
    std::random_device rd;
    path_ = root / (prefix + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path write(const std::string& name, const std::string& content) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream out(p, std::ios::binary);
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    return p;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace spin
