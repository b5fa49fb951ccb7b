"""Aggregate run records into "mean ± std over seeds" per configuration, and list the runs left out."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from longseq.report.outcome import COMPLETED
from longseq.report.runs import RunRecord

SEED_KEY = "seed"


def varying_override_keys(runs: list[RunRecord], exclude: tuple[str, ...] = (SEED_KEY,)) -> list[str]:
    """Override keys (in first-seen order) whose value differs between runs, ``seed`` and ``hydra.*`` excluded."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.overrides if k not in keys]
    return [k for k in keys if k not in exclude and not k.startswith("hydra.")
            and len({run.overrides.get(k, "") for run in runs}) > 1]


def swept_keys(roots: list[Path]) -> list[str] | None:
    """The keys a multirun sweeps, from ``<root>/multirun.yaml`` (command-line ``a=x,y`` and
    ``hydra.sweeper.params``); None when no root holds one. Known before every job has finished, so a report
    of a sweep in progress still groups by every swept key."""
    from omegaconf import OmegaConf

    keys: list[str] = []
    found = False
    for root in roots:
        path = Path(root) / "multirun.yaml"
        if not path.is_file():
            continue
        found = True
        hydra = OmegaConf.load(path).hydra
        overrides = [str(o) for o in (OmegaConf.select(hydra, "overrides.task") or [])]
        params = OmegaConf.select(hydra, "sweeper.params") or {}
        candidates = [o.partition("=")[0].lstrip("+") for o in overrides if "," in o.partition("=")[2]]
        candidates += [str(k) for k, v in params.items() if "," in str(v)]
        keys += [k for k in candidates if k not in keys]
    return keys if found else None


def default_metric(runs: list[RunRecord]) -> str:
    """``test/<m>`` for the task's monitor ``val/<m>`` when the runs logged it, else the monitor itself."""
    for run in runs:
        monitor = run.value("task.monitor")
        if monitor:
            test = "test/" + monitor.split("/", 1)[-1]
            return test if any(test in r.metrics for r in runs) else monitor
    raise ValueError("no run records task.monitor: pass --metric <name> (e.g. --metric test/bpd)")


def metric_mode(runs: list[RunRecord], metric: str) -> str:
    """``min`` or ``max``: the task's ``task.mode`` when ``metric`` is its monitor on any split, else by name."""
    for run in runs:
        monitor, mode = run.value("task.monitor"), run.value("task.mode")
        if monitor and mode in ("min", "max") and monitor.split("/")[-1] == metric.split("/")[-1]:
            return mode
    return "max" if any(word in metric for word in ("acc", "f1", "auc")) else "min"


def as_float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


@dataclass
class Report:
    """The aggregated table (one row per group) and the runs that are not in it, with the reason."""

    table: pd.DataFrame
    left_out: pd.DataFrame
    metric: str
    by: list[str]
    mode: str

    def markdown(self, root: Path | None = None) -> str:
        """The table as markdown (``mean ± std``), followed by the list of runs left out."""
        lines = [markdown_table(self.display_frame())]
        if len(self.left_out):
            lines += ["", f"Not in the table ({len(self.left_out)} run(s)):", ""]
            lines.append(markdown_table(self.left_out_frame(root)))
        return "\n".join(lines) + "\n"

    def display_frame(self) -> pd.DataFrame:
        frame = self.table[self.by].copy()
        frame[f"{self.metric} (mean ± std)"] = [
            f"{m:.4f} ± {s:.4f}" if not math.isnan(s) else f"{m:.4f}" for m, s in zip(self.table["mean"], self.table["std"])
        ]
        frame["n"] = self.table["n"]
        frame[f"best ({self.mode})"] = [f"{b:.4f}" for b in self.table["best"]]
        frame["seeds"] = self.table["seeds"]
        return frame

    def left_out_frame(self, root: Path | None = None) -> pd.DataFrame:
        frame = self.left_out.copy()
        if root is not None:
            frame["run"] = [relative(Path(p), root) for p in frame["run"]]
        return frame

    def print(self, console: Console | None = None, root: Path | None = None) -> None:
        """Print the table (and the left-out runs) with rich, as markdown-shaped tables."""
        # Not a terminal (a pipe, a notebook, a log file): wide enough that no cell is cut.
        console = console or Console(width=None if sys.stdout.isatty() else 240)
        console.print(rich_table(self.display_frame(), f"{self.metric}: mean ± std over seeds ({self.mode} is best)"))
        if len(self.left_out):
            console.print(rich_table(self.left_out_frame(root), f"not in the table: {len(self.left_out)} run(s)"))


