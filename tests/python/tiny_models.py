"""Writers for tiny random models that the forward-pass tests load into spin and into the numpy
reference: HF directories (config.json + safetensors, single or sharded; F32, F16 or BF16) and
GGUF twins of HF models (the same weights, laid out the way llama.cpp's converter writes them).

Every model gets a small byte-level BPE tokenizer (tokenizer.json in HF dirs, tokenizer.ggml.*
in GGUF) so that loaders which expect one find it; the forward tests feed token ids directly.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

VOCAB = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_CORPUS = ["the quick brown fox jumps over the lazy dog"] * 10 + [
    "hello world, this is a tiny model for testing spin"]

# name -> architecture description. Shapes are tiny; each covers one combination of features.
SPECS = {
    # Untied embeddings, Llama-3 rope scaling whose bands (original context 64) cover all three
    # cases for head_dim 16: kept, blended and divided frequencies. Sharded into 3 files.
    "llama_untied_llama3": dict(
        model_type="llama", layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
        tied=False, dtype="F32", shards=3, rope_theta=10000.0, max_pos=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Tied embeddings, linear rope scaling, F16 weights in one file.
    "llama_tied_linear": dict(
        model_type="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
        tied=True, dtype="F16", shards=1, rope_theta=10000.0, max_pos=256,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Qwen3: q/k RMSNorm, head_dim 32 != hidden/heads, YaRN (factor 4, ramp between dims 5 and
    # 12 of 16 for original context 4096), BF16 weights sharded into 2 files. max_position is
    # factor * original so that every transformers version derives the same factor.
    "qwen3_yarn": dict(
        model_type="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128,
        tied=False, dtype="BF16", shards=2, rope_theta=10000.0, max_pos=16384,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    # HF twins of the GGUF files below (plain RoPE; values rounded to what the GGUF stores).
    "llama_twin": dict(
        model_type="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
        tied=False, dtype="F32", shards=1, rope_theta=10000.0, max_pos=256, rope_scaling=None),
    "qwen3_twin": dict(
        model_type="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=96,
        tied=True, dtype="F32", shards=1, rope_theta=1000000.0, max_pos=256, rope_scaling=None),
}
RMS_EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# Weights


def hf_weights(spec: dict, seed: int) -> dict:
    """float32 HF-named weights. Matrices ~ N(0, 1/fan_in) scaled so each residual branch adds
    O(1) signal; norm weights near 1 so no layer is degenerate."""
    rng = np.random.default_rng(seed)
    h, d, f = spec["hidden"], spec["head_dim"], spec["ffn"]
    nq, nkv = spec["heads"] * d, spec["kv_heads"] * d

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": (0.25 * rng.standard_normal((VOCAB, h))).astype(np.float32)}
    for i in range(spec["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(nq, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = mat(nkv, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = mat(nkv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq)
        if spec["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
    w["model.norm.weight"] = norm(h)
    if not spec["tied"]:
        w["lm_head.weight"] = mat(VOCAB, h, 2.0)
    return w


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB}")
    return tok


def tokenizer_tables(tok) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as 'a b' strings) of a BPE tokenizer."""
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


# ---------------------------------------------------------------------------------------------
# HF directory


