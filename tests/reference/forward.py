"""Independent numpy reference forward pass for Llama-family decoders (Llama, SmolLM2, Qwen3).

It shares no code with spin: weights come through the `gguf` package (GGUFReader +
gguf.quants.dequantize) or `safetensors`, and the math follows the published model definitions
(HF transformers' Llama/Qwen3 modules and rope-scaling rules; llama.cpp's GGUF conventions).

Precision: every weight is dequantized/converted to float64 and all arithmetic (matmuls, norms,
RoPE, softmax) runs in float64, so this reference is ~1e-12 accurate relative to exact math on
the stored weights. SmolLM2-135M in float64 takes ~1.1 GB of memory and a 32-token prefill
takes well under a second.

Conventions that matter for agreement with other implementations:
- RoPE "neox" (HF rotate_half): dims i and i + rot/2 of a head form a rotation pair. Used for
  HF checkpoints and GGUF qwen2/qwen3.
- RoPE "adjacent" (llama.cpp's NORM mode): dims 2i and 2i+1 form a pair. GGUF `llama` files need
  it because llama.cpp's converter permutes the rows of Q and K per head with
  reshape(heads, 2, hd/2, in).swapaxes(1, 2): HF row j*(hd/2)+i lands at GGUF row 2i+j, which
  turns HF's (i, i+hd/2) pairs into adjacent pairs (K uses the KV head count).
- YaRN's attention factor multiplies cos and sin, so it scales both q and k and the
  attention logits grow by its square (as in HF transformers).
"""
from __future__ import annotations

import json
import math
import pathlib
import struct
from dataclasses import dataclass, field

import numpy as np

# ---------------------------------------------------------------------------------------------
# Configuration and RoPE frequencies


@dataclass
class Config:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rope_dim: int                   # rotated dims per head (<= head_dim)
    rope_style: str                 # "neox" or "adjacent"
    rope_scaling: dict = field(default_factory=dict)  # HF-style dict; {} means none
    qk_norm: bool = False
    max_position_embeddings: int = 0


