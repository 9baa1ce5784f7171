#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"

int main(int argc, char** argv) {
  // stdout carries generated text and tool output; logs go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("spin"));
  CLI::App app{"spin: long-context LLM serving with dynamic sparse attention over a two-tier KV cache"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "spin 0.1.0");
  spin::cli::add_generate_command(app);
  spin::cli::add_tokenize_command(app);
  spin::cli::add_inspect_command(app);
  spin::cli::add_serve_command(app);
  spin::cli::add_bench_command(app);
  spin::cli::add_eval_command(app);
  // vLLM's `-tp N` (a two-letter short flag, which CLI11 would read as `-t p`) means --tp N.
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::string& arg : args) {
    if (arg == "-tp" || arg.rfind("-tp=", 0) == 0) arg.insert(0, "-");
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last-first
  app.name(argv[0]);
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const spin::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
