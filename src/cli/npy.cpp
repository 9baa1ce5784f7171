#include "cli/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "base/error.h"

namespace spin::cli {

void write_npy(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  SPIN_CHECK(f != nullptr, "cannot write '{}': {}", path, std::strerror(errno));
  const uint16_t len = static_cast<uint16_t>(header.size());
  const unsigned char prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                    static_cast<unsigned char>(len & 0xff),
                                    static_cast<unsigned char>(len >> 8)};
  bool ok = std::fwrite(prefix, 1, 10, f.get()) == 10 &&
            std::fwrite(header.data(), 1, header.size(), f.get()) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f.get()) == data.size();
  SPIN_CHECK(ok, "cannot write '{}': {}", path, std::strerror(errno));
}

}  // namespace spin::cli
