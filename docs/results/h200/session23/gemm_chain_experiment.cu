// Experiment (session 23): does prefetching the next product's weights into L2 during the short
// kernels between products shorten a batch-1 decode chain? Llama-3.1-8B's shapes, 32 layers,
// cuBLASLt products (heuristic's first algorithm, as GemmRunner), a 134 MB streaming read standing
// in for 32K-token attention, and short one-block kernels standing in for RoPE / store / merge /
// norms / SiLU. Whole chain captured in one CUDA graph; medians of replays.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)
#define LK(x)                                                      \
  do {                                                             \
    cublasStatus_t s_ = (x);                                       \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                             \
      std::fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, (int)s_); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

using bf16 = __nv_bfloat16;

struct Prefetch {
  const char* base = nullptr;
  long long rows = 0, row_bytes = 0;  // the weight matrix
  long long bytes = 0;                // 0: none
  int mode = 0;                       // 0 linear prefix, 1 prefix of every row
  int evict_last = 0;
};

__device__ __forceinline__ void bulk_prefetch(const void* p, unsigned bytes, int evict_last) {
  if (evict_last) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(bytes), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  }
}

// Block 0: a short dependent op (reads 8 KB, writes 8 KB). Blocks 1..: prefetch.
__global__ void short_op(const float* x, float* y, int n, Prefetch pf) {
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * 1.0001f + 1e-7f;
    return;
  }
  if (pf.bytes == 0) return;
  const long long t = (long long)(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const long long threads = (long long)(gridDim.x - 1) * blockDim.x;
  if (pf.mode == 0) {
    const long long piece = 16384;
    for (long long off = t * piece; off < pf.bytes; off += threads * piece) {
      const long long len = min(piece, pf.bytes - off);
      bulk_prefetch(pf.base + off, (unsigned)len, pf.evict_last);
    }
  } else {
    long long per_row = pf.bytes / pf.rows / 16 * 16;
    if (per_row < 16) per_row = 16;
    if (per_row > pf.row_bytes) per_row = pf.row_bytes;
    for (long long r = t; r < pf.rows; r += threads) bulk_prefetch(pf.base + r * pf.row_bytes, (unsigned)per_row, pf.evict_last);
  }
}

__global__ void stream_read(const uint4* p, long long n, float* out) {
  float acc = 0.f;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);
    acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) + __uint_as_float(v.w);
  }
  if (acc == 12345.f) out[0] = acc;
}


struct Gemm {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t w, a, o;
  cublasLtMatmulAlgo_t algo;
};

static cublasLtHandle_t lt;
static void* ws;
static const size_t kWs = 32 << 20;

static unsigned cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &w);
  return v;
}

// Candidates of the heuristic (up to n) with a reduction-scheme mask.
std::vector<cublasLtMatmulHeuristicResult_t> candidates(Gemm& g, long long out, long long in, long long rows, uint32_t mask, int n) {
  LK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
  LK(cublasLtMatrixLayoutCreate(&g.w, CUDA_R_16BF, in, out, in));
  LK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, in, rows, in));
  LK(cublasLtMatrixLayoutCreate(&g.o, CUDA_R_16BF, out, rows, out));
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = kWs;
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
  std::vector<cublasLtMatmulHeuristicResult_t> r(n);
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.w, g.a, g.o, g.o, pref, n, r.data(), &found);
  if (st != CUBLAS_STATUS_SUCCESS) found = 0;
  r.resize(found);
  return r;
}

void run_gemm(const Gemm& g, const cublasLtMatmulAlgo_t& algo, const bf16* w, const bf16* a, bf16* o, cudaStream_t s) {
  float alpha = 1, beta = 0;
  LK(cublasLtMatmul(lt, g.op, &alpha, w, g.w, a, g.a, &beta, o, g.o, o, g.o, &algo, ws, kWs, s));
}

__global__ void short_pdl(const float* x, float* y, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * 1.0001f + 1e-7f;
}

void launch_short(const float* x, float* y, int n, cudaStream_t s) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3((n + 255) / 256);
  c.blockDim = dim3(256);
  c.stream = s;
  cudaLaunchAttribute at[1] = {};
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at;
  c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, short_pdl, x, y, n));
}

// Split-K as a strided batch: chunk j of K for every product, fp32 partials [s][rows][out], no
// reduction kernel (the next kernel sums the partials).
std::vector<cublasLtMatmulHeuristicResult_t> batched(Gemm& g, long long out, long long in, long long rows, int splits, int n) {
  LK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
  const long long k = in / splits;
  LK(cublasLtMatrixLayoutCreate(&g.w, CUDA_R_16BF, k, out, in));
  LK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, k, rows, in));
  LK(cublasLtMatrixLayoutCreate(&g.o, CUDA_R_32F, out, rows, out));
  int32_t count = splits;
  long long wo = k, ao = k, oo = out * rows;
  for (auto* l : {g.w, g.a, g.o}) LK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  LK(cublasLtMatrixLayoutSetAttribute(g.w, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &wo, sizeof(wo)));
  LK(cublasLtMatrixLayoutSetAttribute(g.a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &ao, sizeof(ao)));
  LK(cublasLtMatrixLayoutSetAttribute(g.o, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &oo, sizeof(oo)));
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = kWs;
  uint32_t mask = 1;  // no separate reduction
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
  std::vector<cublasLtMatmulHeuristicResult_t> r(n);
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.w, g.a, g.o, g.o, pref, n, r.data(), &found) != CUBLAS_STATUS_SUCCESS) found = 0;
  r.resize(found);
  return r;
}