def relative(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def markdown_table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    def cell(value: object) -> str:  # one line per row: a multi-line error message would break the table
        return " ".join(str(value).split()).replace("|", "\\|")

    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def rich_table(frame: pd.DataFrame, title: str) -> Table:
    table = Table(title=title, box=box.MARKDOWN)
    for column in frame.columns:
        table.add_column(str(column))
    for row in frame.itertuples(index=False):
        table.add_row(*(str(v) for v in row))
    return table


def aggregate(runs: list[RunRecord], metric: str | None = None, by: list[str] | None = None,
              mode: str | None = None) -> Report:
    """Group completed runs by ``by`` (default: the keys the sweep varies — from ``multirun.yaml`` when
    present, and any override that differs between the runs — except ``seed``) and summarize ``metric``.

    Per group: mean, sample standard deviation (ddof 1; NaN for one run), n, best (min or max by ``mode``,
    default from ``task.mode``) and the seeds. Runs that did not complete, or completed without ``metric``
    (or with a non-finite value), go to ``left_out`` with their status and reason instead of being dropped.
    """
    if not runs:
        raise ValueError("no runs to report")
    metric = metric or default_metric(runs)
    if not by:
        swept = swept_keys(sorted({run.path.parent for run in runs}))
        varying = varying_override_keys(runs)
        by = [k for k in (swept or []) if k != SEED_KEY] + [k for k in varying if k not in (swept or [])]
    mode = mode or metric_mode(runs, metric)
    if mode not in ("min", "max"):
        raise ValueError(f"--mode must be min or max, got {mode!r}")
    rows, left_out = [], []
    for run in runs:
        reason = None
        if run.status != COMPLETED:
            reason = run.error or ("no metrics.json: still running, or killed before the end"
                                   if run.status == "unfinished" else "")
        elif metric not in run.metrics:
            reason = f"{metric} not recorded (recorded: {', '.join(sorted(run.metrics)) or 'nothing'})"
        elif not math.isfinite(as_float(run.metrics[metric])):
            reason = f"{metric} = {run.metrics[metric]}"
        overrides = " ".join(f"{k}={v}" for k, v in run.overrides.items())
        if reason is not None:
            left_out.append({"run": str(run.path), "status": run.status if run.status != COMPLETED else "no metric",
                             "overrides": overrides, "reason": reason})
            continue
        rows.append({**{k: run.value(k) for k in by}, SEED_KEY: run.value(SEED_KEY),
                     "value": as_float(run.metrics[metric])})
    columns = [*by, "mean", "std", "n", "best", "seeds"]
    if rows:
        frame = pd.DataFrame(rows)
        keys = by or (lambda _: "all")
        grouped = frame.groupby(keys, sort=False, dropna=False)
        table = grouped["value"].agg(mean="mean", std="std", n="count", best=mode).reset_index()
        table["seeds"] = grouped[SEED_KEY].agg(lambda s: ",".join(map(str, s))).values
        if not by:
            table = table.drop(columns=table.columns[0])
        table = table.sort_values("mean", ascending=mode == "min", kind="stable").reset_index(drop=True)[columns]
    else:
        table = pd.DataFrame(columns=columns)
    return Report(table=table, left_out=pd.DataFrame(left_out, columns=["run", "status", "overrides", "reason"]),
                  metric=metric, by=by, mode=mode)
