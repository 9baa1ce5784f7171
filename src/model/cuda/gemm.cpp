#include "model/cuda/gemm.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>

#include "kernels/cuda/gemv.h"

namespace spin {

namespace {

// Enough for cuBLASLt's split-K kernels on Hopper (its documentation recommends 32 MiB there).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Prefill chunks come in every length; past this many cached shapes the cache starts over.
constexpr size_t kMaxPlans = 4096;
// Timed rounds over the candidates when tuning (after one untimed round); each one's median counts.
constexpr int kTimedRuns = 5;
// A candidate replaces the heuristic's pick only when this much faster. Timed alone (ncu),
// gains the tuner measured at 3-7% held and one of 1.7% did not (docs/results/h200/session31/).
constexpr float kMinGain = 0.03f;

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("cuBLASLt error in {}: {} ({})", what, cublasLtGetStatusString(status), static_cast<int>(status));
  }
}

// Events for timing on a stream, destroyed however the timing ends.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    cuda_check(cudaEventCreate(&start), "timing event");
    if (const cudaError_t status = cudaEventCreate(&stop); status != cudaSuccess) {
      cudaEventDestroy(start);
      cuda_check(status, "timing event");
    }
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

}  // namespace

static_assert(GemmRunner::kDefaultGemvRows <= cuda::kMaxGemvRows);

void GemmRunner::check_gemv_rows(int64_t gemv_rows) {
  SPIN_CHECK(gemv_rows >= 0 && gemv_rows <= cuda::kMaxGemvRows, "--gemv-rows must be 0 to {}, not {}",
             cuda::kMaxGemvRows, gemv_rows);
}

GemmRunner::GemmRunner(const std::filesystem::path& tuning_file, int64_t gemv_rows)
    : gemv_rows_(gemv_rows), workspace_(kWorkspaceBytes, "cuBLASLt workspace") {
  check_gemv_rows(gemv_rows);
  lt_check(cublasLtCreate(&handle_), "cublasLtCreate");
  if (tuning_file.empty()) return;
  try {
    int device = 0;
    cudaDeviceProp prop{};
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    // The stored algorithms hold for this GPU model and cuBLASLt build only.
    const std::string hardware = fmt::format("{} / cuBLASLt {}", prop.name, cublasLtGetVersion());
    std::error_code ec;
    const bool exists = std::filesystem::exists(tuning_file, ec);
    tuning_ = GemmTuningTable::load(tuning_file, hardware);
    if (!exists) tuning_->save();  // an unwritable path fails now, not after the first step
    spdlog::info("GEMM tuning file {}: {} stored choices for {}", tuning_file.string(), tuning_->size(), hardware);
  } catch (...) {
    cublasLtDestroy(handle_);
    throw;
  }
}

GemmRunner::~GemmRunner() {
  for (auto& [key, p] : plans_) destroy(p);
  if (handle_) cublasLtDestroy(handle_);
}

void GemmRunner::destroy(Plan& p) {
  if (p.w) cublasLtMatrixLayoutDestroy(p.w);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.out) cublasLtMatrixLayoutDestroy(p.out);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

// cuBLASLt is column-major: a row-major [rows][n] matrix is its column-major [n][rows]. So
// out^T[out][rows] = W[out][in] (stored as column-major [in][out], hence transposed) * a^T[in][rows].
void GemmRunner::describe(Plan& p, int64_t rows, int64_t out_features, int64_t in_features, cudaDataType_t out_type) {
  lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
           "matmul transa");
  lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "matmul transb");
  lt_check(cublasLtMatrixLayoutCreate(&p.w, CUDA_R_16BF, in_features, out_features, in_features), "weight layout");
  lt_check(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, in_features, rows, in_features), "input layout");
  lt_check(cublasLtMatrixLayoutCreate(&p.out, out_type, out_features, rows, out_features), "output layout");
}

std::vector<cublasLtMatmulAlgo_t> GemmRunner::candidates(const Plan& p, int count) const {
  cublasLtMatmulPreference_t preference = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&preference), "matmul preference");
  const uint64_t workspace_bytes = workspace_.bytes();
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int found = 0;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.w, p.a, p.out, p.out, preference, count, results.data(),
                                            &found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  lt_check(status, "matmul heuristic");
  std::vector<cublasLtMatmulAlgo_t> algos;
  for (int i = 0; i < found; ++i) {
    if (results[static_cast<size_t>(i)].state == CUBLAS_STATUS_SUCCESS) algos.push_back(results[static_cast<size_t>(i)].algo);
  }
  return algos;
}

