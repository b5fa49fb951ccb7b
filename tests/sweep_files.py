"""Fake sweep job directories as ``train.py -m`` leaves them, shared by the report and notebook tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from longseq.report import write_run_metrics

# test/bpd per (attention, seed) of the fabricated sweep
VALUES = {("full", 1): 2.10, ("full", 2): 2.20, ("full", 3): 2.60,
          ("combiner_fixed", 1): 1.90, ("combiner_fixed", 2): 1.95, ("combiner_fixed", 3): 2.00}


def fake_job(job_dir: Path, attention: str, seed: int, status: str | None, value: float | None = None,
             error: str | None = None) -> Path:
    """A Hydra multirun job directory as train.py leaves it: .hydra/overrides.yaml, config_resolved.yaml,
    and (unless ``status`` is None: still running / killed) metrics.json."""
    (job_dir / ".hydra").mkdir(parents=True)
    overrides = ["experiment=digits/default", f"attention={attention}", f"seed={seed}"]
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {"seed": seed, "attention": {"name": attention, "block_size": 8},
              "task": {"name": "digits", "monitor": "val/bpd", "mode": "min"}}
    (job_dir / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    if status is not None:
        metrics = {"val/bpd": value + 0.01, "test/bpd": value} if value is not None else {}
        write_run_metrics(job_dir, metrics, status, error=error)
    return job_dir

