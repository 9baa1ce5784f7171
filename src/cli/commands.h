#pragma once
// Each `spin` subcommand lives in its own file and registers itself on the root app.
#include <CLI/CLI.hpp>

namespace spin::cli {

void add_generate_command(CLI::App& app);  // cli/generate.cpp
void add_tokenize_command(CLI::App& app);  // cli/tokenize.cpp
void add_inspect_command(CLI::App& app);   // cli/inspect.cpp
void add_serve_command(CLI::App& app);     // cli/serve.cpp
void add_bench_command(CLI::App& app);     // cli/bench.cpp
void add_eval_command(CLI::App& app);      // cli/eval.cpp

}  // namespace spin::cli
