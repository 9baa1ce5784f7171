"""`spin serve` on SmolLM2 through the official `openai` client and raw HTTP.

References: greedy text from `spin generate --temperature 0` (the single-sequence generator,
no batching), token counts from HF `tokenizers` built from the GGUF vocabulary and the chat
template rendered with jinja2, and the OpenAI / SSE / Prometheus formats themselves.
"""
import concurrent.futures
import http.client
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import gguf
import jinja2
import numpy as np
import openai
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

API_KEY = "test-key-123"
MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, spin_bin, model, log_path, *extra):
        self.port = free_port()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(spin_bin), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN), *map(str, extra)],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.time() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"spin serve exited with {self.proc.returncode}; log: {open(log_path).read()[-3000:]}")
            try:
                status, _, _ = self.request("GET", "/health")
                if status == 200:
                    break
                assert status == 503, status  # still loading
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("spin serve did not become healthy in time")
            time.sleep(0.2)
        self.ready_line = self.proc.stdout.readline()

    def request(self, method, path, body=None, headers=None, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def api(self, path, body, key=API_KEY):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return self.request("POST", path, body, headers)

    def metrics(self):
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(spin_bin, test_model, test_tmp):
    s = Server(spin_bin, test_model, test_tmp / "server.log", "--api-key", API_KEY, "--max-num-seqs", 16)
    yield s
    assert s.stop() == 0, "spin serve did not exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def hf_tokenizer(test_model):
    reader = gguf.GGUFReader(str(test_model))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is False
    hf = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == 3])
    template = jinja2.Environment().from_string(reader.fields["tokenizer.chat_template"].contents())
    return hf, template


def spin_generate(run_spin, test_model, test_tmp, prompt, n, chat=False):
    ids_path = test_tmp / "server_generate_ids.json"
    args = ["generate", "--model", test_model, "-p", prompt, "-n", n, "--temperature", 0, "--ids-out", ids_path]
    proc = run_spin(*(args + (["--chat"] if chat else [])))
    text = proc.stdout[:-1] if proc.stdout.endswith("\n") else proc.stdout
    ids = json.loads(ids_path.read_text())
    return text, ids


def expected_completion_tokens(ids):
    # spin generate leaves a final end-of-sequence token out of output_ids; usage counts it.
    return len(ids["output_ids"]) + (1 if ids["finish_reason"] == "stop" else 0)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three primary colors are", "Water boils at", "My favourite book is",
           "import numpy as np\n", "The quick brown fox", "1, 2, 3, 4,", "In 1969, humans",
           "The best way to learn a language is", "Dear Sir or Madam,", "Photosynthesis is",
           "The largest planet in the solar system", "To make a cup of tea,", "Q: What is 2+2?\nA:"]


def test_health_models_and_ready_line(server, client):
    assert f"http://127.0.0.1:{server.port}/v1" in server.ready_line
    assert server.request("GET", "/health")[0] == 200
    models_list = client.models.list()
    assert [m.id for m in models_list.data] == [MODEL_NAME]


