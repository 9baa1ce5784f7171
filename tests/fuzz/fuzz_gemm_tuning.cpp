// libFuzzer target: the fuzz input is a GEMM tuning file (model/gemm_tuning.h). Loading it must
// either give a table or throw spin::Error; a table that loaded saves and loads back with the
// same choices.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "base/error.h"
#include "model/gemm_tuning.h"

namespace {

const std::string kHardware = "NVIDIA H100 80GB HBM3 / cuBLASLt 130100";

// The loader reads a path: a scratch file of this process, removed when it exits.
struct ScratchFile {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("spin_fuzz_gemm_tuning_" + std::to_string(getpid()) + ".json");
  ~ScratchFile() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ScratchFile input;
  {
    std::ofstream out(input.path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  spin::GemmTuningTable table;
  try {
    table = spin::GemmTuningTable::load(input.path, kHardware);
  } catch (const spin::Error&) {
    return 0;
  }
  table.save();
  const spin::GemmTuningTable back = spin::GemmTuningTable::load(input.path, kHardware);
  if (back.size() != table.size()) std::abort();
  return 0;
}
