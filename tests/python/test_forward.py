"""spin's forward pass against the independent numpy reference (tests/reference/forward.py).

1. The reference itself: its building blocks against naive second formulations, its KV cache
   against recomputation, GGUF/HF twins against each other, and SmolLM2 answering "Paris".
2. Logits of every prompt position from `spin generate -n 0 --logits-out` on SmolLM2 (Q4_1
   GGUF) and on tiny random HF/GGUF models: relative error <= 1e-4 per position, same argmax.
3. Chunked prefill gives the same logits as one chunk.
4. Greedy continuations (32 ids) equal the reference's, from ids and from a text prompt.
"""
import json
import math

import numpy as np
import pytest

import tiny_models
from reference import forward as ref

LOGITS_REL_TOL = 1e-4       # spin computes in fp32, the reference in fp64
CHUNKED_REL_TOL = 1e-5      # same engine, different prefill chunking
GREEDY_TOKENS = 32

# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def smollm_reader(test_model):
    import gguf

    return gguf.GGUFReader(str(test_model))


@pytest.fixture(scope="module")
def smollm(test_model, smollm_reader):
    return ref.load_gguf(test_model, smollm_reader)


@pytest.fixture(scope="module")
def smollm_vocab(smollm_reader):
    return smollm_reader.fields["tokenizer.ggml.tokens"].contents()


@pytest.fixture(scope="module")
def tiny_paths(test_tmp):
    return tiny_models.write_all(test_tmp / "forward_tiny_models")


@pytest.fixture(scope="module")
def tiny_refs(tiny_paths):
    return {name: ref.load(path) for name, path in tiny_paths.items()}


