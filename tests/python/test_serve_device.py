"""`spin serve --device`: which backend serves, and that startup errors end the process.

The reference is the process itself: its exit status, its /health and /v1/models answers, and the
backend line it logs. A startup error (bad --model, --device cuda where CUDA cannot run) must exit
with status 1 and a message, never leave the listening server hanging.
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import time

import pytest

SPIN = os.environ["SPIN_BIN"]
TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def start(*args):
    """Starts spin serve on a free port; returns (process, port). stderr goes to a pipe."""
    port = free_port()
    proc = subprocess.Popen([SPIN, "serve", "--host", "127.0.0.1", "--port", str(port), *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, port


def wait_healthy_or_exit(proc, port):
    """Returns True once /health says 200, False if the process exited first."""
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            status, _ = get(port, "/health")
            if status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail("spin serve neither became healthy nor exited")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("spin serve did not stop on SIGTERM")
    return err


def test_cpu_device_serves_a_dummy_model():
    for flags in ([], ["--no-elastic-kv-buffers"]):
        proc, port = start("--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--max-model-len",
                           "256", *flags)
        assert wait_healthy_or_exit(proc, port), proc.communicate()[1]
        status, body = get(port, "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-llama"
        err = stop(proc)
        assert proc.returncode == 0, err
        assert "device cpu (fp32)" in err
        assert ("elastic KV buffers off" in err) == bool(flags), err


def small_gpu_config(tmp_path):
    """A Qwen3-shaped config.json with head_dim 64, a shape the GPU kernels run."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "eos_token_id": 2}))
    return path


def test_cuda_device_serves_or_says_why_not(tmp_path):
    # Where spin has no CUDA or sees no GPU (CI) this is an error naming the flag; on a GPU
    # machine the same command serves on the GPU.
    proc, port = start("--model", small_gpu_config(tmp_path), "--load-format", "dummy", "--device", "cuda",
                       "--max-model-len", "256", "--gpu-memory-utilization", "0.5")
    if wait_healthy_or_exit(proc, port):
        err = stop(proc)
        assert proc.returncode == 0, err
        assert "device cuda" in err
    else:
        err = proc.communicate()[1]
        assert proc.returncode == 1
        assert "error: --device cuda:" in err, err


def expect_startup_error(args, message):
    """spin serve with `args` exits with status 1 and `message` on stderr, without hanging."""
    proc, _ = start(*args)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"spin serve {' '.join(map(str, args))} hung after a startup error")
    assert proc.returncode == 1 and message in err, err


def test_startup_errors_end_the_process():
    for args, message in [(["--model", "/nonexistent/model.gguf"], "model not found"),
                          (["--model", "tiny-llama", "--load-format", "dummy", "--max-num-seqs", "0"], "--max-num-seqs"),
                          (["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--gemm-tuning",
                            "/nonexistent/tuning.json"], "--gemm-tuning tunes the products of one GPU"),
                          (["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--gemv-rows", "0"],
                           "--gemv-rows chooses a GPU's product kernel")]:
        expect_startup_error(args, message)


