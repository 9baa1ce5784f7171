"""`spin bench` against a live `spin serve` on SmolLM2 with a tiny workload, and against a fake
server whose requests fail on purpose.

References: the workload the test asks for (with --range-ratio 0 every prompt and output has the
asked length), the server's own /metrics token counters, and the order statistics' definition.
"""
import http.server
import json
import threading

from test_server import Server

NUM_PROMPTS = 6
INPUT_LEN = 16
OUTPUT_LEN = 4


def token_counters(server):
    m = server.metrics()
    return m["spin_prompt_tokens_total"], m["spin_generation_tokens_total"]


def check_summary(name, s, count):
    assert s["count"] == count, (name, s)
    assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
    assert s["mean"] > 0, (name, s)


def test_bench_counts_latencies_and_server_counters(spin_bin, test_model, test_tmp, run_spin):
    server = Server(spin_bin, test_model, test_tmp / "server_bench.log", "--max-num-seqs", 8)
    try:
        prompt0, gen0 = token_counters(server)
        out = test_tmp / "bench.json"
        proc = run_spin("bench", "--base-url", f"http://127.0.0.1:{server.port}/v1", "--num-prompts", NUM_PROMPTS,
                        "--input-len", INPUT_LEN, "--output-len", OUTPUT_LEN, "--range-ratio", 0,
                        "--request-rate", 50, "inf", "--burstiness", 0.5, "--max-concurrency", 4,
                        "--token-ids", "300:40000", "--goodput", "ttft:600000", "tpot:600000",
                        "--extra-body", '{"spin": {"algorithm": "quest", "budget": 16}}',
                        "--json-out", out, timeout=120)
        doc = json.loads(out.read_text())
        assert doc["model"] == "smollm2-test"  # from /v1/models
        assert [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
        for r in doc["runs"]:
            assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, r["errors"]
            assert r["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
            assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: every output full length
            check_summary("ttft", r["ttft_ms"], NUM_PROMPTS)
            check_summary("e2el", r["e2el_ms"], NUM_PROMPTS)
            check_summary("tpot", r["tpot_ms"], NUM_PROMPTS)
            assert r["itl_ms"]["count"] >= 1 and r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
            # A request's first token comes before its last.
            assert r["ttft_ms"]["mean"] < r["e2el_ms"]["mean"]
            assert r["e2el_ms"]["p99"] <= r["duration_s"] * 1e3 * 1.001
            assert 0 <= r["arrival_span_s"] <= r["duration_s"]
            assert abs(r["request_throughput"] - NUM_PROMPTS / r["duration_s"]) < 1e-6 * r["request_throughput"]
            assert abs(r["output_throughput"] - r["total_output_tokens"] / r["duration_s"]) < 1e-6 * r["output_throughput"]
            # SLOs of 10 minutes: every request is good.
            assert r["good_requests"] == NUM_PROMPTS
            # Sampled from /metrics: never above the concurrency limit, and some request was seen.
            assert 0 < r["max_running_batch"] <= 4 and 0 <= r["mean_running_batch"] <= r["max_running_batch"]
        assert "request rate" in proc.stdout and "TTFT" in proc.stdout
        # The realized arrival rate, for the finite rate only (at inf every request goes at once).
        assert proc.stdout.count("arrivals within") == 1
        span = doc["runs"][0]["arrival_span_s"]
        assert f"arrivals within {span:.1f} s: {(NUM_PROMPTS - 1) / span:.3f} req/s" in proc.stdout
        prompt1, gen1 = token_counters(server)
        assert prompt1 - prompt0 == sum(r["total_input_tokens"] for r in doc["runs"])
        assert gen1 - gen0 == sum(r["total_output_tokens"] for r in doc["runs"])

        # Mixed lengths: what bench counted equals what the server counted.
        out2 = test_tmp / "bench_mixed.json"
        run_spin("bench", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", NUM_PROMPTS,
                 "--input-len", 24, "--output-len", 6, "--range-ratio", 0.5, "--token-ids", "300:40000",
                 "--seed", 3, "--json-out", out2, timeout=120)
        r = json.loads(out2.read_text())["runs"][0]
        assert r["completed"] == NUM_PROMPTS
        prompt2, gen2 = token_counters(server)
        assert prompt2 - prompt1 == r["total_input_tokens"]
        assert gen2 - gen1 == r["total_output_tokens"]
        assert 12 * NUM_PROMPTS <= r["total_input_tokens"] <= 36 * NUM_PROMPTS
    finally:
        assert server.stop() == 0


def test_bench_times_a_model_without_tokenizer(spin_bin, test_tmp, run_spin):
    # A dummy model has no tokenizer, so its stream carries no text: each step still sends a chunk
    # (empty text), which bench times as a token. The dummy-weights GPU runs rely on this.
    server = Server(spin_bin, "tiny-llama", test_tmp / "server_bench_dummy.log", "--load-format", "dummy",
                    "--max-num-seqs", 4)
    try:
        out = test_tmp / "bench_dummy.json"
        run_spin("bench", "--base-url", f"http://127.0.0.1:{server.port}/v1", "--num-prompts", 4,
                 "--input-len", 8, "--output-len", 5, "--range-ratio", 0, "--token-ids", "3:200",
                 "--json-out", out, timeout=120)
        r = json.loads(out.read_text())["runs"][0]
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] == 4 * 5
        check_summary("ttft", r["ttft_ms"], 4)
        check_summary("tpot", r["tpot_ms"], 4)
        assert r["itl_ms"]["count"] == 4 * (5 - 1)  # one chunk per token after the first

        # Outputs scaled apart from prompts: 8 x 2 prompt tokens, 6 x 0.5 output tokens.
        out2 = test_tmp / "bench_dummy_scaled.json"
        run_spin("bench", "--base-url", f"http://127.0.0.1:{server.port}/v1", "--num-prompts", 4,
                 "--input-len", 8, "--output-len", 6, "--range-ratio", 0, "--token-ids", "3:200",
                 "--length-scale", 2, "--output-length-scale", 0.5, "--json-out", out2, timeout=120)
        doc = json.loads(out2.read_text())
        assert doc["length_scale"] == 2 and doc["output_length_scale"] == 0.5
        r = doc["runs"][0]
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert r["total_input_tokens"] == 4 * 16
        assert r["total_output_tokens"] == 4 * 3
    finally:
        assert server.stop() == 0


def test_bench_rejects_bad_flags(run_spin):
    for args, message in [(["--request-rate", "0"], "--request-rate"),
                          (["--goodput", "latency:5"], "unknown SLO"),
                          (["--range-ratio", "1.5"], "--range-ratio"),
                          (["--output-length-scale", "0"], "--output-length-scale"),
                          (["--base-url", "ftp://x"], "http://"),
                          (["--extra-body", "[1]"], "JSON object")]:
        proc = run_spin("bench", "--model", "m", *args, expect_ok=False)
        assert message in proc.stderr, (args, proc.stderr)


class FakeCompletions:
    """An OpenAI-style /v1/completions server whose first `failures` requests get HTTP 400 and the
    rest a one-token stream; GET /metrics is 404, so bench samples no batch."""

    def __init__(self, failures):
        self.failures = failures
        self.requests = 0
        lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    fake.requests += 1
                    fail = fake.requests <= fake.failures
                if fail:
                    self.reply(400, "application/json", json.dumps({"error": {"message": "bad request"}}))
                    return
                chunks = [{"choices": [{"text": "a", "finish_reason": None}]},
                          {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}]
                self.reply(200, "text/event-stream",
                           "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

            def do_GET(self):
                self.reply(404, "text/plain", "")

            def reply(self, status, content_type, body):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def bench_fake(run_spin, test_tmp, url, name, *args, expect_ok):
    out = test_tmp / f"bench_{name}.json"
    out.unlink(missing_ok=True)
    proc = run_spin("bench", "--base-url", url, "--model", "m", "--num-prompts", 2, "--input-len", 4,
                    "--output-len", 1, "--max-concurrency", 1, "--json-out", out, *args, expect_ok=expect_ok,
                    timeout=60)
    return proc, json.loads(out.read_text())["runs"]


def test_bench_fails_when_no_request_completes(run_spin, test_tmp):
    # Nothing listens on port 1: every request fails to connect. The report is still written.
    proc, runs = bench_fake(run_spin, test_tmp, "http://127.0.0.1:1", "refused", expect_ok=False)
    assert runs[0]["completed"] == 0 and runs[0]["failed"] == 2
    assert "no request completed at request rate inf" in proc.stderr, proc.stderr
    assert "0/2 completed" in proc.stdout

    fake = FakeCompletions(failures=2)
    try:
        # Every request of the first rate gets a 400, every one of the second completes: the error
        # names the first rate only.
        proc, runs = bench_fake(run_spin, test_tmp, fake.url, "rejected", "--request-rate", "inf", "1000",
                                expect_ok=False)
        assert [r["completed"] for r in runs] == [0, 2]
        assert "no request completed at request rate inf (first error: HTTP 400: bad request)" in proc.stderr, \
            proc.stderr
    finally:
        fake.close()


def test_bench_succeeds_when_some_requests_complete(run_spin, test_tmp):
    fake = FakeCompletions(failures=1)
    try:
        _, runs = bench_fake(run_spin, test_tmp, fake.url, "partial", expect_ok=True)
        assert runs[0]["completed"] == 1 and runs[0]["failed"] == 1
        assert runs[0]["errors"] == ["HTTP 400: bad request"]
    finally:
        fake.close()
