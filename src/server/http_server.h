#pragma once
// The OpenAI-compatible HTTP server (cpp-httplib): /v1/completions, /v1/chat/completions (SSE
// streaming), /v1/models, /health, /metrics. It listens before the model is loaded (/health
// answers 503 until attach()), and aborts a streaming request as soon as its client goes away.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "engine/engine.h"
#include "model/tokenizer.h"

namespace httplib {
class Server;
class DataSink;
}

namespace spin::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;               // 0 = any free port
  std::string api_key;           // empty = no authentication
  size_t max_body_bytes = 8u << 20;
  int threads = 64;              // connection threads (each streaming client holds one)
};

class ConnectionPool;  // the connection threads (http_server.cpp)

class HttpServer {
 public:
  explicit HttpServer(const ServerConfig& config);
  ~HttpServer();

  // Binds the socket and starts the connection threads; returns the port (useful with port 0).
  // Throws spin::Error on failure.
  int bind();
  // Serves until stop(); blocks. Call once, after bind(). Throws spin::Error when it stops
  // accepting connections for another reason.
  void listen();
  void stop();

  // Makes the API live. engine and tokenizer (may be null) must outlive the server.
  // default_attention: what requests get without a "spin" extension object.
  void attach(Engine* engine, const Tokenizer* tokenizer, std::string model_name,
              const AttentionSettings& default_attention = {});

  struct State;  // what the request handlers share (http_server.cpp)

 private:
  void install_routes();
  void raise_listen_backlog();

  ServerConfig config_;
  int listen_fd_ = -1;  // the socket httplib bound last (captured in its socket-options hook)
  std::unique_ptr<httplib::Server> http_;
  std::unique_ptr<ConnectionPool> pool_;  // started by bind(), handed to httplib by listen()
  std::shared_ptr<State> state_;
};

// One call of a streaming response's content provider. An exception must not escape into httplib
// (it would end the process): one from `provide` is logged, `abort` ends the request, and a
// stream still open gets an error event and `data: [DONE]`. Returns what httplib expects of a
// provider: true to go on (or when the stream was completed), false to drop the connection.
bool run_stream_provider(httplib::DataSink& sink, const std::function<bool()>& provide,
                         const std::function<void()>& abort, const std::string& what);

// Prometheus text exposition of the engine's metrics.
std::string render_metrics(const EngineMetrics& m, bool engine_alive);

}  // namespace spin::server
