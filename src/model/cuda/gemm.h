#pragma once
// The forward pass's matrix products through cuBLASLt: activations [rows][in] times a weight
// matrix stored [out][in] (the HF layout), bf16 inputs, fp32 accumulation, bf16 or fp32 output.
// Each shape's descriptors and algorithm are chosen once and cached, so a step costs one
// cublasLtMatmul call per product and can be captured in a CUDA graph (fixed workspace, no
// allocation).
//
// A product of at most the runner's gemv_rows rows (a decode step of that batch) whose operands
// kernels/cuda/gemv.h takes runs that kernel instead: it streams the weights at HBM speed and
// starts loading them while the kernel before it finishes (1.03-1.07x a dense step at batch 1 and
// 2 on an H100; slower from 3 rows on, hence kDefaultGemvRows).
// It sums in another order than cuBLASLt, so a row's product can differ by a rounding between a
// step small enough for it and a larger one.
//
// With a tuning file (model/gemm_tuning.h), a larger decode-sized product (at most kMaxTunedRows
// rows) runs the fastest of the heuristic's first kCandidates algorithms where it beats the first
// pick by a margin: timed once, on the first product of that shape with the real operands, then
// stored in the file and reused by later runs.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "model/cuda/device_buffer.h"
#include "model/gemm_tuning.h"

namespace spin {

class GemmRunner {
 public:
  static constexpr int64_t kMaxTunedRows = 64;
  static constexpr int kCandidates = 8;

  // Products of at most this many rows run gemv.h's kernel unless the runner is told otherwise.
  static constexpr int64_t kDefaultGemvRows = 2;

  // `tuning_file` empty: the heuristic's first pick for every shape. `gemv_rows` (0 to
  // cuda::kMaxGemvRows, else spin::Error): products of at most that many rows run
  // gemv.h's kernel; 0: every product runs cuBLASLt.
  explicit GemmRunner(const std::filesystem::path& tuning_file = {}, int64_t gemv_rows = kDefaultGemvRows);
  // The constructor's check of `gemv_rows`, for callers that validate a flag before they load a model.
  static void check_gemv_rows(int64_t gemv_rows);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // out[rows][out_features] = a[rows][in_features] * w[out_features][in_features]^T
  void matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* out, int64_t rows,
                 int64_t out_features, int64_t in_features, cudaStream_t stream);
  void matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int64_t rows,
                 int64_t out_features, int64_t in_features, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t w = nullptr, a = nullptr, out = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;  // rows, out, in, output type

  // A product's plan; making one may run the product (timing candidates), so it takes the operands.
  const Plan& plan(int64_t rows, int64_t out_features, int64_t in_features, cudaDataType_t out_type, const void* a,
                   const __nv_bfloat16* w, void* out, cudaStream_t stream);
  // Fills a plan's descriptors (not its algorithm) for a product of this shape.
  static void describe(Plan& p, int64_t rows, int64_t out_features, int64_t in_features, cudaDataType_t out_type);
  // Up to `count` of the heuristic's algorithms for p's shape that fit the workspace, best first.
  std::vector<cublasLtMatmulAlgo_t> candidates(const Plan& p, int count) const;
  // The tuning file's algorithm for this shape, or the fastest of `algos` (then stored).
  cublasLtMatmulAlgo_t tuned_algorithm(const Plan& p, const GemmShape& shape, const std::vector<cublasLtMatmulAlgo_t>& algos,
                                       const void* a, const __nv_bfloat16* w, void* out, cudaStream_t stream);
  // Median time of each of `algos` on p's product, each run after reading twice L2's size of
  // other memory (so the weights come from HBM, as between a step's products). Empty when the
  // scratch for that cannot be allocated.
  std::vector<float> time_candidates(const Plan& p, int64_t in_features, const std::vector<cublasLtMatmulAlgo_t>& algos,
                                     const void* a, const __nv_bfloat16* w, void* out, cudaStream_t stream);
  void run(const void* a, const __nv_bfloat16* w, void* out, int64_t rows, int64_t out_features,
           int64_t in_features, cudaDataType_t out_type, cudaStream_t stream);
  static void destroy(Plan& p);

  int64_t gemv_rows_ = kDefaultGemvRows;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<char> workspace_;
  std::map<Key, Plan> plans_;
  std::optional<GemmTuningTable> tuning_;
};

}  // namespace spin