def test_completion_matches_generate(server, client, run_spin, test_model, test_tmp, hf_tokenizer):
    hf, _ = hf_tokenizer
    prompt = PROMPTS[0]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    text, ids = spin_generate(run_spin, test_model, test_tmp, prompt, 16)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("length" if ids["finish_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == len(hf.encode(prompt).ids) == len(ids["prompt_ids"])
    assert r.usage.completion_tokens == expected_completion_tokens(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL_NAME and r.object == "text_completion"


def test_chat_matches_generate(server, client, run_spin, test_model, test_tmp, hf_tokenizer):
    hf, template = hf_tokenizer
    question = "What is the capital of France?"
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                       max_tokens=24, temperature=0)
    text, ids = spin_generate(run_spin, test_model, test_tmp, question, 24, chat=True)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    rendered = template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(hf.encode(rendered).ids)
    assert r.usage.completion_tokens == expected_completion_tokens(ids)

    # max_completion_tokens is the newer name of max_tokens.
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                        max_completion_tokens=5, temperature=0)
    assert r2.usage.completion_tokens <= 5
    assert text.startswith(r2.choices[0].message.content)


def test_sixteen_concurrent_greedy_requests_equal_each_alone(server, client, run_spin, test_model, test_tmp):
    n = 8

    def complete(prompt):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    # Alone: a few through the server one at a time (the C++ engine test covers all 16 ids on
    # the dummy model; here the real model and server path, kept short for the ASan run).
    checked = [0, 3, 9, 15]
    alone = {i: complete(PROMPTS[i]) for i in checked}
    steps_before = server.metrics()["spin_engine_steps_total"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(complete, PROMPTS))
    steps = server.metrics()["spin_engine_steps_total"] - steps_before
    for i in checked:
        assert together[i] == alone[i], PROMPTS[i]
    # Run one at a time, the 16 requests need at least one step per generated token.
    assert steps < sum(tokens for _, tokens in together) / 2, f"{steps} steps: not batched"
    text, ids = spin_generate(run_spin, test_model, test_tmp, PROMPTS[3], n)
    assert together[3] == (text, expected_completion_tokens(ids))


def test_streaming_equals_non_streaming(client):
    prompt = PROMPTS[2]
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    stream = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert all(c.usage is None for c in stream)  # no include_usage: no usage chunk


def test_sse_framing_ends_with_done(server):
    status, headers, body = server.api("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["usage"]["total_tokens"] == (payloads[-1]["usage"]["prompt_tokens"] +
                                                     payloads[-1]["usage"]["completion_tokens"])


def test_stop_sequences(client):
    prompt = PROMPTS[6]
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[:full.find(stop)]
    for stop_arg in (stop, [stop, "never-appears-xyz"]):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop_arg)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=8, temperature=1.0,
                                         top_p=0.95, seed=seed,
                                         extra_body={"top_k": 50, "min_p": 0.01}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) >= 2


def test_n_choices(client):
    one = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=6, temperature=0)
    three = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.text == one.choices[0].text for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    # Sampled: choice i draws with seed + i, so each choice equals a single request with that seed.
    messages = [{"role": "user", "content": "Write a word."}]
    two = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=1.0,
                                         seed=77, n=2)
    for i in range(2):
        single = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                temperature=1.0, seed=77 + i)
        assert two.choices[i].message.content == single.choices[0].message.content
    streamed = ["", ""]
    reasons = [None, None]
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                temperature=1.0, seed=77, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert streamed == [c.message.content for c in two.choices]
    assert reasons == [c.finish_reason for c in two.choices]


def test_several_prompts(client):
    # /v1/completions takes a list of prompts (text or token ids); choice k * n + j is prompt k's
    # j-th, equal to that prompt sent alone; usage counts each prompt once.
    prompts = [PROMPTS[0], PROMPTS[6], [504, 1023, 30, 7]]
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    both = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    streamed = [""] * 3
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [s.choices[0].text for s in singles]
    # Sampled: each prompt's choices draw with seed + j, as the prompt sent alone would.
    alone = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=5,
                                      n=2)
    batched = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[2], PROMPTS[2]], max_tokens=8,
                                        temperature=1.0, seed=5, n=2)
    assert [c.text for c in batched.choices] == [c.text for c in alone.choices] * 2
    assert alone.choices[0].text != alone.choices[1].text


def log_softmax(row):
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_logprobs_match_numpy(server, client, run_spin, test_model, test_tmp, hf_tokenizer):
    hf, _ = hf_tokenizer
    prompt = PROMPTS[0]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 2
    assert lp.text_offset == [0, len(lp.tokens[0].encode())]
    # Reference: spin generate's logits of the last prompt position, log-softmaxed in numpy;
    # then the same with the first generated token appended to the prompt.
    _, ids = spin_generate(run_spin, test_model, test_tmp, prompt, 2)
    prompt_ids = list(ids["prompt_ids"])
    for step in range(2):
        logits_path = test_tmp / "server_logits.npy"
        run_spin("generate", "--model", test_model, "--prompt-ids", ",".join(map(str, prompt_ids)), "-n", 1,
                 "--temperature", 0, "--logits-out", logits_path)
        ref = log_softmax(np.load(logits_path)[-1])
        token = ids["output_ids"][step]
        assert lp.tokens[step] == hf.decode([token])
        assert abs(lp.token_logprobs[step] - ref[token]) < 2e-3
        best = np.argsort(-ref, kind="stable")[:3]
        got = lp.top_logprobs[step]
        assert list(got) == [hf.decode([int(t)]) for t in best]
        for t in best:
            assert abs(got[hf.decode([int(t)])] - ref[t]) < 2e-3
        prompt_ids.append(token)

    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode() == c.token
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, stream=True))
    entries = [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(c.token, c.logprob) for c in content]


