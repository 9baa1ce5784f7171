"""Compares spin_bench_model runs of builds timed in one call (scripts/gpu-ab.sh).

usage: ab_compare.py FILE...

Each file holds runs of spin_bench_model's markdown output. A line "=== LABEL ..." names the build
of the runs after it; runs before any such line take the file's name. For every decode row
(model, attention, batch, context) it prints, per build, the median over that build's runs of the
decode tok/s, and of measured / ideal for sparse runs (their step breakdown), then the last
build's median tok/s over the first's.
"""
import os
import statistics
import sys
from collections import OrderedDict, defaultdict


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(paths):
    """Returns (labels in first-seen order, {key: {label: {"tok/s": [...], "ideal": [...]}}})."""
    labels = []
    rows = defaultdict(lambda: defaultdict(lambda: {"tok/s": [], "ideal": []}))
    for path in paths:
        label = os.path.splitext(os.path.basename(path))[0]
        model, attention, header = "?", "dense", None
        with open(path) as f:
            for line in f:
                if line.startswith("=== "):
                    label = line.split()[1]
                    continue
                if line.startswith("["):  # a log line (spdlog) between a table's rows
                    continue
                if line.startswith("## "):
                    model, attention = line.split()[1], "dense"
                    continue
                if not line.startswith("|"):
                    header = None
                    continue
                c = cells(line)
                if c[:2] == ["measurement", "value"]:
                    continue
                if c[0] == "attention" and len(c) == 2:
                    attention = c[1].split(",")[0]
                    continue
                if c[:2] == ["batch", "context"]:
                    header = c
                    continue
                if header is None or set(line.strip()) <= set("|-") or len(c) != len(header):
                    continue
                if label not in labels:
                    labels.append(label)
                key = (model, attention, int(c[0]), int(c[1]))
                record = dict(zip(header, c))
                if "decode tok/s" in record:
                    rows[key][label]["tok/s"].append(float(record["decode tok/s"]))
                if "measured (graphs) / ideal" in record:
                    rows[key][label]["ideal"].append(float(record["measured (graphs) / ideal"]))
    return labels, OrderedDict(sorted(rows.items()))


def median_or_none(values):
    return statistics.median(values) if values else None


def table(labels, rows):
    head = ["model", "attention", "batch", "context"]
    for label in labels:
        head += [f"{label} tok/s (runs)", f"{label} measured/ideal"]
    head.append(f"{labels[-1]} / {labels[0]} tok/s" if len(labels) > 1 else "")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, attention, batch, context), by_label in rows.items():
        line = [model, attention, str(batch), str(context)]
        speeds = []
        for label in labels:
            tok = median_or_none(by_label[label]["tok/s"])
            ideal = median_or_none(by_label[label]["ideal"])
            speeds.append(tok)
            line.append(f"{tok:.1f} ({len(by_label[label]['tok/s'])})" if tok is not None else "-")
            line.append(f"{ideal:.2f}" if ideal is not None else "-")
        ratio = speeds[-1] / speeds[0] if len(speeds) > 1 and speeds[0] and speeds[-1] else None
        line.append(f"{ratio:.3f}" if ratio is not None else "-")
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    labels, rows = parse(sys.argv[1:])
    if not rows:
        sys.exit("no decode rows found in " + ", ".join(sys.argv[1:]))
    print(table(labels, rows))


if __name__ == "__main__":
    main()
