// CPU forward-pass benchmark: prefill tok/s at 512 and 4096 prompt tokens and decode tok/s,
// next to the decode bound set by memory bandwidth measured in the same run
// (fp32 weight bytes read per token ÷ the read bandwidth of all the model's threads).
// Prints a markdown table.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/ops.h"
#include "model/contiguous_attention.h"
#include "model/loader.h"
#include "model/transformer.h"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Bytes read per second by the model's threads (an OpenMP sum over a buffer far larger than
// the caches): decode streams every weight once, so this is its ceiling.
double read_bandwidth(size_t bytes, int repeats) {
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  std::unique_ptr<float[]> data(new float[static_cast<size_t>(n)]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(i & 7);  // first touch per thread
  std::vector<double> rates;
  double checksum = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t = clock_type::now();
    double sum = 0.0;
    // 32 independent accumulators per block, so the adds never wait on each other.
    constexpr int64_t kLanes = 32, kBlock = 1024;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t b = 0; b < n / kBlock; ++b) {
      float acc[kLanes] = {};
      for (int64_t k = 0; k < kBlock; k += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += data[b * kBlock + k + j];
      }
      for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
    }
    rates.push_back(static_cast<double>(bytes) / seconds_since(t));
    checksum += sum;
  }
  SPIN_CHECK(checksum > 0.0, "read bandwidth: the sum was optimised away");
  return median(rates);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"spin CPU model benchmark"};
  std::string model_path;
  std::vector<int64_t> prefill_lengths{512, 4096};
  int64_t decode_tokens = 64;
  std::vector<int64_t> decode_contexts{128, 8192};
  int repeats = 3;
  int threads = 0;
  app.add_option("--model", model_path, ".gguf file or HF directory")->required();
  app.add_option("--prefill", prefill_lengths, "prompt lengths to time")->capture_default_str();
  app.add_option("--decode-tokens", decode_tokens, "decode steps to time")->capture_default_str();
  app.add_option("--decode-context", decode_contexts, "context lengths to decode after")
      ->capture_default_str();
  app.add_option("--repeats", repeats, "repeats (median reported)")->capture_default_str();
  app.add_option("--threads", threads, "threads (default: all cores)");
  CLI11_PARSE(app, argc, argv);

  try {
    spin::cpu::set_num_threads(threads);
    spin::LoadedModel model = spin::load_model({model_path, "auto", 0});
    const spin::ModelConfig& c = model.weights.config;
    spin::Transformer transformer(model.weights);
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size) - 1);
    std::vector<float> logits;

    std::printf("| measurement | value |\n|---|---|\n");
    std::printf("| threads | %d |\n", spin::cpu::num_threads());
    for (int64_t n : prefill_lengths) {
      std::vector<int32_t> prompt(n);
      for (int32_t& t : prompt) t = token(rng);
      std::vector<double> rates;
      for (int r = 0; r < repeats; ++r) {
        spin::ContiguousAttention kv(transformer.attention_shape(), n);
        const auto t = clock_type::now();
        for (int64_t pos = 0; pos < n; pos += 512) {
          const int64_t len = std::min<int64_t>(512, n - pos);
          spin::SequenceChunk chunk{std::span<const int32_t>(prompt).subspan(pos, len), pos, &kv};
          transformer.forward(std::span(&chunk, 1), false, logits);
        }
        rates.push_back(n / seconds_since(t));
      }
      std::printf("| prefill %lld tokens (tok/s, chunks of 512) | %.1f |\n",
                  static_cast<long long>(n), median(rates));
    }

    // Decode after prompts of each length: the first is short, so weights dominate the step.
    std::vector<double> decode_rates;
    for (int64_t context : decode_contexts) {
      // One prefill per context; each repeat continues the same sequence for decode_tokens steps.
      spin::ContiguousAttention kv(transformer.attention_shape(),
                                   context + repeats * decode_tokens + 1);
      std::vector<int32_t> prompt(context);
      for (int32_t& t : prompt) t = token(rng);
      for (int64_t pos = 0; pos < context; pos += 512) {
        const int64_t len = std::min<int64_t>(512, context - pos);
        spin::SequenceChunk chunk{std::span<const int32_t>(prompt).subspan(pos, len), pos, &kv};
        transformer.forward(std::span(&chunk, 1), false, logits);
      }
      std::vector<double> rates;
      int64_t pos = context;
      for (int r = 0; r < repeats; ++r) {
        const auto t = clock_type::now();
        for (int64_t i = 0; i < decode_tokens; ++i, ++pos) {
          const int32_t id = token(rng);
          spin::SequenceChunk step{std::span(&id, 1), pos, &kv};
          transformer.forward(std::span(&step, 1), false, logits);
        }
        rates.push_back(decode_tokens / seconds_since(t));
      }
      decode_rates.push_back(median(rates));
      std::printf("| decode after %lld tokens (tok/s; ms/step) | %.1f; %.1f |\n",
                  static_cast<long long>(context), decode_rates.back(), 1e3 / decode_rates.back());
    }
    const double decode = decode_rates.front();

    // Weight bytes one decode step reads: every matrix once (fp32), plus norms; the embedding
    // table contributes one row unless it doubles as the LM head.
    const int64_t params = c.parameter_count();
    const int64_t embedding_not_read = c.tie_embeddings ? 0 : (c.vocab_size - 1) * c.hidden_size;
    const double weight_bytes = 4.0 * static_cast<double>(params - embedding_not_read);
    const double bandwidth = read_bandwidth(size_t{1} << 30, 7);
    const double bound = bandwidth / weight_bytes;
    std::printf("| fp32 weight bytes read per token | %.1f MB |\n", weight_bytes / 1e6);
    std::printf("| read bandwidth (%d threads, 1 GiB, median of 7) | %.2f GB/s |\n", spin::cpu::num_threads(),
                bandwidth / 1e9);
    std::printf("| decode bound = bandwidth / weight bytes (tok/s) | %.1f |\n", bound);
    std::printf("| decode after %lld tokens / bound | %.0f%% |\n",
                static_cast<long long>(decode_contexts.front()), 100.0 * decode / bound);
  } catch (const spin::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
