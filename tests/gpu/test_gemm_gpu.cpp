// The forward pass's products (model/cuda/gemm.h) against a double-precision reference on the same
// bf16 inputs, with and without a tuning file (1 and kDefaultGemvRows rows run kernels/cuda/gemv.h's
// kernel, 16 and 96 cuBLASLt), and the tuning file's life cycle: cuBLASLt's decode-sized shapes
// are timed once and stored, a second runner reuses them without rewriting the file, larger shapes
// and the products gemv.h runs (up to the runner's gemv_rows) are never stored, and another GPU's
// table is kept.
// Tolerance: max |gpu - ref| / max(|ref|, 0.05 * rms(ref)) <= 1e-3 for fp32 output (fp32 sums of
// exact bf16 products) and 1e-2 for bf16 output (its rounding alone gives <= 2^-9).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../cpp/test_files.h"
#include "base/error.h"
#include "base/half.h"
#include "base/mapped_file.h"
#include "kernels/cuda/gemv.h"
#include "model/cuda/gemm.h"

namespace spin {
namespace {

constexpr int64_t kIn = 2048, kOut = 3072;

double max_error(const std::vector<float>& got, const std::vector<double>& ref) {
  double ss = 0.0;
  for (double r : ref) ss += r * r;
  const double floor = 0.05 * std::sqrt(ss / std::max<size_t>(ref.size(), 1));
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::abs(got[i] - ref[i]) / std::max(std::abs(ref[i]), floor));
  }
  return worst;
}

class GpuGemm : public SeededGpuTest<std::mt19937> {
 protected:
  void SetUp() override {
    SeededGpuTest::SetUp();
    if (IsSkipped()) return;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    a_.resize(static_cast<size_t>(kMaxRows * kIn));
    w_.resize(static_cast<size_t>(kOut * kIn));
    for (auto& v : a_) v = f32_to_bf16(normal(rng_));
    for (auto& v : w_) v = f32_to_bf16(normal(rng_) * 0.02f);
  }

  std::vector<double> reference(int64_t rows) const {
    std::vector<double> out(static_cast<size_t>(rows * kOut));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < kOut; ++o) {
        double sum = 0.0;
        for (int64_t i = 0; i < kIn; ++i) {
          sum += static_cast<double>(bf16_to_f32(a_[static_cast<size_t>(r * kIn + i)])) *
                 bf16_to_f32(w_[static_cast<size_t>(o * kIn + i)]);
        }
        out[static_cast<size_t>(r * kOut + o)] = sum;
      }
    }
    return out;
  }

  // Runs rows x kIn by kOut x kIn^T on `gemm`; fp32 output, or bf16 widened to float.
  std::vector<float> product(GemmRunner& gemm, int64_t rows, bool float_output) const {
    const DeviceArray<uint16_t> a(a_), w(w_);
    const auto* a_ptr = reinterpret_cast<const __nv_bfloat16*>(a.get());
    const auto* w_ptr = reinterpret_cast<const __nv_bfloat16*>(w.get());
    std::vector<float> got(static_cast<size_t>(rows * kOut));
    if (float_output) {
      const DeviceArray<float> out(got.size());
      gemm.matmul_nt(a_ptr, w_ptr, out.get(), rows, kOut, kIn, nullptr);
      got = out.download();
    } else {
      const DeviceArray<uint16_t> out(got.size());
      gemm.matmul_nt(a_ptr, w_ptr, reinterpret_cast<__nv_bfloat16*>(out.get()), rows, kOut, kIn, nullptr);
      const std::vector<uint16_t> bits = out.download();
      for (size_t i = 0; i < bits.size(); ++i) got[i] = bf16_to_f32(bits[i]);
    }
    return got;
  }

  static constexpr int64_t kMaxRows = 96;  // above GemmRunner::kMaxTunedRows: one untuned shape
  std::vector<uint16_t> a_, w_;
};