void run_gemm_any(const Gemm& g, const cublasLtMatmulAlgo_t& algo, const bf16* w, const bf16* a, void* o, cudaStream_t s) {
  float alpha = 1, beta = 0;
  LK(cublasLtMatmul(lt, g.op, &alpha, w, g.w, a, g.a, &beta, o, g.o, o, g.o, &algo, ws, kWs, s));
}

// Norm stand-in: sums `parts` fp32 partials (or reads bf16 when parts == 0) of `n` values per row.
__global__ void norm_standin(const void* in, int parts, int n, int rows, float* y) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int row = blockIdx.x;
  float acc = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = 0.f;
    if (parts == 0) v = __bfloat162float(reinterpret_cast<const bf16*>(in)[(size_t)row * n + i]);
    for (int p = 0; p < parts; ++p) v += reinterpret_cast<const float*>(in)[((size_t)p * rows + row) * n + i];
    acc += v * v;
  }
  if (acc == 1234.5f) y[row] = acc;
}

void launch_norm(const void* in, int parts, int n, int rows, float* y, cudaStream_t s) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(rows);
  c.blockDim = dim3(1024);
  c.stream = s;
  cudaLaunchAttribute at[1] = {};
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at;
  c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, norm_standin, in, parts, n, rows, y));
}

