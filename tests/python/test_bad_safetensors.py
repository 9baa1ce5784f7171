"""Corrupt HF model directories must end `spin generate` with a clear error, never a crash.

Each case starts from a tiny valid Llama checkpoint written here with the `safetensors` package
(and json for config.json / the shard index), breaks one thing, and checks that spin exits with a
positive status (not a signal), prints "error:" and a keyword naming the defect, and shows no
sanitizer report.
"""

import json
import os
import shutil
import struct
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

SPIN_BIN = os.environ.get("SPIN_BIN")

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 32, 16, 32, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def _spin_generate_exists():
    if not SPIN_BIN or not Path(SPIN_BIN).exists():
        return False
    result = subprocess.run([SPIN_BIN, "generate", "--help"], capture_output=True, timeout=60)
    return result.returncode == 0


pytestmark = pytest.mark.skipif(
    not _spin_generate_exists(), reason="SPIN_BIN is not set or has no `generate` subcommand"
)


@pytest.fixture
def scratch(tmp_path):
    base = os.environ.get("SPIN_TEST_TMP")
    if not base:
        yield tmp_path
        return
    path = Path(base) / f"bad_safetensors_{uuid.uuid4().hex}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config_dict(**overrides):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def weights():
    rng = np.random.default_rng(0)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.02 * rng.standard_normal(n)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": mat(VOCAB, HIDDEN),
        "model.norm.weight": norm(HIDDEN),
        "lm_head.weight": mat(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(HIDDEN)
        tensors[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        tensors[p + "mlp.gate_proj.weight"] = mat(INTER, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = mat(INTER, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = mat(HIDDEN, INTER)
    return tensors


def write_model(directory, tensors=None, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or config_dict()))
    save_file(tensors if tensors is not None else weights(), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def write_sharded(directory):
    """Layer 1 in the second shard, everything else in the first."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict()))
    tensors = weights()
    second = {k: v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    first = {k: v for k, v in tensors.items() if k not in second}
    save_file(first, str(directory / SHARD1))
    save_file(second, str(directory / SHARD2))
    weight_map = {k: (SHARD2 if k in second else SHARD1) for k in tensors}
    write_index(directory, weight_map)
    return directory


def write_index(directory, weight_map):
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def read_index(directory):
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def split_file(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_file(path, header_text, data):
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text.encode() + data)


def edit_header(directory, edit):
    """Applies edit(header_dict) to model.safetensors' header and writes the file back."""
    path = directory / "model.safetensors"
    header, data = split_file(path)
    edit(header)
    join_file(path, json.dumps(header), data)


def first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def last_tensor(header):
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


# ------------------------------------------------------------------ the corruptions


def truncated_header(d):
    path = write_model(d) / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[: 8 + n // 2])


def truncated_data(d):
    path = write_model(d) / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])


def header_length_past_eof(d):
    path = write_model(d) / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])


def header_length_2_63(d):
    path = write_model(d) / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 63) + raw[8:])


def empty_file(d):
    (write_model(d) / "model.safetensors").write_bytes(b"")


def invalid_json(d):
    path = write_model(d) / "model.safetensors"
    _, data = split_file(path)
    join_file(path, '{"model.norm.weight": {"dtype": "F32", ', data)


def non_object_json(d):
    path = write_model(d) / "model.safetensors"
    _, data = split_file(path)
    join_file(path, '["model.norm.weight", 1, 2]', data)


def tensor_entry_not_object(d):
    edit_header(write_model(d), lambda h: h.__setitem__(first_tensor(h), [1, 2]))


def unknown_dtype(d):
    edit_header(write_model(d), lambda h: h[first_tensor(h)].__setitem__("dtype", "F7"))


def shape_product_overflow(d):
    edit_header(write_model(d), lambda h: h[first_tensor(h)].__setitem__("shape", [2**32, 2**32, 16]))


def negative_shape(d):
    edit_header(write_model(d), lambda h: h[first_tensor(h)].__setitem__("shape", [-4, 4]))


def offsets_past_end(d):
    def edit(h):
        t = last_tensor(h)
        begin, end = h[t]["data_offsets"]
        h[t]["data_offsets"] = [begin + 4096, end + 4096]

    edit_header(write_model(d), edit)


def offsets_size_mismatch(d):
    def edit(h):
        t = first_tensor(h)
        rows, cols = h[t]["shape"]
        h[t]["shape"] = [rows, cols + 1]

    edit_header(write_model(d), edit)


def overlapping_offsets(d):
    def edit(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = names[0], names[1]
        # b now claims a's bytes: same length needed, so give b a's shape and dtype too.
        h[b] = dict(h[a])

    edit_header(write_model(d), edit)


def trailing_bytes(d):
    path = write_model(d) / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 64)


def duplicate_tensor_name(d):
    path = write_model(d) / "model.safetensors"
    header, data = split_file(path)
    name = "model.norm.weight"
    entry = json.dumps(header[name])
    text = json.dumps(header)
    # The same name twice with the same range: a JSON parser would keep one silently.
    text = text[:-1] + f', "{name}": {entry}' + "}"
    join_file(path, text, data)


def missing_tensor(d):
    tensors = weights()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_model(d, tensors)


def missing_lm_head_untied(d):
    tensors = weights()
    del tensors["lm_head.weight"]
    write_model(d, tensors)


def wrong_shape(d):
    tensors = weights()
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    write_model(d, tensors)


def unsupported_tensor_dtype(d):
    tensors = weights()
    tensors["model.norm.weight"] = np.ones(HIDDEN, dtype=np.int32)
    write_model(d, tensors)


