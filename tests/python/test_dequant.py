"""spin's dequantization against the `gguf` package (numpy reference).

Every tensor that `spin inspect --all-out` writes must equal `gguf.quants.dequantize` of the same
bytes read by `gguf.GGUFReader`: same numpy shape, and max |spin - ref| <= 1e-6 * max |ref|
(in practice the results are bit-identical; the tolerance only allows for a different order of
float operations in a fused multiply-add).
"""
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf import quants

SPIN = os.environ.get("SPIN_BIN", "spin")
MODEL = os.environ.get("SPIN_TEST_MODEL", "")
REL_TOL = 1e-6

# Bytes per block, elements per block, byte offsets of fp16 scale fields inside a block.
BLOCKS = {
    T.Q4_K: (144, 256, [0, 2]),
    T.Q6_K: (210, 256, [208]),
    T.Q4_0: (18, 32, [0]),
    T.Q4_1: (20, 32, [0, 2]),
    T.Q8_0: (34, 32, [0]),
}


@pytest.fixture
def tmp(tmp_path):
    root = os.environ.get("SPIN_TEST_TMP")
    if not root:
        return tmp_path
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="dequant_", dir=root))


def spin_all_out(gguf_path, out_dir):
    proc = subprocess.run([SPIN, "inspect", "--model", str(gguf_path), "--all-out", str(out_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out_dir


def compare_file(gguf_path, out_dir):
    """Compares every tensor of the file; returns the type names seen."""
    reader = GGUFReader(gguf_path)
    seen = set()
    assert len(reader.tensors) > 0
    for t in reader.tensors:
        ref = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        got = np.load(out_dir / f"{t.name}.npy")
        assert got.dtype == np.float32, t.name
        assert got.shape == ref.shape, (t.name, got.shape, ref.shape)
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        if ref.size:
            assert np.array_equal(np.isfinite(got), np.isfinite(ref)), t.name
            finite = np.isfinite(ref)
            err = float(np.max(np.abs(got[finite] - ref[finite]), initial=0.0))
            assert err <= REL_TOL * max(scale, 1e-30), (t.name, t.tensor_type.name, err, scale)
        seen.add(t.tensor_type.name)
    return seen


@pytest.mark.skipif(not MODEL or not Path(MODEL).exists(), reason="SPIN_TEST_MODEL not available")
def test_every_tensor_of_the_default_model(tmp):
    out = spin_all_out(MODEL, tmp / "model")
    seen = compare_file(MODEL, out)
    assert len(list(out.glob("*.npy"))) == len(GGUFReader(MODEL).tensors)
    assert {"Q4_1", "Q8_0", "F32"} <= seen


def random_blocks(rng, qtype, n_blocks):
    block_bytes, _, f16_at = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for at in f16_at:
        scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


def test_every_type_written_by_gguf_writer(tmp):
    rng = np.random.default_rng(20240607)
    path = tmp / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("test.marker", 1)
    floats = (rng.standard_normal((6, 64)) * 3).astype(np.float32)
    floats[0, :4] = [1e-7, -6e-8, 65504.0, -0.0]  # fp16 subnormals, the largest half, signed zero
    w.add_tensor("f32", floats)
    w.add_tensor("f32_1d", floats[1])
    w.add_tensor("f32_3d", floats.reshape(3, 2, 64))
    w.add_tensor("f16", floats.astype(np.float16))
    w.add_tensor("bf16", quants.quantize(floats, T.BF16), raw_dtype=T.BF16)
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        w.add_tensor(qtype.name.lower(), quants.quantize(floats, qtype), raw_dtype=qtype)
    # gguf cannot quantize to the k-quants: random super-blocks with finite fp16 scales.
    for qtype in BLOCKS:
        n_rows, blocks_per_row = 3, 2
        raw = random_blocks(rng, qtype, n_rows * blocks_per_row)
        w.add_tensor(f"raw_{qtype.name.lower()}", raw.reshape(n_rows, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = spin_all_out(path, tmp / "types")
    seen = compare_file(path, out)
    assert seen == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}

    # The single-tensor export gives the same array as --all-out.
    single = tmp / "one.npy"
    proc = subprocess.run([SPIN, "inspect", "--model", str(path), "--tensor", "raw_q6_k",
                           "--out", str(single)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(np.load(single), np.load(out / "raw_q6_k.npy"))
    assert np.load(single).shape == (3, 512)


def test_inspect_lists_metadata_and_tensors(tmp):
    path = tmp / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("test.greeting", "hello")
    w.add_array("test.list", list(range(100)))
    w.add_tensor("tensor.one", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proc = subprocess.run([SPIN, "inspect", "--model", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "GGUF version 3" in proc.stdout
    assert '"hello"' in proc.stdout
    assert "(100 elements)" in proc.stdout  # long arrays are abbreviated
    line = next(l for l in proc.stdout.splitlines() if "tensor.one" in l)
    assert "F32" in line and "[32, 2]" in line