TEST_F(GpuGemm, TunedAndUntunedProductsMatchTheReference) {
  static_assert(kMaxRows > GemmRunner::kMaxTunedRows);
  TempDir dir("gemm_gpu_");
  GemmRunner plain;
  GemmRunner tuned(dir.path() / "tuning.json");
  static_assert(16 > cuda::kMaxGemvRows);
  for (const int64_t rows : {int64_t{1}, GemmRunner::kDefaultGemvRows, int64_t{16}, kMaxRows}) {
    const std::vector<double> ref = reference(rows);
    for (const bool float_output : {true, false}) {
      const double tol = float_output ? 1e-3 : 1e-2;
      EXPECT_LE(max_error(product(plain, rows, float_output), ref), tol) << rows << " rows, plain";
      EXPECT_LE(max_error(product(tuned, rows, float_output), ref), tol) << rows << " rows, tuned";
    }
  }
  const nlohmann::json saved = nlohmann::json::parse(read_text_file((dir.path() / "tuning.json").string()));
  ASSERT_EQ(saved["tables"].size(), 1u);
  const nlohmann::json& choices = saved["tables"][0]["choices"];
  // 16 rows, with both output types: 1 and kDefaultGemvRows rows run gemv.h's kernel, and the 96-row
  // product is not decode-sized.
  ASSERT_EQ(choices.size(), 2u) << saved.dump(1);
  for (const auto& c : choices) {
    EXPECT_LE(c["rows"].get<int64_t>(), GemmRunner::kMaxTunedRows);
    EXPECT_GT(c["us"].get<double>(), 0.0);
    // The stored choice is the heuristic's pick or one measured faster than it.
    EXPECT_LE(c["us"].get<double>(), c["heuristic_us"].get<double>());
  }
}

// A runner's gemv_rows is the largest product gemv.h's kernel runs: above it (and everywhere at 0)
// cuBLASLt runs it, timed and stored like any other decode-sized shape.
TEST_F(GpuGemm, ProductsAboveGemvRowsRunCublasLt) {
  for (const int64_t gemv_rows : {int64_t{0}, int64_t{2}}) {
    TempDir dir("gemm_gpu_");
    GemmRunner gemm(dir.path() / "tuning.json", gemv_rows);
    for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{3}})
      for (const bool float_output : {true, false})
        EXPECT_LE(max_error(product(gemm, rows, float_output), reference(rows)), float_output ? 1e-3 : 1e-2)
            << rows << " rows, gemv_rows " << gemv_rows;
    const nlohmann::json saved = nlohmann::json::parse(read_text_file((dir.path() / "tuning.json").string()));
    std::vector<int64_t> stored;
    for (const auto& c : saved["tables"][0]["choices"]) stored.push_back(c["rows"].get<int64_t>());
    std::sort(stored.begin(), stored.end());
    const std::vector<int64_t> expected =
        gemv_rows == 0 ? std::vector<int64_t>{1, 1, 2, 2, 3, 3} : std::vector<int64_t>{3, 3};
    EXPECT_EQ(stored, expected) << "gemv_rows " << gemv_rows << ": " << saved.dump(1);
  }
  for (const int64_t gemv_rows : {int64_t{-1}, cuda::kMaxGemvRows + 1})
    EXPECT_THROW(GemmRunner({}, gemv_rows), Error) << gemv_rows;
}

TEST_F(GpuGemm, StoredChoicesAreReusedWithoutRewriting) {
  TempDir dir("gemm_gpu_");
  const auto path = dir.path() / "tuning.json";
  {
    GemmRunner first(path);
    product(first, 16, false);
  }
  const std::string before = read_text_file(path.string());
  ASSERT_NE(before.find("\"rows\": 16"), std::string::npos) << before;
  GemmRunner second(path);
  EXPECT_LE(max_error(product(second, 16, false), reference(16)), 1e-2);
  EXPECT_EQ(read_text_file(path.string()), before);  // no shape was timed again
  product(second, 24, false);     // a new shape is added beside the stored one
  const nlohmann::json saved = nlohmann::json::parse(read_text_file(path.string()));
  EXPECT_EQ(saved["tables"][0]["choices"].size(), 2u);
}

TEST_F(GpuGemm, AnotherGpusTableIsKept) {
  TempDir dir("gemm_gpu_");
  const nlohmann::json other = {{"hardware", "Other GPU / cuBLASLt 1"}, {"choices", nlohmann::json::array()}};
  const auto path = dir.write("tuning.json", nlohmann::json{{"format", "spin-gemm-tuning/1"}, {"tables", {other}}}.dump());
  GemmRunner gemm(path);
  product(gemm, 16, true);
  const nlohmann::json saved = nlohmann::json::parse(read_text_file(path.string()));
  ASSERT_EQ(saved["tables"].size(), 2u);
  EXPECT_EQ(saved["tables"][0], other);
  EXPECT_EQ(saved["tables"][1]["choices"].size(), 1u);
}

TEST_F(GpuGemm, MalformedTuningFileFailsAtConstruction) {
  TempDir dir("gemm_gpu_");
  const auto path = dir.write("tuning.json", "{not json");
  expect_error([&] { GemmRunner gemm(path); }, {path.string(), "not valid JSON"});
}

}  // namespace
}  // namespace spin
