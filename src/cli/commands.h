#pragma once
// Each `spin` subcommand lives in its own file and registers itself on the root app.
#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdint>
#include <string>

namespace spin::cli {

// A count flag's check: an integer >= 0 (CLI11's NonNegativeNumber would print DBL_MAX as its bound).
inline const CLI::Validator kNonNegativeInteger(
    [](std::string& value) -> std::string {
      int64_t x = 0;
      const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), x);
      if (error != std::errc() || end != value.data() + value.size() || x < 0) {
        return "must be an integer >= 0, got " + value;
      }
      return {};
    },
    "INT >= 0");

void add_generate_command(CLI::App& app);  // cli/generate.cpp
void add_tokenize_command(CLI::App& app);  // cli/tokenize.cpp
void add_inspect_command(CLI::App& app);   // cli/inspect.cpp
void add_serve_command(CLI::App& app);     // cli/serve.cpp
void add_bench_command(CLI::App& app);     // cli/bench.cpp
void add_eval_command(CLI::App& app);      // cli/eval.cpp

}  // namespace spin::cli
