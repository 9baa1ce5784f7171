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
