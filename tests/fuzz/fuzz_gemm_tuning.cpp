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

// The loader reads paths: two scratch files of this process, removed when it exits.
struct ScratchFiles {
  std::filesystem::path input, copy;
  ScratchFiles() {
    const auto base = std::filesystem::temp_directory_path() / ("spin_fuzz_gemm_tuning_" + std::to_string(getpid()));
    input = base.string() + ".json";
    copy = base.string() + "_copy.json";
  }
  ~ScratchFiles() {
    std::error_code ec;
    std::filesystem::remove(input, ec);
    std::filesystem::remove(copy, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ScratchFiles files;
  const std::filesystem::path& input = files.input;
  const std::filesystem::path& copy = files.copy;
  {
    std::ofstream out(input, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  spin::GemmTuningTable table;
  try {
    table = spin::GemmTuningTable::load(input, kHardware);
  } catch (const spin::Error&) {
    return 0;
  }
  std::filesystem::copy_file(input, copy, std::filesystem::copy_options::overwrite_existing);
  spin::GemmTuningTable saved = spin::GemmTuningTable::load(copy, kHardware);
  saved.save();
  const spin::GemmTuningTable back = spin::GemmTuningTable::load(copy, kHardware);
  if (back.size() != table.size()) std::abort();
  return 0;
}
