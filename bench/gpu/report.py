"""Prints the GPU check's closing table from the GoogleTest JSON and the benchmark CSVs.

usage: report.py gpu_tests.json spin_kernels.csv sdpa.csv
Missing files are reported as such, so a failed step still leaves the others' rows.
"""
import csv
import json
import os
import sys


def load_csv(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def main():
    tests_json, spin_csv, sdpa_csv = sys.argv[1:4]
    print("\n| check | result |\n|---|---|")
    if os.path.exists(tests_json):
        report = json.load(open(tests_json))
        for suite in report["testsuites"]:
            for t in suite["testsuite"]:
                if "failures" in t:
                    result = "FAIL"
                elif t.get("result") == "SKIPPED":
                    result = "skipped"  # e.g. tensor parallelism on a machine with one GPU
                else:
                    result = "pass"
                print(f"| {suite['name']}.{t['name']} | {result} ({t['time']}) |")
    else:
        print("| GPU tests | no report (build or run failed) |")

    rows = load_csv(spin_csv) + load_csv(sdpa_csv)
    by = {}
    for r in rows:
        by[(r["bench"], r["config"], r["variant"])] = float(r["gbps"])

    def get(bench, config, prefix):
        vals = [v for (b, c, var), v in by.items() if b == bench and c == config and var.startswith(prefix)]
        return max(vals) if vals else None

    def fmt(v):
        return "n/a" if v is None else f"{v:.0f}"

    def ratio(a, b):
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    configs = []
    for r in rows:
        if r["bench"] == "dense" and r["config"] not in configs:
            configs.append(r["config"])
    print("\n| dense decode attention (bf16, d128) | spin GB/s, page 16 | page 32 | page 64 | cuDNN GB/s | flash GB/s "
          "| spin/cuDNN, page 16 | page 32 | page 64 | spin/flash, page 16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        s, s32, s64 = by.get(("dense", c, "spin")), by.get(("dense", c, "spin page 32")), by.get(("dense", c, "spin page 64"))
        cu, fl = get("dense", c, "torch cudnn"), get("dense", c, "torch flash")
        print(f"| {c} | {fmt(s)} | {fmt(s32)} | {fmt(s64)} | {fmt(cu)} | {fmt(fl)} | {ratio(s, cu)} | {ratio(s32, cu)} "
              f"| {ratio(s64, cu)} | {ratio(s, fl)} |")

    # Prefill rows carry GFLOP/s in the gbps column (see gpu_kernels_bench.cu).
    times = {(r["bench"], r["config"], r["variant"]): float(r["time_us"]) for r in rows}

    def tflops(v):
        return "n/a" if v is None else f"{v / 1e3:.0f}"

    print("\n| causal prefill, one sequence (bf16, hq32/hkv8, d128, page 16) | spin ms | spin TFLOP/s | spin 8x16 TFLOP/s | cuDNN TFLOP/s | flash TFLOP/s | spin/cuDNN | spin/flash |")
    print("|---|---|---|---|---|---|---|---|")
    for c in dict.fromkeys(r["config"] for r in rows if r["bench"] == "prefill"):
        s = by.get(("prefill", c, "spin"))
        t = times.get(("prefill", c, "spin"))
        s8 = get("prefill", c, "spin variant 1")
        cu, fl = get("prefill", c, "torch cudnn"), get("prefill", c, "torch flash")
        ms = "n/a" if t is None else f"{t / 1e3:.2f}"
        print(f"| {c} | {ms} | {tflops(s)} | {tflops(s8)} | {tflops(cu)} | {tflops(fl)} | {ratio(s, cu)} | {ratio(s, fl)} |")

    print("\n| sparse decode (2K of 128K per KV head, page 16) | sparse GB/s | dense equal-bytes GB/s | sparse/dense |")
    print("|---|---|---|---|")
    for c in dict.fromkeys(r["config"] for r in rows if r["bench"] == "sparse"):
        sp, de = get("sparse", c, "spin sparse"), get("sparse", c, "spin dense-equal")
        print(f"| {c} | {fmt(sp)} | {fmt(de)} | {ratio(sp, de)} |")

    print("\n| gather host->device, 64 MB of pages | kernel <=16 SMs GB/s (SMs) | per-page memcpyAsync | cudaMemcpyBatchAsync | bulk memcpy | kernel/batch | kernel/bulk |")
    print("|---|---|---|---|---|---|---|")
    for c in dict.fromkeys(r["config"] for r in rows if r["bench"] == "gather"):
        kern = [(v, var) for (b, cc, var), v in by.items() if b == "gather" and cc == c and var.startswith("kernel")]
        best = max(kern) if kern else None
        k = best[0] if best else None
        sms = best[1].split()[1] if best else "-"
        pp, ba, bu = get("gather", c, "memcpyAsync"), get("gather", c, "cudaMemcpyBatch"), get("gather", c, "bulk")
        print(f"| {c} | {fmt(k)} ({sms}) | {fmt(pp)} | {fmt(ba)} | {fmt(bu)} | {ratio(k, ba)} | {ratio(k, bu)} |")

    step_configs = [c for c in dict.fromkeys(r["config"] for r in rows if r["bench"] == "step") if c.startswith("hq")]
    if step_configs:
        print("\n| one layer's decode step (hq40/hkv8, d128, page 16, 2K budget, cache 6x budget) | dense us "
              "| score | select | retrieve | attention | sparse us | ideal us | sparse/ideal | dense/sparse |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c in step_configs:
            t = {v: times.get(("step", c, v)) for v in ("dense attention", "sparse score", "sparse select",
                                                        "sparse retrieve", "sparse attention", "sparse total",
                                                        "ideal envelope")}
            us = {k: "n/a" if v is None else f"{v:.0f}" for k, v in t.items()}
            total, ideal, dense = t["sparse total"], t["ideal envelope"], t["dense attention"]
            print(f"| {c} | {us['dense attention']} | {us['sparse score']} | {us['sparse select']} | "
                  f"{us['sparse retrieve']} | {us['sparse attention']} | {us['sparse total']} | {us['ideal envelope']} | "
                  f"{ratio(total, ideal)} | {ratio(dense, total)} |")

    product_configs = [c for c in dict.fromkeys(r["config"] for r in rows if r["bench"] == "product") if " rows" in c]
    gemv = next((v for (b, _, v) in times if b == "product" and v.startswith("gemv_rows")), None)
    if product_configs and gemv:
        print(f"\n| decode-sized product (bf16) | {gemv} us | cuBLASLt us | cuBLASLt / {gemv} "
              "| its GB/s / the weights copy's |")
        print("|---|---|---|---|---|")
        for c in product_configs:
            g, lt = times.get(("product", c, gemv)), times.get(("product", c, "cublasLt"))
            best = get("product", c, gemv)
            copy = get("product", c.rsplit(" rows", 1)[0], "weights copy (read + write)")
            us = {k: "n/a" if v is None else f"{v:.1f}" for k, v in (("g", g), ("lt", lt))}
            print(f"| {c} | {us['g']} | {us['lt']} | {ratio(lt, g)} | {ratio(best, copy)} |")


if __name__ == "__main__":
    main()