def base_inv_freq(theta: float, rope_dim: int) -> np.ndarray:
    """theta^(-2i/rope_dim) for i in [0, rope_dim/2)."""
    return 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: Config) -> tuple[np.ndarray, float]:
    """(inv_freq [rope_dim/2], attention factor applied to cos and sin), following HF
    transformers' ROPE_INIT_FUNCTIONS for default, linear, llama3 and yarn."""
    inv_freq = base_inv_freq(cfg.rope_theta, cfg.rope_dim)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_ff = float(scaling["low_freq_factor"])
        high_ff = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2.0 * math.pi / inv_freq
        low_freq_wavelen = old_ctx / low_ff
        high_freq_wavelen = old_ctx / high_ff
        # Long wavelengths are interpolated fully, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1.0 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            else:
                attention_factor = yarn_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32.0
        beta_slow = scaling.get("beta_slow") or 1.0
        dim = cfg.rope_dim

        def correction_dim(rotations: float) -> float:
            # The dim index whose wavelength fits `rotations` times into the original context.
            return dim * math.log(original / (rotations * 2.0 * math.pi)) / (2.0 * math.log(cfg.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # 1: keep original (extrapolate), 0: interpolate by factor
        return inv_freq / factor * (1.0 - keep) + inv_freq * keep, float(attention_factor)
    raise ValueError(f"reference: unsupported rope scaling {kind!r}")


# ---------------------------------------------------------------------------------------------
# Building blocks (float64)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * weight / sqrt(mean(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attn_factor: float,
               style: str) -> np.ndarray:
    """Rotates x [T, heads, head_dim] at integer positions [T]; only the first 2*len(inv_freq)
    dims of each head rotate, the rest pass through."""
    rot = 2 * inv_freq.size
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]   # [T, rot/2]
    cos = (np.cos(angles) * attn_factor)[:, None, :]
    sin = (np.sin(angles) * attn_factor)[:, None, :]
    out = x.copy()
    if style == "neox":
        a, b = x[..., : rot // 2], x[..., rot // 2: rot]
        out[..., : rot // 2] = a * cos - b * sin
        out[..., rot // 2: rot] = b * cos + a * sin
    elif style == "adjacent":
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * cos - b * sin
        out[..., 1:rot:2] = b * cos + a * sin
    else:
        raise ValueError(f"reference: unknown rope style {style!r}")
    return out


def causal_gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_start: int) -> np.ndarray:
    """q [T, H, D] for absolute positions q_start..q_start+T-1; k, v [S, KV, D] for positions
    0..S-1. Query head h reads KV head h // (H / KV) (HF repeat_kv order). Returns [T, H, D]."""
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    k_full = np.repeat(k, group, axis=1)                    # [S, H, D]
    v_full = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k_full) / math.sqrt(head_dim)
    q_pos = q_start + np.arange(n_tokens)
    future = np.arange(k.shape[0])[None, :] > q_pos[:, None]  # [T, S]
    scores = np.where(future[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v_full)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------------------------------------
# Model and forward pass


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray      # [H*D, hidden]
    wk: np.ndarray      # [KV*D, hidden]
    wv: np.ndarray      # [KV*D, hidden]
    wo: np.ndarray      # [hidden, H*D]
    ffn_norm: np.ndarray
    w_gate: np.ndarray  # [ffn, hidden]
    w_up: np.ndarray    # [ffn, hidden]
    w_down: np.ndarray  # [hidden, ffn]
    q_norm: np.ndarray | None = None   # [D] (Qwen3)
    k_norm: np.ndarray | None = None


@dataclass
class Model:
    cfg: Config
    embed: np.ndarray       # [vocab, hidden]
    output: np.ndarray      # [vocab, hidden]; the same array as embed when tied
    final_norm: np.ndarray
    layers: list
    inv_freq: np.ndarray = None
    attn_factor: float = 1.0

    def __post_init__(self):
        if self.inv_freq is None:
            self.inv_freq, self.attn_factor = rope_parameters(self.cfg)


class Session:
    """Holds the KV cache of one sequence; forward() appends tokens and returns their logits."""

    def __init__(self, model: Model):
        self.model = model
        cfg = model.cfg
        empty = np.zeros((0, cfg.n_kv_heads, cfg.head_dim))
        self.keys = [empty] * cfg.n_layers
        self.values = [empty] * cfg.n_layers
        self.n_past = 0

    def forward(self, token_ids) -> np.ndarray:
        m, cfg = self.model, self.model.cfg
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab:
            raise ValueError("reference: token ids must be a non-empty list within the vocabulary")
        n = ids.size
        positions = self.n_past + np.arange(n)
        x = m.embed[ids].astype(np.float64)
        for li, layer in enumerate(m.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            q = (h @ layer.wq.T).reshape(n, cfg.n_heads, cfg.head_dim)
            k = (h @ layer.wk.T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
            v = (h @ layer.wv.T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, layer.q_norm, cfg.rms_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_eps)
            q = apply_rope(q, positions, m.inv_freq, m.attn_factor, cfg.rope_style)
            k = apply_rope(k, positions, m.inv_freq, m.attn_factor, cfg.rope_style)
            self.keys[li] = np.concatenate([self.keys[li], k])
            self.values[li] = np.concatenate([self.values[li], v])
            attn = causal_gqa_attention(q, self.keys[li], self.values[li], self.n_past)
            x = x + attn.reshape(n, cfg.n_heads * cfg.head_dim) @ layer.wo.T
            h = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
            x = x + (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
        self.n_past += n
        return rms_norm(x, m.final_norm, cfg.rms_eps) @ m.output.T


def logits(model: Model, token_ids) -> np.ndarray:
    """float64 logits [n_tokens, vocab] of every position of one sequence."""
    return Session(model).forward(token_ids)


def greedy(model: Model, prompt_ids, n: int) -> list[int]:
    """n greedily decoded token ids (argmax, first index on ties), no stop tokens."""
    session = Session(model)
    last = session.forward(prompt_ids)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(last)))
        if len(out) < n:
            last = session.forward([out[-1]])[-1]
    return out


# ---------------------------------------------------------------------------------------------
# GGUF loader (gguf package)

NEOX_GGUF_ARCHS = {"qwen2", "qwen3"}
QK_NORM_GGUF_ARCHS = {"qwen3"}


def _gguf_scalar(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"reference: GGUF key {key} missing")
        return default
    return f.contents()


def load_gguf(path, reader=None) -> Model:
    """reader: an already open gguf.GGUFReader of path, to save parsing the file twice."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    arch = _gguf_scalar(reader, "general.architecture")
    if arch not in {"llama", "qwen2", "qwen3"}:
        raise ValueError(f"reference: unsupported GGUF architecture {arch}")
    tensors = {}
    for t in reader.tensors:
        tensors[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)

    def key(name, default=None):
        return _gguf_scalar(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    scaling = {}
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                   "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
    elif scaling_type != "none":
        raise ValueError(f"reference: unsupported GGUF rope scaling {scaling_type}")
    cfg = Config(
        n_layers=int(key("block_count")), hidden=hidden, n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        vocab=tensors["token_embd.weight"].shape[0],
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_style="neox" if arch in NEOX_GGUF_ARCHS else "adjacent",
        rope_scaling=scaling, qk_norm=arch in QK_NORM_GGUF_ARCHS,
        max_position_embeddings=int(key("context_length", 0)))
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(Layer(
            attn_norm=tensors[p + "attn_norm.weight"], wq=tensors[p + "attn_q.weight"],
            wk=tensors[p + "attn_k.weight"], wv=tensors[p + "attn_v.weight"],
            wo=tensors[p + "attn_output.weight"], ffn_norm=tensors[p + "ffn_norm.weight"],
            w_gate=tensors[p + "ffn_gate.weight"], w_up=tensors[p + "ffn_up.weight"],
            w_down=tensors[p + "ffn_down.weight"],
            q_norm=tensors.get(p + "attn_q_norm.weight"), k_norm=tensors.get(p + "attn_k_norm.weight")))
    embed = tensors["token_embd.weight"]
    model = Model(cfg=cfg, embed=embed, output=tensors.get("output.weight", embed),
                  final_norm=tensors["output_norm.weight"], layers=layers)
    # llama.cpp stores Llama-3 rope scaling as per-frequency divisors of the angle.
    if "rope_freqs.weight" in tensors:
        model.inv_freq = model.inv_freq / tensors["rope_freqs.weight"].reshape(-1)
    return model


# ---------------------------------------------------------------------------------------------
# HF directory loader (config.json + safetensors, optionally sharded)


def _read_safetensors(path: pathlib.Path) -> dict:
    """float64 tensors of one .safetensors file. numpy has no bfloat16, so BF16 tensors are
    decoded here from the raw little-endian bytes (upper 16 bits of a float32)."""
    from safetensors.numpy import load_file

    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8: 8 + header_len])
    if not any(isinstance(v, dict) and v.get("dtype") == "BF16" for v in header.values()):
        return {k: v.astype(np.float64) for k, v in load_file(str(path)).items()}
    data = memoryview(raw)[8 + header_len:]
    kinds = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(kinds[info["dtype"]]).newbyteorder("<"))
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def load_hf(directory) -> Model:
    directory = pathlib.Path(directory)
    conf = json.loads((directory / "config.json").read_text())
    model_type = conf.get("model_type", "llama")
    if model_type not in {"llama", "qwen3", "mistral"}:
        raise ValueError(f"reference: unsupported HF model_type {model_type}")
    index = directory / "model.safetensors.index.json"
    tensors = {}
    if index.exists():
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(_read_safetensors(directory / shard))
    else:
        tensors = _read_safetensors(directory / "model.safetensors")
    hidden, n_heads = conf["hidden_size"], conf["num_attention_heads"]
    head_dim = conf.get("head_dim") or hidden // n_heads
    cfg = Config(
        n_layers=conf["num_hidden_layers"], hidden=hidden, n_heads=n_heads,
        n_kv_heads=conf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        vocab=conf["vocab_size"], rms_eps=conf.get("rms_norm_eps", 1e-6),
        rope_theta=conf.get("rope_theta", 10000.0),
        rope_dim=int(head_dim * conf.get("partial_rotary_factor", 1.0)), rope_style="neox",
        rope_scaling=conf.get("rope_scaling") or {}, qk_norm=model_type == "qwen3",
        max_position_embeddings=conf.get("max_position_embeddings", 0))
    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layers.append(Layer(
            attn_norm=tensors[p + "input_layernorm.weight"], wq=tensors[p + "self_attn.q_proj.weight"],
            wk=tensors[p + "self_attn.k_proj.weight"], wv=tensors[p + "self_attn.v_proj.weight"],
            wo=tensors[p + "self_attn.o_proj.weight"], ffn_norm=tensors[p + "post_attention_layernorm.weight"],
            w_gate=tensors[p + "mlp.gate_proj.weight"], w_up=tensors[p + "mlp.up_proj.weight"],
            w_down=tensors[p + "mlp.down_proj.weight"],
            q_norm=tensors.get(p + "self_attn.q_norm.weight"), k_norm=tensors.get(p + "self_attn.k_norm.weight")))
    embed = tensors["model.embed_tokens.weight"]
    tied = conf.get("tie_word_embeddings", False) or "lm_head.weight" not in tensors
    return Model(cfg=cfg, embed=embed, output=embed if tied else tensors["lm_head.weight"],
                 final_norm=tensors["model.norm.weight"], layers=layers)


def load(path) -> Model:
    """A GGUF file or an HF model directory."""
    path = pathlib.Path(path)
    return load_hf(path) if path.is_dir() else load_gguf(path)
