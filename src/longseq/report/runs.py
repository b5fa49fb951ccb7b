"""Find the run directories of a multirun (or single runs) and read what each one recorded.

A run directory is any folder holding ``.hydra/overrides.yaml`` (Hydra writes it when the job starts). From
it the report reads the overrides, the resolved config (``config_resolved.yaml``, written by the runner
before training; ``.hydra/config.yaml`` as a fallback) and the outcome (``metrics.json``, see
:mod:`longseq.report.outcome`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from longseq.report.outcome import COMPLETED, METRICS_FILE, UNFINISHED
from longseq.utils.rundir import RESOLVED_CONFIG


@dataclass
class RunRecord:
    """What one run directory says about itself."""

    path: Path
    overrides: dict[str, str]
    config: DictConfig | None
    status: str = UNFINISHED
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def value(self, key: str) -> str:
        """The run's value of ``key``: its command-line override, else the resolved config's entry, else ''."""
        if key in self.overrides:
            return self.overrides[key]
        if self.config is not None:
            try:
                found = OmegaConf.select(self.config, key, default=None, throw_on_missing=False)
            except Exception:  # an unresolvable interpolation in .hydra/config.yaml (no resolved copy)
                found = None
            if found is not None:
                return str(OmegaConf.to_container(found, resolve=False)) if isinstance(found, DictConfig) else str(found)
        return ""


def natural_key(path: Path) -> list[Any]:
    """Sort key that puts job ``10`` after job ``9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def is_run_dir(path: Path) -> bool:
    """A Hydra job directory, or a run directory made without Hydra's files (``train(cfg)`` from Python)."""
    return (path / ".hydra" / "overrides.yaml").is_file() or (path / RESOLVED_CONFIG).is_file()


def find_run_dirs(paths: list[str | Path]) -> list[Path]:
    """Every run directory in ``paths``: a path that is a run itself, or the Hydra jobs anywhere below it.

    Raises ``FileNotFoundError`` naming a path that does not exist or holds no run.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such directory (pass a multirun directory or run directories)")
        if is_run_dir(path):
            runs = [path]
        else:
            runs = sorted((p.parent.parent for p in path.rglob(".hydra/overrides.yaml")), key=natural_key)
        if not runs:
            raise FileNotFoundError(f"{path}: no run directory below it (none holds .hydra/overrides.yaml)")
        found += [run for run in runs if run not in found]
    return found


def parse_overrides(lines: list[str]) -> dict[str, str]:
    """``["attention=sparse", "+x=1", "~y"]`` -> ``{"attention": "sparse", "x": "1"}`` (deletions skipped)."""
    parsed = {}
    for line in lines:
        key, sep, value = str(line).partition("=")
        if sep and not key.startswith("~"):
            parsed[key.lstrip("+")] = value
    return parsed


def load_run(path: Path) -> RunRecord:
    """Read one run directory (any file may be missing: a job that died early still gets a record)."""
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = parse_overrides(list(OmegaConf.load(overrides_file) or [])) if overrides_file.is_file() else {}
    config = None
    for candidate in (path / RESOLVED_CONFIG, path / ".hydra" / "config.yaml"):
        if candidate.is_file():
            config = OmegaConf.load(candidate)
            break
    record = RunRecord(path=path, overrides=overrides, config=config)
    outcome = path / METRICS_FILE
    if outcome.is_file():
        try:
            data = json.loads(outcome.read_text())
        except json.JSONDecodeError as error:
            record.error = f"{outcome}: unreadable ({error})"
            return record
        record.status = data.get("status", COMPLETED)
        record.metrics = dict(data.get("metrics") or {})
        record.error = data.get("error")
    return record


def load_runs(paths: list[str | Path]) -> list[RunRecord]:
    """Records of every run directory in ``paths`` (see :func:`find_run_dirs`)."""
    return [load_run(path) for path in find_run_dirs(paths)]


def runs_of_task(runs: list[RunRecord], task: str | None) -> tuple[list[RunRecord], dict[str, int]]:
    """``(the runs of task, {other task: how many runs})``; ``task`` None: the task of the newest run (the one a
    report of ``logs/train/runs`` is about, e.g. ``make train``'s digits)."""
    if task is None and runs:
        task = runs_by_time(runs)[-1].value("task.name")
    kept = [run for run in runs if run.value("task.name") == task]
    others: dict[str, int] = {}
    for run in runs:
        if run not in kept:
            name = run.value("task.name") or "?"
            others[name] = others.get(name, 0) + 1
    return kept, others


def runs_by_time(runs: list[RunRecord]) -> list[RunRecord]:
    return sorted(runs, key=lambda run: run.path.stat().st_mtime)


def default_checkpoint(logs: str | Path, task: str = "digits") -> Path | None:
    """The checkpoint a notebook draws from when none is named: among the runs of ``task`` under ``logs`` that saved
    one, ``make train``'s default run (no command-line overrides) before any other, then the best validation score
    (``task.monitor`` in the direction of ``task.mode``, from ``metrics.json``), then the newest. Its ``best.ckpt``,
    else ``last.ckpt``; None when there is none (a 20-step smoke run no longer wins by being the newest)."""
    candidates = []
    for record in (load_run(p.parent) for p in Path(logs).rglob(RESOLVED_CONFIG)):
        ckpt = next((c for c in (record.path / "checkpoints" / name for name in ("best.ckpt", "last.ckpt"))
                     if c.is_file()), None)
        if ckpt is None or record.value("task.name") != task:
            continue
        monitor, mode = record.value("task.monitor"), record.value("task.mode") or "min"
        score = record.metrics.get(f"{monitor}_best", record.metrics.get(monitor))
        goodness = -math.inf  # a run without a recorded score ranks below every scored one
        if isinstance(score, (int, float)) and math.isfinite(score):
            goodness = -float(score) if mode == "min" else float(score)
        candidates.append(((not record.overrides, goodness, record.path.stat().st_mtime), ckpt))
    return max(candidates)[1] if candidates else None


def learning_curves(run: RunRecord, column: str) -> pd.DataFrame:
    """``step`` and ``column`` from what the run logged: its CSV logger files (``<run>/**/metrics.csv``; resumed
    parts appended; every run writes one unless ``extras.csv_metrics=false``), else its TensorBoard event files.

    Empty when the run logged ``column`` to neither.
    """
    frames = []
    for csv in sorted(run.path.rglob("metrics.csv"), key=natural_key):
        frame = pd.read_csv(csv)
        if column in frame and "step" in frame:
            frames.append(frame[["step", column]].dropna())
    if not frames:
        frames = tensorboard_curves(run.path, column)
    if not frames:
        return pd.DataFrame(columns=["step", column])
    return pd.concat(frames).drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


def tensorboard_curves(path: Path, column: str) -> list[pd.DataFrame]:
    """``step`` / ``column`` frames from the TensorBoard event files below ``path`` (one per event folder)."""
    folders = sorted({p.parent for p in path.rglob("events.out.tfevents.*")}, key=natural_key)
    if not folders:
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    frames = []
    for folder in folders:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        if column in events.Tags().get("scalars", []):
            frames.append(pd.DataFrame([(e.step, e.value) for e in events.Scalars(column)], columns=["step", column]))
    return frames
