// Experiment (session 30): which of Qwen3-14B's decode products make cuBLASLt add a memset node to
// a captured graph, what the heuristic's memset-free candidates cost, and whether a 40-layer chain
// built from them runs or launches faster. Products as GemmRunner plans them (bf16, fp32 compute,
// 32 MiB workspace, no reduction-scheme mask); chains captured in one graph; medians of replays.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)
#define LK(x)                                                                  \
  do {                                                                         \
    cublasStatus_t s_ = (x);                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, (int)s_); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

using bf16 = __nv_bfloat16;

static cublasLtHandle_t lt;
static void* ws;
static const size_t kWs = size_t{32} << 20;

struct Gemm {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t w, a, o;
};

static unsigned cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &w);
  return v;
}

static Gemm make_gemm(long long out, long long in, long long rows) {
  Gemm g;
  LK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  LK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
  LK(cublasLtMatrixLayoutCreate(&g.w, CUDA_R_16BF, in, out, in));
  LK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, in, rows, in));
  LK(cublasLtMatrixLayoutCreate(&g.o, CUDA_R_16BF, out, rows, out));
  return g;
}

static std::vector<cublasLtMatmulHeuristicResult_t> candidates(const Gemm& g, int n) {
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = kWs;
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  std::vector<cublasLtMatmulHeuristicResult_t> r(n);
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.w, g.a, g.o, g.o, pref, n, r.data(), &found) != CUBLAS_STATUS_SUCCESS)
    found = 0;
  cublasLtMatmulPreferenceDestroy(pref);
  r.resize(found);
  return r;
}

static void run_gemm(const Gemm& g, const cublasLtMatmulAlgo_t& algo, const bf16* w, const bf16* a, bf16* o,
                     cudaStream_t s) {
  float alpha = 1, beta = 0;
  LK(cublasLtMatmul(lt, g.op, &alpha, w, g.w, a, g.a, &beta, o, g.o, o, g.o, &algo, ws, kWs, s));
}

struct Nodes { int kernels = 0, memsets = 0, other = 0; };

static Nodes count_nodes(cudaGraph_t graph) {
  size_t n = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CK(cudaGraphGetNodes(graph, nodes.data(), &n));
  Nodes c;
  for (auto node : nodes) {
    cudaGraphNodeType t;
    CK(cudaGraphNodeGetType(node, &t));
    (t == cudaGraphNodeTypeKernel ? c.kernels : t == cudaGraphNodeTypeMemset ? c.memsets : c.other)++;
  }
  return c;
}

struct Timing { double gpu_ms, host_us; Nodes nodes; };

