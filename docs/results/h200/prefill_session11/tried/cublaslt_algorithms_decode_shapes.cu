// Experiment: for decode-shaped products (rows 1..64) time every algorithm cuBLASLt's heuristic
// offers (up to 32) against its first choice. Same descriptors as model/cuda/gemm.cpp.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { auto e = (x); if (e != 0) { std::printf("error %d at %s:%d\n", (int)e, __FILE__, __LINE__); std::exit(1);} } while (0)
int main() {
  struct Shape { const char* name; int out, in; };
  std::vector<Shape> shapes = {{"qwen3-14b qkv", 7168, 5120}, {"qwen3-14b o", 5120, 5120}, {"qwen3-14b gate_up", 34816, 5120},
                               {"qwen3-14b down", 5120, 17408}, {"llama-3.1-8b qkv", 6144, 4096}, {"llama-3.1-8b o", 4096, 4096},
                               {"llama-3.1-8b gate_up", 28672, 4096}, {"llama-3.1-8b down", 4096, 14336}};
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  const size_t ws_bytes = 32u << 20; void* ws; CK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (const Shape& s : shapes) {
    const size_t wbytes = size_t(s.out) * s.in * 2;
    const int copies = std::max<int>(4, int((512u << 20) / wbytes) + 1);
    std::vector<void*> w(copies);
    for (auto& p : w) { CK(cudaMalloc(&p, wbytes)); CK(cudaMemset(p, 0x11, wbytes)); }
    void *a, *o; CK(cudaMalloc(&a, size_t(64) * s.in * 2)); CK(cudaMemset(a, 0x22, size_t(64) * s.in * 2));
    CK(cudaMalloc(&o, size_t(64) * s.out * 2));
    for (int rows : {1, 4, 8, 16, 32, 64}) {
      cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t lw, la, lo;
      CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T));
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof N));
      CK(cublasLtMatrixLayoutCreate(&lw, CUDA_R_16BF, s.in, s.out, s.in));
      CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.in, rows, s.in));
      CK(cublasLtMatrixLayoutCreate(&lo, CUDA_R_16BF, s.out, rows, s.out));
      cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
      uint64_t wsb = ws_bytes;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
      cublasLtMatmulHeuristicResult_t res[32]; int found = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(h, op, lw, la, lo, lo, pref, 32, res, &found));
      const float alpha = 1, beta = 0;
      std::vector<double> times;
      for (int i = 0; i < found; ++i) {
        const int calls = copies;
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int c = 0; c < calls; ++c)
          cublasLtMatmul(h, op, &alpha, w[c], lw, a, la, &beta, o, lo, o, lo, &res[i].algo, ws, ws_bytes, st);
        if (cudaStreamEndCapture(st, &g) != cudaSuccess) { cudaGetLastError(); times.push_back(1e30); continue; }
        CK(cudaGraphInstantiate(&ge, g, 0));
        std::vector<float> t;
        for (int r = 0; r < 13; ++r) {
          CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r >= 3) t.push_back(ms * 1000 / calls);
        }
        std::sort(t.begin(), t.end());
        times.push_back(t[t.size() / 2]);
        cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
      }
      int best = int(std::min_element(times.begin(), times.end()) - times.begin());
      const double gb = double(wbytes) / 1e3;
      std::printf("%-22s rows %2d  algos %2d  first %7.2f us (%5.0f GB/s)  best #%2d %7.2f us (%5.0f GB/s)  gain %.2fx\n", s.name, rows,
                  found, times[0], gb / times[0], best, times[best], gb / times[best], times[0] / times[best]);
      std::fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(lw); cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lo); cublasLtMatmulDescDestroy(op);
    }
    for (auto p : w) cudaFree(p);
    cudaFree(a); cudaFree(o);
  }
  return 0;
}
