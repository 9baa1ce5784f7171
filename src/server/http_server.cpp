#include "server/http_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <system_error>
#include <thread>
#include <vector>

#include "base/error.h"
#include "server/openai_api.h"

namespace spin::server {

// Responses keep their field order (id, object, ...; top_logprobs most likely first).
using json = nlohmann::ordered_json;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_error(httplib::Response& res, int status, const std::string& type, const std::string& message,
                const std::string& param = {}, const std::string& code = {}) {
  res.status = status;
  res.set_content(dump(error_body(message, type, param, code)), "application/json");
}

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The n engine requests of one API request (one per choice) and what the handler has seen of
// them; the stream provider and its releaser share it.
struct ChoiceSet {
  BlockingQueue<std::pair<size_t, RequestOutput>> queue;  // (choice index, output)
  std::vector<uint64_t> engine_ids;
  std::vector<bool> finished;
  std::vector<int64_t> completion_tokens;
  std::vector<int64_t> text_bytes;  // text sent so far per choice (logprobs text_offset)
  // With 'echo': the prompts (ids, text) sent before each choice's first output; choice i is
  // prompt i / per_prompt's.
  std::vector<ParsedPrompt> echo;
  size_t per_prompt = 1;
  std::vector<bool> echoed;
  bool sent_role = false;
  bool done = false;

  // The prompt echoed before choice i, or null without 'echo'.
  const ParsedPrompt* echo_of(size_t i) const { return echo.empty() ? nullptr : &echo[i / per_prompt]; }

  int64_t total_completion_tokens() const {
    int64_t total = 0;
    for (int64_t t : completion_tokens) total += t;
    return total;
  }
  void abort_unfinished(Engine& engine) const {
    for (size_t i = 0; i < engine_ids.size(); ++i) {
      if (!finished[i]) engine.abort(engine_ids[i]);
    }
  }
};

// Numeric address and port of a socket address (as httplib formats Request::remote_addr).
bool numeric_address(const sockaddr_storage& addr, socklen_t len, std::string& ip, int& port) {
  if (addr.ss_family == AF_INET) {
    port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  } else {
    return false;
  }
  char host[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) {
    return false;
  }
  ip = host;
  return true;
}

// The socket of the connection a request came on, or -1. httplib 0.11 does not hand it to a
// handler, but the connection's two addresses name it: the one socket whose peer is
// (remote_addr, remote_port) and whose own end is (local_addr, local_port). The server thread
// keeps it open until the handler returns, so no other connection can take that pair meanwhile.
int connection_socket(const httplib::Request& req) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    std::string ip;
    int port = -1;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !numeric_address(addr, len, ip, port) ||
        port != req.remote_port || ip != req.remote_addr) {
      continue;
    }
    len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !numeric_address(addr, len, ip, port) ||
        port != req.local_port || ip != req.local_addr) {
      continue;
    }
    return fd;
  }
  return -1;
}

// True once the peer of a connection that sent its whole request has closed it (end of stream or
// a reset). Bytes waiting (a pipelined request) count as open.
bool peer_closed(int fd) {
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n >= 0) return n == 0;
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

// Whether a request carries a body (httplib leaves it in the stream unless a route reads it).
bool has_body(const httplib::Request& req) {
  return req.has_header("Transfer-Encoding") || req.get_header_value<uint64_t>("Content-Length") > 0;
}

// A response after which its connection ends, because the request's body was left unread (in
// part or whole). httplib 0.11 keeps a connection open unless the request asks to close it, and
// would parse the rest of the body as requests; close_after_response ends it instead.
void mark_closing(httplib::Response& res) { res.set_header("Connection", "close"); }
bool marked_closing(const httplib::Response& res) { return res.get_header_value("Connection") == "close"; }

// Ends a connection whose response is written but whose request body was not read: no more
// writes (the client sees the end of the stream after the response), then what the client still
// sends is read and dropped for up to kLingerSeconds, then no more reads, so httplib's next read
// ends the connection. Closing with unread bytes would reset it, and a reset can make the
// client's TCP stack drop the response before the client reads it.
constexpr int kLingerSeconds = 2;
void close_after_response(const httplib::Request& req) {
  const int fd = connection_socket(req);
  if (fd < 0) return;
  shutdown(fd, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kLingerSeconds);
  std::vector<char> sink(1 << 16);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    if (recv(fd, sink.data(), sink.size(), 0) <= 0) break;
  }
  shutdown(fd, SHUT_RD);
}

// A streaming response: what its content provider needs, and the provider's one call.
struct StreamResponse {
  std::shared_ptr<ChoiceSet> choices;
  Engine* engine = nullptr;
  Endpoint ep = Endpoint::Completions;
  std::string id;
  int64_t created = 0;
  std::string model;
  bool include_usage = false;
  int64_t n_prompt = 0;
  size_t n = 1;
  std::chrono::steady_clock::time_point t0;
  bool with_logprobs = false;
  const Tokenizer* tokenizer = nullptr;
  std::string path;