const GemmRunner::Plan& GemmRunner::plan(int64_t rows, int64_t out_features, int64_t in_features,
                                         cudaDataType_t out_type, const void* a, const __nv_bfloat16* w, void* out,
                                         cudaStream_t stream) {
  const Key key{rows, out_features, in_features, static_cast<int>(out_type)};
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;
  if (plans_.size() >= kMaxPlans) {
    for (auto& [k, p] : plans_) destroy(p);
    plans_.clear();
  }
  Plan p;
  try {
    describe(p, rows, out_features, in_features, out_type);
    const bool tuned = tuning_ && rows <= kMaxTunedRows;
    const std::vector<cublasLtMatmulAlgo_t> algos = candidates(p, tuned ? kCandidates : 1);
    SPIN_CHECK(!algos.empty(), "cuBLASLt has no algorithm for a bf16 product of [{} x {}] by [{} x {}]^T", rows,
               in_features, out_features, in_features);
    p.algo = algos.front();
    if (tuned) {
      const GemmShape shape{rows, out_features, in_features, out_type == CUDA_R_32F};
      p.algo = tuned_algorithm(p, shape, algos, a, w, out, stream);
    }
  } catch (...) {
    destroy(p);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

cublasLtMatmulAlgo_t GemmRunner::tuned_algorithm(const Plan& p, const GemmShape& shape,
                                                 const std::vector<cublasLtMatmulAlgo_t>& algos, const void* a,
                                                 const __nv_bfloat16* w, void* out, cudaStream_t stream) {
  const std::string product = fmt::format("[{} x {}] by [{} x {}]^T ({} output)", shape.rows, shape.in_features,
                                          shape.out_features, shape.in_features, shape.float_output ? "f32" : "bf16");
  if (const GemmChoice* stored = tuning_->find(shape)) {
    cublasLtMatmulAlgo_t algo{};
    std::memcpy(algo.data, stored->algo.data(), sizeof(algo.data));
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle_, p.op, p.w, p.a, p.out, p.out, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= workspace_.bytes()) {
      return algo;
    }
    spdlog::warn("GEMM tuning file {}: cuBLASLt rejects the stored algorithm for {}; timing the candidates again",
                 tuning_->path().string(), product);
  }
  // Timing synchronises the stream, which a graph capture forbids; plans are meant to be made by
  // an eager step first (cuda_model.cpp), so this is only a fallback.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "capture status");
  if (capture != cudaStreamCaptureStatusNone || algos.size() < 2) return algos.front();

  const std::vector<float> us = time_candidates(p, shape.in_features, algos, a, w, out, stream);
  if (us.empty()) return algos.front();
  const auto fastest = static_cast<size_t>(std::min_element(us.begin(), us.end()) - us.begin());
  const size_t chosen = us[fastest] < (1 - kMinGain) * us.front() ? fastest : 0;
  GemmChoice choice;
  std::memcpy(choice.algo.data(), algos[chosen].data, sizeof(algos[chosen].data));
  choice.time_us = us[chosen];
  choice.heuristic_us = us.front();
  tuning_->put(shape, choice);
  spdlog::info("GEMM tuning: {}: candidate {} of {}, {:.1f} us (the heuristic's pick: {:.1f} us)", product, chosen,
               algos.size(), us[chosen], us.front());
  try {
    tuning_->save();
  } catch (const Error& e) {
    spdlog::warn("{} (the choice holds for this run only)", e.what());
  }
  return algos[chosen];
}

std::vector<float> GemmRunner::time_candidates(const Plan& p, int64_t in_features,
                                               const std::vector<cublasLtMatmulAlgo_t>& algos, const void* a,
                                               const __nv_bfloat16* w, void* out, cudaStream_t stream) {
  int device = 0, l2_bytes = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "L2 size");
  // The flush: one row of the input times a zero matrix of 2 x L2 bytes, into scratch.
  const int64_t flush_rows = std::max<int64_t>(1, 2 * int64_t{l2_bytes} / (2 * in_features));
  DeviceBuffer<__nv_bfloat16> flush_weights;
  DeviceBuffer<float> flush_out;
  try {
    flush_weights.reserve(static_cast<size_t>(flush_rows * in_features), "GEMM tuning's L2 flush");
    flush_out.reserve(static_cast<size_t>(flush_rows), "GEMM tuning's L2 flush");
  } catch (const Error& e) {
    spdlog::warn("GEMM tuning skipped for this product: {}", e.what());
    return {};
  }
  cuda_check(cudaMemsetAsync(flush_weights.get(), 0, flush_weights.bytes(), stream), "L2 flush fill");
  Plan flush;
  try {
    describe(flush, 1, flush_rows, in_features, CUDA_R_32F);
    const std::vector<cublasLtMatmulAlgo_t> flush_algo = candidates(flush, 1);
    SPIN_CHECK(!flush_algo.empty(), "cuBLASLt has no algorithm for the GEMM tuning's L2 flush");
    const EventPair events;
    const float alpha = 1.0f, beta = 0.0f;
    // Round-robin over the candidates, so a drift of the GPU's clocks over the timing (it starts
    // from a light prefill) is shared by all of them instead of weighing on the first.
    std::vector<std::vector<float>> us(algos.size());
    for (int run = 0; run <= kTimedRuns; ++run) {
      for (size_t c = 0; c < algos.size(); ++c) {
        lt_check(cublasLtMatmul(handle_, flush.op, &alpha, flush_weights.get(), flush.w, a, flush.a, &beta,
                                flush_out.get(), flush.out, flush_out.get(), flush.out, &flush_algo.front(),
                                workspace_.get(), workspace_.bytes(), stream),
                 "cublasLtMatmul (L2 flush)");
        cuda_check(cudaEventRecord(events.start, stream), "timing event");
        lt_check(cublasLtMatmul(handle_, p.op, &alpha, w, p.w, a, p.a, &beta, out, p.out, out, p.out, &algos[c],
                                workspace_.get(), workspace_.bytes(), stream),
                 "cublasLtMatmul (tuning)");
        cuda_check(cudaEventRecord(events.stop, stream), "timing event");
        cuda_check(cudaEventSynchronize(events.stop), "timing");
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, events.start, events.stop), "timing");
        if (run > 0) us[c].push_back(ms * 1e3f);  // the first round loads the kernels
      }
    }
    std::vector<float> medians;
    for (std::vector<float>& times : us) {
      std::nth_element(times.begin(), times.begin() + kTimedRuns / 2, times.end());
      medians.push_back(times[kTimedRuns / 2]);
    }
    destroy(flush);
    return medians;
  } catch (...) {
    destroy(flush);
    throw;
  }
}

