// `spin bench`: a serving benchmark client for any OpenAI-compatible /v1/completions endpoint.
// Requests arrive as a Poisson process (or gamma with --burstiness, as vLLM's benchmark), stream
// their tokens (SSE), and the run reports TTFT, TPOT, ITL and end-to-end latency percentiles,
// request and token throughput, and goodput under SLOs. Prompts are token-id arrays of the
// workload's lengths; outputs run to their length (ignore_eos).
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/error.h"
#include "cli/commands.h"

namespace spin::cli {

namespace {

using json = nlohmann::json;
using clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";
  std::string model;
  std::string api_key;
  int64_t num_prompts = 100;
  std::vector<std::string> request_rates{"inf"};
  double burstiness = 1.0;
  int64_t max_concurrency = 0;
  std::string dataset = "random";
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;
  double length_scale = 1.0;
  std::optional<double> output_length_scale;  // outputs only; unset: length_scale
  double output_scale() const { return output_length_scale.value_or(length_scale); }
  std::string token_ids = "256:10000";
  uint64_t seed = 0;
  std::vector<std::string> goodput;
  std::string extra_body;
  std::string json_out;
  double timeout_s = 3600;
};

struct Workload {
  int64_t prompt_len = 0;
  int64_t output_len = 0;
};

// Request lengths of the workload, scaled by --length-scale and outputs by --output-length-scale
// (at least 1 token each).
std::vector<Workload> make_workload(const BenchArgs& a, std::mt19937_64& rng) {
  std::vector<Workload> out(static_cast<size_t>(a.num_prompts));
  const auto scale_by = [](double scale) {
    return [scale](double tokens) { return std::max<int64_t>(1, std::llround(tokens * scale)); };
  };
  const auto scaled = scale_by(a.length_scale);
  const auto scaled_output = scale_by(a.output_scale());
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  for (Workload& w : out) {
    if (a.dataset == "random") {
      // As vLLM's random dataset: uniform within +-range_ratio of the length.
      w.prompt_len = scaled(std::round(uniform(a.input_len * (1 - a.range_ratio), a.input_len * (1 + a.range_ratio) + 1e-9)));
      w.output_len = scaled_output(std::round(uniform(a.output_len * (1 - a.range_ratio), a.output_len * (1 + a.range_ratio) + 1e-9)));
    } else if (a.dataset == "longbench-v2") {
      // Input 32K..120K with mean ~55K: 32K plus an exponential tail (mean 23K) clipped at 120K;
      // output mean 5K: uniform 2.5K..7.5K.
      const double tail = std::exponential_distribution<double>(1.0 / 23000.0)(rng);
      w.prompt_len = scaled(std::min(32000.0 + tail, 120000.0));
      w.output_len = scaled_output(uniform(2500, 7500));
    } else {  // longgenbench: input ~18K, output ~12K
      w.prompt_len = scaled(uniform(16000, 20000));
      w.output_len = scaled_output(uniform(9000, 15000));
    }
  }
  return out;
}

struct RequestResult {
  bool ok = false;
  std::string error;
  int64_t prompt_len = 0;
  int64_t output_tokens = 0;
  double ttft = 0;  // seconds
  double e2e = 0;
  std::vector<double> itl;  // gaps between streamed chunks after the first
};

struct Target {
  std::string scheme_host_port;
  std::string path_prefix;  // e.g. "/v1" when --base-url ends with it
};

Target parse_base_url(const std::string& url) {
  const auto scheme_end = url.find("://");
  SPIN_CHECK(scheme_end != std::string::npos && url.substr(0, scheme_end) == "http",
             "--base-url must start with http:// (got '{}')", url);
  const auto path_start = url.find('/', scheme_end + 3);
  Target t;
  t.scheme_host_port = url.substr(0, path_start);
  if (path_start != std::string::npos) t.path_prefix = url.substr(path_start);
  while (!t.path_prefix.empty() && t.path_prefix.back() == '/') t.path_prefix.pop_back();
  // An OpenAI-style base URL ends in /v1; the endpoint already carries it.
  if (t.path_prefix.size() >= 3 && t.path_prefix.substr(t.path_prefix.size() - 3) == "/v1") {
    t.path_prefix.resize(t.path_prefix.size() - 3);
  }
  return t;
}

httplib::Headers auth_headers(const BenchArgs& a) {
  httplib::Headers h;
  if (!a.api_key.empty()) h.emplace("Authorization", "Bearer " + a.api_key);
  return h;
}

RequestResult run_request(const BenchArgs& a, const Target& target, const json& body) {
  RequestResult r;
  httplib::Client client(target.scheme_host_port);
  const auto timeout = std::chrono::duration<double>(a.timeout_s);
  client.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client.set_connection_timeout(30);
  httplib::Request req;
  req.method = "POST";
  req.path = target.path_prefix + a.endpoint;
  req.headers = auth_headers(a);
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  const auto start = clock::now();
  auto last = start;
  bool first = true, done = false;
  std::string buffer, error_body;
  int status = 0;
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  auto on_event = [&](const std::string& data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json chunk = json::parse(data, nullptr, false);
    if (chunk.is_discarded() || !chunk.is_object()) {
      r.error = "unparsable stream chunk";
      return;
    }
    if (chunk.contains("error")) {
      r.error = chunk["error"].value("message", "error chunk");
      return;
    }
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      r.output_tokens = chunk["usage"].value("completion_tokens", int64_t{0});
    }
    const json& choices = chunk.value("choices", json::array());
    for (const json& c : choices) {
      // A chunk carrying text is a token event; so is an empty one that ends nothing (a server
      // whose model has no tokenizer sends those).
      if (!c.is_object() || !c.contains("text") || !c["text"].is_string()) continue;
      if (c["text"].get_ref<const std::string&>().empty() && !c.value("finish_reason", json()).is_null()) continue;
      const auto now = clock::now();
      if (first) {
        r.ttft = std::chrono::duration<double>(now - start).count();
        first = false;
      } else {
        r.itl.push_back(std::chrono::duration<double>(now - last).count());
      }
      last = now;
    }
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (status != 200) {
      error_body.append(data, n);
      return true;
    }
    buffer.append(data, n);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client.send(req, res, err);
  r.e2e = std::chrono::duration<double>(clock::now() - start).count();
  if (!sent) {
    r.error = "HTTP error: " + httplib::to_string(err);
  } else if (status != 200) {
    const json e = json::parse(error_body, nullptr, false);
    r.error = fmt::format("HTTP {}: {}", status,
                          e.is_object() && e.contains("error") ? e["error"].value("message", "") : error_body.substr(0, 200));
  } else if (r.error.empty() && !done) {
    r.error = "stream ended without [DONE]";
  } else if (r.error.empty() && first) {
    r.error = "no tokens streamed";
  }
  r.ok = r.error.empty();
  return r;
}

// The server's running batch, sampled from its Prometheus /metrics (spin's or vLLM's gauge) every
// 200 ms until `stop`; empty when the server has neither.
std::vector<double> sample_running_batch(const BenchArgs& a, const Target& target, const std::atomic<bool>& stop) {
  std::vector<double> samples;
  httplib::Client client(target.scheme_host_port);
  client.set_connection_timeout(2);
  client.set_read_timeout(2);
  while (!stop) {
    if (auto res = client.Get(target.path_prefix + "/metrics", auth_headers(a)); res && res->status == 200) {
      std::istringstream lines(res->body);
      for (std::string line; std::getline(lines, line);) {
        if (!line.starts_with("spin_num_requests_running") && !line.starts_with("vllm:num_requests_running")) continue;
        const char* value = line.c_str() + line.rfind(' ') + 1;
        char* end = nullptr;
        const double v = std::strtod(value, &end);
        if (end != value) samples.push_back(v);
        break;
      }
    } else if (samples.empty()) {
      return samples;  // no /metrics: nothing to sample
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return samples;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  // Linear interpolation between closest ranks (numpy's default).
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

json summary_ms(const std::vector<double>& seconds) {
  double sum = 0;
  for (double x : seconds) sum += x;
  const double mean = seconds.empty() ? 0.0 : sum / static_cast<double>(seconds.size());
  return json{{"mean", mean * 1e3}, {"p50", percentile(seconds, 50) * 1e3}, {"p90", percentile(seconds, 90) * 1e3},
              {"p99", percentile(seconds, 99) * 1e3}, {"count", seconds.size()}};
}

struct Slo {
  std::map<std::string, double> limits_ms;  // ttft, tpot, e2el
};

Slo parse_goodput(const std::vector<std::string>& specs) {
  Slo slo;
  for (const std::string& s : specs) {
    const auto colon = s.find(':');
    SPIN_CHECK(colon != std::string::npos, "--goodput takes NAME:MS pairs (ttft, tpot, e2el), got '{}'", s);
    const std::string name = s.substr(0, colon);
    SPIN_CHECK(name == "ttft" || name == "tpot" || name == "e2el", "--goodput: unknown SLO '{}' (ttft, tpot, e2el)", name);
    double ms = 0;
    try {
      size_t used = 0;
      ms = std::stod(s.substr(colon + 1), &used);
      SPIN_CHECK(used == s.size() - colon - 1, "");
    } catch (const std::exception&) {
      fail("--goodput: '{}' is not a number of milliseconds", s.substr(colon + 1));
    }
    SPIN_CHECK(std::isfinite(ms) && ms > 0, "--goodput: {} must be a positive number of ms, got {}", name, ms);
    slo.limits_ms[name] = ms;
  }
  return slo;
}

double parse_rate(const std::string& s) {
  if (s == "inf") return std::numeric_limits<double>::infinity();
  try {
    size_t used = 0;
    const double r = std::stod(s, &used);
    if (used == s.size() && std::isfinite(r) && r > 0) return r;
  } catch (const std::exception&) {
  }
  fail("--request-rate must be a positive number or inf, got '{}'", s);
}

// One benchmark run at one request rate.
json run_at_rate(const BenchArgs& a, const Target& target, const std::string& model, double rate,
                 const std::vector<Workload>& workload, const std::vector<std::vector<int32_t>>& prompts,
                 const json& extra, const Slo& slo) {
  std::mt19937_64 rng(a.seed + 1);
  // Gamma inter-arrival times with shape k and mean 1/rate; k = 1 is Poisson.
  std::gamma_distribution<double> gap(a.burstiness, 1.0 / (rate * a.burstiness));
  std::vector<RequestResult> results(workload.size());
  std::mutex mutex;
  std::condition_variable slot_free;
  int64_t in_flight = 0;
  std::atomic<int64_t> finished{0};
  std::vector<std::thread> threads;
  threads.reserve(workload.size());
  std::atomic<bool> stop_sampling{false};
  std::vector<double> running;
  std::thread sampler([&] { running = sample_running_batch(a, target, stop_sampling); });
  const auto start = clock::now();
  auto next_arrival = start;
  for (size_t i = 0; i < workload.size(); ++i) {
    if (std::isfinite(rate)) {
      std::this_thread::sleep_until(next_arrival);
      next_arrival += std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(gap(rng)));
    }
    if (a.max_concurrency > 0) {
      std::unique_lock lock(mutex);
      slot_free.wait(lock, [&] { return in_flight < a.max_concurrency; });
    }
    {
      std::lock_guard lock(mutex);
      ++in_flight;
    }
    json body = extra;
    body["model"] = model;
    body["prompt"] = prompts[i];
    body["max_tokens"] = workload[i].output_len;
    body["ignore_eos"] = true;
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    if (!body.contains("temperature")) body["temperature"] = 0;
    threads.emplace_back([&, i, body = std::move(body)] {
      results[i] = run_request(a, target, body);
      results[i].prompt_len = workload[i].prompt_len;
      const int64_t n = ++finished;
      if (n % std::max<int64_t>(1, static_cast<int64_t>(workload.size()) / 10) == 0) {
        spdlog::info("rate {}: {}/{} requests done", rate, n, workload.size());
      }
      {
        std::lock_guard lock(mutex);
        --in_flight;
      }
      slot_free.notify_all();
    });
  }
  const double arrival_span = std::chrono::duration<double>(clock::now() - start).count();
  for (std::thread& t : threads) t.join();
  const double duration = std::chrono::duration<double>(clock::now() - start).count();
  stop_sampling = true;
  sampler.join();

  std::vector<double> ttft, tpot, itl, e2el;
  int64_t completed = 0, input_tokens = 0, output_tokens = 0, good = 0;
  std::vector<std::string> errors;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (errors.size() < 5) errors.push_back(r.error);
      continue;
    }
    ++completed;
    input_tokens += r.prompt_len;
    output_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2el.push_back(r.e2e);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    const double t = r.output_tokens > 1 ? (r.e2e - r.ttft) / static_cast<double>(r.output_tokens - 1) : 0.0;
    if (r.output_tokens > 1) tpot.push_back(t);
    bool meets = true;
    if (auto it = slo.limits_ms.find("ttft"); it != slo.limits_ms.end()) meets &= r.ttft * 1e3 <= it->second;
    if (auto it = slo.limits_ms.find("tpot"); it != slo.limits_ms.end()) meets &= t * 1e3 <= it->second;
    if (auto it = slo.limits_ms.find("e2el"); it != slo.limits_ms.end()) meets &= r.e2e * 1e3 <= it->second;
    good += meets ? 1 : 0;
  }
  json out{{"request_rate", std::isfinite(rate) ? json(rate) : json("inf")},
           {"burstiness", a.burstiness},
           {"max_concurrency", a.max_concurrency},
           {"num_prompts", workload.size()},
           {"completed", completed},
           {"failed", static_cast<int64_t>(workload.size()) - completed},
           {"errors", errors},
           {"duration_s", duration},
           // Realised arrivals: the last request was sent this long after the first.
           {"arrival_span_s", arrival_span},
           {"total_input_tokens", input_tokens},
           {"total_output_tokens", output_tokens},
           {"request_throughput", completed / duration},
           {"output_throughput", output_tokens / duration},
           {"total_token_throughput", (input_tokens + output_tokens) / duration},
           {"ttft_ms", summary_ms(ttft)},
           {"tpot_ms", summary_ms(tpot)},
           {"itl_ms", summary_ms(itl)},
           {"e2el_ms", summary_ms(e2el)}};
  if (!running.empty()) {
    // Over the whole run, idle gaps between arrivals included.
    out["mean_running_batch"] = std::accumulate(running.begin(), running.end(), 0.0) / static_cast<double>(running.size());
    out["max_running_batch"] = *std::max_element(running.begin(), running.end());
  }
  if (!slo.limits_ms.empty()) {
    out["goodput_slo_ms"] = slo.limits_ms;
    out["goodput"] = good / duration;
    out["good_requests"] = good;
  }
  return out;
}

void print_run(const json& r) {
  auto line = [](const char* name, const json& s) {
    std::printf("  %-5s ms  mean %9.2f  p50 %9.2f  p90 %9.2f  p99 %9.2f\n", name, s["mean"].get<double>(),
                s["p50"].get<double>(), s["p90"].get<double>(), s["p99"].get<double>());
  };
  std::printf("request rate %s: %lld/%lld completed in %.2f s; %.3f req/s, %.1f output tok/s, %.1f total tok/s\n",
              r["request_rate"].dump().c_str(), static_cast<long long>(r["completed"].get<int64_t>()),
              static_cast<long long>(r["num_prompts"].get<int64_t>()), r["duration_s"].get<double>(),
              r["request_throughput"].get<double>(), r["output_throughput"].get<double>(),
              r["total_token_throughput"].get<double>());
  // A few Poisson arrivals can come far faster or slower than the rate asked for.
  const auto sent = r["num_prompts"].get<int64_t>();
  const double span = r["arrival_span_s"].get<double>();
  if (r["request_rate"].is_number() && sent > 1 && span > 0) {
    std::printf("  arrivals within %.1f s: %.3f req/s between the first and the last\n", span,
                static_cast<double>(sent - 1) / span);
  }
  line("TTFT", r["ttft_ms"]);
  line("TPOT", r["tpot_ms"]);
  line("ITL", r["itl_ms"]);
  line("E2E", r["e2el_ms"]);
  if (r.contains("goodput")) std::printf("  goodput %.3f req/s\n", r["goodput"].get<double>());
  if (r.contains("mean_running_batch")) {
    std::printf("  running batch mean %.2f, max %.0f\n", r["mean_running_batch"].get<double>(),
                r["max_running_batch"].get<double>());
  }
  for (const json& e : r["errors"]) std::printf("  error: %s\n", e.get<std::string>().c_str());
  std::fflush(stdout);
}

void run_bench(const BenchArgs& a) {
  SPIN_CHECK(a.num_prompts > 0 && a.num_prompts <= 1000000, "--num-prompts must be in 1..1000000, got {}", a.num_prompts);
  SPIN_CHECK(std::isfinite(a.burstiness) && a.burstiness > 0, "--burstiness must be > 0, got {}", a.burstiness);
  SPIN_CHECK(a.max_concurrency >= 0, "--max-concurrency must be >= 0, got {}", a.max_concurrency);
  SPIN_CHECK(a.input_len > 0 && a.output_len > 0, "--input-len and --output-len must be positive");
  SPIN_CHECK(std::isfinite(a.range_ratio) && a.range_ratio >= 0 && a.range_ratio < 1,
             "--range-ratio must be in [0, 1), got {}", a.range_ratio);
  for (const auto& [flag, scale] :
       {std::pair{"--length-scale", a.length_scale}, std::pair{"--output-length-scale", a.output_scale()}})
    SPIN_CHECK(std::isfinite(scale) && scale > 0 && scale <= 100, "{} must be in (0, 100], got {}", flag, scale);
  SPIN_CHECK(std::isfinite(a.timeout_s) && a.timeout_s > 0, "--timeout must be positive");
  std::vector<double> rates;
  for (const std::string& s : a.request_rates) rates.push_back(parse_rate(s));
  SPIN_CHECK(!rates.empty(), "--request-rate needs at least one value");
  const Slo slo = parse_goodput(a.goodput);
  int64_t id_lo = 0, id_hi = 0;
  {
    const auto colon = a.token_ids.find(':');
    try {
      SPIN_CHECK(colon != std::string::npos, "");
      id_lo = std::stoll(a.token_ids.substr(0, colon));
      id_hi = std::stoll(a.token_ids.substr(colon + 1));
    } catch (const std::exception&) {
      fail("--token-ids must be LO:HI, got '{}'", a.token_ids);
    }
    SPIN_CHECK(id_lo >= 0 && id_lo < id_hi && id_hi <= std::numeric_limits<int32_t>::max(),
               "--token-ids LO:HI needs 0 <= LO < HI, got '{}'", a.token_ids);
  }
  json extra = json::object();
  if (!a.extra_body.empty()) {
    extra = json::parse(a.extra_body, nullptr, false);
    SPIN_CHECK(!extra.is_discarded() && extra.is_object(), "--extra-body must be a JSON object");
  }

  const Target target = parse_base_url(a.base_url);
  std::string model = a.model;
  if (model.empty()) {
    httplib::Client client(target.scheme_host_port);
    client.set_connection_timeout(10);
    auto res = client.Get(target.path_prefix + "/v1/models", auth_headers(a));
    SPIN_CHECK(res && res->status == 200, "cannot list models at {}{}/v1/models ({}); pass --model", a.base_url,
               "", res ? fmt::format("HTTP {}", res->status) : httplib::to_string(res.error()));
    const json models = json::parse(res->body, nullptr, false);
    SPIN_CHECK(!models.is_discarded() && models.contains("data") && models["data"].is_array() && !models["data"].empty() &&
                   models["data"][0].contains("id") && models["data"][0]["id"].is_string(),
               "the server's /v1/models answer lists no model; pass --model");
    model = models["data"][0]["id"].get<std::string>();
  }

  std::mt19937_64 rng(a.seed);
  const std::vector<Workload> workload = make_workload(a, rng);
  std::uniform_int_distribution<int32_t> token(static_cast<int32_t>(id_lo), static_cast<int32_t>(id_hi - 1));
  std::vector<std::vector<int32_t>> prompts;
  for (const Workload& w : workload) {
    std::vector<int32_t> p(static_cast<size_t>(w.prompt_len));
    for (int32_t& t : p) t = token(rng);
    prompts.push_back(std::move(p));
  }
  spdlog::info("bench: {} prompts of the {} workload against {} (model '{}'), rates: {}", a.num_prompts, a.dataset,
               a.base_url, model, fmt::join(a.request_rates, ", "));

  json runs = json::array();
  for (double rate : rates) {
    json r = run_at_rate(a, target, model, rate, workload, prompts, extra, slo);
    print_run(r);
    runs.push_back(std::move(r));
  }
  if (!a.json_out.empty()) {
    json doc{{"base_url", a.base_url}, {"model", model}, {"endpoint", a.endpoint}, {"dataset", a.dataset},
             {"input_len", a.input_len}, {"output_len", a.output_len}, {"range_ratio", a.range_ratio},
             {"length_scale", a.length_scale}, {"output_length_scale", a.output_scale()}, {"seed", a.seed},
             {"extra_body", extra}, {"runs", runs}};
    std::ofstream f(a.json_out);
    SPIN_CHECK(f.good(), "cannot write {}", a.json_out);
    f << doc.dump(2) << "\n";
    SPIN_CHECK(f.good(), "cannot write {}", a.json_out);
  }
  // A rate where no request completed measured nothing (its latencies read 0): fail the command
  // so scripts see it, after the report. Some failures at a rate are data; all of them are not.
  std::vector<std::string> failed_rates;
  std::string first_error;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i]["completed"].get<int64_t>() > 0) continue;
    failed_rates.push_back(a.request_rates[i]);
    const json& errors = runs[i]["errors"];
    if (first_error.empty() && !errors.empty()) first_error = errors.front().get<std::string>();
  }
  SPIN_CHECK(failed_rates.empty(), "no request completed at request rate {} (first error: {})",
             fmt::join(failed_rates, ", "), first_error);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Benchmark an OpenAI-compatible server (latency percentiles, throughput)");
  cmd->add_option("--base-url", a->base_url, "server URL (a trailing /v1 is fine)")->capture_default_str();
  cmd->add_option("--endpoint", a->endpoint, "completions endpoint path")->capture_default_str();
  cmd->add_option("--model", a->model, "model name (default: the first of /v1/models)");
  cmd->add_option("--api-key", a->api_key, "sent as 'Authorization: Bearer <key>'");
  cmd->add_option("--num-prompts", a->num_prompts, "requests per rate")->capture_default_str();
  cmd->add_option("--request-rate", a->request_rates, "requests per second (inf: all at once); several for a sweep")
      ->capture_default_str();
  cmd->add_option("--burstiness", a->burstiness, "gamma shape of inter-arrival times (1: Poisson)")->capture_default_str();
  cmd->add_option("--max-concurrency", a->max_concurrency, "requests in flight at most (0: no limit)")->capture_default_str();
  cmd->add_option("--dataset-name", a->dataset, "random | longbench-v2 | longgenbench")
      ->check(CLI::IsMember({"random", "longbench-v2", "longgenbench"}))
      ->capture_default_str();
  cmd->add_option("--input-len", a->input_len, "random: prompt tokens")->capture_default_str();
  cmd->add_option("--output-len", a->output_len, "random: output tokens")->capture_default_str();
  cmd->add_option("--range-ratio", a->range_ratio, "random: lengths uniform within +-ratio")->capture_default_str();
  cmd->add_option("--length-scale", a->length_scale, "multiply every length (small models: e.g. 0.01)")->capture_default_str();
  cmd->add_option("--output-length-scale", a->output_length_scale,
                  "multiply output lengths by this instead (full-length prompts with short outputs, e.g. 0.1)");
  cmd->add_option("--token-ids", a->token_ids, "prompt token ids drawn uniformly from LO:HI")->capture_default_str();
  cmd->add_option("--seed", a->seed, "workload and arrival seed")->capture_default_str();
  cmd->add_option("--goodput", a->goodput, "SLOs as NAME:MS (ttft, tpot, e2el), e.g. --goodput ttft:500 tpot:50");
  cmd->add_option("--extra-body", a->extra_body, "JSON object merged into every request, e.g. '{\"spin\": {\"algorithm\": \"quest\"}}'");
  cmd->add_option("--timeout", a->timeout_s, "seconds one request may take")->capture_default_str();
  cmd->add_option("--json-out", a->json_out, "write the results as JSON");
  cmd->callback([a] { run_bench(*a); });
}

}  // namespace spin::cli
