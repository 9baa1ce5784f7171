#pragma once
// Next-token sampling on the GPU, one row of fp32 logits per sequence, with the semantics of
// the CPU Sampler (engine/sampler.h): temperature 0 = greedy (lowest index among equal maxima);
// otherwise softmax(logits / temperature), then top-k, top-p (smallest set of most likely
// tokens whose mass reaches top_p), min-p (drop p < min_p * p_max), renormalise, draw. Only the
// first `vocab` logits of a row are candidates (padding rows beyond the tokenizer are never
// drawn). The draw uses a counter-based RNG keyed by (seed, step), so a row's result depends
// on its own parameters only, never on the batch it ran in.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace spin::cuda {

struct SamplingRow {
  float temperature = 1.0f;
  int top_k = 0;        // 0 = off
  float top_p = 1.0f;   // 1 = off
  float min_p = 0.0f;   // 0 = off
  uint64_t seed = 0;
  uint64_t step = 0;    // advances per sampled token of the sequence
};

// Bytes of workspace sample_tokens needs for rows x vocab.
size_t sampling_workspace_bytes(int64_t rows, int64_t vocab);

// logits: [rows][row_stride] fp32 (device); params: [rows] (device); out: [rows] (device).
cudaError_t sample_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                          const SamplingRow* params, int32_t* out, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace spin::cuda