def _write_safetensors_bf16(path: pathlib.Path, tensors: dict) -> None:
    """safetensors has no numpy bfloat16, so BF16 files are written by hand: 8-byte header
    length, JSON header (padded to 8 bytes), then the raw little-endian data."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        blob = to_bf16_bits(value).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for blob in blobs:
            out.write(blob)


def write_hf(directory, spec: dict, weights: dict) -> pathlib.Path:
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM" if spec["model_type"] == "qwen3" else "LlamaForCausalLM"],
        "model_type": spec["model_type"], "vocab_size": VOCAB, "hidden_size": spec["hidden"],
        "intermediate_size": spec["ffn"], "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"], "hidden_act": "silu", "rms_norm_eps": RMS_EPS,
        "rope_theta": spec["rope_theta"], "rope_scaling": spec["rope_scaling"],
        "max_position_embeddings": spec["max_pos"], "tie_word_embeddings": spec["tied"],
        "bos_token_id": 1, "eos_token_id": 0, "torch_dtype": {"F32": "float32", "F16": "float16",
                                                             "BF16": "bfloat16"}[spec["dtype"]],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))

    names = list(weights)
    n_shards = spec["shards"]
    groups = [names[i::n_shards] for i in range(n_shards)]
    files = (["model.safetensors"] if n_shards == 1 else
             [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)])
    weight_map = {}
    for file, group in zip(files, groups):
        part = {n: weights[n] for n in group}
        if spec["dtype"] == "BF16":
            _write_safetensors_bf16(directory / file, part)
        else:
            kind = np.float16 if spec["dtype"] == "F16" else np.float32
            save_file({n: np.ascontiguousarray(v, dtype=kind) for n, v in part.items()},
                      str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    if n_shards > 1:
        total = sum(weights[n].size for n in names) * {"F32": 4, "F16": 2, "BF16": 2}[spec["dtype"]]
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    tok = make_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[0],
         "add_bos_token": False, "model_max_length": spec["max_pos"]}, indent=2))
    return directory


# ---------------------------------------------------------------------------------------------
# GGUF twin


def permute_for_gguf_llama(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's rows from HF's [first half | second half] to
    interleaved pairs, so that its adjacent-pair (NORM) RoPE equals HF's rotate_half RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def round_like_gguf(weights: dict) -> dict:
    """The values the GGUF twin stores: 2-D matrices in F16, norms and embeddings in F32."""
    return {n: (v.astype(np.float16).astype(np.float32) if v.ndim == 2 and "embed_tokens" not in n
                else v) for n, v in weights.items()}


def write_gguf_twin(path, spec: dict, weights: dict) -> pathlib.Path:
    """GGUF (`llama` or `qwen3` arch) holding the same weights as an HF twin: matrices as F16,
    the embedding table and norms as F32. Q/K rows are permuted for `llama` only, as
    llama.cpp's converter does."""
    import gguf

    arch = spec["model_type"]
    path = pathlib.Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-twin")
    writer.add_block_count(spec["layers"])
    writer.add_context_length(spec["max_pos"])
    writer.add_embedding_length(spec["hidden"])
    writer.add_feed_forward_length(spec["ffn"])
    writer.add_head_count(spec["heads"])
    writer.add_head_count_kv(spec["kv_heads"])
    writer.add_key_length(spec["head_dim"])
    writer.add_value_length(spec["head_dim"])
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(spec["rope_theta"])
    writer.add_rope_dimension_count(spec["head_dim"])
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens, merges = tokenizer_tables(make_tokenizer())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)

    def put(name, value):
        if value.ndim == 2 and name != "token_embd.weight":
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float16))
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(spec["layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        wq = weights[p + "self_attn.q_proj.weight"]
        wk = weights[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            wq = permute_for_gguf_llama(wq, spec["heads"])
            wk = permute_for_gguf_llama(wk, spec["kv_heads"])
        put(b + "attn_norm.weight", weights[p + "input_layernorm.weight"])
        put(b + "attn_q.weight", wq)
        put(b + "attn_k.weight", wk)
        put(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        if arch == "qwen3":
            put(b + "attn_q_norm.weight", weights[p + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", weights[p + "self_attn.k_norm.weight"])
        put(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    if not spec["tied"]:
        put("output.weight", weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------


def write_all(root) -> dict:
    """Writes every tiny model under root; returns name -> path (HF dirs and .gguf files).
    GGUF twins are named '<hf name>.gguf' and hold the same values as their HF twin."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for seed, (name, spec) in enumerate(SPECS.items()):
        weights = hf_weights(spec, seed=1000 + seed)
        twin = name.endswith("_twin")
        if twin:
            weights = round_like_gguf(weights)
        paths[name] = write_hf(root / name, spec, weights)
        if twin:
            paths[name + ".gguf"] = write_gguf_twin(root / f"{name}.gguf", spec, weights)
    return paths
