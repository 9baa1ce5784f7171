"""Load and fault behaviour of `spin serve` on SmolLM2: 220 concurrent streaming requests of mixed
lengths, half through dense attention and half through Quest on the paged two-tier store, 20% of
the clients hanging up mid-stream.

References: each (prompt, attention) pair's greedy text from a single request sent alone before
the load (no batching); the store's idle /metrics values read before the load; the request count
the test itself sent.
"""
import concurrent.futures
import http.client
import json
import os
import random
import time

import pytest

from test_server import Server

N_REQUESTS = 220
DISCONNECT_SHARE = 0.2
REF_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def add(a, b):",
    "List three colours of the rainbow:",
    "Water boils at a temperature of",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "In mathematics, a prime number is",
    "My favourite book is",
]
QUEST = {"algorithm": "quest", "budget": 32}
# The page and segment gauges that must come back to their idle values.
IDLE_GAUGES = ["spin_num_requests_running", "spin_num_requests_waiting", "spin_kv_tokens_used",
               "spin_kv_device_pages_reserved", "spin_kv_host_pages_reserved", "spin_kv_device_pages_used",
               "spin_kv_host_pages_used", "spin_kv_logical_segments_used", "spin_kv_resident_segments_used",
               "spin_kv_requests", "spin_kv_metadata_device_bytes", "spin_kv_metadata_host_bytes"]


@pytest.fixture(scope="module")
def load_server(spin_bin, test_model, test_tmp):
    s = Server(spin_bin, test_model, test_tmp / "server_load.log", "--max-num-seqs", 32, "--max-waiting", 256,
               "--max-num-batched-tokens", 512, "--kv-device-pages", 40000, "--kv-host-pages", 60000)
    yield s
    assert s.stop() == 0, "spin serve did not exit cleanly on SIGTERM"


def body(prompt, max_tokens, spin_ext, stream):
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "spin": dict(spin_ext or {}, ignore_eos=True)}
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


