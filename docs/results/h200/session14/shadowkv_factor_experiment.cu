// Where ShadowKV's first decode step goes: the library calls of engine/cuda/shadowkv_factors.cpp at
// Qwen3-14B's shape (38 sparse layers, 8 KV heads x 128 = 1024-wide keys, 32K-token prompt, rank
// 160), each timed alone, with the alternatives for the eigensolver and TF32 for the products.
// Build: nvcc -O2 -std=c++17 -arch=sm_90 shadowkv_factor_experiment.cu -lcublas -lcusolver
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x) do { auto e_ = (x); if (static_cast<int>(e_) != 0) { std::printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, static_cast<int>(e_)); std::exit(1); } } while (0)

__global__ void fill(float* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = (h & 0xffff) / 65536.0f - 0.5f;
  }
}

int main() {
  const int layers = 38, width = 1024, tokens = 32768, chunk = 8192, rank = 160;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t blas;
  cusolverDnHandle_t solver;
  cusolverDnParams_t params;
  CK(cublasCreate(&blas));
  CK(cublasSetStream(blas, s));
  CK(cusolverDnCreate(&solver));
  CK(cusolverDnSetStream(solver, s));
  CK(cusolverDnCreateParams(&params));
  float *keys, *gram, *work_gram, *values, *coeffs;
  int* info;
  const size_t matrix = size_t{width} * width;
  CK(cudaMalloc(&keys, size_t{chunk} * width * 4));
  CK(cudaMalloc(&gram, matrix * layers * 4));
  CK(cudaMalloc(&work_gram, matrix * layers * 4));
  CK(cudaMalloc(&values, size_t{width} * layers * 4));
  CK(cudaMalloc(&coeffs, size_t{tokens} * rank * 4));
  CK(cudaMalloc(&info, layers * 4));
  fill<<<1024, 256, 0, s>>>(keys, size_t{chunk} * width, 1);
  const float one = 1.0f, zero = 0.0f;
  const auto time = [&](const char* what, int reps, const std::function<void()>& f) {
    f();
    CK(cudaStreamSynchronize(s));
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      const auto t = std::chrono::steady_clock::now();
      f();
      CK(cudaStreamSynchronize(s));
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf("%-60s %9.2f ms (median of %d)\n", what, ms[ms.size() / 2], reps);
  };
  const auto grams = [&] {
    for (int l = 0; l < layers; ++l)
      for (int c = 0; c < tokens / chunk; ++c)
        CK(cublasSsyrk(blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, width, chunk, &one, keys, width, c == 0 ? &zero : &one,
                       gram + matrix * l, width));
  };
  const auto products = [&] {
    for (int l = 0; l < layers; ++l)
      for (int c = 0; c < tokens / chunk; ++c)
        CK(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, rank, chunk, width, &one, gram + matrix * l + static_cast<size_t>(width - rank) * width,
                       width, keys, width, &zero, coeffs + size_t{c} * chunk * rank, rank));
  };
  time("Gram matrices, SSYRK fp32, 38 layers x 4 chunks", 5, grams);
  time("coefficients, SGEMM fp32, 38 layers x 4 chunks", 5, products);
  CK(cublasSetMathMode(blas, CUBLAS_TF32_TENSOR_OP_MATH));
  time("Gram matrices, SSYRK with TF32 math mode", 5, grams);
  time("Gram matrices, SGEMM K Kt (full) with TF32 math mode", 5, [&] {
    for (int l = 0; l < layers; ++l)
      for (int c = 0; c < tokens / chunk; ++c)
        CK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, width, width, chunk, &one, keys, width, keys, width,
                       c == 0 ? &zero : &one, gram + matrix * l, width));
  });
  time("coefficients, SGEMM with TF32 math mode", 5, products);
  CK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  grams();
  CK(cudaStreamSynchronize(s));
  const auto restore = [&] { CK(cudaMemcpyAsync(work_gram, gram, matrix * layers * 4, cudaMemcpyDeviceToDevice, s)); };
  time("restore copy alone", 5, restore);

  size_t dev = 0, host = 0;
  CK(cusolverDnXsyevBatched_bufferSize(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, width, CUDA_R_32F,
                                       work_gram, width, CUDA_R_32F, values, CUDA_R_32F, &dev, &host, layers));
  void* dwork;
  CK(cudaMalloc(&dwork, std::max<size_t>(dev, 1)));
  std::vector<char> hwork(std::max<size_t>(host, 1));
  time("XsyevBatched, 38 x 1024 (+ restore)", 3, [&] {
    restore();
    CK(cusolverDnXsyevBatched(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, width, CUDA_R_32F, work_gram,
                              width, CUDA_R_32F, values, CUDA_R_32F, dwork, dev, hwork.data(), host, info, layers));
  });
  size_t dev1 = 0, host1 = 0;
  CK(cusolverDnXsyevd_bufferSize(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, width, CUDA_R_32F,
                                 work_gram, width, CUDA_R_32F, values, CUDA_R_32F, &dev1, &host1));
  void* dwork1;
  CK(cudaMalloc(&dwork1, std::max<size_t>(dev1, 1)));
  std::vector<char> hwork1(std::max<size_t>(host1, 1));
  time("Xsyevd, one call per layer, 38 x 1024 (+ restore)", 3, [&] {
    restore();
    for (int l = 0; l < layers; ++l)
      CK(cusolverDnXsyevd(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, width, CUDA_R_32F,
                          work_gram + matrix * l, width, CUDA_R_32F, values + width * l, CUDA_R_32F, dwork1, dev1,
                          hwork1.data(), host1, info));
  });
  size_t dev2 = 0, host2 = 0;
  int64_t found = 0;
  CK(cusolverDnXsyevdx_bufferSize(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER,
                                  width, CUDA_R_32F, work_gram, width, nullptr, nullptr, width - rank + 1, width, &found,
                                  CUDA_R_32F, values, CUDA_R_32F, &dev2, &host2));
  void* dwork2;
  CK(cudaMalloc(&dwork2, std::max<size_t>(dev2, 1)));
  std::vector<char> hwork2(std::max<size_t>(host2, 1));
  time("Xsyevdx, top 160 only, one call per layer (+ restore)", 3, [&] {
    restore();
    for (int l = 0; l < layers; ++l)
      CK(cusolverDnXsyevdx(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER, width,
                           CUDA_R_32F, work_gram + matrix * l, width, nullptr, nullptr, width - rank + 1, width, &found,
                           CUDA_R_32F, values + width * l, CUDA_R_32F, dwork2, dev2, hwork2.data(), host2, info));
  });
  std::printf("workspace: batched %zu / %zu B, syevd %zu / %zu B, syevdx %zu / %zu B (device / host)\n", dev, host, dev1,
              host1, dev2, host2);
  return 0;
}
