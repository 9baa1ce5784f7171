// The GEMM tuning file (model/gemm_tuning.h): what is saved is what loads, other hardware's
// tables survive a rewrite, and every malformed file is a spin::Error naming the file and the
// fault. Files are written here as JSON text, so the expected values come from the test.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "base/mapped_file.h"
#include "model/gemm_tuning.h"
#include "test_files.h"

namespace spin {
namespace {

const std::string kHardware = "NVIDIA H100 80GB HBM3 / cuBLASLt 130100";

// A valid one-choice entry, to be broken one field at a time.
nlohmann::json valid_choice() {
  return {{"rows", 1},
          {"out", 5120},
          {"in", 4096},
          {"output", "bf16"},
          {"algo", std::string(127, '0') + "7"},
          {"us", 12.5},
          {"heuristic_us", 13.0}};
}

std::string file_with(const nlohmann::json& choices, const std::string& hardware = kHardware) {
  return nlohmann::json{{"format", "spin-gemm-tuning/1"}, {"tables", {{{"hardware", hardware}, {"choices", choices}}}}}
      .dump();
}

TEST(GemmTuning, MissingAndEmptyFilesAreEmptyTables) {
  TempDir dir("gemm_tuning_");
  const GemmTuningTable missing = GemmTuningTable::load(dir.path() / "none.json", kHardware);
  EXPECT_EQ(missing.size(), 0u);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "none.json"));  // loading never writes
  const GemmTuningTable empty = GemmTuningTable::load(dir.write("empty.json", " \n"), kHardware);
  EXPECT_EQ(empty.size(), 0u);
}

TEST(GemmTuning, SavedChoicesLoadBackBitExact) {
  TempDir dir("gemm_tuning_");
  const auto path = dir.path() / "tuning.json";
  GemmTuningTable table = GemmTuningTable::load(path, kHardware);
  const GemmShape qkv{1, 7168, 5120, false}, head{8, 151936, 5120, true};
  GemmChoice a, b;
  for (size_t i = 0; i < 8; ++i) {
    a.algo[i] = 0x0123456789abcdefULL * (i + 1);
    b.algo[i] = ~a.algo[i];
  }
  a.time_us = 41.25;
  a.heuristic_us = 43.5;
  b.time_us = 700.0;
  b.heuristic_us = 731.75;
  table.put(qkv, a);
  table.put(head, b);
  table.save();
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "tuning.json.tmp"));

  const GemmTuningTable back = GemmTuningTable::load(path, kHardware);
  ASSERT_EQ(back.size(), 2u);
  ASSERT_NE(back.find(qkv), nullptr);
  ASSERT_NE(back.find(head), nullptr);
  EXPECT_EQ(back.find(qkv)->algo, a.algo);
  EXPECT_EQ(back.find(head)->algo, b.algo);
  EXPECT_DOUBLE_EQ(back.find(qkv)->time_us, 41.25);
  EXPECT_DOUBLE_EQ(back.find(head)->heuristic_us, 731.75);
  // The output type is part of the shape.
  EXPECT_EQ(back.find(GemmShape{1, 7168, 5120, true}), nullptr);
  EXPECT_EQ(back.find(GemmShape{2, 7168, 5120, false}), nullptr);
}

TEST(GemmTuning, OtherHardwareTablesAreIgnoredAndKept) {
  TempDir dir("gemm_tuning_");
  const auto path = dir.write("tuning.json", file_with(nlohmann::json::array({valid_choice()}), "Other GPU / cuBLASLt 1"));
  GemmTuningTable table = GemmTuningTable::load(path, kHardware);
  EXPECT_EQ(table.size(), 0u);
  GemmChoice c;
  c.algo[0] = 42;
  table.put(GemmShape{1, 4096, 4096, false}, c);
  table.save();

  const GemmTuningTable other = GemmTuningTable::load(path, "Other GPU / cuBLASLt 1");
  ASSERT_EQ(other.size(), 1u);
  ASSERT_NE(other.find(GemmShape{1, 5120, 4096, false}), nullptr);
  EXPECT_EQ(other.find(GemmShape{1, 5120, 4096, false})->algo[7], 7u);
  const GemmTuningTable mine = GemmTuningTable::load(path, kHardware);
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_EQ(mine.find(GemmShape{1, 4096, 4096, false})->algo[0], 42u);
}