def stream_request(port, payload, hang_up):
    """POSTs a streaming completion; returns (text, usage, saw_done). With hang_up, closes the
    socket right after the first content chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read()[:500])
        text, usage, done = "", None, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["text"]
                if hang_up and choice["text"]:
                    conn.sock.close()
                    return text, None, False
        return text, usage, done
    finally:
        conn.close()


def wait_idle(server, timeout_s):
    deadline = time.time() + timeout_s
    while True:
        m = server.metrics()
        if m["spin_num_requests_running"] == 0 and m["spin_num_requests_waiting"] == 0:
            return m
        assert time.time() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.2)


def test_concurrent_streams_with_disconnects(load_server):
    server = load_server
    # Alone: the reference text of every (prompt, attention) pair.
    references = {}
    t0 = time.time()
    for i, prompt in enumerate(PROMPTS):
        for ext_name, ext in (("dense", None), ("quest", QUEST)):
            status, _, raw = server.api("/v1/completions", body(prompt, REF_TOKENS, ext, False), key=None)
            assert status == 200, raw[:500]
            out = json.loads(raw)
            assert out["usage"]["completion_tokens"] == REF_TOKENS
            references[(i, ext_name)] = out["choices"][0]["text"]
    per_request_s = (time.time() - t0) / len(references)
    # A slow build (sanitizers) keeps the request count but shortens the outputs.
    slow = per_request_s > 1.5 or os.environ.get("SPIN_TEST_SLOW") == "1"
    lengths = [2, 4, 6, 8] if slow else [4, 8, 12, 16, 20, 24]

    idle = server.metrics()
    rng = random.Random(1234)
    jobs = []
    for j in range(N_REQUESTS):
        i = rng.randrange(len(PROMPTS))
        ext_name = "quest" if j % 2 else "dense"
        hang_up = j % 5 == 0  # exactly 20%
        max_tokens = lengths[-1] if hang_up else rng.choice(lengths)
        jobs.append((i, ext_name, max_tokens, hang_up))

    def run(job):
        i, ext_name, max_tokens, hang_up = job
        payload = body(PROMPTS[i], max_tokens, QUEST if ext_name == "quest" else None, True)
        return stream_request(server.port, payload, hang_up)

    t_load = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=N_REQUESTS) as pool:
        results = list(pool.map(run, jobs))
    load_s = time.time() - t_load

    completed = 0
    for (i, ext_name, max_tokens, hang_up), (text, usage, done) in zip(jobs, results):
        if hang_up:
            continue
        completed += 1
        assert done, "stream did not end with [DONE]"
        assert usage == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": max_tokens,
                         "total_tokens": usage["prompt_tokens"] + max_tokens}, usage
        ref = references[(i, ext_name)]
        # The first max_tokens greedy tokens of the reference: its text starts with this text.
        assert text and ref.startswith(text), (ext_name, PROMPTS[i], max_tokens, text, ref)
        if max_tokens == REF_TOKENS:
            assert text == ref
    assert completed == N_REQUESTS - int(N_REQUESTS * DISCONNECT_SHARE)

    after = wait_idle(server, 120)
    status, _, _ = server.request("GET", "/health")
    assert status == 200 and server.proc.poll() is None
    for name in IDLE_GAUGES:
        assert after[name] == idle[name], (name, idle[name], after[name])
    finished = lambda m: (m['spin_request_success_total{finished_reason="length"}']
                          + m['spin_request_success_total{finished_reason="stop"}'])
    aborted = after["spin_requests_aborted_total"] - idle["spin_requests_aborted_total"]
    succeeded = finished(after) - finished(idle)
    # Every request ended exactly once; a hung-up client's request aborts unless it had already
    # finished; most hang up long before their 24 tokens.
    assert succeeded + aborted == N_REQUESTS
    assert 0 < aborted <= N_REQUESTS * DISCONNECT_SHARE
    assert after["spin_engine_up"] == 1
    # Quest requests went through the paged store: offloaded, and read pages through Retrieve.
    assert after["spin_kv_offload_bytes_total"] > idle["spin_kv_offload_bytes_total"]
    assert after["spin_kv_cache_hits_total"] + after["spin_kv_cache_misses_total"] > \
        idle["spin_kv_cache_hits_total"] + idle["spin_kv_cache_misses_total"]
    print(f"load: {N_REQUESTS} requests in {load_s:.1f}s (reference {per_request_s:.2f}s/request, slow={slow}), "
          f"aborted {aborted:.0f}")


# ---------------------------------------------------------------------------------------------
# Fuzzed request bodies against the live server.

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
          "best_of", "echo", "suffix", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "spin", "response_format", "tools", "user"]
SPIN_FIELDS = ["algorithm", "budget", "sink_tokens", "window_tokens", "first_dense_layers", "ignore_eos", "nope"]


def random_value(rng, depth=0):
    choices = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.choice([-1, 0, 1, 3, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30]),
        lambda: rng.choice([0.5, -0.0, 1e308, -1e308, 1.5, 2.0000001, 1e-320]),
        lambda: "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(0, 12))),
        lambda: rng.choice(["dense", "quest", "smollm2-test", "", "\u0000", "user", "text"]),
    ]
    if depth < 3:
        choices += [lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))],
                    lambda: {rng.choice(FIELDS + SPIN_FIELDS + ["type", "text", "role", "content"]): random_value(rng, depth + 1)
                             for _ in range(rng.randrange(0, 4))}]
    return rng.choice(choices)()


def valid_bodies():
    return [
        {"model": "smollm2-test", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
        {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
        {"prompt": "Once", "max_tokens": 2, "n": 2, "seed": 5, "stop": ["\n"],
         "spin": {"algorithm": "quest", "budget": 0.5, "ignore_eos": True}},
    ]


def fuzzed_bodies(rng, count):
    """(path, bytes) pairs: valid bodies with fields set to random values, deep nesting, huge
    numbers, invalid UTF-8, truncation and random bytes."""
    out = []
    for k in range(count):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        base = json.loads(json.dumps(rng.choice(valid_bodies())))
        kind = k % 8
        if kind in (0, 1, 2):
            for _ in range(rng.randrange(1, 4)):
                base[rng.choice(FIELDS)] = random_value(rng)
            data = json.dumps(base).encode()
        elif kind == 3:
            spin = base.setdefault("spin", {})
            for _ in range(rng.randrange(1, 4)):
                spin[rng.choice(SPIN_FIELDS)] = random_value(rng)
            data = json.dumps(base).encode()
        elif kind == 4:
            depth = rng.choice([100, 1000, 20000])
            data = json.dumps(base).encode()[:-1] + b', "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 5:
            text = json.dumps(base).encode()
            i = text.find(b'"', text.find(b":") + 1) + 1 or 1
            data = text[:i] + bytes(rng.choice([[0xff], [0xc3], [0xed, 0xa0, 0x80], [0xf8, 0x88]])) + text[i:]
        elif kind == 6:
            text = json.dumps(base).encode()
            data = text[:rng.randrange(0, len(text))]
        else:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
            if rng.random() < 0.5:
                data = json.dumps(rng.choice([[], 3, "x", None, [1, 2], {"prompt": None}])).encode()
        out.append((path, data))
    return out


def test_fuzzed_bodies_get_openai_errors_never_500(load_server):
    server = load_server
    rng = random.Random(99)
    bodies = fuzzed_bodies(rng, 300)

    def send(item):
        path, data = item
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", ""), resp.read()
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(send, bodies))
    statuses = {}
    for (path, data), (status, content_type, raw) in zip(bodies, answers):
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (status, path, data[:300], raw[:300])
        if status == 200:
            if content_type.startswith("text/event-stream"):
                assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            else:
                assert json.loads(raw)["choices"], raw[:300]
            continue
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert err["type"] in ("invalid_request_error", "not_found_error"), err
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k >= 400) > 200, statuses
    status, _, _ = server.request("GET", "/health")
    assert status == 200 and server.proc.poll() is None
    m = wait_idle(server, 60)
    assert m["spin_kv_tokens_used"] == 0 and m["spin_kv_device_pages_reserved"] == 0