def qwen2_biases(d):
    tensors = weights()
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(HEADS * HEAD_DIM, np.float32)
    write_model(d, tensors, config_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))


def no_weight_files(d):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config_dict()))


def missing_shard_file(d):
    (write_sharded(d) / SHARD2).unlink()


def index_names_missing_tensor(d):
    write_sharded(d)
    weight_map = read_index(d)
    weight_map["model.layers.0.self_attn.extra.weight"] = SHARD1
    write_index(d, weight_map)


def index_lacks_tensor(d):
    write_sharded(d)
    weight_map = read_index(d)
    del weight_map["model.norm.weight"]
    write_index(d, weight_map)


def index_escapes_directory(d):
    write_sharded(d)
    weight_map = read_index(d)
    weight_map["model.norm.weight"] = "../" + SHARD1
    write_index(d, weight_map)


def config_missing_field(d):
    config = config_dict()
    del config["hidden_size"]
    write_model(d, config=config)


def config_heads_not_dividing(d):
    write_model(d, config=config_dict(num_key_value_heads=3))


def config_unknown_rope_type(d):
    write_model(d, config=config_dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def config_unknown_architecture(d):
    write_model(d, config=config_dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


def config_not_json(d):
    write_model(d)
    (d / "config.json").write_text('{"vocab_size": 32,')


def config_mismatches_weights(d):
    write_model(d, config=config_dict(hidden_size=2 * HIDDEN))


CASES = [
    (truncated_header, ["header length", "past the end"]),
    (truncated_data, ["past the end"]),
    (header_length_past_eof, ["header length", "past the end"]),
    (header_length_2_63, ["header length", "limit"]),
    (empty_file, ["too short"]),
    (invalid_json, ["invalid JSON"]),
    (non_object_json, ["does not start with '{'"]),
    (tensor_entry_not_object, ["not an object"]),
    (unknown_dtype, ["unknown dtype 'F7'"]),
    (shape_product_overflow, ["overflows"]),
    (negative_shape, ["negative"]),
    (offsets_past_end, ["past the end"]),
    (offsets_size_mismatch, ["span", "need"]),
    (overlapping_offsets, ["overlap"]),
    (trailing_bytes, ["trailing"]),
    (duplicate_tensor_name, ["duplicate", "model.norm.weight"]),
    (missing_tensor, ["missing tensor", "model.layers.1.mlp.up_proj.weight"]),
    (missing_lm_head_untied, ["lm_head.weight", "tie_word_embeddings"]),
    (wrong_shape, ["k_proj", "expected [8, 16]"]),
    (unsupported_tensor_dtype, ["I32"]),
    (qwen2_biases, ["bias", "not supported"]),
    (no_weight_files, ["model.safetensors"]),
    (missing_shard_file, [SHARD2, "missing"]),
    (index_names_missing_tensor, ["model.layers.0.self_attn.extra.weight", "does not contain"]),
    (index_lacks_tensor, ["model.norm.weight", "weight_map"]),
    (index_escapes_directory, ["not a file name"]),
    (config_missing_field, ["missing required field", "hidden_size"]),
    (config_heads_not_dividing, ["num_key_value_heads (3)"]),
    (config_unknown_rope_type, ["rope_scaling type 'dynamic'"]),
    (config_unknown_architecture, ["unsupported architecture", "GPT2LMHeadModel"]),
    (config_not_json, ["config", "not valid JSON"]),
    (config_mismatches_weights, ["model.embed_tokens.weight", "expected"]),
]


def run_spin(*args, timeout=120):
    return subprocess.run([SPIN_BIN, *args], capture_output=True, text=True, timeout=timeout)


def generate(model, *extra):
    return run_spin("generate", "--model", str(model), "--prompt-ids", "1,2,3", "-n", "1", *extra)


def assert_clean_error(result, keywords):
    stderr = result.stderr
    assert result.returncode > 0, f"exit status {result.returncode} (negative = killed by signal)\n{stderr}"
    assert "error:" in stderr, stderr
    for keyword in keywords:
        assert keyword in stderr, f"'{keyword}' not in stderr:\n{stderr}"
    for sanitizer_report in ("AddressSanitizer", "runtime error:", "LeakSanitizer"):
        assert sanitizer_report not in stderr, stderr


def test_valid_models_load(scratch):
    """The unbroken checkpoints (single file and sharded) are accepted."""
    for directory in (write_model(scratch / "single"), write_sharded(scratch / "sharded")):
        result = generate(directory)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("corrupt,keywords", CASES, ids=[c.__name__ for c, _ in CASES])
def test_corrupt_model_gives_clear_error(scratch, corrupt, keywords):
    model = scratch / "model"
    corrupt(model)
    assert_clean_error(generate(model), keywords)


def test_missing_model_path(scratch):
    assert_clean_error(generate(scratch / "does-not-exist"), ["model not found"])


def test_dummy_tiny_preset_runs():
    result = generate("tiny-llama", "--load-format", "dummy", "--seed", "1")
    assert result.returncode == 0, result.stderr


def test_dummy_70b_fails_on_memory_quickly():
    """282 GB of fp32 weights: spin must refuse before allocating, not get OOM-killed."""
    start = time.monotonic()
    result = generate("llama-3.1-70b", "--load-format", "dummy")
    elapsed = time.monotonic() - start
    assert_clean_error(result, ["GB", "memory"])
    assert elapsed < 20, f"took {elapsed:.1f} s"
