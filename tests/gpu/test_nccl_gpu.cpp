// NCCL all-reduce (kernels/cuda/nccl_communicator.h) over every visible GPU: one rank when there
// is one GPU, N ranks on N threads when there are N. Reference: the sum over the ranks' inputs
// computed on the host in double.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test.h"

#if SPIN_WITH_NCCL
#include <cuda_bf16.h>

#include <cmath>
#include <mutex>
#include <random>

#include "base/error.h"
#include "kernels/cuda/nccl_communicator.h"
#endif

namespace spin {
namespace {

#if SPIN_WITH_NCCL

// Rank r's input element i: small integers, so every partial sum is exact in fp32 and in bf16
// (|sum| <= 8 * world, far below bf16's 256 exact integers).
float exact_input(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13) % 17) - 8);
}

// Rank r's random fp32 input (a stream per rank).
std::vector<float> random_input(int rank, size_t n) {
  std::mt19937 rng(1000u + static_cast<unsigned>(rank));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

class NcclGpuTest : public GpuTest {};

// Runs body(rank, communicator, stream) on one thread per visible GPU; returns the failures.
template <typename Body>
std::vector<std::string> on_every_gpu(int world, const Body& body) {
  const cuda::NcclId id = cuda::make_nccl_id();
  std::mutex mutex;
  std::vector<std::string> failures;
  auto report = [&](std::string what) {
    std::lock_guard lock(mutex);
    failures.push_back(std::move(what));
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        cuda::NcclCommunicator comm(id, r, world, r);
        cudaStream_t stream = nullptr;
        if (cudaStreamCreate(&stream) != cudaSuccess) return report("rank " + std::to_string(r) + ": no stream");
        body(r, comm, stream, report);
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        report("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

int visible_gpus() {
  int n = 0;
  cudaGetDeviceCount(&n);
  return n;
}

TEST_F(NcclGpuTest, AllReduceSumsFp32AndBf16OverEveryGpu) {
  // NVLink multicast off before NCCL starts (the shared multi-GPU hosts; KINDS.md).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const int world = visible_gpus();
  const std::vector<size_t> sizes = {1, 7, 4096, (1u << 20) + 3};
  const auto failures = on_every_gpu(world, [&](int r, cuda::NcclCommunicator& comm, cudaStream_t stream,
                                                 const auto& report) {
    if (comm.rank() != r || comm.world_size() != world || comm.device() != r) report("wrong rank/world/device");
    for (size_t n : sizes) {
      // fp32, exact inputs: the sum must be exact. Several collectives in a row on one stream,
      // as a layer's two all-reduces are.
      std::vector<float> host(n), random = random_input(r, n);
      for (size_t i = 0; i < n; ++i) host[i] = exact_input(r, i);
      float *dev = nullptr, *dev_random = nullptr;
      __nv_bfloat16* dev_bf16 = nullptr;
      std::vector<__nv_bfloat16> host_bf16(n);
      for (size_t i = 0; i < n; ++i) host_bf16[i] = __float2bfloat16(host[i]);
      if (cudaMalloc(&dev, n * sizeof(float)) != cudaSuccess ||
          cudaMalloc(&dev_random, n * sizeof(float)) != cudaSuccess ||
          cudaMalloc(&dev_bf16, n * sizeof(__nv_bfloat16)) != cudaSuccess) {
        return report("cudaMalloc failed");
      }
      cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(dev_random, random.data(), n * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(dev_bf16, host_bf16.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
      comm.all_reduce_sum(dev, n, stream);
      comm.all_reduce_sum(dev_random, n, stream);
      comm.all_reduce_sum(dev_bf16, n, stream);
      const cudaError_t sync = cudaStreamSynchronize(stream);
      if (sync != cudaSuccess) return report(std::string("stream: ") + cudaGetErrorString(sync));
      cudaMemcpy(host.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost);
      cudaMemcpy(random.data(), dev_random, n * sizeof(float), cudaMemcpyDeviceToHost);
      cudaMemcpy(host_bf16.data(), dev_bf16, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost);
      cudaFree(dev);
      cudaFree(dev_random);
      cudaFree(dev_bf16);

      size_t wrong = 0, wrong_bf16 = 0;
      double err = 0.0, norm = 0.0;
      std::vector<std::vector<float>> inputs;
      for (int q = 0; q < world; ++q) inputs.push_back(random_input(q, n));
      for (size_t i = 0; i < n; ++i) {
        double exact = 0.0, sum = 0.0;
        for (int q = 0; q < world; ++q) {
          exact += exact_input(q, i);
          sum += inputs[q][i];
        }
        wrong += host[i] != static_cast<float>(exact);
        wrong_bf16 += __bfloat162float(host_bf16[i]) != static_cast<float>(exact);
        err += (random[i] - sum) * (random[i] - sum);
        norm += sum * sum;
      }
      const double rel = std::sqrt(err / std::max(norm, 1e-300));
      if (wrong || wrong_bf16 || rel > 1e-6) {
        report("rank " + std::to_string(r) + " n " + std::to_string(n) + ": " + std::to_string(wrong) +
               " fp32 and " + std::to_string(wrong_bf16) + " bf16 sums wrong, random fp32 rel err " +
               std::to_string(rel));
      }
    }
  });
  EXPECT_TRUE(failures.empty()) << failures.size() << " failures, first: " << failures.front();
  std::printf("[nccl] all-reduce over %d GPU(s) checked\n", world);
}

TEST_F(NcclGpuTest, BadRanksAndDevicesAreRefusedBeforeNcclStarts) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const cuda::NcclId id = cuda::make_nccl_id();
  EXPECT_THROW(cuda::NcclCommunicator(id, 2, 2, 0), Error);
  EXPECT_THROW(cuda::NcclCommunicator(id, -1, 2, 0), Error);
  EXPECT_THROW(cuda::NcclCommunicator(id, 0, 1, visible_gpus()), Error);
  try {
    cuda::NcclCommunicator(id, 0, 1, visible_gpus() + 3);
    ADD_FAILURE() << "no error for a GPU that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU(s) are visible"), std::string::npos) << e.what();
  }
}

// No GPU needed: each setting is applied when unset and never overrides the environment.
TEST(NcclEnv, SettingsApplyOnlyWhereTheEnvironmentIsSilent) {
  for (const char* name : {"NCCL_NVLS_ENABLE", "NCCL_RUNTIME_CONNECT"}) {
    const char* before = std::getenv(name);
    const std::string saved = before ? before : "";
    unsetenv(name);
    cuda::set_nccl_environment();
    ASSERT_NE(std::getenv(name), nullptr) << name;
    EXPECT_EQ(std::string(std::getenv(name)), "0") << name;
    setenv(name, "2", 1);
    cuda::set_nccl_environment();
    EXPECT_EQ(std::string(std::getenv(name)), "2") << name;
    // Back as it was, or off (never left unset on a shared host).
    setenv(name, saved.empty() ? "0" : saved.c_str(), 1);
  }
}

#else

TEST(NcclGpuTest, NotBuilt) { GTEST_SKIP() << "built without NCCL (SPIN_NCCL=OFF or NCCL not found)"; }

#endif

}  // namespace
}  // namespace spin
