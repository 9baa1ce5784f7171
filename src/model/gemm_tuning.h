#pragma once
// A file of measured cuBLASLt algorithm choices (`--gemm-tuning PATH`). cuBLASLt's heuristic
// picks an algorithm per product shape without running it; for the decode steps' small products
// its first pick streams the weights 2-3% slower over a step than the fastest of its own
// candidates (docs/results/h200/session30/). Timing the candidates in every process is not
// enough: a candidate's speed can differ between processes, so the choice would change from run
// to run. The GPU backend times them once, stores the winner here, and later runs reuse it.
//
// An algorithm is stored as cuBLASLt's opaque 64-byte cublasLtMatmulAlgo_t, which NVIDIA
// documents as serialisable for the same cuBLASLt version, so each table belongs to one
// `hardware` string (the GPU's name and the cuBLASLt version); other hardware's tables are kept
// untouched. This file knows nothing of CUDA, so it is tested without a GPU.
#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace spin {

struct GemmShape {
  int64_t rows = 0, out_features = 0, in_features = 0;
  bool float_output = false;  // fp32 output (the LM head's logits); bf16 otherwise
  // Spelled out rather than a defaulted <=>: CUDA sources include this header too.
  bool operator<(const GemmShape& o) const {
    return std::tie(rows, out_features, in_features, float_output) <
           std::tie(o.rows, o.out_features, o.in_features, o.float_output);
  }
};

struct GemmChoice {
  std::array<uint64_t, 8> algo{};  // cublasLtMatmulAlgo_t::data
  double time_us = 0;              // its median time when it was tuned
  double heuristic_us = 0;         // the heuristic's first pick's, in the same measurement
};

class GemmTuningTable {
 public:
  // Reads `path`'s table for `hardware`; a missing file is an empty table (save() creates it).
  // A file that is not a tuning file, or a malformed entry, is a spin::Error naming the file.
  static GemmTuningTable load(const std::filesystem::path& path, const std::string& hardware);

  const GemmChoice* find(const GemmShape& shape) const;
  void put(const GemmShape& shape, const GemmChoice& choice);
  size_t size() const { return choices_.size(); }
  const std::string& hardware() const { return hardware_; }
  const std::filesystem::path& path() const { return path_; }

  // Rewrites the file (a temporary file renamed over it, so a crash never leaves half a file),
  // with the other hardware's tables as they were read.
  void save() const;

 private:
  std::filesystem::path path_;
  std::string hardware_;
  std::map<GemmShape, GemmChoice> choices_;
  std::vector<std::string> other_tables_;  // as JSON text
};

}  // namespace spin