  // Streams every output until the request ends; false when the client went away.
  bool provide(httplib::DataSink& sink) {
    auto send = [&](const std::string& payload) {
      const std::string event = "data: " + payload + "\n\n";
      return sink.write(event.data(), event.size());
    };
    auto gone = [&] {
      choices->abort_unfinished(*engine);
      spdlog::info("{} {} prompt={} client disconnected after {} tokens: aborted", path, id, n_prompt,
                   choices->total_completion_tokens());
      return false;
    };
    if (ep == Endpoint::ChatCompletions && !choices->sent_role) {
      choices->sent_role = true;
      for (size_t i = 0; i < n; ++i) {
        if (!send(dump(chunk_body(ep, id, created, model, i, "", "", true)))) return gone();
      }
    }
    std::string failure;
    size_t n_finished = 0;
    std::string last_reason;
    while (n_finished < n) {
      auto item = choices->queue.pop(std::chrono::milliseconds(100));
      if (!item) {
        if (!sink.is_writable()) return gone();
        continue;
      }
      auto& [i, out] = *item;
      choices->completion_tokens[i] = out.completion_tokens;
      if (const ParsedPrompt* prompt = choices->echo_of(i); prompt && !choices->echoed[i]) {  // the prompt first
        choices->echoed[i] = true;
        const json logprobs = with_logprobs ? echo_logprobs_json(tokenizer, prompt->ids, out.prompt_logprobs) : json();
        choices->text_bytes[i] += static_cast<int64_t>(prompt->echo.size());
        if (!send(dump(chunk_body(ep, id, created, model, i, prompt->echo, "", false, logprobs)))) return gone();
      }
      // A model without a tokenizer has no text: each step's tokens still get a chunk (empty text),
      // so a client sees them arrive.
      if (!out.text.empty() || (with_logprobs && !out.logprobs.empty()) ||
          (tokenizer == nullptr && !out.token_ids.empty() && !out.stop_token)) {
        const json logprobs =
            with_logprobs ? logprobs_json(ep, tokenizer, out.logprobs, choices->text_bytes[i]) : json();
        choices->text_bytes[i] += static_cast<int64_t>(out.text.size());
        if (!send(dump(chunk_body(ep, id, created, model, i, out.text, "", false, logprobs)))) return gone();
      }
      if (!out.finished) continue;
      ++n_finished;
      choices->finished[i] = true;
      last_reason = out.finish_reason;
      if (out.finish_reason == "error") {
        failure = "generation failed: " + out.error;
      } else if (out.finish_reason == "abort") {
        if (failure.empty()) failure = "abort";
      } else if (!send(dump(chunk_body(ep, id, created, model, i, "", out.finish_reason)))) {
        return gone();
      }
    }
    choices->done = true;
    spdlog::info("{} {} stream prompt={} n={} completion={} finish={} e2e={:.3f}s", path, id, n_prompt, n,
                 choices->total_completion_tokens(), last_reason, seconds_since(t0));
    if (!failure.empty()) {
      const bool aborted = failure == "abort";
      send(dump(error_body(aborted ? "the request was aborted (server shutting down)" : failure,
                           aborted ? "service_unavailable" : "server_error")));
    } else if (include_usage) {
      send(dump(usage_chunk_body(ep, id, created, model, n_prompt, choices->total_completion_tokens())));
    }
    send("[DONE]");
    sink.done();
    return true;
  }
};

// Reads a request body of at most `limit` bytes into `body`. Every body goes through here:
// httplib's own limit applies to Content-Length bodies only, and skips an oversized one by
// reading it whole. Past the limit the rest is read and dropped, so that the client, still
// sending, gets the 413 rather than a reset and the connection stays in step for its next
// request; but for at most another `limit` bytes or kBodyDrainSeconds, and not while the server
// stops. Cut short, the connection ends after the 413 (close_after_response), so an endless body
// holds no thread. Returns false with res.status set (413 past the limit) when there is no body
// to handle.
constexpr double kBodyDrainSeconds = 5.0;
bool read_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader,
               size_t limit, const std::atomic<bool>& stopping, std::string& body) {
  size_t received = 0;
  std::optional<std::chrono::steady_clock::time_point> over_since;
  bool cut = false;
  auto count = [&](size_t size) {
    received += size;
    if (received <= limit) return true;
    const auto now = std::chrono::steady_clock::now();
    if (!over_since) over_since = now;
    cut = received - limit > limit || stopping.load(std::memory_order_relaxed) ||
          std::chrono::duration<double>(now - *over_since).count() > kBodyDrainSeconds;
    return !cut;
  };
  auto keep = [&](const char* data, size_t size) {
    if (received + size <= limit) body.append(data, size);
    return count(size);
  };
  // A multipart body is no API request: it is counted and dropped (the JSON parse then refuses it).
  const bool read = req.is_multipart_form_data()
                        ? reader([](const httplib::MultipartFormData&) { return true; },
                                 [&](const char*, size_t size) { return count(size); })
                        : reader(keep);
  if (received > limit) {
    res.status = 413;
    if (cut) mark_closing(res);
  } else if (!read && res.status < 400) {
    res.status = 400;
  }
  if (res.status >= 400) {
    body.clear();
    return false;
  }
  return true;
}

}  // namespace

