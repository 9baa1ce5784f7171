"""`spin eval` on a small configuration (512-token prompts, 4 steps): the JSON is well formed,
dense against itself and any algorithm at a full budget agree exactly, budgets are respected, the
selection trace parses with an independent reader and matches the run's shape, and the locality
replay obeys the properties of stack algorithms (hit rate never drops with a bigger buffer,
Belady never below LRU)."""
import json
import struct
import subprocess

import numpy as np
import pytest

CONTEXT = 512
STEPS = 4
N_LAYERS, N_KV_HEADS, GROUP = 30, 3, 3  # SmolLM2-135M


def run(spin_bin, *args, check=True):
    proc = subprocess.run([str(spin_bin), *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def read_trace(path):
    """The SPINTRC1 format, read independently of spin's reader."""
    data = path.read_bytes()
    assert data[:8] == b"SPINTRC1"
    page_size, _zero, n_records, n_pages = struct.unpack_from("<IIQQ", data, 8)
    records = np.frombuffer(data, dtype=np.dtype([("step", "<u8"), ("request", "<u4"),
                                                  ("layer", "<u4"), ("head", "<u4"),
                                                  ("count", "<u4")]),
                            count=n_records, offset=32)
    pages = np.frombuffer(data, dtype="<u4", count=n_pages, offset=32 + 24 * n_records)
    assert 32 + 24 * n_records + 4 * n_pages == len(data)
    assert records["count"].sum() == n_pages
    return page_size, records, pages


@pytest.fixture(scope="module")
def small_eval(spin_bin, test_model, test_tmp):
    out = test_tmp / "eval_small"
    trace = out / "trace.bin"
    out.mkdir(parents=True, exist_ok=True)
    run(spin_bin, "eval", "--model", test_model, "--algorithms", "dense,quest",
        "--budgets", "1/8,1", "--context", CONTEXT, "--steps", STEPS, "--depths", "0.5",
        "--documents", "1", "--threads", "2", "--out", out, "--trace", trace)
    return out, trace, json.loads((out / "fidelity.json").read_text())


def test_report_is_well_formed_and_exact_where_it_must_be(small_eval):
    out, _trace, report = small_eval
    assert report["context"] == CONTEXT and report["steps"] == STEPS
    assert [p["kind"] for p in report["prompts"]] == ["needle", "document"]
    assert all(p["tokens"] == CONTEXT for p in report["prompts"])
    results = report["results"]
    assert len(results) == 2 * 2 * 2  # prompts x algorithms x budgets
    for r in results:
        assert 0.0 <= r["top1_agreement"] <= 1.0
        assert r["kl_mean"] >= 0.0 and r["kl_max"] >= r["kl_mean"] - 1e-12
        assert r["attn_rel_err_mean"] >= 0.0
        exact = r["algorithm"] == "dense" or r["budget"] == "1"
        if exact:
            # dense vs dense, and any algorithm whose budget covers the context.
            assert r["top1_agreement"] == 1.0, r
            assert r["kl_mean"] < 1e-6, r
            assert r["attn_rel_err_mean"] < 1e-5, r
        if r["algorithm"] == "quest" and r["budget"] == "1/8":
            # 1/8 of the context, in whole 16-token pages, per KV head of the 28 sparse layers.
            assert r["selected_tokens_per_head"] <= (CONTEXT + STEPS) / 8
            assert r["selected_tokens_per_head"] >= 16 * 3  # Quest's minimum of 3 pages
        if r["kind"] == "needle":
            assert isinstance(r["needle_correct"], bool)
    needle = report["prompts"][0]
    assert needle["dense_correct"] == (needle["key"] in needle["dense_answer"])
    summary = {(s["algorithm"], s["budget"]): s for s in report["summary"]}
    assert set(summary) == {("dense", "1/8"), ("dense", "1"), ("quest", "1/8"), ("quest", "1")}
    assert summary[("dense", "1/8")]["needle_accuracy"] == float(needle["dense_correct"])
    md = (out / "fidelity.md").read_text()
    assert md.count("\n| quest |") == 2 and md.count("\n| dense |") == 2


def test_trace_matches_the_run(small_eval, test_tmp):
    _out, trace, _report = small_eval
    page_size, records, pages = read_trace(trace)
    requests = json.loads(trace.with_name(trace.name + ".json").read_text())
    assert len(requests) == 8 and page_size == 16
    for req in requests:
        mine = records[records["request"] == req["request"]]
        # dense selects in every layer; quest's first 2 layers are dense (no Select).
        layers = N_LAYERS if req["algorithm"] == "dense" else N_LAYERS - 2
        assert len(mine) == STEPS * layers * N_KV_HEADS, req
        assert len(np.unique(mine["step"])) == STEPS
        if req["algorithm"] == "quest" and req["budget"] == "1/8":
            assert mine["count"].max() <= (CONTEXT + STEPS) // 8 // 16
    # Selected pages are candidates: never the sink page 0, never past the prompt's pages.
    assert pages.min() >= 1 and pages.max() < (CONTEXT + STEPS) // 16


def test_locality_replay(spin_bin, small_eval, test_tmp):
    _out, trace, _report = small_eval
    out = test_tmp / "eval_locality"
    run(spin_bin, "eval", "--locality", trace, "--out", out)
    rows = json.loads((out / "locality.json").read_text())
    by_key = {}
    for row in rows:
        rates = row["hit_rate"]
        assert row["buffer_multiples"] == list(range(9))
        assert len(rates) == 9 and all(0.0 <= x <= 1.0 for x in rates)
        # LRU and MIN are stack algorithms: a bigger buffer never loses a hit.
        if row["policy"] in ("exact-lru", "belady"):
            assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:])), row
        by_key[(row["algorithm"], row["budget"], row["policy"])] = rates
    for (alg, budget, policy), rates in by_key.items():
        if policy == "belady":
            for other in ("exact-lru", "bucketed-lru"):
                assert all(b >= o - 1e-12 for b, o in zip(rates, by_key[(alg, budget, other)]))
    # Dense selects every page every step: after the first step everything hits.
    dense = by_key[("dense", "1/8", "belady")]
    assert dense[1] > 0.5


