#include "kernels/cuda/sampling.h"

#include <cub/block/block_reduce.cuh>
#include <curand_kernel.h>

#include <climits>

#include "kernels/cuda/launch.cuh"

// How a row is sampled (one thread block per row, no workspace, no sort):
//  * Every filter keeps a prefix of the row in the order (logit descending, index ascending), the
//    CPU Sampler's order, so each is a cut {key, last index} in that order. Logits are compared
//    through an order-preserving 32-bit key.
//  * Probabilities are exp((logit - max) / temperature) as on the CPU, then fixed-point masses
//    (p * 2^s with s chosen so the row's total fits 64 bits): every sum below is an exact,
//    order-independent integer, so a row's draw is deterministic whatever the thread schedule.
//    (Tokens with p below 2^-s, about 1e-14 for a 256K vocabulary, get mass 0.)
//  * top-k and top-p locate their cut by a radix descent over the key, 4 bits per pass over the
//    row (at most 8 passes): each thread counts into its own shared-memory histogram column (no
//    atomics), the block sums the 16 bins and walks them from the top until the target count
//    (top-k) or mass (top-p: ceil(top_p * total)) is reached. Ties at the cut key are then split
//    in index order by one more pass, as the CPU's stable order does. min-p is a per-token test.
//  * The draw: u = uniform in [0, kept mass) from Philox keyed by (seed, step), then the token
//    whose cumulative mass interval (in index order) holds u.
namespace spin::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 4;
constexpr int kBins = 1 << kDigitBits;
static_assert(kBins <= kWarps, "one warp sums each histogram bin");
constexpr int kUnroll = 8;  // loads in flight per thread in a pass over the row
constexpr int32_t kAllTies = INT32_MAX;
constexpr int64_t kMaxVocab = int64_t{1} << 30;
constexpr size_t kHistogramBytes = sizeof(uint64_t) * kBins * kThreads;

// Order-preserving key: a > b as floats <=> key(a) > key(b). Inputs are never NaN or -0.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_to_logit(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ uint64_t warp_inclusive_sum(uint64_t v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint64_t other = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

// A prefix of the row in (logit descending, index ascending) order: every key above `key`, and
// the tokens at `key` up to index `last`.
struct Cut {
  uint32_t key = 0;
  int32_t last = kAllTies;
  __device__ bool keeps(uint32_t k, int32_t i) const { return k > key || (k == key && i <= last); }
};

struct Row {
  const float* logits = nullptr;
  int32_t vocab = 0;
  float top = 0.0f;    // largest logit
  float inv_t = 1.0f;  // 1 / temperature
  float min_p = 0.0f;
  float mass_scale = 1.0f;  // 2^s
  Cut top_k;
  Cut top_p;

  // NaN never wins (it reads as -inf); -0 reads as +0 so equal logits share one key.
  __device__ static float clean(float x) {
    if (isnan(x)) return -INFINITY;
    return x == 0.0f ? 0.0f : x;
  }
  __device__ float logit(int32_t i) const { return clean(__ldg(logits + i)); }
  __device__ float prob(float x) const { return x == top ? 1.0f : expf((x - top) * inv_t); }
  __device__ uint64_t mass(float p) const { return __float2ull_rn(p * mass_scale); }
  // Survives top-k and min-p (what top-p's mass is measured on).
  __device__ bool pre_top_p(uint32_t key, int32_t i, float p) const {
    return top_k.keeps(key, i) && p >= min_p;
  }
  __device__ uint64_t kept_mass(float x, int32_t i) const {
    const uint32_t key = order_key(x);
    const float p = prob(x);
    return pre_top_p(key, i, p) && top_p.keeps(key, i) ? mass(p) : 0;
  }

  // f(x, i) for every token, in no particular order: strided over the block, kUnroll loads in
  // flight per thread, 16 bytes each where the row is aligned (one block reads a whole row, so
  // the bytes in flight set its speed: at batch 1 the greedy pass over a 128K vocabulary is most
  // of the draw).
  template <typename F>
  __device__ void for_each(F&& f) const {
    int32_t scalar_from = 0;
    if ((reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
      const int32_t quads = vocab / 4;
      const float4* quad = reinterpret_cast<const float4*>(logits);
      for (int32_t base = threadIdx.x; base < quads; base += kUnroll * kThreads) {
        float4 x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int32_t j = base + u * kThreads;
          x[u] = j < quads ? __ldg(quad + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int32_t j = base + u * kThreads;
          if (j < quads) {
            f(clean(x[u].x), 4 * j);
            f(clean(x[u].y), 4 * j + 1);
            f(clean(x[u].z), 4 * j + 2);
            f(clean(x[u].w), 4 * j + 3);
          }
        }
      }
      scalar_from = quads * 4;
    }
    for (int32_t base = scalar_from + threadIdx.x; base < vocab; base += kUnroll * kThreads) {
      float x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t i = base + u * kThreads;
        x[u] = i < vocab ? logit(i) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t i = base + u * kThreads;
        if (i < vocab) f(x[u], i);
      }
    }
  }
};

