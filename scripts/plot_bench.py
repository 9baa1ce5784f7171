#!/usr/bin/env python3
"""Plots `spin bench --json-out` results of request-rate sweeps: throughput, TTFT, TPOT and E2E
latency against the request rate (or the arrival rate), one line per label (e.g. one per attention
algorithm).

usage: scripts/plot_bench.py [--arrival-rate] OUT.png RESULT.json[+RESULT.json ...][=LABEL] ...

Files joined by + are one line (runs of one mode from several calls). --arrival-rate puts each run
at the rate its requests actually arrived, (requests - 1) / the seconds from the first to the last,
instead of the rate asked for: a few Poisson arrivals can come far faster or slower.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def arrival_rate(run):
    rate = run["request_rate"]
    if rate == "inf":
        sys.exit("--arrival-rate: a run at rate inf sends every request at once and has no arrival rate")
    if run["num_prompts"] < 2:
        sys.exit(f"--arrival-rate: the run at {rate} req/s has {run['num_prompts']} request; an arrival rate needs 2")
    span = run.get("arrival_span_s") or 0
    if span <= 0:
        sys.exit(f"--arrival-rate: the run at {rate} req/s records no arrival span (arrival_span_s)")
    return (run["num_prompts"] - 1) / span


def load(arg, by_arrival):
    paths, _, label = arg.partition("=")
    runs = []
    for path in paths.split("+"):
        with open(path) as f:
            doc = json.load(f)
        label = label or doc.get("extra_body", {}).get("spin", {}).get("algorithm") or path
        runs += doc["runs"]
    inf_mark = None
    if by_arrival:
        xs = [arrival_rate(r) for r in runs]
    else:
        finite = [r["request_rate"] for r in runs if r["request_rate"] != "inf"]
        # "inf" (all at once) sits one step right of the largest finite rate.
        inf_x = (max(finite) * 1.5) if finite else 1.0
        xs = [inf_x if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
        inf_mark = inf_x if len(finite) < len(runs) else None
    order = sorted(range(len(runs)), key=lambda i: xs[i])
    return label, [xs[i] for i in order], [runs[i] for i in order], inf_mark


def main(argv):
    by_arrival = "--arrival-rate" in argv
    argv = [a for a in argv if a != "--arrival-rate"]
    if len(argv) < 3:
        sys.exit(__doc__)
    out = argv[1]
    panels = [("output_throughput", "output tokens/s", None), ("ttft_ms", "TTFT p50 (ms)", "p50"),
              ("tpot_ms", "TPOT p50 (ms)", "p50"), ("e2el_ms", "E2E p90 (ms)", "p90")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    inf_marks = set()
    for arg in argv[2:]:
        label, xs, runs, inf_x = load(arg, by_arrival)
        if inf_x is not None:
            inf_marks.add(inf_x)
        for ax, (key, title, stat) in zip(axes, panels):
            ys = [r[key][stat] if stat else r[key] for r in runs]
            ax.plot(xs, ys, marker="o", label=label)
            ax.set_title(title)
            ax.set_xlabel("arrival rate (req/s)" if by_arrival else "request rate (req/s)")
            if by_arrival:
                ax.set_xscale("log")
            ax.grid(True, alpha=0.3)
    for ax in axes:
        for x in inf_marks:
            ax.axvline(x, color="grey", linestyle=":", linewidth=0.8)
    axes[0].legend()
    if inf_marks:
        fig.text(0.01, 0.01, "dotted line: all requests at once (rate inf)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
