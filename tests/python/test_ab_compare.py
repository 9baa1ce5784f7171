"""bench/gpu/ab_compare.py, which summarises scripts/gpu-ab.sh's runs of spin_bench_model.

Reference: medians and ratios computed here by hand from the runs the test writes, in
spin_bench_model's own table format (the header rows are copied from its output).
"""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "bench" / "gpu" / "ab_compare.py")
ab_compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_compare)

SPARSE_DECODE = ("| batch | context | first step ms/seq | decode tok/s | ms/step | cache hit rate | "
                 "retrieved GB/step (GPU 0) | HBM GB/step | bound ms/step | of bound |")
SPARSE_STEPS = ("| batch | context | eager ms/step | index+score ms | select ms | retrieve ms | key rebuild ms | "
                "attention ms | rest ms | hit rate | Belady hit rate | ideal ms/step | measured (graphs) / ideal |")
DENSE_DECODE = "| batch | context | decode tok/s | ms/step | host ms/step | bytes read/step | bound tok/s | of bound |"


def sparse_run(label, tok_s, ideal):
    return "\n".join([
        f"=== {label} round: spin_bench_model ...",
        "## qwen3-14b on 1 x NVIDIA H200 (bf16, CUDA graphs on, tensor parallel 1)",
        "", "| measurement | value |", "|---|---|",
        "| attention | quest, budget 512 tokens per KV head (0: its default) |", "",
        SPARSE_DECODE, "|---|---|---|---|---|---|---|---|---|---|",
        f"| 1 | 32768 | 21.0 | {tok_s} | 10.85 | 0.406 | 0.047 | 28.34 | 7.56 | 70% |", "",
        SPARSE_STEPS, "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| 1 | 32768 | 12.47 | 0.63 | 0.42 | 1.51 | 0.08 | 0.48 | 9.37 | 0.488 | 0.622 | 7.25 | {ideal} |", "",
    ])


def dense_run(label, model, tok_s):
    return "\n".join([
        f"=== {label} round: spin_bench_model ...",
        f"## {model} on 1 x NVIDIA H200 (bf16, CUDA graphs on, tensor parallel 1)", "",
        DENSE_DECODE, "|---|---|---|---|---|---|---|---|",
        f"| 1 | 1024 | {tok_s} | 8.30 | 0.145 | 28.16 GB | 149.8 | 80% |", "",
    ])


def test_medians_per_build_and_row(tmp_path):
    raw = tmp_path / "ab.md"
    runs = []
    for before, after in [(92.5, 96.1), (91.6, 95.2), (92.1, 96.1)]:
        runs += [sparse_run("before", before, 1.49), sparse_run("after", after, 1.44)]
    runs += [dense_run("before", "qwen3-14b", 120.5), dense_run("after", "qwen3-14b", 122.0),
             dense_run("before", "llama-3.1-8b", 174.8), dense_run("after", "llama-3.1-8b", 177.7),
             "=== after round: a run that failed", "error: CUDA out of memory"]
    raw.write_text("\n".join(runs) + "\n")

    labels, rows = ab_compare.parse([str(raw)])
    assert labels == ["before", "after"]
    quest = rows[("qwen3-14b", "quest", 1, 32768)]
    assert quest["before"]["tok/s"] == [92.5, 91.6, 92.1]
    assert quest["after"]["ideal"] == [1.44, 1.44, 1.44]
    # Dense rows of two models stay apart; the failed run adds nothing.
    assert rows[("qwen3-14b", "dense", 1, 1024)]["after"]["tok/s"] == [122.0]
    assert rows[("llama-3.1-8b", "dense", 1, 1024)]["before"]["tok/s"] == [174.8]
    assert len(rows) == 3

    text = ab_compare.table(labels, rows)
    lines = {line.split(" | ")[1] + " " + line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    # median(92.5, 91.6, 92.1) = 92.1, median(96.1, 95.2, 96.1) = 96.1, 96.1 / 92.1 = 1.043
    assert lines["quest qwen3-14b"].endswith("| 92.1 (3) | 1.49 | 96.1 (3) | 1.44 | 1.043 |")
    assert lines["dense llama-3.1-8b"].endswith("| 174.8 (1) | - | 177.7 (1) | - | 1.017 |")


def test_runs_without_labels_take_the_file_name(tmp_path):
    a, b = tmp_path / "old.md", tmp_path / "new.md"
    a.write_text(dense_run("x", "qwen3-14b", 100.0).split("\n", 1)[1])
    b.write_text(dense_run("x", "qwen3-14b", 110.0).split("\n", 1)[1])
    labels, rows = ab_compare.parse([str(a), str(b)])
    assert labels == ["old", "new"]
    assert ab_compare.table(labels, rows).splitlines()[2].endswith("| 100.0 (1) | - | 110.0 (1) | - | 1.100 |")


def test_log_lines_inside_a_table_do_not_end_it(tmp_path):
    # A library logging (spdlog, to stdout) while spin_bench_model prints its decode table.
    run = dense_run("after", "llama-3.1-8b", 174.5).replace(
        DENSE_DECODE + "\n|---|---|---|---|---|---|---|\n",
        DENSE_DECODE + "\n|---|---|---|---|---|---|---|\n"
        "[2026-12-02 06:48:11.941] [debug] cuBLASLt, products of 1..8 rows by [6144 x 4096]^T: candidate 0 of 8\n")
    raw = tmp_path / "ab.md"
    raw.write_text(run + "\n")
    _, rows = ab_compare.parse([str(raw)])
    assert rows[("llama-3.1-8b", "dense", 1, 1024)]["after"]["tok/s"] == [174.5]