struct Shared {
  typename cub::BlockReduce<uint64_t, kThreads>::TempStorage reduce;
  uint64_t bins[kBins];
  uint64_t warp_totals[kWarps];
  uint32_t prefix;
  uint64_t above;
  uint64_t need;
  uint64_t ties;
  uint64_t random;
  int32_t located;
};

// Where a radix descent stopped: the cut key, the weight strictly above it, the weight still
// needed from the tokens at the key (>= 1), and their whole weight.
struct Descent {
  uint32_t key;
  uint64_t above;
  uint64_t need;
  uint64_t ties;
};

// Finds the key at which the weight of the tokens, taken in descending key order, reaches
// target_of(total weight). Tokens of nonzero weight must have keys in [lo_key, hi_key].
template <typename Weight, typename Target>
__device__ Descent descend(const Row& row, uint32_t lo_key, uint32_t hi_key, Weight weight,
                           Target target_of, Shared& sh, uint64_t* histogram) {
  const uint32_t differ = lo_key ^ hi_key;
  const int levels = differ ? (32 - __clz(differ) + kDigitBits - 1) / kDigitBits : 1;
  const int top_bits = levels * kDigitBits;
  uint32_t prefix = top_bits >= 32 ? 0u : (hi_key & (~0u << top_bits));
  uint64_t* mine = histogram + threadIdx.x;  // column [bin * kThreads + thread]: no bank conflicts
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int level = levels - 1; level >= 0; --level) {
    const int shift = level * kDigitBits;
    const uint32_t mask = shift + kDigitBits >= 32 ? 0u : (~0u << (shift + kDigitBits));
#pragma unroll
    for (int b = 0; b < kBins; ++b) mine[b * kThreads] = 0;
    row.for_each([&](float x, int32_t i) {
      const uint32_t key = order_key(x);
      if ((key & mask) == prefix) mine[((key >> shift) & (kBins - 1)) * kThreads] += weight(x, key, i);
    });
    __syncthreads();
    if (warp < kBins) {
      uint64_t s = 0;
      for (int t = lane; t < kThreads; t += 32) s += histogram[warp * kThreads + t];
      s = warp_sum(s);
      if (lane == 0) sh.bins[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (level == levels - 1) {
        uint64_t total = 0;
        for (int b = 0; b < kBins; ++b) total += sh.bins[b];
        const uint64_t target = target_of(total);
        sh.need = target < 1 ? 1 : (target > total ? total : target);
        sh.above = 0;
      }
      uint64_t acc = 0;
      int b = kBins - 1;
      for (; b > 0 && acc + sh.bins[b] < sh.need; --b) acc += sh.bins[b];
      sh.above += acc;
      sh.need -= acc;
      sh.ties = sh.bins[b];
      sh.prefix = prefix | (static_cast<uint32_t>(b) << shift);
    }
    __syncthreads();
    prefix = sh.prefix;
  }
  const Descent d{sh.prefix, sh.above, sh.need, sh.ties};
  __syncthreads();  // sh is reused by the next step
  return d;
}

// The token whose interval [cumulative weight before it, + its weight) in index order holds
// position_of(total weight). Warp w scans the w-th contiguous segment of the row; the warp whose
// segment holds the position walks it 32 tokens at a time. Returns `fallback` if none does.
template <typename Weight, typename Position>
__device__ int32_t locate(const Row& row, Weight weight, Position position_of, int32_t fallback,
                          Shared& sh) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int32_t segment = ((row.vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int32_t begin = warp * segment;
  const int32_t end = min(row.vocab, begin + segment);
  uint64_t s = 0;
  for (int32_t i = begin + lane; i < end; i += 32) s += weight(row.logit(i), i);
  s = warp_sum(s);
  if (lane == 0) sh.warp_totals[warp] = s;
  if (threadIdx.x == 0) sh.located = fallback;
  __syncthreads();
  uint64_t before = 0, total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sh.warp_totals[w];
    total += sh.warp_totals[w];
  }
  const uint64_t pos = position_of(total);
  if (pos >= before && pos - before < sh.warp_totals[warp]) {
    for (int32_t base = begin; base < end; base += 32) {
      const int32_t i = base + lane;
      const uint64_t w = i < end ? weight(row.logit(i), i) : 0;
      const uint64_t inclusive = warp_inclusive_sum(w);
      const uint64_t step_total = __shfl_sync(0xffffffffu, inclusive, 31);
      if (pos - before < step_total) {
        const uint64_t offset = pos - before;
        if (offset >= inclusive - w && offset < inclusive) sh.located = i;
        break;
      }
      before += step_total;
    }
  }
  __syncthreads();
  const int32_t result = sh.located;
  __syncthreads();
  return result;
}

