"""bench/gpu/products_compare.py and report.py's product table, over CSVs in the layout
spin_bench_gpu_kernels products writes (bench,config,variant,time_us,bytes,gbps).

Reference: the ratios computed here by hand from the times the test writes.
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPARE = ROOT / "bench" / "gpu" / "products_compare.py"
REPORT = ROOT / "bench" / "gpu" / "report.py"
HEADER = "bench,config,variant,time_us,bytes,gbps"


def csv_text(gemv_variant, rows):
    lines = [HEADER]
    for config, gemv_us, cublas_us in rows:
        if gemv_us is not None:
            lines.append(f"product,{config},{gemv_variant},{gemv_us},1000000,{1e6 / gemv_us / 1e3:.2f}")
        lines.append(f"product,{config},cublasLt,{cublas_us},1000000,{1e6 / cublas_us / 1e3:.2f}")
    lines.append("product,qwen3-14b o,weights copy (read + write),20.0,2000000,100.00")
    return "\n".join(lines) + "\n"


def run(script, *args):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)


def table_rows(stdout):
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in stdout.splitlines() if line.startswith("| qwen")}


def test_builds_side_by_side(tmp_path):
    (tmp_path / "products_a.csv").write_text(csv_text("gemv_rows 4", [("qwen3-14b o rows1", 18.0, 20.0),
                                                                      ("qwen3-14b o rows8", None, 21.0)]))
    (tmp_path / "products_b.csv").write_text(csv_text("gemv_rows 8", [("qwen3-14b o rows1", 25.0, 20.5),
                                                                      ("qwen3-14b o rows8", 20.0, 21.5)]))
    out = run(COMPARE, str(tmp_path), "a", "b")
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)
    # cuBLASLt's time is the first build's: 20 / 18 = 1.111, 20 / 25 = 0.800; b alone ran rows8 on gemv.h.
    assert rows["qwen3-14b o rows1"] == ["20.00", "18.00", "25.00", "1.111", "0.800"]
    assert rows["qwen3-14b o rows8"] == ["21.00", "n/a", "20.00", "n/a", "1.050"]
    assert "qwen3-14b o" not in rows  # the weights copy is no product row


def test_bad_input_is_reported(tmp_path):
    assert run(COMPARE, str(tmp_path)).returncode == 2
    missing = run(COMPARE, str(tmp_path), "none")
    assert missing.returncode == 1 and "products_none.csv" in missing.stderr
    (tmp_path / "products_bad.csv").write_text("not,a,products,file\n1,2,3,4\n")
    bad = run(COMPARE, str(tmp_path), "bad")
    assert bad.returncode == 1 and "products_bad.csv" in bad.stderr


def test_report_prints_the_product_table(tmp_path):
    kernels = tmp_path / "kernels.csv"
    kernels.write_text(csv_text("gemv_rows 4", [("qwen3-14b o rows1", 10.0, 12.0)]))
    out = run(REPORT, str(tmp_path / "no_tests.json"), str(kernels), str(tmp_path / "no_sdpa.csv"))
    assert out.returncode == 0, out.stderr
    assert "| decode-sized product (bf16) | gemv_rows 4 us | cuBLASLt us |" in out.stdout
    # 12 / 10 = 1.20; the kernel's 100 GB/s over the copy's 100 GB/s = 1.00.
    assert table_rows(out.stdout)["qwen3-14b o rows1"] == ["10.0", "12.0", "1.20", "1.00"]