// The connection threads, as httplib's ThreadPool, but started by bind() on the caller's thread:
// httplib starts its own pool in the listening thread, where a thread that cannot start (too many
// for the system's limits) ends the process.
class ConnectionPool final : public httplib::TaskQueue {
 public:
  explicit ConnectionPool(size_t size) {
    threads_.reserve(size);
    try {
      for (size_t i = 0; i < size; ++i) threads_.emplace_back([this] { work(); });
    } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc for a thread's state
      const size_t started = threads_.size();
      shutdown();
      fail("cannot start {} HTTP connection threads (one per request running or queued: --max-num-seqs + "
           "--max-waiting + 16; {} started): {}; lower --max-waiting or raise the system's thread limits",
           size, started, e.what());
    }
  }
  ~ConnectionPool() override { shutdown(); }

  void enqueue(std::function<void()> job) override {
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    job_ready_.notify_one();
  }

  // Runs the jobs queued so far, then ends the threads. Called again, it does nothing.
  void shutdown() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    job_ready_.notify_all();
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        job_ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable job_ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
};

struct HttpServer::State {
  std::atomic<Engine*> engine{nullptr};
  ApiContext ctx;
  std::optional<ChatTemplate> chat_template;
  std::string chat_template_error;
  std::atomic<uint64_t> next_id{1};
  std::string id_salt;
  ServerConfig config;
  std::atomic<bool> stopping{false};  // stop() was called: bodies past the limit are not drained

  std::string make_id(Endpoint ep) {
    return fmt::format("{}-{}{:x}", ep == Endpoint::ChatCompletions ? "chatcmpl" : "cmpl", id_salt,
                       next_id.fetch_add(1));
  }
};

HttpServer::HttpServer(const ServerConfig& config)
    : config_(config), http_(std::make_unique<httplib::Server>()), state_(std::make_shared<State>()) {
  state_->config = config;
  std::random_device rd;
  state_->id_salt = fmt::format("{:08x}", rd());
  install_routes();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  if (config_.port == 0) {
    const int port = http_->bind_to_any_port(config_.host);
    SPIN_CHECK(port > 0, "cannot listen on {} (any port)", config_.host);
    config_.port = port;
  } else {
    SPIN_CHECK(config_.port > 0 && config_.port < 65536, "--port must be in 0..65535 (0: any free port), got {}",
               config_.port);
    SPIN_CHECK(http_->bind_to_port(config_.host, config_.port), "cannot listen on {}:{} (in use, or a bad address?)",
               config_.host, config_.port);
  }
  raise_listen_backlog();
  SPIN_CHECK(!pool_, "the HTTP server binds once");
  pool_ = std::make_unique<ConnectionPool>(static_cast<size_t>(config_.threads));
  return config_.port;
}

// cpp-httplib listens with a backlog of 5; a burst of hundreds of clients then overflows the accept
// queue, and some kernels answer the overflow with a reset. Listening again on the bound socket
// only changes its backlog.
void HttpServer::raise_listen_backlog() {
  SPIN_CHECK(listen_fd_ >= 0 && ::listen(listen_fd_, SOMAXCONN) == 0, "cannot raise the listen backlog on {}:{}",
             config_.host, config_.port);
}

void HttpServer::listen() {
  SPIN_CHECK(pool_, "the HTTP server listens once, after bind()");
  // httplib answers false when accept() fails (not after stop()): no connection is taken then.
  SPIN_CHECK(http_->listen_after_bind(), "the HTTP server on {}:{} stopped accepting connections", config_.host,
             config_.port);
}

void HttpServer::stop() {
  state_->stopping = true;
  if (http_) http_->stop();
}