@pytest.mark.parametrize("args, message", [
    (["--budgets", "2/1"], "outside (0, 1]"),
    (["--budgets", "x"], "is not a fraction"),
    (["--algorithms", "nope"], "unknown algorithm 'nope'"),
    (["--depths", "1.5"], "--depths"),
    (["--budgets", "1/8,1/4,0.125"], "--budgets: '0.125' repeats '1/8'"),
    (["--algorithms", "quest,dense,quest"], "--algorithms: 'quest' is given twice"),
    (["--documents", "-1"], "--documents must be >= 0"),
    (["--depths", "", "--documents", "0"], "nothing to evaluate"),
])
def test_bad_flags(spin_bin, test_model, test_tmp, args, message):
    proc = run(spin_bin, "eval", "--model", test_model, "--context", CONTEXT, "--out",
               test_tmp / "eval_bad", *args, check=False)
    assert proc.returncode == 1
    assert message in proc.stderr


def test_locality_rejects_a_bad_trace(spin_bin, test_tmp):
    bad = test_tmp / "eval_bad_trace.bin"
    bad.write_bytes(b"SPINTRC1" + b"\0" * 10)
    proc = run(spin_bin, "eval", "--locality", bad, "--out", test_tmp / "eval_bad", check=False)
    assert proc.returncode == 1 and "not a spin selection trace" in proc.stderr


def test_seer_trained_gate(spin_bin, test_model, test_tmp):
    """`--seer-gate`: the report names the gate; a full budget stays exact; at 1/8 the trained gate
    (random weights of SmolLM2's shape: 30 layers, 3 KV heads of 3 query heads, head_dim 64)
    chooses otherwise than the training-free one; a gate of another shape is refused."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(3)

    def write_gate(path, head_dim):
        save_file({f"layers.{l}.seer.{name}": rng.normal(0, rows ** -0.5, (N_KV_HEADS, rows, head_dim)).astype(np.float32)
                   for l in range(N_LAYERS)
                   for name, rows in (("k_gate", 3 * head_dim), ("q_gate", GROUP * head_dim))},
                  str(path))
        return path

    gate = write_gate(test_tmp / "eval_seer_gate.safetensors", 64)
    reports = {}
    for name, extra in (("trained", ["--seer-gate", gate]), ("training-free", [])):
        out = test_tmp / f"eval_seer_{name}"
        run(spin_bin, "eval", "--model", test_model, "--algorithms", "seer", "--budgets", "1/8,1", "--context",
            CONTEXT, "--steps", STEPS, "--depths", "0.5", "--documents", "0", "--threads", "2", "--out", out, *extra)
        reports[name] = json.loads((out / "fidelity.json").read_text())
    assert reports["trained"]["seer_gate"] == str(gate)
    assert reports["training-free"]["seer_gate"] == "training-free"
    for r in reports["trained"]["results"]:
        if r["budget"] == "1":
            assert r["top1_agreement"] == 1.0 and r["attn_rel_err_mean"] < 1e-5, r
    errors = {name: [r["attn_rel_err_mean"] for r in report["results"] if r["budget"] == "1/8"]
              for name, report in reports.items()}
    assert errors["trained"] != errors["training-free"]

    proc = run(spin_bin, "eval", "--model", test_model, "--algorithms", "seer", "--context", CONTEXT, "--out",
               test_tmp / "eval_bad", "--seer-gate", write_gate(test_tmp / "eval_bad_gate.safetensors", 32),
               check=False)
    assert proc.returncode == 1 and "layers.0.seer.k_gate" in proc.stderr, proc.stderr[-500:]
