"""Side by side: `spin_bench_gpu_kernels products` CSVs of several builds (DIR/products_BUILD.csv).

Per product and row count: cuBLASLt's time (the first build's), each build's gemv.h side, and
cuBLASLt's time over each build's (above 1: that build's kernel is faster).
usage: products_compare.py DIR BUILD...
"""
import csv
import sys


def load(path):
    """{(config, "cublasLt" | "gemv"): time_us} of one build's CSV."""
    times = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("bench") != "product":
                continue
            kind = "cublasLt" if r["variant"] == "cublasLt" else "gemv"
            times[(r["config"], kind)] = float(r["time_us"])
    return times


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out, builds = sys.argv[1], sys.argv[2:]
    times = {}
    for b in builds:
        path = f"{out}/products_{b}.csv"
        try:
            times[b] = load(path)
        except (OSError, KeyError, ValueError) as e:
            print(f"{path}: not a products CSV ({e})", file=sys.stderr)
            return 1
    configs = [c for (c, kind) in times[builds[0]] if kind == "cublasLt"]
    if not configs:
        print(f"{out}/products_{builds[0]}.csv: no product rows", file=sys.stderr)
        return 1
    print("| product | cuBLASLt us | " + " | ".join(f"{b} us" for b in builds) + " | "
          + " | ".join(f"cuBLASLt / {b}" for b in builds) + " |")
    print("|---" * (2 + 2 * len(builds)) + "|")
    for c in configs:
        lt = times[builds[0]][(c, "cublasLt")]
        g = [times[b].get((c, "gemv")) for b in builds]
        us = " | ".join("n/a" if v is None else f"{v:.2f}" for v in g)
        ratios = " | ".join("n/a" if v is None else f"{lt / v:.3f}" for v in g)
        print(f"| {c} | {lt:.2f} | {us} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
