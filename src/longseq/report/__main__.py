"""``python -m longseq.report <multirun dir or run dirs...> [--metric test/bpd] [--by attention,partition]``

Prints mean ± std over seeds per configuration (and the failed / unfinished runs) and writes
``report.csv`` (one row per group) and ``report.md`` beside the runs (``--out`` to choose the folder).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from longseq.report.runs import load_runs
from longseq.report.table import aggregate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m longseq.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("paths", nargs="+", help="a multirun directory (logs/<task_name>/multiruns/<time>) or run directories")
    parser.add_argument("--metric", help="metric of metrics.json to aggregate (default: test/<the task's monitor>)")
    parser.add_argument("--by", help="comma-separated override or config keys to group by, e.g. attention,partition "
                                     "or attention.name (default: every override that varies, except seed)")
    parser.add_argument("--mode", choices=["min", "max"], help="which is best (default: the task's task.mode)")
    parser.add_argument("--out", type=Path, help="folder for report.csv / report.md (default: the common folder of the paths)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = load_runs(args.paths)
        report = aggregate(runs, metric=args.metric, by=args.by.split(",") if args.by else None, mode=args.mode)
    except (FileNotFoundError, ValueError) as error:
        print(f"longseq.report: {error}", file=sys.stderr)
        return 2
    root = Path(os.path.commonpath([str(Path(p).resolve()) for p in args.paths]))
    out = args.out or (root if root.is_dir() else root.parent)
    out.mkdir(parents=True, exist_ok=True)
    report.print(root=root)
    report.table.to_csv(out / "report.csv", index=False)
    (out / "report.md").write_text(report.markdown(root=root))
    print(f"wrote {out / 'report.csv'} and {out / 'report.md'} ({len(report.table)} group(s), "
          f"{int(report.table['n'].sum()) if len(report.table) else 0} run(s); {len(report.left_out)} left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
