#include "model/cuda/gemm.h"

namespace spin {

namespace {

// Enough for cuBLASLt's split-K kernels on Hopper (its documentation recommends 32 MiB there).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Prefill chunks come in every length; past this many cached shapes the cache starts over.
constexpr size_t kMaxPlans = 4096;

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("cuBLASLt error in {}: {} ({})", what, cublasLtGetStatusString(status), static_cast<int>(status));
  }
}

}  // namespace

GemmRunner::GemmRunner() : workspace_(kWorkspaceBytes, "cuBLASLt workspace") {
  lt_check(cublasLtCreate(&handle_), "cublasLtCreate");
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
const GemmRunner::Plan& GemmRunner::plan(int64_t rows, int64_t out_features, int64_t in_features,
                                         cudaDataType_t out_type) {
  const Key key{rows, out_features, in_features, static_cast<int>(out_type)};
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;
  if (plans_.size() >= kMaxPlans) {
    for (auto& [k, p] : plans_) destroy(p);
    plans_.clear();
  }
  Plan p;
  try {
    lt_check(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
             "matmul transa");
    lt_check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "matmul transb");
    lt_check(cublasLtMatrixLayoutCreate(&p.w, CUDA_R_16BF, in_features, out_features, in_features), "weight layout");
    lt_check(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, in_features, rows, in_features), "input layout");
    lt_check(cublasLtMatrixLayoutCreate(&p.out, out_type, out_features, rows, out_features), "output layout");

    cublasLtMatmulPreference_t preference = nullptr;
    lt_check(cublasLtMatmulPreferenceCreate(&preference), "matmul preference");
    const uint64_t workspace_bytes = workspace_.bytes();
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes));
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.w, p.a, p.out, p.out, preference, 1, &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    lt_check(status, "matmul heuristic");
    SPIN_CHECK(found > 0, "cuBLASLt has no algorithm for a bf16 product of [{} x {}] by [{} x {}]^T", rows,
               in_features, out_features, in_features);
    p.algo = result.algo;
  } catch (...) {
    destroy(p);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

void GemmRunner::run(const void* a, const __nv_bfloat16* w, void* out, int64_t rows, int64_t out_features,
                     int64_t in_features, cudaDataType_t out_type, cudaStream_t stream) {
  if (rows == 0) return;
  const Plan& p = plan(rows, out_features, in_features, out_type);
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