def test_unknown_device_is_refused():
    result = subprocess.run([SPIN, "serve", "--model", "tiny-llama", "--load-format", "dummy", "--device", "tpu"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode != 0
    assert "--device" in result.stderr


def completion(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def served_logprobs(body, *args):
    """Starts spin serve with `args`, answers `body` (a completion asking for logprobs), stops it;
    returns the answer's logprobs and the server's stderr."""
    proc, port = start(*args)
    try:
        assert wait_healthy_or_exit(proc, port), proc.communicate()[1]
        status, answer = completion(port, body)
        assert status == 200, answer
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    return answer["choices"][0]["logprobs"], err


def assert_same_answer(split, one):
    assert split["tokens"] == one["tokens"]
    for a, b in zip(split["token_logprobs"], one["token_logprobs"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))


def test_tensor_parallel_serves_what_one_rank_serves():
    """`--tp 2` on the CPU (two ranks, each with half the heads) answers as one rank does; vLLM's
    `-tp 2` spelling works too. Same dummy weights, greedy, token-id prompts."""
    body = {"prompt": [1, 7, 42, 99, 3, 250, 17], "max_tokens": 12, "temperature": 0, "logprobs": 3}
    answers = []
    for tp in (["--tp", "1"], ["-tp", "2"], ["--tensor-parallel-size", "2"]):
        logprobs, err = served_logprobs(body, "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                                        "--max-model-len", "256", *tp)
        assert ("tensor parallel over 2 ranks" in err) == (tp[1] == "2"), err
        answers.append(logprobs)
    for split in answers[1:]:
        assert_same_answer(split, answers[0])


def write_seer_gate(path, layers, kv_heads, group, head_dim, rows_extra=0, seed=5):
    """Seer gate weights of a model's shape (safetensors, F32)."""
    import numpy as np
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        tensors[f"layers.{layer}.seer.k_gate"] = rng.normal(
            0, (3 * head_dim) ** -0.5, (kv_heads, 3 * head_dim + rows_extra, head_dim)).astype(np.float32)
        tensors[f"layers.{layer}.seer.q_gate"] = rng.normal(
            0, (group * head_dim) ** -0.5, (kv_heads, group * head_dim, head_dim)).astype(np.float32)
    save_file(tensors, str(path))
    return path


def test_seer_gate_serves_and_splits_over_ranks(tmp_path):
    """`--seer-gate` on tiny-llama (2 layers, 2 KV heads of 2 query heads, head_dim 16) with a
    2-page budget: two ranks (one KV head each, each its share of the gate) answer as one, and the
    trained gate answers otherwise than the training-free one (it is used)."""
    gate = write_seer_gate(tmp_path / "gate.safetensors", 2, 2, 2, 16)
    body = {"prompt": list(range(3, 200)), "max_tokens": 8, "temperature": 0, "logprobs": 1}
    one, split, training_free = (
        served_logprobs(body, "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--max-model-len",
                        "512", "--sparse-algorithm", "seer", "--sparse-budget", "32", *flags)[0]
        for flags in (["--seer-gate", gate, "--tp", "1"], ["--seer-gate", gate, "--tp", "2"], []))
    assert_same_answer(split, one)
    assert max(abs(a - b) for a, b in zip(one["token_logprobs"], training_free["token_logprobs"])) > 1e-5


def test_bad_seer_gate_ends_the_process(tmp_path):
    wrong_shape = write_seer_gate(tmp_path / "wrong.safetensors", 2, 2, 2, 16, rows_extra=1)
    for gate, message in [(tmp_path / "missing.safetensors", "missing.safetensors"),
                          (wrong_shape, "layers.0.seer.k_gate")]:
        expect_startup_error(["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--seer-gate", gate],
                             message)


def test_rope_scaling_extends_the_served_context():
    # tiny-qwen3 is made for 4096 positions; YaRN with factor 4 is made for 4 x that, so the longer
    # --max-model-len is refused without it and served with it.
    model = ["--model", "tiny-qwen3", "--load-format", "dummy", "--device", "cpu", "--max-model-len", "16384"]
    expect_startup_error(model, "exceeds the model's context length 4096")
    expect_startup_error([*model, "--rope-scaling", "yarn"], "--rope-scaling is not valid JSON")
    expect_startup_error([*model, "--rope-scaling", '{"rope_type": "yarn", "factor": 0.5}'], "factor >= 1")
    proc, port = start(*model, "--rope-scaling", '{"rope_type": "yarn", "factor": 4.0}')
    assert wait_healthy_or_exit(proc, port), proc.communicate()[1]
    status, body = get(port, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 16384
    err = stop(proc)
    assert proc.returncode == 0, err
    assert "RoPE scaling from --rope-scaling" in err and "context 16384 tokens" in err, err


def test_echo_scores_the_tokens_a_decode_drew(tmp_path):
    """A prompt that ends with the tokens a greedy decode drew, echoed with max_tokens 0: its
    last tokens' logprobs (the prefill's rows for every position) equal those the decode reported
    (each step's last row). On the CPU (fp32: within 1e-3) and, where one serves, on the GPU (bf16,
    prefill kernels against decode kernels: within 0.1)."""
    prompt = [1, 7, 42, 99, 3, 250, 17]
    largest = {}
    for device, tolerance in (("cpu", 1e-3), ("cuda", 0.1)):
        proc, port = start("--model", small_gpu_config(tmp_path), "--load-format", "dummy", "--device", device,
                           "--max-model-len", "256", "--gpu-memory-utilization", "0.5")
        if not wait_healthy_or_exit(proc, port):  # no GPU here: the other test checks the message
            assert device == "cuda" and proc.returncode == 1, proc.communicate()[1]
            continue
        try:
            status, drawn = completion(port, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2})
            assert status == 200, drawn
            decoded = drawn["choices"][0]["logprobs"]
            ids = [int(t.strip("<>")) for t in decoded["tokens"]]
            status, scored = completion(port, {"prompt": prompt + ids, "max_tokens": 0, "echo": True, "logprobs": 2})
            assert status == 200, scored
        finally:
            err = stop(proc)
        assert proc.returncode == 0, err
        echoed = scored["choices"][0]["logprobs"]
        assert scored["choices"][0]["finish_reason"] == "length"
        assert len(echoed["tokens"]) == len(prompt) + len(ids) and echoed["token_logprobs"][0] is None
        assert echoed["tokens"][len(prompt):] == decoded["tokens"]
        gaps = [abs(a - b) for a, b in zip(echoed["token_logprobs"][len(prompt):], decoded["token_logprobs"])]
        assert max(gaps) <= tolerance, (device, echoed["token_logprobs"], decoded["token_logprobs"])
        largest[device] = max(gaps)
    print(f"largest |echoed - decoded| logprob per device that served: {largest}")