def test_echo_scores_the_prompt(server, client, run_spin, test_model, test_tmp, hf_tokenizer):
    """'echo' with logprobs, as lm-eval's loglikelihood asks: the prompt's text and its tokens'
    logprobs (the first has none), then the completion's. Reference: spin generate's logits of every
    prompt position, log-softmaxed in numpy."""
    hf, _ = hf_tokenizer
    prompt = PROMPTS[1]
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    logits_path = test_tmp / "echo_logits.npy"
    _, ids = spin_generate(run_spin, test_model, test_tmp, prompt, 1)
    prompt_ids = list(ids["prompt_ids"])
    run_spin("generate", "--model", test_model, "--prompt-ids", ",".join(map(str, prompt_ids)), "-n", 1,
             "--temperature", 0, "--logits-out", logits_path)
    ref = np.array([log_softmax(row) for row in np.load(logits_path)])
    n = len(prompt_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.tokens[:n] == [hf.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for k in range(1, n):
        assert abs(lp.token_logprobs[k] - ref[k - 1][prompt_ids[k]]) < 2e-3, k
        best = np.argsort(-ref[k - 1], kind="stable")[:2]
        assert list(lp.top_logprobs[k]) == [hf.decode([int(t)]) for t in best], k
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[n:], plain.choices[0].logprobs.token_logprobs)) < 2e-3
    # Offsets run through the echoed text into the completion's.
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt.encode())
    assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t.encode()) for t in lp.tokens[:-1]]

    # max_tokens 0: the prompt scored alone.
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    assert scored.choices[0].logprobs.tokens == lp.tokens[:n]
    assert max(abs(a - b) for a, b in zip(scored.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:n])) < 2e-3

    # Streamed: the prompt comes first, then the same text and tokens.
    chunks = [c for c in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                                   logprobs=2, echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens

    # Token ids echo as their text; chat has no echo; max_tokens 0 needs it.
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=1, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(hf.decode(prompt_ids))
    assert_error(server.api("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}),
                 400, "echo")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "max_tokens": 0}), 400, "max_tokens", ["echo"])


def assert_error(result, status, param=None, contains=()):
    got_status, _, body = result
    assert got_status == status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for s in contains:
        assert s in err["message"], err
    return err


def penalized(row, prompt, output, repetition, frequency, presence):
    """vLLM's penalties in numpy: repetition on tokens of prompt or output, then frequency x count
    and presence once on tokens of the output."""
    row = row.astype(np.float64).copy()
    seen = np.array(sorted(set(prompt) | set(output)), dtype=np.int64)
    row[seen] = np.where(row[seen] > 0, row[seen] / repetition, row[seen] * repetition)
    ids, counts = np.unique(np.array(output, dtype=np.int64), return_counts=True)
    row[ids] -= frequency * counts + presence
    return row