void HttpServer::attach(Engine* engine, const Tokenizer* tokenizer, std::string model_name,
                        const AttentionSettings& default_attention) {
  State& st = *state_;
  st.ctx.default_attention = default_attention;
  st.ctx.tokenizer = tokenizer;
  st.ctx.model_name = std::move(model_name);
  st.ctx.max_model_len = engine->config().max_model_len;
  st.ctx.vocab_size = engine->model_config().vocab_size;
  st.ctx.max_running = engine->config().max_num_seqs;
  st.ctx.max_waiting = engine->config().max_waiting;
  st.ctx.algorithms = engine->algorithms();
  st.ctx.validate_attention = [engine](const AttentionSettings& s) { engine->validate_attention(s); };
  st.chat_template_error = "the model has no tokenizer";
  if (tokenizer) {
    try {
      st.chat_template.emplace(ChatTemplate::detect(tokenizer->chat_template(), *tokenizer));
      st.ctx.chat_template = &*st.chat_template;
    } catch (const Error& e) {
      st.chat_template_error = e.what();
      spdlog::warn("chat completions are off: {}", e.what());
    }
  }
  st.engine.store(engine, std::memory_order_release);
}

namespace {

Engine& live_engine(HttpServer::State& st);

// The methods of each path install_routes adds a route for, as an Allow header (httplib answers
// HEAD where GET has a route).
using RouteMethods = std::map<std::string, std::string, std::less<>>;

}  // namespace

