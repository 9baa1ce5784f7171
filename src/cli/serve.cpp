// `spin serve`: the OpenAI-compatible server. It listens first (/health says 503 while the model
// loads), then serves until SIGINT or SIGTERM.
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "base/error.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "kernels/cpu/ops.h"
#include "model/loader.h"
#include "server/http_server.h"

namespace spin::cli {

namespace {

struct ServeArgs {
  LoadOptions load;
  server::ServerConfig server;
  EngineConfig engine;
  std::string served_model_name;
  int threads = 0;
};

void run_serve(ServeArgs a) {
  // Signals are taken by sigwait below; every thread started from here on inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away must not kill the server
  cpu::set_num_threads(a.threads);
  a.engine.threads = a.threads;

  SPIN_CHECK(a.engine.max_num_seqs > 0 && a.engine.max_num_seqs <= 4096,
             "--max-num-seqs must be in 1..4096, got {}", a.engine.max_num_seqs);
  SPIN_CHECK(a.engine.max_waiting >= 0 && a.engine.max_waiting <= 65536,
             "--max-waiting must be in 0..65536, got {}", a.engine.max_waiting);
  // Each client connection holds a thread while its request runs; a few spare for /health etc.
  a.server.threads = static_cast<int>(a.engine.max_num_seqs + a.engine.max_waiting + 16);
  server::HttpServer http(a.server);
  const int port = http.bind();
  std::thread listener([&] { http.listen(); });
  struct StopOnExit {
    server::HttpServer& http;
    std::thread& listener;
    ~StopOnExit() {
      http.stop();
      if (listener.joinable()) listener.join();
    }
  } stop_on_exit{http, listener};

  spdlog::info("loading {} (listening on {}:{}; /health is 503 until ready)", a.load.model, a.server.host, port);
  LoadedModel model = load_model(a.load);
  Transformer transformer(model.weights);
  Engine engine(transformer, model.tokenizer.get(), a.engine);
  engine.start();
  const std::string name = a.served_model_name.empty() ? model.name : a.served_model_name;
  http.attach(&engine, model.tokenizer.get(), name);
  const EngineConfig& c = engine.config();
  spdlog::info("engine: max-num-seqs {}, max-num-batched-tokens {}, max-model-len {}, KV budget {} tokens",
               c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.kv_token_budget);
  std::printf("spin: serving '%s' at http://%s:%d/v1 (Ctrl-C stops)\n", name.c_str(), a.server.host.c_str(), port);
  std::fflush(stdout);

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("signal {}: shutting down", signal_number);
  // The engine first: it ends every open request as aborted, so streaming handlers return and
  // the HTTP workers can be joined.
  engine.stop();
  http.stop();
  if (listener.joinable()) listener.join();
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible HTTP API");
  cmd->add_option("-m,--model", args->load.model, ".gguf file, HF directory, or preset name")->required();
  cmd->add_option("--load-format", args->load.load_format, "auto | gguf | safetensors | dummy")
      ->check(CLI::IsMember({"auto", "gguf", "safetensors", "dummy"}));
  cmd->add_option("--host", args->server.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", args->server.port, "port (0 = any free port)")->capture_default_str();
  cmd->add_option("--api-key", args->server.api_key, "require 'Authorization: Bearer <key>' on /v1/");
  cmd->add_option("--served-model-name", args->served_model_name, "model name in the API (default: the model's)");
  cmd->add_option("--max-num-seqs", args->engine.max_num_seqs, "requests running at once")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->engine.max_num_batched_tokens, "tokens per engine step")
      ->capture_default_str();
  cmd->add_option("--max-model-len", args->engine.max_model_len, "context length (default: the model's)");
  cmd->add_option("--kv-cache-tokens", args->engine.kv_token_budget,
                  "KV tokens of all requests together (default: max-num-seqs x max-model-len, capped by memory)");
  cmd->add_option("--max-waiting", args->engine.max_waiting, "queued requests beyond the running ones; more get 503")
      ->capture_default_str();
  cmd->add_option("-t,--threads", args->threads, "CPU threads (default: all cores)");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace spin::cli
