"""``python -m longseq.bench.replot <results.csv> [--out plot.png] [--title ...]``: the figure of a saved run drawn
again by ``report.benchmark_figure`` (``make bench`` draws it at the end of a run), e.g. docs/performance.md's
``docs/bench_cpu_fwd_bwd.png`` from ``docs/bench_cpu_fwd_bwd.csv``."""

from __future__ import annotations

import argparse
from pathlib import Path

from longseq.bench.report import plot, read_results


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m longseq.bench.replot", description=__doc__.split(":")[0])
    parser.add_argument("results", type=Path, help="a results.csv written by make bench")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: plot.png beside the CSV)")
    parser.add_argument("--title", help="the figure's title (default: the CSV's name and settings)")
    args = parser.parse_args(argv)
    rows = read_results(args.results)
    first = rows[0]
    title = args.title or (f"{args.results.name}: B={first['batch']} H={first['heads']} D={first['head_dim']} "
                           f"{first['dtype']}, {first['device']}")
    out = args.out or args.results.with_name("plot.png")
    plot(rows, out, title)
    print(out)
    return out


if __name__ == "__main__":
    main()