struct MaxOp {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};
struct MinOp {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a < b ? a : b; }
};

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, int32_t vocab, int64_t row_stride,
                  const SamplingRow* __restrict__ params, int32_t* __restrict__ out,
                  float mass_scale) {
  enter_dependent_grid();
  extern __shared__ uint64_t histogram[];  // [kBins][kThreads]
  __shared__ Shared sh;
  __shared__ uint64_t best_shared, lowest_shared;
  const SamplingRow prm = params[blockIdx.x];
  Row row;
  row.logits = logits + static_cast<int64_t>(blockIdx.x) * row_stride;
  row.vocab = vocab;
  row.mass_scale = mass_scale;

  // Pass 1: the largest key with the lowest index among equals (packed so one max finds both),
  // and the smallest key (bounds the radix descents).
  uint64_t best = 0;
  uint32_t lowest = 0xffffffffu;
  row.for_each([&](float x, int32_t i) {
    const uint32_t key = order_key(x);
    const uint64_t packed = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    best = packed > best ? packed : best;
    lowest = key < lowest ? key : lowest;
  });
  best = cub::BlockReduce<uint64_t, kThreads>(sh.reduce).Reduce(best, MaxOp{});
  __syncthreads();
  const uint64_t low = cub::BlockReduce<uint64_t, kThreads>(sh.reduce).Reduce(lowest, MinOp{});
  if (threadIdx.x == 0) {
    best_shared = best;
    lowest_shared = low;
  }
  __syncthreads();
  const uint32_t max_key = static_cast<uint32_t>(best_shared >> 32);
  const uint32_t min_key = static_cast<uint32_t>(lowest_shared);
  const int32_t argmax = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(best_shared));
  row.top = key_to_logit(max_key);

  if (!(prm.temperature > 0.0f) || prm.top_k == 1 || row.top == -INFINITY) {
    if (threadIdx.x == 0) out[blockIdx.x] = argmax;
    return;
  }
  row.inv_t = 1.0f / prm.temperature;
  row.min_p = fminf(fmaxf(prm.min_p, 0.0f), 1.0f);  // NaN reads as off; the top token always stays

  if (prm.top_k > 0 && prm.top_k < vocab) {
    const uint64_t k = static_cast<uint64_t>(prm.top_k);
    const Descent d = descend(
        row, min_key, max_key, [](float, uint32_t, int32_t) -> uint64_t { return 1; },
        [k](uint64_t) { return k; }, sh, histogram);
    row.top_k.key = d.key;
    if (d.need < d.ties) {
      row.top_k.last = locate(
          row,
          [&](float x, int32_t) -> uint64_t { return order_key(x) == d.key ? 1 : 0; },
          [&](uint64_t) { return d.need - 1; }, kAllTies, sh);
    }
  }

  if (prm.top_p < 1.0f) {
    const double top_p = prm.top_p;
    const Descent d = descend(
        row, row.top_k.key > min_key ? row.top_k.key : min_key, max_key,
        [&](float x, uint32_t key, int32_t i) -> uint64_t {
          const float p = row.prob(x);
          return row.pre_top_p(key, i, p) ? row.mass(p) : 0;
        },
        [top_p](uint64_t total) {
          return static_cast<uint64_t>(ceil(top_p * static_cast<double>(total)));
        },
        sh, histogram);
    // All tokens at the cut key have one logit, so one mass: take whole ones until the need is met.
    const uint64_t each = row.mass(row.prob(key_to_logit(d.key)));
    const uint64_t needed = (d.need + each - 1) / each;
    row.top_p.key = d.key;
    if (needed < d.ties / each) {
      row.top_p.last = locate(
          row,
          [&](float x, int32_t i) -> uint64_t {
            const uint32_t key = order_key(x);
            return key == d.key && row.top_k.keeps(key, i) ? 1 : 0;
          },
          [&](uint64_t) { return needed - 1; }, kAllTies, sh);
    }
  }

  if (threadIdx.x == 0) {
    curandStatePhilox4_32_10_t state;
    curand_init(prm.seed, prm.step, 0, &state);
    const uint4 r = curand4(&state);
    sh.random = (static_cast<uint64_t>(r.x) << 32) | r.y;
  }
  __syncthreads();
  const uint64_t random = sh.random;
  const int32_t token = locate(
      row, [&](float x, int32_t i) { return row.kept_mass(x, i); },
      [random](uint64_t total) { return __umul64hi(random, total); }, argmax, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = token;
}

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

}  // namespace

size_t sampling_workspace_bytes(int64_t, int64_t) { return 0; }

cudaError_t sample_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                          const SamplingRow* params, int32_t* out, void*, size_t,
                          cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || vocab <= 0 || vocab > kMaxVocab || row_stride < vocab)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!logits || !params || !out) return cudaErrorInvalidValue;
  // Each token's mass is at most 2^s and the row holds at most 2^ceil_log2(vocab) of them.
  const float mass_scale = ldexpf(1.0f, 63 - ceil_log2(vocab));
  const cudaError_t attr = cudaFuncSetAttribute(
      sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kHistogramBytes));
  if (attr != cudaSuccess) return attr;
  launch(sample_kernel, static_cast<unsigned>(rows), kThreads, kHistogramBytes, stream,
      logits, static_cast<int32_t>(vocab), row_stride, params, out, mass_scale);
  return cudaGetLastError();
}

}  // namespace spin::cuda
