"""SIGTERM and kill -9 mid-epoch: the resumed run continues from the saved step in the same run directory.

CPU, fixed seed, the CLI as a user runs it: train in a subprocess, interrupt it, resume with
``ckpt_path=<run>/checkpoints/<file>.ckpt`` and check the step, the directory and the loss curve.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "extras.print_config=false", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "logger=csv", "trainer.log_every_n_steps=1", "test=false",
        "logger.csv.flush_logs_every_n_steps=1"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}


def start(run: Path) -> subprocess.Popen:
    """A long CPU run writing last.ckpt every 2 steps (digits: 22 steps per epoch at batch 64)."""
    args = ["trainer.max_steps=100000", "callbacks.model_checkpoint.every_n_train_steps=2", f"hydra.run.dir={run}"]
    return subprocess.Popen([sys.executable, "train.py", *args, *TINY], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def saved_step(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"] if path.is_file() else -1


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while saved_step(path) < step:  # checkpoints are written atomically: never read half-written
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the run did not reach the step in time"
        time.sleep(0.3)


def resume(ckpt: Path, max_steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", f"ckpt_path={ckpt}", f"trainer.max_steps={max_steps}", *TINY],
                          cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)


def losses(path: Path) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f) if r.get("train/loss")]


@pytest.mark.slow  # ~40 s; the fast set resumes from SIGTERM through the same path
def test_kill9_mid_epoch_resumes_in_the_same_run_dir(tmp_path):
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    proc = start(run)
    wait_for_step(last, 6, proc)
    proc.kill()  # SIGKILL: no handler runs, only the periodic last.ckpt survives
    proc.wait(timeout=60)
    state = torch.load(last, weights_only=False)
    step = state["global_step"]
    assert step >= 6 and step % 2 == 0 and state["epoch"] == 0  # mid-epoch
    assert not (run / "checkpoints" / "interrupted.ckpt").exists()

    out = resume(last, step + 4)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no second run directory
    assert saved_step(last) == step + 4
    before, after = losses(run / "csv" / "metrics.csv"), losses(run / "csv" / "resume1" / "metrics.csv")
    assert [s for s, _ in after][:1] == [step]  # the first logged step continues the count
    killed_at = dict(before)[step - 1]
    assert abs(after[0][1] - killed_at) < 0.3  # the loss curve continues ...
    assert after[0][1] < before[0][1] - 0.2  # ... well below the untrained loss


@pytest.mark.slow  # two CLI runs; the fast set sends the signal in-process (test_runs_resume.py, the same checks)
def test_sigterm_mid_epoch_saves_and_the_resumed_run_finishes(tmp_path):
    run = tmp_path / "run"
    proc = start(run)
    wait_for_step(run / "checkpoints" / "last.ckpt", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    interrupted = run / "checkpoints" / "interrupted.ckpt"
    step = saved_step(interrupted)
    assert step >= 2 and torch.load(interrupted, weights_only=False)["epoch"] == 0

    out = resume(interrupted, step + 3)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming in place: {run}" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert saved_step(run / "checkpoints" / "last.ckpt") == step + 3
    assert [s for s, _ in losses(run / "csv" / "resume1" / "metrics.csv")][:1] == [step]
