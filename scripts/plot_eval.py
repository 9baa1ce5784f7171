#!/usr/bin/env python3
"""Plots `spin eval` results.

  scripts/plot_eval.py --fidelity OUT/fidelity.json [--locality OUT/locality.json] --out DIR

fidelity.png: top-1 agreement, KL(dense||sparse) and attention-output relative error against the
budget (fraction of the context), one line per algorithm, averaged over the prompts.
locality.png: device-cache hit rate against buffer size (multiples of the mandatory pages), one
panel per (algorithm, budget), one line per replacement policy.
Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_fidelity(path: pathlib.Path, out: pathlib.Path) -> None:
    report = json.loads(path.read_text())
    series = {}
    for s in report["summary"]:
        fraction = next(r["budget_fraction"] for r in report["results"]
                        if r["algorithm"] == s["algorithm"] and r["budget"] == s["budget"])
        series.setdefault(s["algorithm"], []).append((fraction, s))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    metrics = [("top1_agreement", "top-1 agreement with dense", False),
               ("kl_mean", "KL(dense || sparse), nats", True),
               ("attn_rel_err_mean", "attention output rel. error", True)]
    for ax, (key, label, log) in zip(axes, metrics):
        for algorithm, points in sorted(series.items()):
            points.sort(key=lambda p: p[0])
            ax.plot([p[0] for p in points], [max(p[1][key], 1e-6) if log else p[1][key]
                                             for p in points], marker="o", label=algorithm)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("budget (fraction of context)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(0.97, color="gray", linestyle="--", linewidth=0.8)
    axes[0].legend()
    fig.suptitle(f"{report['model']}, {report['context']}-token prompts, "
                 f"{report['steps']} teacher-forced steps")
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=120)


def plot_locality(path: pathlib.Path, out: pathlib.Path) -> None:
    rows = json.loads(path.read_text())
    panels = sorted({(r["algorithm"], r["budget"]) for r in rows})
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.4 * nrows), squeeze=False)
    for ax, (algorithm, budget) in zip(axes.flat, panels):
        for r in rows:
            if (r["algorithm"], r["budget"]) == (algorithm, budget):
                ax.plot(r["buffer_multiples"], r["hit_rate"], marker="o", label=r["policy"])
        ax.set_title(f"{algorithm} @ {budget}")
        ax.set_xlabel("buffer (× mandatory pages)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "locality.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fidelity", type=pathlib.Path)
    parser.add_argument("--locality", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fidelity:
        plot_fidelity(args.fidelity, args.out)
    if args.locality:
        plot_locality(args.locality, args.out)


if __name__ == "__main__":
    main()
