#!/usr/bin/env python3
"""Per-kernel table of an ncu run over a benchmark's timed decode steps.

Input: the CSV that `ncu --metrics gpu__time_duration.sum --print-summary per-kernel --csv` prints
(the benchmark's own output may come before it). Output: a markdown table, one row per kernel
name and launch shape: launches per step, mean µs per launch, ms per step; sorted by ms per step,
with the total. ncu runs each kernel alone, so the total is longer than a step with overlap.
usage: ncu_summary.py --steps N FILE.csv [FILE.csv ...]
"""
import argparse
import csv
import io
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_rows(text):
    start = text.find('"Process ID"')
    if start < 0:
        raise ValueError("no ncu per-kernel summary (its header starts with \"Process ID\")")
    rows = []
    for r in csv.DictReader(io.StringIO(text[start:])):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "")
        if unit not in UNITS:
            raise ValueError(f"unknown time unit {unit!r}")
        us = float(r["Average"].replace(",", "")) * UNITS[unit]
        rows.append((r["Kernel Name"], r.get("Grid Size", ""), int(r["Invocations"]), us))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, required=True, help="decode steps the profiled range held")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    if a.steps <= 0:
        ap.error("--steps must be positive")
    status = 0
    for path in a.files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                rows = kernel_rows(f.read())
        except (OSError, ValueError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            status = 1
            continue
        per_step = sorted(((n * us / 1e3 / a.steps, n, us, name, grid) for name, grid, n, us in rows), reverse=True)
        print(f"\n{path}: {sum(r[0] for r in per_step):.3f} ms per step over {a.steps} steps\n")
        print("| ms/step | launches/step | µs/launch | kernel | grid |\n|---|---|---|---|---|")
        for ms, n, us, name, grid in per_step:
            print(f"| {ms:.3f} | {n / a.steps:g} | {us:.2f} | {name[:90]} | {grid} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