template <class Body>
static Timing time_graph(cudaStream_t s, int reps, Body&& body) {
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  body();
  CK(cudaStreamEndCapture(s, &graph));
  Timing t;
  t.nodes = count_nodes(graph);
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphDestroy(graph));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  std::vector<double> ms, host;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    const auto h0 = std::chrono::steady_clock::now();
    CK(cudaGraphLaunch(exec, s));
    const auto h1 = std::chrono::steady_clock::now();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float e;
    CK(cudaEventElapsedTime(&e, a, b));
    ms.push_back(e);
    host.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::sort(host.begin(), host.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  t.gpu_ms = ms[ms.size() / 2];
  t.host_us = host[host.size() / 2];
  return t;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  struct Model { const char* name; int layers; long long h, qkv, ff, vocab; };
  const Model models[] = {{"qwen3-14b", 40, 5120, 7168, 17408, 151936}, {"llama-3.1-8b", 32, 4096, 6144, 14336, 128256}};
  LK(cublasLtCreate(&lt));
  CK(cudaMalloc(&ws, kWs));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const Model& m : models) {
    const int L = m.layers;
    struct Shape { const char* name; long long out, in; };
    const Shape shapes[] = {{"qkv", m.qkv, m.h}, {"o", m.h, m.h}, {"gate_up", 2 * m.ff, m.h}, {"down", m.h, m.ff},
                            {"head", m.vocab, m.h}};
    std::vector<bf16*> weights[5];
    for (int p = 0; p < 5; ++p) {
      const int copies = p == 4 ? 1 : L;
      for (int l = 0; l < copies; ++l) {
        bf16* w;
        const size_t bytes = size_t(shapes[p].out) * shapes[p].in * 2;
        CK(cudaMalloc(&w, bytes));
        CK(cudaMemset(w, 0, bytes));
        weights[p].push_back(w);
      }
    }
    bf16 *x, *y;
    CK(cudaMalloc(&x, 8 * m.vocab * 2));
    CK(cudaMalloc(&y, 8 * m.vocab * 2));
    CK(cudaMemset(x, 0, 8 * m.vocab * 2));

    std::printf("\n## %s: the heuristic's candidates (us per product over %d weight copies; nodes of one product's graph)\n\n",
                m.name, L);
    std::printf("| product | rows | # | splitK | reduction | tile | ws KB | kernels | memsets | us | TB/s |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (long long rows : {1LL, 8LL}) {
      cublasLtMatmulAlgo_t first[5], quiet[5];
      bool has_quiet[5] = {};
      for (int p = 0; p < 5; ++p) {
        const Shape& sh = shapes[p];
        Gemm g = make_gemm(sh.out, sh.in, rows);
        auto cands = candidates(g, 8);
        for (size_t c = 0; c < cands.size(); ++c) {
          const cublasLtMatmulAlgo_t algo = cands[c].algo;
          const Timing one = time_graph(s, 3, [&] { run_gemm(g, algo, weights[p][0], x, y, s); });
          const int n = int(weights[p].size()) == 1 ? 8 : L;
          const Timing chain = time_graph(s, reps, [&] {
            for (int l = 0; l < n; ++l) run_gemm(g, algo, weights[p][l % weights[p].size()], x, y, s);
          });
          const double us = chain.gpu_ms * 1e3 / n;
          std::printf("| %s | %lld | %zu | %u | %u | %u | %zu | %d | %d | %.2f | %.2f |\n", sh.name, rows, c,
                      cfg(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                      cfg(algo, CUBLASLT_ALGO_CONFIG_TILE_ID), cands[c].workspaceSize / 1024, one.nodes.kernels,
                      one.nodes.memsets, us, double(sh.out) * sh.in * 2 / (us * 1e-6) / 1e12);
          if (c == 0) first[p] = algo;
          if (!has_quiet[p] && one.nodes.memsets == 0) {
            quiet[p] = algo;
            has_quiet[p] = true;
          }
        }
        if (!has_quiet[p]) quiet[p] = first[p];
      }
      // The whole chain: every layer's four products, then the head, with each product's first
      // candidate or its first candidate without a memset.
      Gemm g[5];
      for (int p = 0; p < 5; ++p) g[p] = make_gemm(shapes[p].out, shapes[p].in, rows);
      for (int variant = 0; variant < 2; ++variant) {
        const cublasLtMatmulAlgo_t* algos = variant == 0 ? first : quiet;
        std::vector<Timing> ts;
        for (int round = 0; round < 3; ++round)
          ts.push_back(time_graph(s, reps, [&] {
            for (int l = 0; l < L; ++l)
              for (int p = 0; p < 4; ++p) run_gemm(g[p], algos[p], weights[p][l], x, y, s);
            run_gemm(g[4], algos[4], weights[4][0], x, y, s);
          }));
        std::printf("\n- %s rows %lld, chain with %s: kernels %d, memsets %d; GPU ms per round %.3f %.3f %.3f; "
                    "cudaGraphLaunch host us %.1f %.1f %.1f\n",
                    m.name, rows, variant == 0 ? "first candidates" : "first memset-free candidates",
                    ts[0].nodes.kernels, ts[0].nodes.memsets, ts[0].gpu_ms, ts[1].gpu_ms, ts[2].gpu_ms,
                    ts[0].host_us, ts[1].host_us, ts[2].host_us);
      }
      std::printf("\n");
    }
    for (auto& v : weights)
      for (bf16* w : v) CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  return 0;
}