TEST(GemmTuning, MalformedFilesAreClearErrors) {
  TempDir dir("gemm_tuning_");
  const auto check = [&](const std::string& text, const std::string& fragment) {
    const auto path = dir.write("bad.json", text);
    expect_error([&] { GemmTuningTable::load(path, kHardware); }, {path.string(), fragment});
  };
  check("{\"format\": ", "not valid JSON");
  check(R"({"format": "spin-gemm-tuning/1", "tables": [], "x": 2e999})", "not valid JSON");  // found by the fuzzer
  check("[1, 2]", "not a spin GEMM tuning file");
  check(R"({"format": "spin-gemm-tuning/2", "tables": []})", "not a spin GEMM tuning file");
  check(R"({"format": "spin-gemm-tuning/1"})", "'tables' must be an array");
  check(R"({"format": "spin-gemm-tuning/1", "tables": [{"choices": []}]})", "'hardware' string");
  check(R"({"format": "spin-gemm-tuning/1", "tables": [{"hardware": "x", "choices": 3}]})", "'choices' must be");

  const auto broken = [&](const char* key, const nlohmann::json& value, const std::string& fragment) {
    nlohmann::json choice = valid_choice();
    if (value.is_null()) {
      choice.erase(key);
    } else {
      choice[key] = value;
    }
    check(file_with(nlohmann::json::array({valid_choice(), choice})), "choice 1: " + fragment);
  };
  broken("rows", nullptr, "missing 'rows'");
  broken("rows", 0, "'rows' must be a positive integer");
  broken("out", -5, "'out' must be a positive integer");
  broken("in", "4096", "'in' must be a positive integer");
  broken("in", 1.5, "'in' must be a positive integer");
  broken("output", "fp16", "'output' must be");
  broken("algo", "abc", "'algo' must be 128 hex digits");
  broken("algo", std::string(127, '0') + "g", "'algo' has 'g', not a hex digit");
  broken("us", -1.0, "'us' must be a non-negative number");
  broken("heuristic_us", "fast", "'heuristic_us' must be");
  // The same shape twice (choice 1 equals choice 0 in every key field).
  check(file_with(nlohmann::json::array({valid_choice(), valid_choice()})), "a second choice for the same shape");
  const nlohmann::json table = {{"hardware", kHardware}, {"choices", nlohmann::json::array()}};
  check(nlohmann::json{{"format", "spin-gemm-tuning/1"}, {"tables", {table, table}}}.dump(), "two tables");
  // Another hardware's malformed table is not read into entries, but must still be a table.
  check(R"({"format": "spin-gemm-tuning/1", "tables": [7]})", "'hardware' string");
}

TEST(GemmTuning, UnwritablePathIsAnError) {
  TempDir dir("gemm_tuning_");
  const auto path = dir.path() / "no_such_dir" / "tuning.json";
  GemmTuningTable table = GemmTuningTable::load(path, kHardware);
  expect_error([&] { table.save(); }, {path.string(), "cannot write"});
}

TEST(GemmTuning, DirectoryIsNotATuningFile) {
  TempDir dir("gemm_tuning_");
  expect_error([&] { GemmTuningTable::load(dir.path(), kHardware); }, {dir.path().string(), "not a regular file"});
}

TEST(GemmTuning, SaveReplacesTheFileWhole) {
  TempDir dir("gemm_tuning_");
  const auto path = dir.write("tuning.json", file_with(nlohmann::json::array({valid_choice()})));
  GemmTuningTable table = GemmTuningTable::load(path, kHardware);
  ASSERT_EQ(table.size(), 1u);
  GemmChoice c;
  c.time_us = 3;
  table.put(GemmShape{1, 5120, 4096, false}, c);  // replaces the loaded choice
  table.save();
  const nlohmann::json saved = nlohmann::json::parse(read_text_file(path.string()));
  ASSERT_EQ(saved["tables"].size(), 1u);
  ASSERT_EQ(saved["tables"][0]["choices"].size(), 1u);
  EXPECT_EQ(saved["tables"][0]["choices"][0]["algo"], std::string(128, '0'));
  EXPECT_EQ(saved["tables"][0]["choices"][0]["us"], 3.0);
}

}  // namespace
}  // namespace spin