int main(int argc, char** argv) {
  const int L = 32;
  const long long H = 4096, QKV = 6144, FF = 14336, V = 128256;
  const long long kv_bytes = 134217728;  // 32K tokens x 8 heads x 128 x 2 x 2 B
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  LK(cublasLtCreate(&lt));
  CK(cudaMalloc(&ws, kWs));
  struct Layer { bf16 *qkv, *o, *gu, *down; char* kv; } layers[L];
  for (int l = 0; l < L; ++l) {
    CK(cudaMalloc(&layers[l].qkv, QKV * H * 2));
    CK(cudaMalloc(&layers[l].o, H * H * 2));
    CK(cudaMalloc(&layers[l].gu, 2 * FF * H * 2));
    CK(cudaMalloc(&layers[l].down, H * FF * 2));
    CK(cudaMalloc(&layers[l].kv, kv_bytes));
    CK(cudaMemset(layers[l].qkv, 0, QKV * H * 2));
    CK(cudaMemset(layers[l].o, 0, H * H * 2));
    CK(cudaMemset(layers[l].gu, 0, 2 * FF * H * 2));
    CK(cudaMemset(layers[l].down, 0, H * FF * 2));
    CK(cudaMemset(layers[l].kv, 0, kv_bytes));
  }
  bf16* head;
  CK(cudaMalloc(&head, V * H * 2));
  CK(cudaMemset(head, 0, V * H * 2));
  bf16 *x, *y;
  float *fx, *fy, *sink;
  CK(cudaMalloc(&x, 8 * V * 2));
  CK(cudaMalloc(&y, 8 * V * 2));
  CK(cudaMemset(x, 0, 8 * V * 2));
  CK(cudaMalloc(&fx, 1 << 16));
  CK(cudaMalloc(&fy, 1 << 16));
  CK(cudaMemset(fx, 0, 1 << 16));
  CK(cudaMalloc(&sink, 64));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  auto time_graph = [&](auto&& body) {
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    body();
    CK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphDestroy(graph));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      CK(cudaEventRecord(a, s));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float t;
      CK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaGraphExecDestroy(exec));
    return ms[ms.size() / 2];
  };

  // Part 1: the heuristic's candidates for each decode product at 1 and 4 rows, timed as 32
  // products over 32 different weight matrices in one graph (each from HBM).
  struct Shape { const char* name; long long out, in; };
  Shape shapes[] = {{"qkv", QKV, H}, {"o", H, H}, {"gate_up", 2 * FF, H}, {"down", H, FF}};
  std::printf("## candidates (32 products in a graph, us per product; mask 7 = any reduction, 3 = none/in place)\n\n");
  std::printf("| product | rows | mask | # | splitK | reduction | tile | stages | ws KB | us | TB/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes)
    for (long long rows : {1LL, 4LL})
      for (uint32_t mask : {7u, 3u}) {
        Gemm g;
        auto cands = candidates(g, sh.out, sh.in, rows, mask, 6);
        for (size_t c = 0; c < cands.size(); ++c) {
          const cublasLtMatmulAlgo_t algo = cands[c].algo;
          const float ms = time_graph([&] {
            for (int l = 0; l < L; ++l) {
              const bf16* w = sh.out == QKV ? layers[l].qkv : sh.out == H && sh.in == H ? layers[l].o : sh.out == 2 * FF ? layers[l].gu : layers[l].down;
              run_gemm(g, algo, w, x, y, s);
            }
          });
          const double us = ms * 1e3 / L;
          std::printf("| %s | %lld | %u | %zu | %u | %u | %u | %u | %zu | %.2f | %.2f |\n", sh.name, rows, mask, c,
                      cfg(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                      cfg(algo, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                      cands[c].workspaceSize / 1024, us, sh.out * sh.in * 2 / (us * 1e-6) / 1e12);
        }
      }

  // Part 2: the cost of one short kernel in the chain: products + attention stand-in + N short
  // programmatic-launch kernels per layer.
  Gemm gq, go, ggu, gd, gh;
  auto pick = [&](Gemm& g, long long out, long long in) { return candidates(g, out, in, 1, 7u, 1)[0].algo; };
  const cublasLtMatmulAlgo_t aq = pick(gq, QKV, H), ao = pick(go, H, H), agu = pick(ggu, 2 * FF, H), ad = pick(gd, H, FF), ah = pick(gh, V, H);
  const double weight_bytes = (double)L * 2 * (QKV * H + H * H + 2 * FF * H + H * FF) + 2.0 * V * H;
  const double all_bytes = weight_bytes + (double)L * kv_bytes;
  std::printf("\n## chain (Llama-3.1-8B at batch 1, 32K; heuristic's first algorithms)\n\n| variant | round | ms | bytes / time TB/s |\n|---|---|---|---|\n");
  for (int round = 1; round <= 2; ++round)
    for (int shorts : {0, 3, 6, 9}) {
      for (int attn = 0; attn <= 1; ++attn) {
        if (!attn && shorts) continue;
        const float ms = time_graph([&] {
          for (int l = 0; l < L; ++l) {
            run_gemm(gq, aq, layers[l].qkv, x, y, s);
            for (int k = 0; k < shorts / 3; ++k) launch_short(fx, fy, 4096, s);
            if (attn) stream_read<<<sms * 4, 512, 0, s>>>(reinterpret_cast<const uint4*>(layers[l].kv), kv_bytes / 16, sink);
            run_gemm(go, ao, layers[l].o, x, y, s);
            for (int k = 0; k < shorts / 3; ++k) launch_short(fx, fy, 4096, s);
            run_gemm(ggu, agu, layers[l].gu, x, y, s);
            run_gemm(gd, ad, layers[l].down, x, y, s);
            for (int k = 0; k < shorts / 3; ++k) launch_short(fx, fy, 4096, s);
          }
          run_gemm(gh, ah, head, x, y, s);
        });
        const double bytes = attn ? all_bytes : weight_bytes;
        std::printf("| products%s + %d short kernels a layer | %d | %.3f | %.2f |\n", attn ? " + attention stand-in" : "", shorts, round, ms, bytes / (ms * 1e-3) / 1e12);
      }
    }

  // Part 3: o and down products followed by the norm that reads their output, as cuBLAS's split-K
  // (its own reduction kernel) or as a strided batch of K chunks whose fp32 partials the norm sums.
  {
    float* partials;
    CK(cudaMalloc(&partials, 8 * 8 * FF * 4 * 2));
    std::printf("\n## product + norm, 32 layers' weights in one graph (us per pair)\n\n| product | rows | variant | splitK | reduction | us | TB/s |\n|---|---|---|---|---|---|---|\n");
    for (int which = 0; which < 2; ++which)
      for (long long rows : {1LL, 8LL}) {
        const long long out = H, in = which == 0 ? H : FF;
        auto weight = [&](int l) { return which == 0 ? layers[l].o : layers[l].down; };
        Gemm g;
        const cublasLtMatmulAlgo_t heur = candidates(g, out, in, rows, 7u, 1)[0].algo;
        const float ms0 = time_graph([&] {
          for (int l = 0; l < L; ++l) {
            run_gemm(g, heur, weight(l), x, y, s);
            launch_norm(y, 0, (int)out, (int)rows, fy, s);
          }
        });
        std::printf("| %s | %lld | cuBLAS heuristic | %u | %u | %.2f | %.2f |\n", which ? "down" : "o", rows,
                    cfg(heur, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg(heur, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                    ms0 * 1e3 / L, out * in * 2 / (ms0 * 1e-3 / L) / 1e12);
        for (int splits : {1, 2, 3, 4, 6, 8}) {
          if (in % (splits * 64)) continue;
          Gemm b;
          auto cands = batched(b, out, in, rows, splits, 3);
          for (size_t c = 0; c < cands.size(); ++c) {
            const float ms = time_graph([&] {
              for (int l = 0; l < L; ++l) {
                run_gemm_any(b, cands[c].algo, weight(l), x, partials, s);
                launch_norm(partials, splits, (int)out, (int)rows, fy, s);
              }
            });
            std::printf("| %s | %lld | batch of %d K chunks, candidate %zu | %u | %u | %.2f | %.2f |\n", which ? "down" : "o",
                        rows, splits, c, cfg(cands[c].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                        cfg(cands[c].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), ms * 1e3 / L,
                        out * in * 2 / (ms * 1e-3 / L) / 1e12);
          }
        }
      }
  }
  return 0;
}
