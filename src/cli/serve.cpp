// `spin serve`: the OpenAI-compatible server. It listens first (/health says 503 while the model
// loads), then serves until SIGINT or SIGTERM.
#include <pthread.h>
#include <unistd.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "cli/backend.h"
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
  std::string sparse_algorithm = "dense";
  double sparse_budget = 0.0;  // >= 1: tokens per KV head; in (0, 1): a fraction of the context
  BackendOptions backend;      // --device, GPU memory, CUDA graphs, KV store sizes
};

// The server's default attention settings from --sparse-algorithm / --sparse-budget.
AttentionSettings default_attention(const ServeArgs& a) {
  AttentionSettings s;
  s.algorithm = a.sparse_algorithm;
  SPIN_CHECK(std::isfinite(a.sparse_budget) && a.sparse_budget >= 0.0,
             "--sparse-budget must be >= 0, got {}", a.sparse_budget);
  if (a.sparse_budget >= 1.0) {
    SPIN_CHECK(a.sparse_budget == std::floor(a.sparse_budget) && a.sparse_budget <= 4294967295.0,
               "--sparse-budget in tokens must be a whole number up to 2^32-1, got {}", a.sparse_budget);
    s.budget = static_cast<int64_t>(a.sparse_budget);
  } else if (a.sparse_budget > 0.0) {
    s.budget_fraction = a.sparse_budget;
  }
  return s;
}

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
  // Each client connection holds a thread while its request runs, so every request the engine
  // would run or queue has one and the engine's 503 answers the rest (a smaller pool would queue
  // them unbounded); a few spare for /health etc. bind() starts them all, and refuses to start
  // when the system has too few threads to give.
  a.server.threads = static_cast<int>(a.engine.max_num_seqs + a.engine.max_waiting + 16);
  server::HttpServer http(a.server);
  const int port = http.bind();
  std::atomic<bool> listening_ended{false};
  std::exception_ptr listen_error;  // read after the listener is joined
  std::thread listener([&] {
    try {
      http.listen();
    } catch (...) {
      // The server cannot take connections: shut down (the sigwait below) and report it.
      listen_error = std::current_exception();
      kill(getpid(), SIGTERM);
    }
    listening_ended = true;
  });
  // httplib ignores a stop() that comes before its listen loop runs (an early error, such as a
  // bad --model, would then hang here): stop until the loop has ended.
  struct StopHttp {
    server::HttpServer& http;
    std::thread& listener;
    std::atomic<bool>& ended;
    void now() {
      while (!ended) {
        http.stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (listener.joinable()) listener.join();
    }
    ~StopHttp() { now(); }
  } stop_http{http, listener, listening_ended};

  spdlog::info("loading {} (listening on {}:{}; /health is 503 until ready)", a.load.model, a.server.host, port);
  const AttentionSettings attention = default_attention(a);
  SPIN_CHECK(!attention.algorithm.empty(), "--sparse-algorithm is empty");
  a.backend.sparse_default = attention.algorithm != "dense";
  Backend backend = make_backend(a.load, a.backend, a.engine);
  const LoadedModel& model = *backend.model;
  Engine engine(*backend.forward, model.tokenizer.get(), a.engine, std::move(backend.attention));
  // The default attention must admit the smallest request (one prompt token, one to generate), or
  // every request without a "spin" object would be refused.
  try {
    const std::vector<int32_t> smallest_prompt{0};
    RequestParams smallest;
    smallest.max_tokens = 1;
    smallest.attention = attention;
    engine.validate_request(smallest_prompt, smallest);
  } catch (const InvalidRequest& e) {
    fail("this server would refuse every request (the smallest one, with the default attention '{}', is refused): "
         "{}",
         attention.algorithm, e.what());
  }
  engine.start();
  const std::string name = a.served_model_name.empty() ? model.name : a.served_model_name;
  http.attach(&engine, model.tokenizer.get(), name, attention);
  const EngineConfig& c = engine.config();
  // The engine's token budget admits contiguous (CPU dense) KV; the paged stores admit by pages.
  spdlog::info("engine: max-num-seqs {}, max-num-batched-tokens {}, max-model-len {}{}{}", c.max_num_seqs,
               c.max_num_batched_tokens, c.max_model_len,
               backend.device == "cpu" ? fmt::format(", KV budget {} tokens", c.kv_token_budget) : std::string(),
               c.elastic_kv_buffers ? "" : ", elastic KV buffers off");
  spdlog::info("attention: default '{}'; {}", attention.algorithm, backend.description);
  // An IPv6 address goes in brackets in a URL (RFC 3986).
  const bool ipv6 = a.server.host.find(':') != std::string::npos;
  const std::string host = ipv6 ? "[" + a.server.host + "]" : a.server.host;
  // A listener that failed while the model loaded has signalled the shutdown below: no URL then.
  if (!listening_ended) {
    std::printf("spin: serving '%s' at http://%s:%d/v1 (Ctrl-C stops)\n", name.c_str(), host.c_str(), port);
    std::fflush(stdout);
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("signal {}: shutting down", signal_number);
  // The engine first: it ends every open request as aborted, so streaming handlers return and
  // the HTTP workers can be joined.
  engine.stop();
  stop_http.now();
  if (listen_error) std::rethrow_exception(listen_error);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible HTTP API");
  add_model_options(*cmd, args->load);
  cmd->add_option("--host", args->server.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", args->server.port, "port (0 = any free port)")->capture_default_str();
  cmd->add_option("--api-key", args->server.api_key, "require 'Authorization: Bearer <key>' on /v1/");
  cmd->add_option("--served-model-name", args->served_model_name, "model name in the API (default: the model's)");
  cmd->add_option("--max-num-seqs", args->engine.max_num_seqs, "requests running at once")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->engine.max_num_batched_tokens, "tokens per engine step")
      ->capture_default_str();
  cmd->add_option("--max-model-len", args->engine.max_model_len, "context length (0: the model's)")
      ->check(kNonNegativeInteger);
  cmd->add_option("--kv-cache-tokens", args->engine.kv_token_budget,
                  "KV tokens of all requests together (default: max-num-seqs x max-model-len, capped by memory)")
      ->check(kNonNegativeInteger);
  cmd->add_option("--max-waiting", args->engine.max_waiting, "queued requests beyond the running ones; more get 503")
      ->capture_default_str();
  cmd->add_option("-t,--threads", args->threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 4096));
  cmd->add_option("--sparse-algorithm", args->sparse_algorithm,
                  "attention of requests without a \"spin\" object (dense, dense-offload, quest, ...)")
      ->capture_default_str();
  cmd->add_option("--sparse-budget", args->sparse_budget,
                  "default selection budget: tokens per KV head (>= 1) or a fraction of the context (< 1); "
                  "0 = the algorithm's default");
  cmd->add_option("--device", args->backend.device,
                  "cpu, cuda, or auto (cuda when spin was built with CUDA, a GPU is present and the default "
                  "attention is dense)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->add_option("--gpu-memory-utilization", args->backend.gpu_memory_utilization,
                  "cuda: share of the GPU's memory for weights, activations and the KV pool (the pool gets the rest)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  // vLLM's "-tp" is no valid CLI11 2.1 name; main() rewrites it to --tp.
  cmd->add_option("--tensor-parallel-size,--tp", args->backend.tensor_parallel_size,
                  "split every layer over N ranks (cuda: GPUs 0..N-1 joined by NCCL; cpu: N thread groups); N must "
                  "divide the model's KV heads")
      ->capture_default_str();
  cmd->add_flag("--cuda-graphs,!--no-cuda-graphs", args->backend.cuda_graphs,
                "cuda: replay decode steps as CUDA graphs (default on)");
  cmd->add_option("--gemm-tuning", args->backend.gemm_tuning_file,
                  "cuda, one GPU: a file of measured cuBLASLt algorithm choices for decode-sized products; shapes it "
                  "lacks are timed on first use and added (created if missing)");
  cmd->add_option("--gemv-rows", args->backend.gemv_rows,
                  "cuda: products of at most N rows (decode steps of at most N requests) run spin's own kernel, "
                  "larger ones cuBLASLt; 0: all cuBLASLt, one product path for every batch size "
                  "(default 2: measured faster than cuBLASLt at 1 and 2 rows, slower from 3)");
  cmd->add_option("--block-size", args->backend.kv.page_size, "paged KV store: tokens per page (8..64)")->capture_default_str();
  cmd->add_option("--kv-device-pages", args->backend.kv.device_pages,
                  "paged KV store: device-tier pages, each page_size tokens of one layer x KV head (default: from memory; "
                  "cuda: from --gpu-memory-utilization)");
  cmd->add_option("--kv-host-pages", args->backend.kv.host_pages, "paged KV store: host-tier pages (CPU default: from memory; CUDA: pinned memory, 0 = none, quest needs it)");
  cmd->add_option("--kv-buffer-factor", args->backend.kv.buffer_factor,
                  "paged KV store: the most cached pages a sparse request keeps beside its selection, as a multiple "
                  "of the selection budget (elastic buffers grow up to it into free device pages; more helps where "
                  "selections change a lot from step to step)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 64.0));
  cmd->add_option("--seer-gate", args->backend.seer_gate,
                  "seer: trained gate weights (safetensors, layers.{l}.seer.k_gate / q_gate per layer) for every seer "
                  "request; default: the training-free gate");
  cmd->add_flag("--elastic-kv-buffers,!--no-elastic-kv-buffers", args->engine.elastic_kv_buffers,
                "paged KV store: grow buffers into free device pages and shrink them to admit requests (default "
                "on); off: each request keeps its largest buffer from admission on (an ablation)");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace spin::cli
