"""Each run's outcome on disk: ``<run>/metrics.json`` with the final metrics and a status.

``longseq.runner.train`` is wrapped by :func:`records_run_outcome`, so every run directory of a single run or
a multirun job ends with one of

- ``{"status": "completed", "metrics": {...}}`` — fit and test finished;
- ``{"status": "failed", "error": "ValueError: ...", "metrics": {}}`` — the job raised;
- ``{"status": "interrupted", ...}`` — SIGTERM (preemption); resume from ``checkpoints/interrupted.ckpt``;

and a job directory without ``metrics.json`` is still running or was killed (``kill -9``, out of memory):
``longseq.report`` lists it as unfinished. Only global rank zero writes it. This module imports nothing from the
runner, so the runner can import it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from longseq.utils.rundir import rank_zero

METRICS_FILE = "metrics.json"
COMPLETED, FAILED, INTERRUPTED, UNFINISHED = "completed", "failed", "interrupted", "unfinished"


def json_number(value: Any) -> Any:
    """A JSON-safe copy of a metric value: floats stay floats (NaN/Inf as strings), tensors become floats."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def write_run_metrics(output_dir: str | Path, metrics: Mapping[str, Any] | None, status: str = COMPLETED,
                      error: BaseException | str | None = None) -> Path:
    """Write ``<output_dir>/metrics.json`` atomically (write a temp file, then rename) and return its path."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"status": status, "metrics": {k: json_number(v) for k, v in (metrics or {}).items()}}
    if error is not None:
        record["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    path = output_dir / METRICS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


# SystemExit codes of a run stopped from outside, not by its own failure: 143 is SIGTERM; -1 is submitit's exit after
# its signal handler requeued a preempted or timed-out SLURM job (the next attempt resumes in place and rewrites this)
STOPPED_FROM_OUTSIDE = (143, -1)


def records_run_outcome(train: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Decorate ``train(cfg, **options)`` so that its run directory (``cfg.paths.output_dir``) ends with
    ``metrics.json``.

    The metrics are those ``train`` returns; an exception is recorded (status ``failed``, or ``interrupted`` for
    the exits of ``STOPPED_FROM_OUTSIDE``) and re-raised unchanged; a run that removed its directory on a refusal
    (``runner``) records nothing.
    """

    @functools.wraps(train)
    def wrapper(cfg: Any, **options: Any) -> dict[str, Any]:
        output_dir = Path(cfg.paths.output_dir)
        if not rank_zero():  # a DDP rank that Lightning launched again shares its rank 0's run directory and record
            return train(cfg, **options)
        try:
            metrics = train(cfg, **options)
        except SystemExit as stop:
            if output_dir.is_dir():
                status = INTERRUPTED if stop.code in STOPPED_FROM_OUTSIDE else FAILED
                write_run_metrics(output_dir, None, status, error=f"SystemExit: {stop.code}")
            raise
        except BaseException as error:
            if output_dir.is_dir():  # a check that fails before the run directory exists leaves nothing behind
                write_run_metrics(output_dir, None, FAILED, error=error)
            raise
        write_run_metrics(output_dir, metrics, COMPLETED)
        return metrics

    return wrapper
