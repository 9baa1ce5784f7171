// Seer: exact at full budget; Select against a brute-force reimplementation of both gates
// (training-free, and trained weights from a safetensors file the test writes); gate file errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "sparse_exactness.h"

namespace {

using spin::AttentionShape;
using spin::sparse::SparseSettings;

const AttentionShape kShape{3, 8, 2, 16, 0.25f};  // GQA groups of 4
constexpr uint32_t kPage = 16, kBlock = 32, kHd = 16, kKv = 2, kGroup = 4;

TEST(SparseSeer, FullBudgetEqualsDense) {
  SparseSettings s{.algorithm = "seer", .budget_fraction = 1.0, .seer_block_tokens = kBlock};
  EXPECT_LE(spin_test::max_error_vs_dense(kShape, s, kPage), 1e-6);
  EXPECT_LE(spin_test::max_logit_error_through_transformer(s, kPage), 1e-6);
}

// Writes F32 gate tensors for every layer; returns the file path.
std::string write_gates(const std::vector<std::vector<float>>& k_gate,
                        const std::vector<std::vector<float>>& q_gate, bool bad_shape = false) {
  nlohmann::json header;
  std::string data;
  for (size_t l = 0; l < k_gate.size(); ++l) {
    for (auto [name, values, rows] :
         {std::tuple{"k_gate", &k_gate[l], 3 * kHd}, std::tuple{"q_gate", &q_gate[l], kGroup * kHd}}) {
      const size_t begin = data.size();
      data.append(reinterpret_cast<const char*>(values->data()), values->size() * sizeof(float));
      header["layers." + std::to_string(l) + ".seer." + name] = {
          {"dtype", "F32"},
          {"shape", {kKv, bad_shape ? rows + 1 : rows, kHd}},
          {"data_offsets", {begin, data.size()}}};
    }
  }
  const std::string json = header.dump();
  const char* tmp = std::getenv("SPIN_TEST_TMP");
  const std::filesystem::path dir = tmp ? tmp : std::filesystem::temp_directory_path().string();
  std::filesystem::create_directories(dir);
  // Named after the running test: ctest runs tests as parallel processes, and two that shared one
  // file read each other's half-written gates.
  const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string path =
      (dir / ("seer_gate_" + test + (bad_shape ? "_bad" : "") + ".safetensors")).string();
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = json.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << json << data;
  return path;
}

struct SeerCase {
  uint32_t pages = 40;
  std::vector<float> pre;  // [g][page][token][hd]
  std::vector<float> q;
  spin::RopeTable rope = spin::make_rope_table(spin::RopeConfig{}, kHd);
  SeerCase() {
    std::mt19937 rng(17);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    pre.resize(size_t{kKv} * pages * kPage * kHd);
    for (float& x : pre) x = normal(rng);
    q.resize(size_t{kKv} * kGroup * kHd);
    for (float& x : q) x = normal(rng);
  }
  const float* page(uint32_t g, uint32_t p) const { return pre.data() + (size_t{g} * pages + p) * kPage * kHd; }

};

// Pooled [max | min | mean] of pre-RoPE keys of pages [p0, p1) of KV head g.
std::vector<double> pool(const SeerCase& c, uint32_t g, uint32_t p0, uint32_t p1) {
  std::vector<double> out(3 * kHd);
  for (uint32_t d = 0; d < kHd; ++d) out[d] = -1e30, out[kHd + d] = 1e30;
  for (uint32_t p = p0; p < p1; ++p)
    for (uint32_t t = 0; t < kPage; ++t)
      for (uint32_t d = 0; d < kHd; ++d) {
        const double x = c.page(g, p)[t * kHd + d];
        out[d] = std::max(out[d], x);
        out[kHd + d] = std::min(out[kHd + d], x);
        out[2 * kHd + d] += x / ((p1 - p0) * kPage);
      }
  return out;
}

// RoPE of a double vector through the kernel (float), as a position-dependent rotation.
std::vector<double> rotate(const SeerCase& c, const std::vector<double>& x, int64_t pos) {
  std::vector<float> f(x.begin(), x.end());
  spin::cpu::rope(f.data(), 1, kHd, pos, c.rope.inv_freq.data(), c.rope.mscale, c.rope.neox);
  return {f.begin(), f.end()};
}

// Candidates [1, end); the current position 37·16 + 5 is in block 18, which holds pages 36, 37, and
// pages [end, 36) are the recent window. A block pools its pages below `end`, or all of them with
// `whole_blocks` (the trained gate; all 40 pages are indexed).
void check_selection(const SparseSettings& settings, uint32_t end, bool whole_blocks,
                     const std::function<double(const SeerCase&, uint32_t g, uint32_t b,
                                                const std::vector<double>& pooled)>& score) {
  SeerCase c;
  spin::kv::KvLayout layout{3, kKv, kHd, kPage};
  auto algo = spin::sparse::AlgorithmRegistry::global().create("seer", {kShape, layout, &settings});
  for (uint32_t l = 0; l < 3; ++l) {
    spin::sparse::IndexInput in{.layer = l, .first_page = 0, .end_page = 25,
                                .page_keys = nullptr,
                                .page_keys_pre_rope = [&](uint32_t g, uint32_t p) { return c.page(g, p); }};
    algo->index(in);
    in.first_page = 25;
    in.end_page = c.pages;
    algo->index(in);
  }
  const uint32_t first = 1, budget = 7, tokens = 37 * kPage + 6;
  spin::sparse::SelectQuery query{.layer = 2, .q = c.q.data(), .num_kv_heads = kKv, .group = kGroup,
                                  .context_tokens = tokens, .first_candidate = first,
                                  .end_candidate = end, .budget_pages = budget, .rope = &c.rope};
  spin::kv::LayerSelection out;
  spin::sparse::StepBudget step;
  algo->select(query, out, step);
  ASSERT_EQ(out.num_heads(), kKv);
  const uint32_t bp = kBlock / kPage;
  for (uint32_t g = 0; g < kKv; ++g) {
    std::vector<std::pair<double, uint32_t>> ranked;
    for (uint32_t b = first / bp; b < (end + bp - 1) / bp; ++b)
      ranked.emplace_back(-score(c, g, b, pool(c, g, b * bp, whole_blocks ? (b + 1) * bp : std::min(end, (b + 1) * bp))),
                          b);
    std::stable_sort(ranked.begin(), ranked.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<uint32_t> blocks{18};  // the current block first
    for (const auto& [s, b] : ranked)
      if (b != 18) blocks.push_back(b);
    std::set<uint32_t> want;
    for (uint32_t b : blocks)
      for (uint32_t p = std::max(first, b * bp); p < std::min(end, (b + 1) * bp) && want.size() < budget; ++p)
        want.insert(p);
    const auto head = out.head(g);
    EXPECT_EQ(std::set<uint32_t>(head.begin(), head.end()), want) << "KV head " << g;
    if (end > 36) {
      EXPECT_TRUE(want.count(36)) << "the current block's candidate page";
    }
  }
}

TEST(SparseSeer, TrainingFreeGateMatchesBruteForce) {
  check_selection({.algorithm = "seer", .seer_block_tokens = kBlock}, 37, false,
                  [](const SeerCase& c, uint32_t g, uint32_t b, const std::vector<double>& pooled) {
                    const std::vector<double> mean(pooled.begin() + 2 * kHd, pooled.end());
                    const std::vector<double> key = rotate(c, mean, int64_t{b} * kBlock + kBlock / 2);
                    double best = -1e300;
                    for (uint32_t h = g * kGroup; h < (g + 1) * kGroup; ++h) {
                      double dot = 0.0;
                      for (uint32_t d = 0; d < kHd; ++d) dot += c.q[h * kHd + d] * key[d];
                      best = std::max(best, dot);
                    }
                    return best;
                  });
}

TEST(SparseSeer, TrainedGateMatchesBruteForce) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<std::vector<float>> k_gate(3), q_gate(3);
  for (uint32_t l = 0; l < 3; ++l) {
    k_gate[l].resize(size_t{kKv} * 3 * kHd * kHd);
    q_gate[l].resize(size_t{kKv} * kGroup * kHd * kHd);
    for (float& x : k_gate[l]) x = normal(rng);
    for (float& x : q_gate[l]) x = normal(rng);
  }
  const auto gate = spin::sparse::load_seer_gate(write_gates(k_gate, q_gate), kShape);
  // A window of two pages: block 17 (pages 34, 35) scores with page 35 too.
  check_selection({.algorithm = "seer", .seer_block_tokens = kBlock, .seer_gate = gate}, 35, true,
                  [&](const SeerCase& c, uint32_t g, uint32_t b, const std::vector<double>& pooled) {
                    std::vector<double> key(kHd, 0.0), gq(kHd, 0.0);
                    for (uint32_t i = 0; i < 3 * kHd; ++i)
                      for (uint32_t d = 0; d < kHd; ++d)
                        key[d] += pooled[i] * k_gate[2][(size_t{g} * 3 * kHd + i) * kHd + d];
                    key = rotate(c, key, int64_t{b} * kBlock);
                    for (uint32_t i = 0; i < kGroup * kHd; ++i)
                      for (uint32_t d = 0; d < kHd; ++d)
                        gq[d] += c.q[g * kGroup * kHd + i] * q_gate[2][(size_t{g} * kGroup * kHd + i) * kHd + d];
                    double dot = 0.0;
                    for (uint32_t d = 0; d < kHd; ++d) dot += gq[d] * key[d];
                    return dot;
                  });
}

TEST(SparseSeer, RejectsBadGateFilesAndBlocks) {
  std::vector<std::vector<float>> k_gate(3, std::vector<float>(size_t{kKv} * 3 * kHd * kHd)),
      q_gate(3, std::vector<float>(size_t{kKv} * kGroup * kHd * kHd));
  try {
    spin::sparse::load_seer_gate(write_gates(k_gate, q_gate, true), kShape);
    ADD_FAILURE() << "a gate of the wrong shape was accepted";
  } catch (const spin::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.seer.k_gate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(spin::sparse::load_seer_gate("/nonexistent.st", kShape), spin::Error);
  // A gate file with layers 0..2 lacks layer 3 of a deeper model.
  EXPECT_THROW(spin::sparse::load_seer_gate(write_gates(k_gate, q_gate), AttentionShape{4, 8, 2, 16, 0.25f}),
               spin::Error);
  spin_test::PagedStore store(kShape, 64, kPage);
  EXPECT_THROW(store.attention(kShape, {.algorithm = "seer", .seer_block_tokens = 24}), spin::Error);
  // A gate read for other KV heads (a tensor-parallel rank's share) does not fit the model.
  const auto gate = spin::sparse::load_seer_gate(write_gates(k_gate, q_gate), kShape);
  try {
    store.attention(kShape, {.algorithm = "seer", .seer_gate = spin::sparse::seer_gate_heads(gate, 1, 1)});
    ADD_FAILURE() << "a gate of one KV head was accepted for a model of two";
  } catch (const spin::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 KV heads"), std::string::npos) << e.what();
  }
}

}  // namespace