void GemmRunner::run(const void* a, const __nv_bfloat16* w, void* out, int64_t rows, int64_t out_features,
                     int64_t in_features, cudaDataType_t out_type, cudaStream_t stream) {
  if (rows == 0) return;
  if (rows <= gemv_rows_ && cuda::gemv_fits(a, w, rows, out_features, in_features)) {
    const auto* x = static_cast<const __nv_bfloat16*>(a);
    cuda_check(out_type == CUDA_R_32F
                   ? cuda::gemv_nt(x, w, static_cast<float*>(out), rows, out_features, in_features, stream)
                   : cuda::gemv_nt(x, w, static_cast<__nv_bfloat16*>(out), rows, out_features, in_features, stream),
               "decode-sized product");
    return;
  }
  const Plan& p = plan(rows, out_features, in_features, out_type, a, w, out, stream);
  const float alpha = 1.0f, beta = 0.0f;
  lt_check(cublasLtMatmul(handle_, p.op, &alpha, w, p.w, a, p.a, &beta, out, p.out, out, p.out, &p.algo,
                          workspace_.get(), workspace_.bytes(), stream),
           "cublasLtMatmul");
}

void GemmRunner::matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* out, int64_t rows,
                           int64_t out_features, int64_t in_features, cudaStream_t stream) {
  run(a, w, out, rows, out_features, in_features, CUDA_R_16BF, stream);
}

void GemmRunner::matmul_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int64_t rows,
                           int64_t out_features, int64_t in_features, cudaStream_t stream) {
  run(a, w, out, rows, out_features, in_features, CUDA_R_32F, stream);
}

}  // namespace spin