def byte_decoder() -> dict:
    """Inverse of the GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves,
    the other 68 bytes map to code points 256, 257, ... in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_DECODER = byte_decoder()


def detokenize(vocab, ids) -> str:
    return bytes(BYTE_DECODER[c] for i in ids for c in vocab[i]).decode("utf-8", errors="replace")


def ids_arg(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


@pytest.fixture(scope="module")
def spin_logits(run_spin, test_tmp):
    """spin_logits(model, ids, *extra_flags) -> float32 logits [n_ids, vocab] of every prompt
    position; memoized so tests that compare the same run do not pay for it twice."""
    cache = {}

    def get(model, ids, *extra):
        key = (str(model), tuple(int(i) for i in ids), tuple(map(str, extra)))
        if key not in cache:
            out = test_tmp / f"forward_logits_{len(cache)}.npy"
            out.unlink(missing_ok=True)
            run_spin("generate", "--model", model, "--prompt-ids", ids_arg(ids), "-n", "0",
                     "--logits-out", out, *extra)
            assert out.is_file(), "spin generate --logits-out wrote no file"
            logits = np.load(out)
            assert logits.dtype == np.float32, f"--logits-out dtype {logits.dtype}, want float32"
            cache[key] = logits
        return cache[key]

    return get


def spin_greedy(run_spin, tmp, model, *prompt_args) -> dict:
    out = tmp / "forward_ids.json"
    out.unlink(missing_ok=True)
    run_spin("generate", "--model", model, *prompt_args, "-n", GREEDY_TOKENS, "--temperature", "0",
             "--ignore-eos", "--ids-out", out)
    assert out.is_file(), "spin generate --ids-out wrote no file"
    return json.loads(out.read_text())


def assert_logits_close(got: np.ndarray, want: np.ndarray, tol: float = LOGITS_REL_TOL):
    assert got.shape == want.shape, f"logits shape {got.shape}, want {want.shape}"
    assert np.all(np.isfinite(got)), "non-finite logits"
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    worst = int(rel.argmax())
    assert rel[worst] <= tol, (f"relative error {rel[worst]:.3g} at position {worst} (tolerance "
                               f"{tol}); per position: {np.array2string(rel, precision=2)}")
    bad = np.nonzero(got.argmax(axis=1) != want.argmax(axis=1))[0]
    assert bad.size == 0, (f"argmax differs at positions {bad.tolist()}: spin "
                           f"{got.argmax(1)[bad].tolist()} vs reference {want.argmax(1)[bad].tolist()}")


def assert_well_conditioned(reference_logits: np.ndarray):
    """The argmax comparison is meaningful only if the reference's top two logits are apart by
    far more than fp32 noise; a fixed prompt that violated this would make a flaky test."""
    top2 = np.sort(reference_logits, axis=1)[:, -2:]
    gap = (top2[:, 1] - top2[:, 0]) / reference_logits.std(axis=1)
    assert gap.min() > 1e-4, f"prompt has a near-tie at position {int(gap.argmin())}; pick another"


# Prompts for SmolLM2 (vocab 49152): one starting with BOS (id 1), one of fixed pseudo-random
# ids, and one from real text through `spin tokenize`.
SMOLLM_BOS_PROMPT = [1, 504, 3575, 282, 4649, 314, 253, 1345, 2156, 28, 357, 3575, 282, 7221, 314]
SMOLLM_RANDOM_PROMPT = [int(i) for i in np.random.default_rng(7).integers(3, 49152, size=24)]
SMOLLM_TEXT = ("Photosynthesis converts light energy into chemical energy, which plants store "
               "as sugar. Most of it happens in the leaves.")
TEXT_PROMPT = "The capital of France is"
TINY_PROMPT = [1, 45, 260, 17, 299, 3, 88, 150, 201, 77, 9, 270, 33, 120, 240, 5, 64, 190, 2, 111,
               280, 14, 99, 160, 6, 250, 31, 8, 222, 71]

# ---------------------------------------------------------------------------------------------
# 1. The reference against second formulations


def test_reference_rms_norm_matches_scalar_loop():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 37)) * 3.0, rng.standard_normal(37)
    got = ref.rms_norm(x, w, 1e-5)
    for r in range(3):
        scale = 1.0 / math.sqrt(sum(v * v for v in x[r]) / 37 + 1e-5)
        want = [x[r, i] * scale * w[i] for i in range(37)]
        np.testing.assert_allclose(got[r], want, rtol=1e-13)


@pytest.mark.parametrize("style", ["neox", "adjacent"])
def test_reference_rope_matches_complex_rotation(style):
    rng = np.random.default_rng(1)
    n_tok, heads, head_dim, rot = 5, 3, 12, 8            # last 4 dims are not rotated
    x = rng.standard_normal((n_tok, heads, head_dim))
    positions = np.array([0, 1, 7, 100, 4095])
    inv_freq = rng.uniform(0.01, 1.0, rot // 2)
    got = ref.apply_rope(x, positions, inv_freq, 1.3, style)
    for t in range(n_tok):
        for h in range(heads):
            for i in range(rot // 2):
                a, b = (i, i + rot // 2) if style == "neox" else (2 * i, 2 * i + 1)
                z = complex(x[t, h, a], x[t, h, b]) * 1.3 * complex(
                    math.cos(positions[t] * inv_freq[i]), math.sin(positions[t] * inv_freq[i]))
                assert abs(got[t, h, a] - z.real) < 1e-12 and abs(got[t, h, b] - z.imag) < 1e-12
            np.testing.assert_array_equal(got[t, h, rot:], x[t, h, rot:])


def test_reference_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    inv_freq = ref.base_inv_freq(10000.0, 16)

    def score(m, n):
        qm = ref.apply_rope(q, np.array([m]), inv_freq, 1.0, "neox")
        kn = ref.apply_rope(k, np.array([n]), inv_freq, 1.0, "neox")
        return float(np.sum(qm * kn))

    assert abs(score(3, 1) - score(103, 101)) < 1e-10
    assert abs(score(3, 1) - score(4, 1)) > 1e-3


def test_reference_attention_matches_loop():
    rng = np.random.default_rng(3)
    n_past, n_tok, heads, kv_heads, dim = 4, 3, 4, 2, 8
    q = rng.standard_normal((n_tok, heads, dim))
    k = rng.standard_normal((n_past + n_tok, kv_heads, dim))
    v = rng.standard_normal((n_past + n_tok, kv_heads, dim))
    got = ref.causal_gqa_attention(q, k, v, n_past)
    for t in range(n_tok):
        for h in range(heads):
            g = h // (heads // kv_heads)
            visible = range(n_past + t + 1)
            s = [sum(q[t, h, d] * k[j, g, d] for d in range(dim)) / math.sqrt(dim) for j in visible]
            e = [math.exp(val - max(s)) for val in s]
            want = [sum(e[j] * v[j, g, d] for j in visible) / sum(e) for d in range(dim)]
            np.testing.assert_allclose(got[t, h], want, rtol=1e-12, atol=1e-14)


def _cfg(**scaling):
    return ref.Config(n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10,
                      rms_eps=1e-5, rope_theta=10000.0, rope_dim=16, rope_style="neox",
                      rope_scaling=scaling, max_position_embeddings=16384)


def test_reference_rope_scaling_frequencies():
    base = ref.base_inv_freq(10000.0, 16)
    inv, factor = ref.rope_parameters(_cfg(rope_type="linear", factor=2.0))
    np.testing.assert_allclose(inv, base / 2.0, rtol=1e-15)
    assert factor == 1.0

    # Llama 3 (original context 64, low 1, high 4): wavelengths < 16 keep their frequency,
    # > 64 are divided by 8, and those between blend linearly in 64/wavelength.
    inv, factor = ref.rope_parameters(_cfg(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=64))
    for i, f in enumerate(base):
        wavelength = 2 * math.pi / f
        if wavelength < 16:
            want = f
        elif wavelength > 64:
            want = f / 8
        else:
            s = (64 / wavelength - 1) / 3
            want = (1 - s) * f / 8 + s * f
        assert abs(inv[i] - want) <= 1e-15 * f, i
    assert factor == 1.0
    assert inv[0] == base[0] and inv[-1] == base[-1] / 8 and base[1] / 8 < inv[1] < base[1]

    # YaRN, factor 4, original 4096, head dim 32: correction dims floor(5.24)=5, ceil(11.26)=12.
    cfg = _cfg(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)
    cfg.head_dim = cfg.rope_dim = 32
    base32 = ref.base_inv_freq(10000.0, 32)
    inv, factor = ref.rope_parameters(cfg)
    for i, f in enumerate(base32):
        extrapolate = 1.0 - min(1.0, max(0.0, (i - 5) / 7))
        assert abs(inv[i] - (f * extrapolate + f / 4 * (1 - extrapolate))) <= 1e-15 * f, i
    assert abs(factor - (1 + 0.1 * math.log(4.0))) < 1e-15
    np.testing.assert_array_equal(inv[:6], base32[:6])
    np.testing.assert_allclose(inv[12:], base32[12:] / 4, rtol=1e-15)


def test_reference_kv_cache_matches_recompute(tiny_refs):
    model = tiny_refs["qwen3_yarn"]
    whole = ref.logits(model, TINY_PROMPT)
    session = ref.Session(model)
    parts = [session.forward(TINY_PROMPT[a:b]) for a, b in [(0, 7), (7, 8), (8, 20), (20, 30)]]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["llama_twin", "qwen3_twin"])
def test_reference_gguf_twin_matches_hf(tiny_refs, name):
    hf, gg = tiny_refs[name], tiny_refs[name + ".gguf"]
    assert (hf.cfg.rope_style, gg.cfg.rope_style) == (
        "neox", "adjacent" if name.startswith("llama") else "neox")
    want = ref.logits(hf, TINY_PROMPT)
    np.testing.assert_allclose(ref.logits(gg, TINY_PROMPT), want, rtol=1e-10, atol=1e-10)
    if name.startswith("llama"):
        # Non-vacuity: the permuted GGUF rows need the adjacent-pair rotation.
        gg.cfg.rope_style = "neox"
        try:
            wrong = ref.logits(gg, TINY_PROMPT)
        finally:
            gg.cfg.rope_style = "adjacent"
        assert np.linalg.norm(wrong - want) / np.linalg.norm(want) > 1e-2


def test_reference_smollm2_knows_paris(smollm, smollm_reader, smollm_vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ")) for m in smollm_reader.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(smollm_vocab)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids = tok.encode(TEXT_PROMPT).ids
    assert detokenize(smollm_vocab, ids) == TEXT_PROMPT
    text = detokenize(smollm_vocab, ref.greedy(smollm, ids, 8))
    print(f"\nreference SmolLM2: {TEXT_PROMPT!r} -> {text!r}")
    assert "Paris" in text


# ---------------------------------------------------------------------------------------------
# 2. spin logits against the reference


def smollm_text_ids(run_spin, test_model, smollm_vocab):
    proc = run_spin("tokenize", "--model", test_model, "--text", SMOLLM_TEXT, "--json")
    parsed = json.loads(proc.stdout)
    ids = parsed if isinstance(parsed, list) else parsed.get("ids")
    assert isinstance(ids, list) and ids, f"unexpected `spin tokenize --json` output: {proc.stdout[:200]}"
    assert detokenize(smollm_vocab, ids) == SMOLLM_TEXT, "token ids do not spell the text"
    assert 16 <= len(ids) <= 40
    return ids


@pytest.mark.parametrize("prompt", ["bos", "random", "text"])
def test_smollm2_logits_match_reference(prompt, run_spin, spin_logits, test_model, smollm, smollm_vocab):
    ids = {"bos": lambda: SMOLLM_BOS_PROMPT, "random": lambda: SMOLLM_RANDOM_PROMPT,
           "text": lambda: smollm_text_ids(run_spin, test_model, smollm_vocab)}[prompt]()
    want = ref.logits(smollm, ids)
    assert_well_conditioned(want)
    assert_logits_close(spin_logits(test_model, ids), want)


@pytest.mark.parametrize("name", list(tiny_models.SPECS) + [n + ".gguf" for n in tiny_models.SPECS
                                                              if n.endswith("_twin")])
def test_tiny_model_logits_match_reference(name, spin_logits, tiny_paths, tiny_refs):
    want = ref.logits(tiny_refs[name], TINY_PROMPT)
    assert_well_conditioned(want)
    assert_logits_close(spin_logits(tiny_paths[name], TINY_PROMPT), want)


@pytest.mark.parametrize("name", ["llama_twin", "qwen3_twin"])
def test_spin_gguf_twin_matches_hf_twin(name, spin_logits, tiny_paths):
    from_hf = spin_logits(tiny_paths[name], TINY_PROMPT)
    from_gguf = spin_logits(tiny_paths[name + ".gguf"], TINY_PROMPT)
    assert_logits_close(from_gguf, from_hf.astype(np.float64), tol=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. Chunked prefill


def test_chunked_prefill_matches_single_chunk_smollm2(spin_logits, test_model):
    one = spin_logits(test_model, SMOLLM_RANDOM_PROMPT)
    chunked = spin_logits(test_model, SMOLLM_RANDOM_PROMPT, "--prefill-chunk", "5")
    assert_logits_close(chunked, one.astype(np.float64), tol=CHUNKED_REL_TOL)


def test_chunked_prefill_matches_single_chunk_tiny(spin_logits, tiny_paths):
    model = tiny_paths["qwen3_yarn"]
    one = spin_logits(model, TINY_PROMPT)
    chunked = spin_logits(model, TINY_PROMPT, "--prefill-chunk", "5")
    assert_logits_close(chunked, one.astype(np.float64), tol=CHUNKED_REL_TOL)


# ---------------------------------------------------------------------------------------------
# 4. Greedy generation


def assert_same_continuation(result, model, prompt_ids, vocab=None):
    assert result["prompt_ids"] == list(prompt_ids)
    got = result["output_ids"]
    want = ref.greedy(model, prompt_ids, GREEDY_TOKENS)
    if vocab is not None:
        print(f"\nspin:      {detokenize(vocab, got)!r}\nreference: {detokenize(vocab, want)!r}")
    assert len(got) == GREEDY_TOKENS, f"spin produced {len(got)} tokens, want {GREEDY_TOKENS}"
    if got != want:
        step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        logits = ref.logits(model, list(prompt_ids) + want[:step])[-1]
        top2 = np.sort(logits)[-2:]
        pytest.fail(f"greedy ids differ from step {step}: spin {got[step]} vs reference {want[step]} "
                    f"(reference top-2 logit gap there: {top2[1] - top2[0]:.3g})\n"
                    f"spin {got}\nref  {want}")


def test_greedy_smollm2_from_ids(run_spin, test_model, test_tmp, smollm, smollm_vocab):
    result = spin_greedy(run_spin, test_tmp, test_model, "--prompt-ids", ids_arg(SMOLLM_BOS_PROMPT))
    assert_same_continuation(result, smollm, SMOLLM_BOS_PROMPT, smollm_vocab)


def test_greedy_smollm2_from_text(run_spin, test_model, test_tmp, smollm, smollm_vocab):
    result = spin_greedy(run_spin, test_tmp, test_model, "--prompt", TEXT_PROMPT)
    assert detokenize(smollm_vocab, result["prompt_ids"]) == TEXT_PROMPT
    assert_same_continuation(result, smollm, result["prompt_ids"], smollm_vocab)
    assert "Paris" in detokenize(smollm_vocab, result["output_ids"])


def test_greedy_tiny_model(run_spin, test_tmp, tiny_paths, tiny_refs):
    result = spin_greedy(run_spin, test_tmp, tiny_paths["llama_untied_llama3"], "--prompt-ids",
                         ids_arg(TINY_PROMPT[:10]))
    assert_same_continuation(result, tiny_refs["llama_untied_llama3"], TINY_PROMPT[:10])
