"""What a run prints when stdout is a file (SLURM logs, ``> train.log``): plain lines, no cursor escapes, no
all-zero FLOPs column, no log record glued to a bar, known noise filtered."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "extras.print_config=false"]


def run_to_files(args: list[str], tmp_path: Path, name: str) -> tuple[str, str]:
    """``python train.py <args>`` with stdout and stderr redirected to files (not a terminal); their text."""
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    with out.open("w") as stdout, err.open("w") as stderr:
        done = subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / name}"], cwd=ROOT,
                              stdout=stdout, stderr=stderr, env=env, timeout=300)
    assert done.returncode == 0, err.read_text()[-3000:]
    return out.read_text(), err.read_text()


@pytest.mark.slow  # ~20 s: a CLI run
def test_a_run_logged_to_a_file_reads_as_plain_lines(tmp_path: Path) -> None:
    out, err = run_to_files(TINY + ["trainer.max_steps=20", "trainer.val_check_interval=10",
                                    "trainer.limit_val_batches=3", "trainer.limit_test_batches=1"], tmp_path, "train")
    for text in (out, err):
        assert "\r" not in text and "\x1b[" not in text  # no carriage returns, no cursor / colour escapes
    lines = out.splitlines()
    # every log record starts its own line (none glued behind a bar)
    glued = [line for line in lines if re.search(r".\[\d{4}-\d\d-\d\d [\d:,]+\]\[", line)]
    assert not glued, glued
    # the model summary without the FLOPs column Lightning cannot fill (no example_input_array)
    assert "FLOPs" not in out and "Flops" not in out
    assert any(re.match(r"0 \| net +\| Transformer", line) for line in lines)
    assert any(line.startswith("train: 1/20 (5%) [") for line in lines)
    assert any(line.startswith("train: 20/20 (100%) [") and "train/loss=" in line for line in lines)
    assert any(re.fullmatch(r"validation at step 10: val/bpd=\d\.\d{4}, val/bpd_best=\d\.\d{4}", line)
               for line in lines)
    assert not any("Validation" in line or "Sanity" in line or "Testing" in line for line in lines)
    assert out.count("\n") < 60  # a handful of lines, not one per bar refresh
    assert "Trainer already configured" not in err and "Tip" not in err


def test_debug_fdr_prints_no_anomaly_detection_warning(tmp_path: Path) -> None:
    """``debug=fdr`` turns on ``detect_anomaly`` on purpose; Lightning's notice that it slows training is dropped
    where it is logged, while its other lines still come through."""
    from conftest import compose_config

    from longseq.runner import build_trainer

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    source = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = Collect(level=logging.DEBUG)
    source.addHandler(handler)
    level, source.level = source.level, logging.INFO
    try:
        trainer = build_trainer(compose_config(["debug=fdr"], tmp_path), [], [])
    finally:
        source.removeHandler(handler)
        source.setLevel(level)
    assert trainer._detect_anomaly
    assert any("GPU available" in line for line in seen)
    assert not any("detect_anomaly" in line for line in seen), seen


@pytest.mark.slow  # a fresh interpreter importing optuna
def test_optuna_import_prints_no_alembic_plugin_lines() -> None:
    """An Optuna sweep imports alembic, which logs one INFO line per plugin; the console module (imported by
    train.py before Hydra's sweeper) keeps alembic at WARNING."""
    code = ("import logging; logging.basicConfig(level=logging.INFO); import longseq.utils.console; import optuna; "
            "logging.getLogger('alembic.runtime.plugins').info('setup plugin probe')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "alembic" not in done.stdout + done.stderr


def test_debug_level_logging_prints_no_font_or_file_system_records() -> None:
    """``debug=`` sets the root logger to DEBUG for the project's own records; matplotlib's font scoring (one record
    per font, every figure) and fsspec's file opens (every checkpoint) stay at WARNING: ``debug=limit`` printed 234
    such lines of its 277."""
    code = ("import io, logging; logging.basicConfig(level=logging.DEBUG); import longseq.utils.console; "
            "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; import fsspec; "
            "plt.plot([0, 1]); plt.title('probe'); plt.savefig(io.BytesIO(), format='png'); "
            "fsspec.filesystem('file').ls('.'); logging.getLogger('longseq.probe').debug('own record')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert lines == ["DEBUG:longseq.probe:own record"], lines[:5]