void HttpServer::install_routes() {
  httplib::Server& http = *http_;
  std::shared_ptr<State> st = state_;
  // Filled by get / post below, before the server listens; read by the error handler.
  auto routes = std::make_shared<RouteMethods>();
  http.new_task_queue = [this] { return pool_.release(); };
  // Bodies are limited by read_body, which stops reading an endless one; httplib's limit would read
  // an oversized Content-Length body whole to skip it.
  http.set_payload_max_length(std::numeric_limits<size_t>::max());
  // SO_REUSEADDR only: httplib's default SO_REUSEPORT would let a second server share the port.
  http.set_socket_options([this](int fd) {
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd_ = fd;
  });

  http.set_pre_routing_handler([st](const httplib::Request& req, httplib::Response& res) {
    // Only the methods with body routes read a body (through read_body); httplib would read
    // another's (PRI's) whole, and leave a GET's in the stream to be parsed as requests.
    const bool body_method = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                             req.method == "DELETE";
    if (!body_method && has_body(req)) {
      send_error(res, 400, "invalid_request_error", fmt::format("a {} request takes no body", req.method));
      mark_closing(res);
      return httplib::Server::HandlerResponse::Handled;
    }
    const std::string& key = st->config.api_key;
    if (key.empty() || req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + key) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    send_error(res, 401, "authentication_error", "a valid API key is required (Authorization: Bearer <key>)",
               "", "invalid_api_key");
    if (has_body(req)) mark_closing(res);  // its body is not read
    return httplib::Server::HandlerResponse::Handled;
  });

  http.set_error_handler(httplib::Server::HandlerWithResponse([st, routes](const httplib::Request& req,
                                                                              httplib::Response& res) {
    if (!res.body.empty() || res.content_length_ > 0) return httplib::Server::HandlerResponse::Unhandled;
    if (res.status == 404) {
      // A route that exists under another method is 405 with Allow, as HTTP (and vLLM's server) has it.
      if (const auto route = routes->find(req.path); route != routes->end()) {
        const std::string& allowed = route->second;
        res.set_header("Allow", allowed);
        send_error(res, 405, "invalid_request_error",
                   fmt::format("{} is not allowed on {}: use {}", req.method, req.path, allowed), "", "method_not_allowed");
      } else {
        send_error(res, 404, "not_found_error", fmt::format("no route for {} {}", req.method, req.path));
      }
    } else if (res.status == 413) {
      send_error(res, 413, "invalid_request_error",
                 fmt::format("the request body is larger than the limit of {} bytes", st->config.max_body_bytes),
                 "", "request_too_large");
    } else if (res.status >= 500) {
      send_error(res, res.status, "server_error", "internal server error");
    } else {
      send_error(res, res.status, "invalid_request_error", fmt::format("bad request ({})", res.status));
    }
    return httplib::Server::HandlerResponse::Handled;
  }));

  // httplib calls its logger once the response is written: where the request's body went unread,
  // the connection ends there.
  http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    if (res.status >= 400) spdlog::info("{} {} -> {}", req.method, req.path, res.status);
    if (marked_closing(res)) close_after_response(req);
  });

  // Every API handler: exceptions become OpenAI-style errors (error_reply); the server's own
  // failures are logged.
  auto guarded = [](auto handler) {
    return [handler](const httplib::Request& req, httplib::Response& res, const auto&... body) {
      try {
        handler(req, res, body...);
      } catch (...) {
        const ErrorReply e = error_reply(std::current_exception());
        if (e.server_fault()) spdlog::error("{} {}: {}", req.method, req.path, e.message);
        send_error(res, e.status, e.type, e.message, e.param, e.code);
      }
    };
  };

  const auto get = [&](const char* path, httplib::Server::Handler handler) {
    http.Get(path, std::move(handler));
    (*routes)[path] = "GET, HEAD";
  };
  get("/health", [st](const httplib::Request&, httplib::Response& res) {
    Engine* engine = st->engine.load(std::memory_order_acquire);
    if (!engine) return send_error(res, 503, "service_unavailable", "the model is loading");
    if (!engine->alive()) return send_error(res, 503, "service_unavailable", "the engine stopped after an internal error");
    res.set_content("", "text/plain");
  });

  get("/metrics", [st](const httplib::Request&, httplib::Response& res) {
    Engine* engine = st->engine.load(std::memory_order_acquire);
    EngineMetrics m = engine ? engine->metrics() : EngineMetrics{};
    res.set_content(render_metrics(m, engine && engine->alive()), "text/plain; version=0.0.4");
  });

  get("/v1/models", guarded([st](const httplib::Request&, httplib::Response& res) {
    live_engine(*st);
    json model{{"id", st->ctx.model_name},
               {"object", "model"},
               {"created", unix_now()},
               {"owned_by", "spin"},
               {"max_model_len", st->ctx.max_model_len}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({model})}}), "application/json");
  }));

  auto generate = [st](Endpoint ep) {
    return [st, ep](const httplib::Request& req, httplib::Response& res, const std::string& body) {
      Engine& engine = live_engine(*st);
      if (ep == Endpoint::ChatCompletions && !st->ctx.chat_template) {
        throw ApiError(400, "invalid_request_error",
                       "this model has no usable chat template (" + st->chat_template_error +
                           "): use /v1/completions");
      }
      const auto t0 = std::chrono::steady_clock::now();
      ParsedRequest pr = parse_request(ep, body, st->ctx);
      const std::string id = st->make_id(ep);
      const int64_t created = unix_now();
      const std::string& model = st->ctx.model_name;
      int64_t n_prompt = 0;  // all prompts' tokens (usage counts each prompt once, whatever its 'n')
      for (const ParsedPrompt& prompt : pr.prompts) n_prompt += static_cast<int64_t>(prompt.ids.size());
      auto choices = std::make_shared<ChoiceSet>();
      const size_t n = pr.prompts.size() * static_cast<size_t>(pr.n);
      choices->finished.assign(n, false);
      choices->completion_tokens.assign(n, 0);
      choices->text_bytes.assign(n, 0);
      const bool with_logprobs = pr.params.top_logprobs >= 0;
      const Tokenizer* tokenizer = st->ctx.tokenizer;
      try {
        for (size_t i = 0; i < n; ++i) {
          const ParsedPrompt& prompt = pr.prompts[i / static_cast<size_t>(pr.n)];
          RequestParams params = pr.params;
          params.max_tokens = prompt.max_tokens;
          // Distinct choices from one seed: a prompt's choice j samples with seed + j (as each prompt
          // sent alone would).
          if (params.sampling.seed) params.sampling.seed = *params.sampling.seed + i % static_cast<size_t>(pr.n);
          choices->engine_ids.push_back(engine.add_request(
              prompt.ids, params, [choices, i](const RequestOutput& out) { choices->queue.push({i, out}); }));
        }
      } catch (...) {
        for (uint64_t engine_id : choices->engine_ids) engine.abort(engine_id);
        throw;
      }
      if (pr.echo) {
        choices->echo = std::move(pr.prompts);
        choices->per_prompt = static_cast<size_t>(pr.n);
        choices->echoed.assign(n, false);
      }

      if (!pr.stream) {
        std::vector<Choice> results(n);
        std::vector<std::vector<TokenLogprob>> logprobs(n), prompt_logprobs(n);
        std::string failure;
        size_t n_finished = 0;
        // Nothing is written until the end, so the socket itself is watched for the client leaving.
        const int socket_fd = connection_socket(req);
        if (socket_fd < 0) {
          spdlog::warn("{} {}: connection socket not found; a disconnect is seen only at the end", req.path, id);
        }
        constexpr auto kSocketCheck = std::chrono::milliseconds(100);
        auto next_check = std::chrono::steady_clock::now() + kSocketCheck;
        while (n_finished < n) {
          auto item = choices->queue.pop(kSocketCheck);
          // Outputs may keep arriving faster than the check interval: check by the clock.
          if (socket_fd >= 0 && std::chrono::steady_clock::now() >= next_check) {
            next_check = std::chrono::steady_clock::now() + kSocketCheck;
            if (peer_closed(socket_fd)) {
              choices->abort_unfinished(engine);
              spdlog::info("{} {} prompt={} client disconnected after {} tokens: aborted", req.path, id, n_prompt,
                           choices->total_completion_tokens());
              return send_error(res, 499, "client_closed_request", "the client closed the connection");
            }
          }
          if (!item) continue;
          auto& [i, out] = *item;
          results[i].text += out.text;
          logprobs[i].insert(logprobs[i].end(), out.logprobs.begin(), out.logprobs.end());
          prompt_logprobs[i].insert(prompt_logprobs[i].end(), out.prompt_logprobs.begin(), out.prompt_logprobs.end());
          choices->completion_tokens[i] = out.completion_tokens;
          if (!out.finished) continue;
          ++n_finished;
          choices->finished[i] = true;
          results[i].finish_reason = out.finish_reason;
          if (out.finish_reason == "error") failure = "generation failed: " + out.error;
          if (out.finish_reason == "abort" && failure.empty()) failure = "abort";
        }
        spdlog::info("{} {} prompt={} n={} completion={} finish={} e2e={:.3f}s", req.path, id, n_prompt, n,
                     choices->total_completion_tokens(), results[0].finish_reason, seconds_since(t0));
        if (failure == "abort") {
          return send_error(res, 503, "service_unavailable", "the request was aborted (server shutting down)");
        }
        if (!failure.empty()) return send_error(res, 500, "server_error", failure);
        for (size_t i = 0; i < n; ++i) {
          const ParsedPrompt* echo = choices->echo_of(i);
          const int64_t offset = echo ? static_cast<int64_t>(echo->echo.size()) : 0;
          if (with_logprobs) results[i].logprobs = logprobs_json(ep, tokenizer, logprobs[i], offset);
          if (with_logprobs && echo) {
            results[i].logprobs =
                join_logprobs(echo_logprobs_json(tokenizer, echo->ids, prompt_logprobs[i]), results[i].logprobs);
          }
          if (echo) results[i].text.insert(0, echo->echo);
        }
        res.set_content(dump(completion_body(ep, id, created, model, results, n_prompt,
                                             choices->total_completion_tokens())),
                        "application/json");
        return;
      }

      auto stream = std::make_shared<StreamResponse>(StreamResponse{
          choices, &engine, ep, id, created, model, pr.include_usage, n_prompt, n, t0, with_logprobs, tokenizer,
          req.path});
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [stream](size_t, httplib::DataSink& sink) {
            return run_stream_provider(
                sink, [&] { return stream->provide(sink); },
                [&] {
                  stream->choices->abort_unfinished(*stream->engine);
                  stream->choices->done = true;
                },
                stream->path + " " + stream->id);
          },
          [stream](bool) {
            // The connection ended before the request did (a write failed, the server stops).
            if (!stream->choices->done) stream->choices->abort_unfinished(*stream->engine);
          });
    };
  };
  // Every request with a body reads it with read_body (httplib would read a chunked body whole):
  // the API's POST routes, and any other POST, PUT, PATCH or DELETE, which then gets a 404 (or a
  // 405 on a path that has a route) from the error handler. httplib tries these body routes before plain ones of the same method, so
  // a route added later must use with_body and come before the catch-alls.
  auto with_body = [st](auto handler) {
    return [st, handler](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
      std::string body;
      if (read_body(req, res, reader, st->config.max_body_bytes, st->stopping, body)) handler(req, res, body);
    };
  };
  const auto post = [&](const char* path, httplib::Server::HandlerWithContentReader handler) {
    http.Post(path, std::move(handler));
    (*routes)[path] = "POST";
  };
  post("/v1/completions", with_body(guarded(generate(Endpoint::Completions))));
  post("/v1/chat/completions", with_body(guarded(generate(Endpoint::ChatCompletions))));
  const auto no_route =
      with_body([](const httplib::Request&, httplib::Response& res, const std::string&) { res.status = 404; });
  http.Post(".*", no_route);
  http.Put(".*", no_route);
  http.Patch(".*", no_route);
  http.Delete(".*", no_route);
}

