#pragma once
// A read-only memory-mapped file. Model files are mapped, never copied whole into memory; small
// text files (JSON configs, tokenizers) are read whole.
#include <cstddef>
#include <cstdint>
#include <string>

namespace spin {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws spin::Error with the path and reason
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The whole file as bytes; spin::Error naming the path when it cannot be opened or read.
std::string read_text_file(const std::string& path);

}  // namespace spin
