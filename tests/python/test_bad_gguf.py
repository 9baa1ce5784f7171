"""Corrupt GGUF files: each must end with a clear `error:` naming the defect and exit code 1 —
never a crash, a signal, a sanitizer report or a hang.

The corrupt variants are made from a small valid tiny-llama GGUF that this test serializes itself
(so every field's position is known), checked first to be valid by both `gguf.GGUFReader` and
`spin inspect --check`, plus a few made from the real model's header.
"""
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

SPIN = os.environ.get("SPIN_BIN", "spin")
MODEL = os.environ.get("SPIN_TEST_MODEL", "")

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}
T_F32, T_Q8_0 = 0, 8


def gguf_str(s):
    b = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(b)) + b


def value_bytes(vtype, value):
    if vtype == STR:
        return gguf_str(value)
    if vtype == ARR:
        elem_type, items = value
        return struct.pack("<IQ", elem_type, len(items)) + b"".join(
            value_bytes(elem_type, v) for v in items)
    return struct.pack(PACK[vtype], value)


class Image:
    """A GGUF file as editable parts; build() serializes it."""

    def __init__(self):
        self.version = 3
        self.kvs = []      # (key bytes/str, type, raw value bytes)
        self.tensors = []  # dicts: name, dims, type, data, offset (None = next aligned)
        self.alignment = 32
        self.n_tensors = None  # override of the header counts
        self.n_kv = None

    def kv(self, key, vtype, value):
        self.kvs.append((key, vtype, value_bytes(vtype, value)))

    def set_kv(self, key, vtype, value):
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        self.kv(key, vtype, value)

    def tensor(self, name, array, ttype=T_F32, data=None):
        dims = list(reversed(array.shape))  # ggml order: fastest dim first
        if data is None:
            data = array.astype(np.float32).tobytes()
        self.tensors.append({"name": name, "dims": dims, "type": ttype, "data": data,
                             "offset": None})

    def build(self):
        out = bytearray(b"GGUF")
        out += struct.pack("<I", self.version)
        out += struct.pack("<QQ", len(self.tensors) if self.n_tensors is None else self.n_tensors,
                           len(self.kvs) if self.n_kv is None else self.n_kv)
        for key, vtype, raw in self.kvs:
            out += gguf_str(key) + struct.pack("<I", vtype) + raw
        offset = 0
        for t in self.tensors:
            out += gguf_str(t["name"]) + struct.pack("<I", len(t["dims"]))
            out += b"".join(struct.pack("<Q", d) for d in t["dims"])
            out += struct.pack("<IQ", t["type"], offset if t["offset"] is None else t["offset"])
            offset += -(-len(t["data"]) // self.alignment) * self.alignment
        out += b"\0" * (-len(out) % self.alignment)
        for t in self.tensors:
            out += t["data"] + b"\0" * (-len(t["data"]) % self.alignment)
        return bytes(out)


HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def byte_level_vocab():
    """GPT-2's byte-to-unicode token strings for all 256 bytes, then two special tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    tokens = []
    for b in range(256):
        if b in printable:
            tokens.append(chr(b))
        else:
            tokens.append(chr(256 + extra))
            extra += 1
    return tokens + ["<|endoftext|>", "<|im_start|>"]


def tiny_llama():
    rng = np.random.default_rng(5)
    tokens = byte_level_vocab()
    vocab = len(tokens)
    img = Image()
    img.kv("general.architecture", STR, "llama")
    img.kv("general.name", STR, "tiny test llama")
    img.kv("llama.block_count", U32, LAYERS)
    img.kv("llama.context_length", U32, 256)
    img.kv("llama.embedding_length", U32, HIDDEN)
    img.kv("llama.feed_forward_length", U32, FFN)
    img.kv("llama.attention.head_count", U32, HEADS)
    img.kv("llama.attention.head_count_kv", U32, KV_HEADS)
    img.kv("llama.rope.freq_base", F32, 10000.0)
    img.kv("llama.attention.layer_norm_rms_epsilon", F32, 1e-5)
    img.kv("llama.vocab_size", U32, vocab)
    img.kv("tokenizer.ggml.model", STR, "gpt2")
    img.kv("tokenizer.ggml.pre", STR, "smollm")
    img.kv("tokenizer.ggml.tokens", ARR, (STR, tokens))
    img.kv("tokenizer.ggml.token_type", ARR, (I32, [1] * 256 + [3, 3]))
    img.kv("tokenizer.ggml.merges", ARR, (STR, ["Ġ t", "h e"]))
    img.kv("tokenizer.ggml.bos_token_id", U32, vocab - 1)
    img.kv("tokenizer.ggml.eos_token_id", U32, vocab - 2)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    emb = w(vocab, HIDDEN)
    # The embedding as Q8_0 blocks (34 bytes: fp16 scale + 32 int8) keeps one quantized tensor in.
    scales = np.full((vocab * HIDDEN // 32, 1), 0.01, dtype=np.float16).view(np.uint8)
    qs = rng.integers(-127, 128, size=(vocab * HIDDEN // 32, 32), dtype=np.int8).view(np.uint8)
    img.tensor("token_embd.weight", emb, T_Q8_0, np.concatenate([scales, qs], axis=1).tobytes())
    img.tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        img.tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        img.tensor(p + "attn_q.weight", w(HEADS * head_dim, HIDDEN))
        img.tensor(p + "attn_k.weight", w(KV_HEADS * head_dim, HIDDEN))
        img.tensor(p + "attn_v.weight", w(KV_HEADS * head_dim, HIDDEN))
        img.tensor(p + "attn_output.weight", w(HIDDEN, HEADS * head_dim))
        img.tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        img.tensor(p + "ffn_gate.weight", w(FFN, HIDDEN))
        img.tensor(p + "ffn_up.weight", w(FFN, HIDDEN))
        img.tensor(p + "ffn_down.weight", w(HIDDEN, FFN))
    return img


@pytest.fixture(scope="module")
def tmp():
    root = os.environ.get("SPIN_TEST_TMP")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="bad_gguf_", dir=root))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_spin(args, timeout=60):
    return subprocess.run([SPIN, *args], capture_output=True, text=True, timeout=timeout)


def assert_clean_error(proc, keywords):
    out = proc.stderr + proc.stdout
    assert "Sanitizer" not in out and "core dumped" not in out, out
    assert proc.returncode > 0, f"exit {proc.returncode} (negative = killed by a signal)\n{out}"
    assert "error:" in proc.stderr, out
    msg = proc.stderr.lower()
    assert any(k.lower() in msg for k in keywords), f"none of {keywords} in: {proc.stderr}"


def inspect_fails(path, keywords, check=False):
    proc = run_spin(["inspect", "--model", str(path)] + (["--check"] if check else []))
    assert_clean_error(proc, keywords)


def write(tmp, name, data):
    path = tmp / name
    path.write_bytes(data)
    return path


def test_base_file_is_valid(tmp):
    path = write(tmp, "good.gguf", tiny_llama().build())
    reader = GGUFReader(path)
    assert len(reader.tensors) == 2 + 9 * LAYERS
    proc = run_spin(["inspect", "--model", str(path), "--check"])
    assert proc.returncode == 0, proc.stderr
    assert "model OK" in proc.stdout


# ---- file-level defects ---------------------------------------------------------------------

def patched(data, at, fmt, value):
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def test_truncated_at_many_points(tmp):
    data = tiny_llama().build()
    cuts = sorted({0, 1, 3, 4, 6, 8, 12, 16, 20, 24, 25, 30, 40, 100, 1000, 3000}
                  | set(range(50, len(data), max(1, len(data) // 23)))
                  | {len(data) - 1, len(data) - 100})
    for n in cuts:
        path = write(tmp, f"cut_{n}.gguf", data[:n])
        inspect_fails(path, ["truncated", "past the end", "exceeds", "cannot fit"])


def test_bad_magic(tmp):
    data = tiny_llama().build()
    inspect_fails(write(tmp, "magic.gguf", b"GGML" + data[4:]), ["magic"])


@pytest.mark.parametrize("version", [1, 99])
def test_bad_version(tmp, version):
    data = patched(tiny_llama().build(), 4, "<I", version)
    inspect_fails(write(tmp, f"v{version}.gguf", data), [f"version {version}"])


@pytest.mark.parametrize("field,keyword", [("n_tensors", "tensor count"), ("n_kv", "metadata count")])
def test_absurd_counts(tmp, field, keyword):
    img = tiny_llama()
    setattr(img, field, 2**63)
    inspect_fails(write(tmp, f"count_{field}.gguf", img.build()), [keyword])


METADATA_CASES = {
    # name: (mutation of the image, keywords expected in the error)
    "huge_string_value": (lambda i: i.kvs.insert(
        0, ("k", STR, struct.pack("<Q", 2**62) + b"abc")), ["string length"]),
    "huge_array": (lambda i: i.kvs.insert(
        0, ("k", ARR, struct.pack("<IQ", U8, 2**62))), ["cannot fit"]),
    "huge_string_array": (lambda i: i.kvs.insert(
        0, ("k", ARR, struct.pack("<IQ", STR, 2**61))), ["cannot fit"]),
    "nesting_too_deep": (lambda i: i.kvs.insert(
        0, ("k", ARR, struct.pack("<IQ", ARR, 1) * 200 + struct.pack("<IQ", U8, 0))), ["nesting"]),
    "unknown_value_type": (lambda i: i.kvs.insert(0, ("k", 55, b"\0" * 8)),
                           ["unknown metadata value type 55"]),
    "unknown_array_elem_type": (lambda i: i.kvs.insert(
        0, ("k", ARR, struct.pack("<IQ", 200, 1))), ["unknown metadata value type 200"]),
    "invalid_utf8_key": (lambda i: i.kvs.insert(0, (b"bad\xc3\x28key", U8, b"\1")), ["utf-8"]),
    "duplicate_key": (lambda i: i.kv("llama.block_count", U32, 2), ["duplicate metadata key"]),
    "bool_not_0_1": (lambda i: i.kvs.insert(0, ("k", BOOL, b"\x07")), ["bool"]),
    "alignment_zero": (lambda i: i.kv("general.alignment", U32, 0), ["power of two"]),
    "alignment_not_pow2": (lambda i: i.kv("general.alignment", U32, 24), ["power of two"]),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_metadata_defects(tmp, case):
    mutate, keywords = METADATA_CASES[case]
    img = tiny_llama()
    mutate(img)
    inspect_fails(write(tmp, f"{case}.gguf", img.build()), keywords)


def test_huge_key_length(tmp):
    # The first key's length prefix (right after the 24-byte header) claims 2^63 bytes.
    data = patched(tiny_llama().build(), 24, "<Q", 2**63)
    inspect_fails(write(tmp, "huge_key.gguf", data), ["string length"])


def set_tensor(tensor_name, **fields):
    def fn(img):
        t = next(t for t in img.tensors if t["name"] == tensor_name)
        t.update(fields)
    return fn


TENSOR_CASES = {
    "dims_product_overflows": (set_tensor("blk.0.attn_q.weight", dims=[2**32, 2**32]), ["overflow"]),
    "dims_product_overflows_4d": (set_tensor("output_norm.weight", dims=[2**16] * 4),
                                  ["overflow"]),
    "too_many_dims": (set_tensor("output_norm.weight", dims=[64, 1, 1, 1, 1]), ["dimensions"]),
    "offset_past_end": (set_tensor("blk.1.ffn_down.weight", offset=2**40), ["past the end"]),
    "offset_wraps": (set_tensor("blk.1.ffn_down.weight", offset=2**64 - 32), ["past the end"]),
    "misaligned_offset": (set_tensor("blk.0.attn_k.weight", offset=36), ["aligned"]),
    "unknown_tensor_type": (set_tensor("blk.0.attn_v.weight", type=99), ["unknown tensor type id 99"]),
    "unsupported_tensor_type": (set_tensor("blk.0.attn_v.weight", type=6), ["Q5_0"]),
    "row_not_multiple_of_block": (set_tensor("output_norm.weight", type=T_Q8_0, dims=[48]),
                                  ["block size"]),
    "invalid_utf8_tensor_name": (set_tensor("blk.0.ffn_up.weight", name=b"blk.0.\xff"), ["utf-8"]),
    "duplicate_tensor_name": (set_tensor("blk.0.ffn_up.weight", name="blk.0.ffn_gate.weight"),
                              ["duplicate tensor name"]),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_tensor_defects(tmp, case):
    mutate, keywords = TENSOR_CASES[case]
    img = tiny_llama()
    mutate(img)
    inspect_fails(write(tmp, f"{case}.gguf", img.build()), keywords)


# ---- the real model's header ----------------------------------------------------------------

@pytest.mark.skipif(not MODEL or not Path(MODEL).exists(), reason="SPIN_TEST_MODEL not available")
def test_real_model_header_defects(tmp):
    with open(MODEL, "rb") as f:
        head = f.read(2_500_000)  # magic, counts, metadata (vocabulary), tensor infos, some data
    cases = [
        (head[:1000], ["truncated", "exceeds", "cannot fit"]),
        (head[:1_000_000], ["truncated", "exceeds", "cannot fit"]),
        (head, ["past the end"]),
        (patched(head, 4, "<I", 1), ["version 1"]),
        (patched(head, 8, "<Q", 2**63), ["tensor count"]),
        (patched(head, 16, "<Q", 2**63), ["metadata count"]),
        (b"\0\0\0\0" + head[4:4096], ["magic"]),
    ]
    for n, (data, keywords) in enumerate(cases):
        inspect_fails(write(tmp, f"real_{n}.gguf", data), keywords)


# ---- model-level defects: spin inspect --check and spin generate ----------------------------

def drop_tensor(name):
    def fn(img):
        img.tensors = [t for t in img.tensors if t["name"] != name]
    return fn


def reshape_tensor(name, shape):
    def fn(img):
        t = next(t for t in img.tensors if t["name"] == name)
        t["dims"] = list(reversed(shape))
        t["data"] = np.zeros(shape, np.float32).tobytes()
    return fn


def add_tensor(name, shape):
    return lambda img: img.tensor(name, np.ones(shape, np.float32))


MODEL_CASES = {
    "missing_tensor": (drop_tensor("blk.1.ffn_up.weight"), ["missing tensor 'blk.1.ffn_up.weight'"]),
    "missing_embedding": (drop_tensor("token_embd.weight"), ["missing tensor 'token_embd.weight'"]),
    "wrong_shape": (reshape_tensor("blk.0.attn_q.weight", (HIDDEN, HIDDEN // 2)), ["wrong shape"]),
    "wrong_norm_length": (reshape_tensor("output_norm.weight", (HIDDEN + 1,)), ["wrong shape"]),
    "kv_heads_do_not_divide": (lambda i: i.set_kv("llama.attention.head_count_kv", U32, 3),
                               ["multiple"]),
    "heads_do_not_divide_hidden": (lambda i: i.set_kv("llama.attention.head_count", U32, 5),
                                   ["divide"]),
    "zero_layers": (lambda i: i.set_kv("llama.block_count", U32, 0), ["must be positive"]),
    "unknown_architecture": (lambda i: i.set_kv("general.architecture", STR, "gpt-neox"),
                             ["unsupported architecture 'gpt-neox'"]),
    "missing_block_count": (lambda i: i.kvs.remove(next(k for k in i.kvs if k[0] == "llama.block_count")),
                            ["llama.block_count"]),
    "block_count_is_string": (lambda i: i.set_kv("llama.block_count", STR, "2"), ["integer"]),
    "bos_outside_vocab": (lambda i: i.set_kv("tokenizer.ggml.bos_token_id", U32, 10**6),
                          ["outside the vocabulary"]),
    "llama3_rope_freqs": (add_tensor("rope_freqs.weight", (HIDDEN // HEADS // 2,)), ["rope_freqs"]),
    "unknown_rope_scaling": (lambda i: i.kv("llama.rope.scaling.type", STR, "ntk-magic"),
                             ["rope.scaling.type"]),
}


def model_case_file(tmp, case):
    mutate, keywords = MODEL_CASES[case]
    img = tiny_llama()
    mutate(img)
    return write(tmp, f"model_{case}.gguf", img.build()), keywords


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_defects_inspect(tmp, case):
    path, keywords = model_case_file(tmp, case)
    inspect_fails(path, keywords, check=True)


def generate_available():
    # The root app answers `--help` too, so look for generate's own option in the help text.
    try:
        proc = run_spin(["generate", "--help"], timeout=30)
    except OSError:
        return False
    return proc.returncode == 0 and "--prompt" in proc.stdout


@pytest.mark.skipif(not generate_available(), reason="spin generate is not built yet")
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_defects_generate(tmp, case):
    path, keywords = model_case_file(tmp, case)
    proc = run_spin(["generate", "--model", str(path), "--prompt", "x", "-n", "1"], timeout=120)
    assert_clean_error(proc, keywords)


@pytest.mark.skipif(not generate_available(), reason="spin generate is not built yet")
@pytest.mark.parametrize("case", ["offset_past_end", "unknown_tensor_type", "duplicate_tensor_name"])
def test_file_defects_generate(tmp, case):
    mutate, keywords = TENSOR_CASES[case]
    img = tiny_llama()
    mutate(img)
    path = write(tmp, f"gen_{case}.gguf", img.build())
    proc = run_spin(["generate", "--model", str(path), "--prompt", "x", "-n", "1"], timeout=120)
    assert_clean_error(proc, keywords)