bool run_stream_provider(httplib::DataSink& sink, const std::function<bool()>& provide,
                         const std::function<void()>& abort, const std::string& what) {
  try {
    return provide();
  } catch (...) {
    const ErrorReply e = error_reply(std::current_exception());
    spdlog::error("{}: streaming failed: {}", what, e.message);
    abort();
    if (!sink.is_writable || !sink.is_writable()) return false;
    const std::string events = "data: " + dump(error_body(e.message, e.type)) + "\n\ndata: [DONE]\n\n";
    if (!sink.write(events.data(), events.size())) return false;
    sink.done();
    return true;
  }
}

namespace {

Engine& live_engine(HttpServer::State& st) {
  Engine* engine = st.engine.load(std::memory_order_acquire);
  if (!engine) throw ApiError(503, "service_unavailable", "the model is still loading");
  if (!engine->alive()) throw ApiError(503, "service_unavailable", "the engine stopped after an internal error");
  return *engine;
}

// One sample of /metrics: a series of a family (families are consecutive rows of one name) and
// how to read its value from a source T (the engine's metrics, the paged store's usage).
template <typename T>
struct MetricRow {
  const char* name;
  const char* type;    // "gauge" or "counter"
  const char* help;
  const char* labels;  // "" or `key="value"`
  double (*value)(const T&);
};

template <typename T>
double num(T x) {
  return static_cast<double>(x);
}

const MetricRow<EngineMetrics> kEngineRows[] = {
    {"spin_num_requests_running", "gauge", "Requests in the running batch", "",
     [](const EngineMetrics& m) { return num(m.requests_running); }},
    {"spin_num_requests_waiting", "gauge", "Requests waiting to be scheduled", "",
     [](const EngineMetrics& m) { return num(m.requests_waiting); }},
    {"spin_kv_tokens_used", "gauge", "KV tokens held by requests (whole blocks)", "",
     [](const EngineMetrics& m) { return num(m.kv_tokens_used); }},
    {"spin_kv_tokens_capacity", "gauge", "KV-token budget of all requests together", "",
     [](const EngineMetrics& m) { return num(m.kv_tokens_capacity); }},
    {"spin_prompt_tokens_total", "counter", "Prompt tokens received", "",
     [](const EngineMetrics& m) { return num(m.prompt_tokens_total); }},
    {"spin_generation_tokens_total", "counter", "Tokens generated", "",
     [](const EngineMetrics& m) { return num(m.generation_tokens_total); }},
    {"spin_preemptions_total", "counter",
     "Requests preempted, by kind (swap: KV kept in the host tier; recompute: KV freed)", "kind=\"swap\"",
     [](const EngineMetrics& m) { return num(m.preemptions_swap); }},
    {"spin_preemptions_total", "counter", "", "kind=\"recompute\"",
     [](const EngineMetrics& m) { return num(m.preemptions_recompute); }},
    {"spin_request_success_total", "counter", "Requests finished, by reason", "finished_reason=\"stop\"",
     [](const EngineMetrics& m) { return num(m.requests_finished_stop); }},
    {"spin_request_success_total", "counter", "", "finished_reason=\"length\"",
     [](const EngineMetrics& m) { return num(m.requests_finished_length); }},
    {"spin_requests_aborted_total", "counter", "Requests aborted (client gone or shutdown)", "",
     [](const EngineMetrics& m) { return num(m.requests_aborted); }},
    {"spin_engine_steps_total", "counter", "Scheduler iterations", "",
     [](const EngineMetrics& m) { return num(m.steps_total); }},
    {"spin_engine_step_seconds_total", "counter",
     "Engine thread time in steps, by phase (schedule: choosing the work; forward: the model; finish: drawing "
     "tokens and handing outputs to clients)",
     "phase=\"schedule\"", [](const EngineMetrics& m) { return m.step_schedule_seconds; }},
    {"spin_engine_step_seconds_total", "counter", "", "phase=\"forward\"",
     [](const EngineMetrics& m) { return m.step_forward_seconds; }},
    {"spin_engine_step_seconds_total", "counter", "", "phase=\"finish\"",
     [](const EngineMetrics& m) { return m.step_finish_seconds; }},
    {"spin_kv_store_exhausted_total", "counter",
     "Steps in which the paged KV store ran out (an algorithm above its admission bound)", "",
     [](const EngineMetrics& m) { return num(m.kv_store_exhausted_total); }},
    {"spin_kv_device_pages_reserved", "gauge", "Paged KV store: device pages the scheduler reserved", "",
     [](const EngineMetrics& m) { return num(m.kv_device_pages_reserved); }},
    {"spin_kv_host_pages_reserved", "gauge", "Paged KV store: host pages the scheduler reserved", "",
     [](const EngineMetrics& m) { return num(m.kv_host_pages_reserved); }},
    {"spin_kv_buffer_pages_reserved", "gauge", "Paged KV store: reserved device pages of elastic buffers", "",
     [](const EngineMetrics& m) { return num(m.kv_buffer_pages_reserved); }},
    {"spin_kv_dense_layer_pages_reserved", "gauge",
     "Paged KV store: reserved pages of the first dense layers' own device pool (GPU)", "",
     [](const EngineMetrics& m) { return num(m.kv_dense_layer_pages_reserved); }},
};

const MetricRow<KvStoreUsage> kStoreRows[] = {
    {"spin_kv_device_pages_used", "gauge", "Paged KV store: device-tier pages in use", "",
     [](const KvStoreUsage& u) { return num(u.device_pages_used); }},
    {"spin_kv_device_pages_capacity", "gauge", "Paged KV store: device-tier pages", "",
     [](const KvStoreUsage& u) { return num(u.device_pages_capacity); }},
    {"spin_kv_host_pages_used", "gauge", "Paged KV store: host-tier pages in use", "",
     [](const KvStoreUsage& u) { return num(u.host_pages_used); }},
    {"spin_kv_host_pages_capacity", "gauge", "Paged KV store: host-tier pages", "",
     [](const KvStoreUsage& u) { return num(u.host_pages_capacity); }},
    {"spin_kv_page_bytes", "gauge", "Paged KV store: bytes of one page (K and V of one layer x KV head)", "",
     [](const KvStoreUsage& u) { return num(u.page_bytes); }},
    {"spin_kv_logical_segments_used", "gauge", "Paged KV store: logical page-table segments in use", "",
     [](const KvStoreUsage& u) { return num(u.logical_segments_used); }},
    {"spin_kv_resident_segments_used", "gauge", "Paged KV store: resident page-table segments in use", "",
     [](const KvStoreUsage& u) { return num(u.resident_segments_used); }},
    {"spin_kv_requests", "gauge", "Paged KV store: request slots taken", "",
     [](const KvStoreUsage& u) { return num(u.requests); }},
    {"spin_kv_metadata_device_bytes", "gauge", "Paged KV store: page-table bytes on the device tier", "",
     [](const KvStoreUsage& u) { return num(u.metadata_device_bytes); }},
    {"spin_kv_metadata_host_bytes", "gauge", "Paged KV store: page-table bytes on the host tier", "",
     [](const KvStoreUsage& u) { return num(u.metadata_host_bytes); }},
    {"spin_kv_cache_hits_total", "counter", "Paged KV store: selected pages already on the device", "",
     [](const KvStoreUsage& u) { return num(u.hits); }},
    {"spin_kv_cache_misses_total", "counter", "Paged KV store: selected pages fetched from the host tier", "",
     [](const KvStoreUsage& u) { return num(u.misses); }},
    {"spin_kv_retrieve_bytes_total", "counter", "Paged KV store: bytes copied host to device", "",
     [](const KvStoreUsage& u) { return num(u.retrieve_bytes); }},
    {"spin_kv_offload_bytes_total", "counter", "Paged KV store: bytes copied device to host", "",
     [](const KvStoreUsage& u) { return num(u.offload_bytes); }},
    {"spin_kv_evictions_total", "counter", "Paged KV store: device pages evicted", "",
     [](const KvStoreUsage& u) { return num(u.evictions); }},
};

const MetricRow<ForwardStats> kForwardRows[] = {
    {"spin_model_forwards_total", "counter",
     "Device model forwards, by how they ran (eager: kernel by kernel; graph: a CUDA graph launch)", "kind=\"eager\"",
     [](const ForwardStats& f) { return num(f.eager_steps); }},
    {"spin_model_forwards_total", "counter", "", "kind=\"graph\"",
     [](const ForwardStats& f) { return num(f.graph_replays); }},
    {"spin_model_graphs_captured_total", "counter", "Decode shapes captured into CUDA graphs", "",
     [](const ForwardStats& f) { return num(f.graphs_captured); }},
    {"spin_model_device_wait_seconds_total", "counter",
     "Time forwards blocked at their end until the device finished them (the rest of the forward phase is host "
     "work and earlier waits)",
     "",
     [](const ForwardStats& f) { return f.device_wait_seconds; }},
};

const struct {
  const char* name;
  const char* help;
  Histogram EngineMetrics::*histogram;
} kHistograms[] = {
    {"spin_time_to_first_token_seconds", "Time from arrival to the first token", &EngineMetrics::time_to_first_token},
    {"spin_inter_token_latency_seconds", "Time between consecutive tokens of a request",
     &EngineMetrics::inter_token_latency},
    {"spin_e2e_request_latency_seconds", "Time from arrival to the last token", &EngineMetrics::e2e_latency},
};

template <typename T, size_t N>
void render_rows(std::string& out, const MetricRow<T> (&rows)[N], const T& source) {
  std::string_view family;
  for (const MetricRow<T>& row : rows) {
    if (family != row.name) {
      family = row.name;
      out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n", row.name, row.help, row.type);
    }
    const std::string labels = *row.labels ? fmt::format("{{{}}}", row.labels) : std::string();
    out += fmt::format("{}{} {}\n", row.name, labels, row.value(source));
  }
}

}  // namespace

std::string render_metrics(const EngineMetrics& m, bool engine_alive) {
  std::string out = fmt::format(
      "# HELP spin_engine_up 1 while the engine runs, 0 while loading or after it failed\n"
      "# TYPE spin_engine_up gauge\nspin_engine_up {}\n",
      engine_alive ? 1 : 0);
  render_rows(out, kEngineRows, m);
  if (m.kv_store) render_rows(out, kStoreRows, *m.kv_store);
  if (m.forward) render_rows(out, kForwardRows, *m.forward);
  for (const auto& [name, help, member] : kHistograms) {
    const Histogram& h = m.*member;
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
    for (size_t i = 0; i < h.bounds().size(); ++i) {
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds()[i], h.cumulative_counts()[i]);
    }
    out += fmt::format("{0}_bucket{{le=\"+Inf\"}} {1}\n{0}_sum {2}\n{0}_count {1}\n", name, h.count(), h.sum());
  }
  return out;
}

}  // namespace spin::server
