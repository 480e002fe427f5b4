#!/usr/bin/env python3
"""Plot allreduce_bench CSV output: busbw vs message size, one line per algorithm.

    mpirun -np 2 build/benchmarks/allreduce_bench --format csv > bench.csv
    /usr/bin/python3 scripts/plot_bench.py bench.csv -o docs/allreduce_busbw.png

Needs matplotlib (Debian: python3-matplotlib, hence /usr/bin/python3 where
another python3 comes first on PATH). The x axis (message size) is
logarithmic; "mpi" and "gloo*" lines are drawn dashed as baselines.
"""
import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def human(n):
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="CSV written by allreduce_bench --format csv ('-' = stdin)")
    parser.add_argument("-o", "--output", default="allreduce_busbw.png", help="PNG to write")
    parser.add_argument("--title", default=None, help="plot title")
    parser.add_argument("--metric", default="busbw_gbps", choices=["busbw_gbps", "algbw_gbps"])
    args = parser.parse_args()

    stream = sys.stdin if args.csv == "-" else open(args.csv, newline="")
    series = defaultdict(list)
    dtype = op = None
    for row in csv.DictReader(line for line in stream if not line.startswith("#")):
        if row["algo"] == "memcpy":
            continue  # a reference without communication: in cache it dwarfs every line
        series[row["algo"]].append((int(row["bytes"]), float(row[args.metric])))
        dtype, op = row["dtype"], row["op"]
    if not series:
        sys.exit("plot_bench.py: no rows in the CSV")

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for algo in sorted(series):
        pts = sorted(series[algo])
        baseline = algo == "mpi" or algo.startswith("gloo")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                linestyle="--" if baseline else "-", label=algo)
    ax.set_xscale("log", base=2)
    sizes = sorted({p[0] for pts in series.values() for p in pts})
    ticks = sizes[:: max(1, len(sizes) // 12)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([human(s) for s in ticks], rotation=45)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)" if args.metric == "busbw_gbps"
                  else "algorithm bandwidth (GB/s)")
    ax.set_title(args.title or f"all-reduce {args.metric.split('_')[0]} ({dtype}, {op})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
