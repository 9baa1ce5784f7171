// EXPERIMENT: does a bulk L2 prefetch of a weight matrix, issued while HBM is idle, shorten the
// 1-row cuBLASLt product that reads it next? Times the product after an L2 flush, with the first
// X MB of its weights prefetched, then either an idle wait (the prefetch done) or a kernel reading
// other data (what the sparse phases read meanwhile).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    auto e = (x);                                                                      \
    if (e != 0) {                                                                      \
      std::printf("error %d at %s:%d\n", static_cast<int>(e), __FILE__, __LINE__);     \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void prefetch_l2(const char* p, long long bytes, int chunk) {
  const long long n = (bytes + chunk - 1) / chunk;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long off = i * chunk;
    const unsigned size = static_cast<unsigned>((chunk < bytes - off ? chunk : bytes - off));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
  }
}

__global__ void read_other(const uint4* p, long long n, uint4* sink) {
  uint4 acc{0, 0, 0, 0};
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    acc.x ^= v.x;
    acc.y ^= v.y;
  }
  if (acc.x == 0x12345678u) *sink = acc;
}

__global__ void spin_wait(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("L2 %d bytes, persisting max %d\n", prop.l2CacheSize, prop.persistingL2CacheMaxSize);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const size_t ws_bytes = 32 << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const size_t flush_bytes = size_t{512} << 20, other_bytes = size_t{16} << 20;
  char *flush, *other;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMalloc(&other, other_bytes));
  CK(cudaMemset(other, 1, other_bytes));
  uint4* sink;
  CK(cudaMalloc(&sink, 16));
  struct Shape {
    const char* name;
    long long out, in;
  };
  const Shape shapes[] = {{"qwen o 5120x5120", 5120, 5120},
                          {"qwen qkv 7168x5120", 7168, 5120},
                          {"qwen down 5120x17408", 5120, 17408},
                          {"qwen gate_up 34816x5120", 34816, 5120},
                          {"llama o 4096x4096", 4096, 4096}};
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Shape& sh : shapes) {
    const size_t wbytes = size_t(sh.out) * sh.in * 2;
    __nv_bfloat16 *w, *x, *y;
    CK(cudaMalloc(&w, wbytes));
    CK(cudaMemset(w, 0, wbytes));
    CK(cudaMalloc(&x, sh.in * 2));
    CK(cudaMemset(x, 0, sh.in * 2));
    CK(cudaMalloc(&y, sh.out * 2));
    cublasLtMatmulDesc_t op;
    CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t lw, lx, ly;
    CK(cublasLtMatrixLayoutCreate(&lw, CUDA_R_16BF, sh.in, sh.out, sh.in));
    CK(cublasLtMatrixLayoutCreate(&lx, CUDA_R_16BF, sh.in, 1, sh.in));
    CK(cublasLtMatrixLayoutCreate(&ly, CUDA_R_16BF, sh.out, 1, sh.out));
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                            sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, op, lw, lx, ly, ly, pref, 1, &res, &found));
    const float one = 1, zero = 0;
    auto gemm = [&] {
      CK(cublasLtMatmul(lt, op, &one, w, lw, x, lx, &zero, y, ly, y, ly, &res.algo, ws, ws_bytes, s));
    };
    const double mb = 1 << 20;
    std::vector<double> sizes = {0, 8, 16, 24, 32, 40, 48};
    sizes.push_back(wbytes / mb);
    for (int between = 0; between < 3; ++between) {  // 0: idle 30 us, 1: read 16 MB other, 2: nothing
      for (double xmb : sizes) {
        const long long xb = std::min<long long>(wbytes, static_cast<long long>(xmb * mb));
        if (xmb > wbytes / mb + 0.5) continue;
        std::vector<float> t;
        for (int r = 0; r < 15; ++r) {
          CK(cudaMemsetAsync(flush, r, flush_bytes, s));
          read_other<<<264, 512, 0, s>>>(reinterpret_cast<const uint4*>(flush), flush_bytes / 16, sink);
          if (xb > 0) prefetch_l2<<<8, 128, 0, s>>>(reinterpret_cast<const char*>(w), xb, 64 << 10);
          if (between == 0) spin_wait<<<1, 32, 0, s>>>(60000);
          if (between == 1) read_other<<<264, 512, 0, s>>>(reinterpret_cast<const uint4*>(other), other_bytes / 16, sink);
          CK(cudaEventRecord(e0, s));
          gemm();
          CK(cudaEventRecord(e1, s));
          CK(cudaEventSynchronize(e1));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (r >= 3) t.push_back(ms * 1e3f);
        }
        std::sort(t.begin(), t.end());
        const char* bn[] = {"idle 30us", "read 16MB", "nothing"};
        std::printf("%-26s %-10s prefetch %6.1f MB of %6.1f: %7.2f us (%.2f TB/s eff)\n", sh.name, bn[between],
                    xb / mb, wbytes / mb, t[t.size() / 2], wbytes / (t[t.size() / 2] * 1e-6) / 1e12);
      }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(lw);
    cublasLtMatrixLayoutDestroy(lx);
    cublasLtMatrixLayoutDestroy(ly);
    cublasLtMatmulDescDestroy(op);
    cudaFree(w);
    cudaFree(x);
    cudaFree(y);
  }
  return 0;
}