def test_penalties_match_numpy(server, client, run_spin, test_model, test_tmp):
    # Greedy with all three penalties on "1, 2, 3, 4," (a prompt that invites repeats): each token
    # must be the argmax of its position's logits (spin generate --logits-out, teacher-forced)
    # penalized in numpy over the prompt and the tokens before it; the server must draw the same.
    prompt, n = PROMPTS[8], 24
    settings = {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.4}
    ids_path = test_tmp / "penalized_ids.json"
    proc = run_spin("generate", "--model", test_model, "-p", prompt, "-n", n, "--temperature", 0, "--ignore-eos",
                    "--ids-out", ids_path, *[x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", v)])
    ids = json.loads(ids_path.read_text())
    prompt_ids, output = ids["prompt_ids"], ids["output_ids"]
    assert len(output) == n
    logits_path = test_tmp / "penalized_logits.npy"
    run_spin("generate", "--model", test_model, "--prompt-ids", ",".join(map(str, prompt_ids + output[:-1])),
             "-n", 0, "--logits-out", logits_path)
    logits = np.load(logits_path)
    for k, token in enumerate(output):
        row = penalized(logits[len(prompt_ids) - 1 + k], prompt_ids, output[:k], **{
            "repetition": settings["repetition_penalty"], "frequency": settings["frequency_penalty"],
            "presence": settings["presence_penalty"]})
        # Decode and a whole-sequence prefill round differently: a near-tie may go either way.
        assert row[token] >= row.max() - 2e-3 * max(1.0, abs(row.max())), (k, token, int(row.argmax()))
    _, plain = spin_generate(run_spin, test_model, test_tmp, prompt, n)
    assert plain["output_ids"][:n] != output, "the penalties changed nothing: the test would not see them"

    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                                  presence_penalty=settings["presence_penalty"],
                                  frequency_penalty=settings["frequency_penalty"],
                                  extra_body={"repetition_penalty": settings["repetition_penalty"],
                                              "ignore_eos": True})
    assert r.choices[0].text == proc.stdout.removesuffix("\n")
    for name, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        assert_error(server.api("/v1/completions", {"prompt": "hi", name: bad}), 400, name)


def test_logit_bias_matches_numpy(server, client, run_spin, test_model, test_tmp, hf_tokenizer):
    # Reference: the prompt's last-position logits (spin generate --logits-out) plus the bias, in numpy.
    hf, _ = hf_tokenizer
    prompt = PROMPTS[0]
    _, ids = spin_generate(run_spin, test_model, test_tmp, prompt, 1)
    logits_path = test_tmp / "bias_logits.npy"
    run_spin("generate", "--model", test_model, "--prompt-ids", ",".join(map(str, ids["prompt_ids"])), "-n", 0,
             "--logits-out", logits_path)
    row = np.load(logits_path)[-1].astype(np.float64)
    first, second = np.argsort(-row, kind="stable")[:2]
    for bias in ({str(first): -100}, {str(first): -100, str(second): -3.5}, {str(second): 2.0}):
        shifted = row.copy()
        for token, b in bias.items():
            shifted[int(token)] += b
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logit_bias=bias)
        assert r.choices[0].text == hf.decode([int(np.argmax(shifted))]), bias
    # A large bias forces its token at every step, sampled or not.
    forced = 1000
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0.7, seed=1,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == hf.decode([forced] * 4)
    for bad in ({"x": 1}, {"5": 101}, {"-1": 1}, {"5": "big"}, {str(10 ** 9): 1}, [1, 2], {"7": 1, "07": 1}):
        assert_error(server.api("/v1/completions", {"prompt": "hi", "logit_bias": bad}), 400, "logit_bias")


