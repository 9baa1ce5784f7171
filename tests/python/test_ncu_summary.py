"""bench/gpu/ncu_summary.py, which tables an ncu per-kernel summary of a benchmark's timed steps.

Reference: per-step times computed here by hand from the rows the test writes, in the CSV layout
ncu --print-summary per-kernel --csv prints (header copied from a real run, session 26 call 5).
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "ncu_summary.py"
HEADER = ('"Process ID","Process Name","Host Name","Kernel Name","Block Size","Grid Size","Device","CC",'
          '"Invocations","Section Name","Metric Name","Metric Unit","Minimum","Maximum","Average"')


def row(kernel, grid, launches, unit, average):
    return (f'"766","spin_bench_model","127.0.0.1","{kernel}","(256, 1, 1)","{grid}","0","9.0","{launches}",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","1","2","{average}"')


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_per_step_table_sorted_by_time(tmp_path):
    csv = tmp_path / "ncu.csv"
    csv.write_text("\n".join([
        "## qwen3-14b on 1 x NVIDIA H200 (the benchmark's own output comes first)",
        "| 8 | 32768 | 70.4 | 0.8 | 10290.58 | 0.971 |",
        HEADER,
        row("small_kernel", "(8, 1, 1)", 160, "ns", "4,690.00"),
        row("gemm_kernel", "(4, 23, 1)", 160, "us", "85.98"),
        row("lm_head", "(2, 66, 1)", 4, "ms", "0.35"),
    ]) + "\n")
    out = run("--steps", "4", str(csv))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| ms/step")]
    # 160 x 85.98 us / 4 steps = 3.439 ms; 4 x 350 us / 4 = 0.350; 160 x 4.69 us / 4 = 0.188.
    assert [line.split("|")[4].strip() for line in rows] == ["gemm_kernel", "lm_head", "small_kernel"]
    table = {line.split("|")[4].strip(): line for line in rows}
    assert table["gemm_kernel"].startswith("| 3.439 | 40 | 85.98 |")
    assert table["lm_head"].startswith("| 0.350 | 1 | 350.00 |")
    assert table["small_kernel"].startswith("| 0.188 | 40 | 4.69 |")
    assert "3.977 ms per step over 4 steps" in out.stdout


def test_errors_are_reported(tmp_path):
    no_table = tmp_path / "none.csv"
    no_table.write_text("error: CUDA out of memory\n")
    bad_unit = tmp_path / "unit.csv"
    bad_unit.write_text(HEADER + "\n" + row("k", "(1, 1, 1)", 1, "cycle", "5") + "\n")
    out = run("--steps", "1", str(no_table), str(bad_unit), str(tmp_path / "missing.csv"))
    assert out.returncode == 1
    assert "no ncu per-kernel summary" in out.stderr
    assert "unknown time unit 'cycle'" in out.stderr
    assert "missing.csv" in out.stderr
    assert run("--steps", "0", str(no_table)).returncode == 2
