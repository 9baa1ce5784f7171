"""Writes the seed corpus for fuzz_gguf (tests/fuzz/corpus_gguf/): tiny GGUF files, each < 4 KB,
covering every metadata type, nested arrays, every supported tensor type and
loadable llama and qwen3 models."""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import GGUFWriter, quants


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def metadata_seed(path):
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(16)
    w.add_uint8("u8", 1)
    w.add_int8("i8", -1)
    w.add_uint16("u16", 2)
    w.add_int16("i16", -2)
    w.add_uint32("u32", 3)
    w.add_int32("i32", -3)
    w.add_float32("f32", 0.5)
    w.add_uint64("u64", 4)
    w.add_int64("i64", -4)
    w.add_float64("f64", 0.25)
    w.add_bool("bool", True)
    w.add_string("str", "héllo")
    w.add_array("arr", ["a", "bc"])
    w.add_key_value("nested", [[1, 2], [3]], V.ARRAY)
    w.add_tensor("t", np.arange(8, dtype=np.float32).reshape(2, 4))
    finish(w)


def types_seed(path):
    rng = np.random.default_rng(1)
    w = GGUFWriter(str(path), "llama")
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("bf16", quants.quantize(x, T.BF16), raw_dtype=T.BF16)
    for q in (T.Q8_0, T.Q4_0, T.Q4_1):
        w.add_tensor(q.name, quants.quantize(x, q), raw_dtype=q)
    for q, nbytes, scales in ((T.Q4_K, 144, [0, 2]), (T.Q6_K, 210, [208])):
        raw = rng.integers(0, 256, size=(1, nbytes), dtype=np.uint8)
        for at in scales:
            raw[0, at:at + 2] = np.array([0.01], np.float16).view(np.uint8)
        w.add_tensor(q.name, raw, raw_dtype=q)
    finish(w)


def model_seed(path, arch, dtype):
    rng = np.random.default_rng(2)
    hidden, heads, kv_heads, ffn, vocab = 8, 2, 1, 8, 4
    head_dim = hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_custom_alignment(8)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def mat(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(dtype))

    mat("token_embd.weight", vocab, hidden)
    mat("output.weight", vocab, hidden)
    mat("output_norm.weight", hidden)
    mat("blk.0.attn_norm.weight", hidden)
    mat("blk.0.ffn_norm.weight", hidden)
    if arch == "qwen3":
        mat("blk.0.attn_q_norm.weight", head_dim)
        mat("blk.0.attn_k_norm.weight", head_dim)
    mat("blk.0.attn_q.weight", heads * head_dim, hidden)
    mat("blk.0.attn_k.weight", kv_heads * head_dim, hidden)
    mat("blk.0.attn_v.weight", kv_heads * head_dim, hidden)
    mat("blk.0.attn_output.weight", hidden, heads * head_dim)
    mat("blk.0.ffn_gate.weight", ffn, hidden)
    mat("blk.0.ffn_up.weight", ffn, hidden)
    mat("blk.0.ffn_down.weight", hidden, ffn)
    finish(w)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "corpus_gguf")
    out.mkdir(parents=True, exist_ok=True)
    metadata_seed(out / "metadata.gguf")
    types_seed(out / "types.gguf")
    model_seed(out / "llama.gguf", "llama", np.float16)
    model_seed(out / "qwen3.gguf", "qwen3", np.float32)
    for f in sorted(out.glob("*.gguf")):
        assert f.stat().st_size < 4096, f
        print(f.name, f.stat().st_size)