def test_client_errors(server, hf_tokenizer):
    hf, _ = hf_tokenizer
    status, _, body = server.api("/v1/completions", b"{not json")
    assert_error((status, None, body), 400)
    assert_error(server.api("/v1/completions", b"[1, 2]"), 400)
    assert_error(server.api("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}), 400, "max_tokens")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "temperature": "hot"}), 400, "temperature")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "temperature": -1}), 400, "temperature")
    assert_error(server.api("/v1/completions", {"prompt": 5}), 400, "prompt")
    assert_error(server.api("/v1/completions", {}), 400, "prompt")
    assert_error(server.api("/v1/completions", {"prompt": [1, 999999]}), 400, "prompt")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "stop": 3}), 400, "stop")
    assert_error(server.api("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert_error(server.api("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400,
                 "messages[0].role")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "n": 0}), 400, "n")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "n": 17}), 400, "n")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "logprobs": 21}), 400, "logprobs", ["0..20"])
    assert_error(server.api("/v1/completions", {"prompt": "hi", "logprobs": True}), 400, "logprobs")
    assert_error(server.api("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2}), 400, "top_logprobs")

    long_prompt = "hello " * 600
    n_long = len(hf.encode(long_prompt).ids)
    assert n_long >= MAX_MODEL_LEN
    err = assert_error(server.api("/v1/completions", {"prompt": long_prompt}), 400, "prompt",
                       [str(n_long), str(MAX_MODEL_LEN)])
    assert err["type"] == "invalid_request_error"
    n_short = len(hf.encode("hello").ids)
    assert_error(server.api("/v1/completions", {"prompt": "hello", "max_tokens": 1000}), 400, "max_tokens",
                 [str(n_short), "1000", str(n_short + 1000), str(MAX_MODEL_LEN)])

    err = assert_error(server.api("/v1/completions", {"model": "gpt-17", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found"
    err = assert_error(server.api("/v1/completions", {"prompt": "hi", "spin": {"algorithm": "no-such"}}), 400,
                       "spin.algorithm", ["no-such", "dense", "quest"])
    assert_error(server.api("/v1/completions", {"prompt": "hi", "spin": {"budget": "big"}}), 400, "spin.budget")
    assert_error(server.api("/v1/completions", {"prompt": "hi", "spin": {"sparsity": 1}}), 400, "spin.sparsity")
    # Settings the engine's KV store refuses are the client's mistake too: 400, never 500.
    assert_error(server.api("/v1/completions", {"prompt": "hi", "spin": {"algorithm": "quest", "sink_tokens": 5}}),
                 400, "spin", ["sink tokens", "multiple of the page size"])
    ok = server.api("/v1/completions", {"prompt": "hi", "max_tokens": 2, "spin": {"algorithm": "dense", "budget": 2048}})
    assert ok[0] == 200, ok[2]

    err = assert_error(server.api("/v1/completions", b"{\"prompt\": \"" + b"a" * (9 << 20) + b"\"}"), 413)
    assert_error(server.request("GET", "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    # A path with a route, under another method: 405 with the method it takes.
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET, HEAD"),
                                  ("POST", "/health", "GET, HEAD")):
        result = server.request(method, path, body=b"{}" if method != "GET" else None, headers=auth)
        err = assert_error(result, 405, contains=[method, path, allowed])
        assert err["code"] == "method_not_allowed"
        assert result[1].get("Allow") == allowed, result[1]
    # The server is still fine after all of that.
    assert server.request("GET", "/health")[0] == 200


def send_chunked(port, path, body, chunk=1 << 16):
    """POSTs body with Transfer-Encoding: chunked on a raw socket; returns the socket and the response."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    for i in range(0, len(body), chunk):
        part = body[i:i + chunk]
        sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
    sock.sendall(b"0\r\n\r\n")
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return sock, (resp.status, dict(resp.getheaders()), resp.read())


def test_chunked_body_over_the_limit_is_413(server):
    # httplib limits only a Content-Length body: a chunked one must meet the same 8 MiB limit.
    too_big = b"{\"prompt\": \"" + b"a" * (9 << 20) + b"\"}"
    for path in ("/v1/completions", "/v1/nothing-here"):
        sock, result = send_chunked(server.port, path, too_big)
        err = assert_error(result, 413)
        assert err["code"] == "request_too_large"
        # The rest of the body was read and dropped: the connection serves its next request.
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 200
        sock.close()
    sock, (status, _, body) = send_chunked(server.port, "/v1/completions",
                                           json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), chunk=5)
    sock.close()
    assert status == 200, body


def endless_body(port, pause_after=None, chunked=True):
    """Starts a POST whose body never ends (64 KiB pieces, chunked or under a 1 TB Content-Length;
    with pause_after, 20 per second once that many bytes went). Returns the socket, a stop event and
    the sender thread, which counts the bytes it sent in thread.sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {10 ** 12}"
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode())
    chunk = b"a" * (1 << 16)
    piece = b"%x\r\n" % len(chunk) + chunk + b"\r\n" if chunked else chunk
    stop = threading.Event()

    def send():
        try:
            while not stop.is_set():
                sock.sendall(piece)
                sender.sent += len(chunk)
                if pause_after is not None and sender.sent > pause_after:
                    time.sleep(0.05)
        except OSError:
            pass  # the server closed the connection

    sender = threading.Thread(target=send, daemon=True)
    sender.sent = 0
    sender.start()
    return sock, stop, sender


def read_to_close(sock):
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def socket_buffer_bytes():
    """The most a loopback TCP stream can hold between sender and reader: the largest receive
    buffer plus the largest send buffer the kernel grows them to."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as rmem, open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
            return int(rmem.read().split()[2]) + int(wmem.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 64 << 20


def test_endless_body_gets_413_and_is_cut(server):
    # Past the 8 MiB limit the server drains at most another 8 MiB (fast sender) or 5 s (slow
    # sender), then answers 413 and ends the connection: an endless body holds no connection
    # thread, and none of it is parsed as further requests. Chunked, and with a Content-Length.
    # The time bounds leave room for a loaded 2-core machine, where one run once failed a bound
    # (the slow sender's was 15 s); a server that never cut the body hits the socket's 60 s timeout.
    # What the sender got off its hands is what the server read plus what the socket buffers held
    # (their receive side grows to 32 MiB on some kernels; a fixed 26 MiB bound failed once).
    most_sent = (16 << 20) + socket_buffer_bytes() + (1 << 20)
    for chunked in (True, False):
        for pause_after, most_seconds in ((None, 30), (9 << 20, 25)):
            start = time.time()
            sock, stop, sender = endless_body(server.port, pause_after, chunked)
            reply = read_to_close(sock)
            stop.set()
            sender.join(timeout=10)
            sock.close()
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert b"request_too_large" in reply
            assert reply.count(b"HTTP/1.1 ") == 1, reply[:2000]
            assert time.time() - start < most_seconds
            assert sender.sent < most_sent, (sender.sent, most_sent)
    assert server.request("GET", "/health")[0] == 200


def test_body_on_a_method_without_one_is_refused(server):
    # httplib would read a PRI body whole and leave a GET's in the stream: both get a 400 and the
    # connection ends, with nothing after the reply.
    for method in ("GET", "PRI"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(f"{method} /health HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n".encode() +
                     b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 4)
        reply = read_to_close(sock)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
        assert f"a {method} request takes no body".encode() in reply
        assert reply.count(b"HTTP/1.1 ") == 1, reply[:2000]
    assert server.request("GET", "/health")[0] == 200


def test_shutdown_does_not_wait_for_an_endless_body(spin_bin, test_model, test_tmp):
    for chunked in (True, False):
        srv = Server(spin_bin, test_model, test_tmp / "serve_endless_body.log")
        try:
            sock, stop, sender = endless_body(srv.port, pause_after=9 << 20, chunked=chunked)
            time.sleep(1.0)  # past the limit, draining slowly
            start = time.time()
            srv.proc.send_signal(signal.SIGINT)
            srv.proc.wait(timeout=15)
            # The drain stops at once; the lingering close after the 413 takes up to 2 s.
            assert time.time() - start < 5.0
            assert srv.proc.returncode == 0
            stop.set()
            sock.close()
        finally:
            srv.stop()


@pytest.mark.skipif(os.environ.get("SPIN_SANITIZED") == "1",
                    reason="ASan reserves terabytes of address space at start: a 4 GiB cap kills it first")
def test_too_many_connection_threads_is_a_startup_error(spin_bin, test_model):
    # A thread per request running or queued: with the address space capped, --max-waiting 65536
    # cannot have them all. That must be a clear error before loading, not an abort after it.
    def cap_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([str(spin_bin), "serve", "--model", str(test_model), "--port", str(free_port()),
                           "--max-waiting", "65536"], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap_address_space)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"cannot start \d+ HTTP connection threads", proc.stderr) and "--max-waiting" in proc.stderr
    assert "serving" not in proc.stdout


def test_default_attention_that_refuses_every_request_is_a_startup_error(run_spin, test_model):
    proc = run_spin("serve", "--model", test_model, "--port", free_port(), "--max-model-len", 256,
                    "--max-num-batched-tokens", 2, "--sparse-algorithm", "quest", expect_ok=False, timeout=120)
    assert proc.returncode == 1
    assert "refuse every request" in proc.stderr and "--max-num-batched-tokens >= 3 (it is 2)" in proc.stderr
    assert "serving" not in proc.stdout


def test_api_key(server):
    err = assert_error(server.api("/v1/completions", {"prompt": "hi", "max_tokens": 1}, key=None), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(server.api("/v1/completions", {"prompt": "hi", "max_tokens": 1}, key="wrong"), 401)
    assert_error(server.request("GET", "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong",
                      max_retries=0).models.list()
    assert server.request("GET", "/health")[0] == 200  # health and metrics stay open
    assert server.request("GET", "/metrics")[0] == 200


METRIC_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? '
                         r'(-?[0-9.e+-]+|\+Inf|NaN)$')


def test_metrics_format_and_counts(server):
    before = server.metrics()
    status, headers, body = server.api("/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True})
    assert status == 200
    usage = json.loads(body)["usage"]
    status, headers, body = server.request("GET", "/metrics")
    assert headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for line in text.splitlines():
        if not line.startswith("#"):
            assert METRIC_LINE.match(line), line
            name = re.split(r"[{ ]", line)[0]
            assert name in types or re.sub(r"_(bucket|sum|count)$", "", name) in types, line
    after = server.metrics()
    assert after["spin_prompt_tokens_total"] - before["spin_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["spin_generation_tokens_total"] - before["spin_generation_tokens_total"] == 5
    assert after['spin_request_success_total{finished_reason="length"}'] == \
        before['spin_request_success_total{finished_reason="length"}'] + 1
    assert after["spin_num_requests_running"] == 0 and after["spin_kv_tokens_used"] == 0
    # Preemptions by kind: both series exist, and one short request preempted nothing.
    for kind in ("swap", "recompute"):
        name = f'spin_preemptions_total{{kind="{kind}"}}'
        assert types["spin_preemptions_total"] == "counter" and after[name] == before[name]
    for hist in ("spin_time_to_first_token_seconds", "spin_inter_token_latency_seconds",
                 "spin_e2e_request_latency_seconds"):
        assert types[hist] == "histogram"
        buckets = [(k, v) for k, v in after.items() if k.startswith(hist + "_bucket")]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0].endswith('le="+Inf"}')
        assert counts[-1] == after[hist + "_count"]
    assert after["spin_time_to_first_token_seconds_count"] == before["spin_time_to_first_token_seconds_count"] + 1
    assert after["spin_inter_token_latency_seconds_count"] == before["spin_inter_token_latency_seconds_count"] + 4
    # The engine thread's step time by phase: the request's forwards took time, and the phases
    # together took less than the request did from send to answer.
    phases = {p: after[f'spin_engine_step_seconds_total{{phase="{p}"}}'] -
              before[f'spin_engine_step_seconds_total{{phase="{p}"}}'] for p in ("schedule", "forward", "finish")}
    assert types["spin_engine_step_seconds_total"] == "counter"
    assert phases["forward"] > 0 and min(phases.values()) >= 0, phases
    e2e = after["spin_e2e_request_latency_seconds_sum"] - before["spin_e2e_request_latency_seconds_sum"]
    assert sum(phases.values()) <= e2e + 0.05, (phases, e2e)
    # The CPU model has no graphs or device waits to count.
    assert not any(name.startswith("spin_model_") for name in after), "CPU model reported device forwards"


def open_stream(port, body, key=API_KEY):
    """Starts a streaming request on a raw socket and reads its first event."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                 (f"Authorization: Bearer {key}\r\n".encode() if key else b"") +
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock


def wait_for(predicate, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_aborts_the_request(server):
    before = server.metrics()
    sock = open_stream(server.port, {"prompt": PROMPTS[7], "max_tokens": 480, "ignore_eos": True,
                                     "stream": True})
    assert server.metrics()["spin_num_requests_running"] == 1
    sock.close()
    assert wait_for(lambda: server.metrics()["spin_requests_aborted_total"] == before["spin_requests_aborted_total"] + 1)
    after = server.metrics()
    assert after["spin_num_requests_running"] == 0 and after["spin_num_requests_waiting"] == 0
    assert after["spin_kv_tokens_used"] == 0
    assert after["spin_generation_tokens_total"] - before["spin_generation_tokens_total"] < 480
    assert server.request("GET", "/health")[0] == 200


def test_non_streaming_client_disconnect_aborts_the_request(server):
    before = server.metrics()
    payload = json.dumps({"prompt": PROMPTS[8], "max_tokens": 480, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                 f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert wait_for(lambda: server.metrics()["spin_generation_tokens_total"] > before["spin_generation_tokens_total"])
    sock.close()
    assert wait_for(lambda: server.metrics()["spin_requests_aborted_total"] == before["spin_requests_aborted_total"] + 1)
    after = server.metrics()
    assert after["spin_num_requests_running"] == 0 and after["spin_num_requests_waiting"] == 0
    assert after["spin_kv_tokens_used"] == 0
    assert after["spin_generation_tokens_total"] - before["spin_generation_tokens_total"] < 480
    assert server.request("GET", "/health")[0] == 200


def test_overload_is_503(spin_bin, test_model, test_tmp):
    small = Server(spin_bin, test_model, test_tmp / "server_small.log", "--max-num-seqs", 1, "--max-waiting", 0)
    try:
        sock = open_stream(small.port, {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
                                        "stream": True}, key=None)
        err = assert_error(small.api("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=None), 503)
        assert err["type"] == "service_unavailable"
        sock.close()
        assert wait_for(lambda: small.metrics()["spin_num_requests_running"] == 0)
        # More choices than the server ever holds could never run: the client's mistake, nothing queued.
        err = assert_error(small.api("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2}, key=None), 400,
                           "n", ["'n' 2 is 2 choices", "at most 1"])
        assert_error(small.api("/v1/completions", {"prompt": ["hi", "ho"], "max_tokens": 3}, key=None), 400,
                     "prompt", ["2 prompts", "at most 1"])
        assert err["type"] == "invalid_request_error"
        assert wait_for(lambda: small.metrics()["spin_num_requests_running"] == 0)
        assert small.api("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=None)[0] == 200
    finally:
        assert small.stop() == 0
