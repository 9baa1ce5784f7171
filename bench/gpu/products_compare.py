"""Side by side: `spin_bench_gpu_kernels products` CSVs of several builds (DIR/products_BUILD.csv).

Per product and row count: cuBLASLt's time (the first build's), each build's gemv.h side, and
cuBLASLt's time over each build's (above 1: that build's kernel is faster).
usage: products_compare.py DIR BUILD...
"""
import csv
import sys


def main():
    out, builds = sys.argv[1], sys.argv[2:]
    times = {}
    for b in builds:
        with open(f"{out}/products_{b}.csv") as f:
            for r in csv.DictReader(f):
                kind = "cublasLt" if r["variant"] == "cublasLt" else "gemv"
                times[(b, r["config"], kind)] = float(r["time_us"])
    configs = dict.fromkeys(c for (b, c, v) in times if b == builds[0] and v == "cublasLt")
    print("| product | cuBLASLt us | " + " | ".join(f"{b} us" for b in builds) + " | "
          + " | ".join(f"cuBLASLt / {b}" for b in builds) + " |")
    print("|---" * (2 + 2 * len(builds)) + "|")
    for c in configs:
        lt = times[(builds[0], c, "cublasLt")]
        g = [times.get((b, c, "gemv")) for b in builds]
        us = " | ".join("n/a" if v is None else f"{v:.2f}" for v in g)
        ratios = " | ".join("n/a" if v is None else f"{lt / v:.3f}" for v in g)
        print(f"| {c} | {lt:.2f} | {us} | {ratios} |")


if __name__ == "__main__":
    main()
