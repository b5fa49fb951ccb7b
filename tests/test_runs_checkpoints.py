"""Faults around checkpoints and runs: bad ckpt_path, set-up failures, NaN, resume in place, atomic writes.

Each test injects one fault and asserts the exit code / exception, the message (naming the key or file), and
which files exist afterwards.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import CONF, ROOT, compose_config, injected_callbacks

from longseq import runner
from longseq.preflight.command import preflight_train
from longseq.runner import evaluate, train
from longseq.utils.checkpoint import save_atomically
from longseq.utils.console import error_summary
from longseq.utils.errors import ConfigError, NonFiniteError

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "extras.print_config=false", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false"]


def cli(script: str, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real CLI run (4 steps, last.ckpt every 2 steps, CSV logger) to resume, evaluate and corrupt."""
    run = tmp_path_factory.mktemp("runs") / "run"
    out = cli("train.py", [f"hydra.run.dir={run}", "trainer.max_steps=4", "logger=csv", "test=false",
                           "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1", *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture
def in_process_ckpt(tmp_path) -> Path:
    """last.ckpt of a 2-step in-process run (the TINY model) in its own directory under ``tmp_path``."""
    run = tmp_path / "trained"
    train(compose_config(["trainer.max_steps=2", "test=false", "callbacks.samples.n_samples=0"], run))
    return run / "checkpoints" / "last.ckpt"


def ckpts(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.ckpt"))


def preflight_error(argv: list[str], capsys) -> str:
    """Run train.py's pre-flight in-process; return the one-line error it exits with."""
    with pytest.raises(SystemExit) as stop:
        preflight_train(["train.py", *argv], CONF, "train")
    assert stop.value.code == 1
    return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))


def test_missing_ckpt_path_fails_before_a_run_dir(tmp_path, capsys):
    line = preflight_error([f"ckpt_path={tmp_path / 'nope.ckpt'}", *TINY], capsys)
    assert line == f"error: ckpt_path: {tmp_path / 'nope.ckpt'} does not exist; {tmp_path} holds no .ckpt file"


@pytest.mark.slow  # CLI train + eval on a cut file; the fast set refuses a random-bytes checkpoint in the pre-flight
def test_truncated_ckpt_path_is_named_by_train_and_eval(trained_run, tmp_path):
    broken = tmp_path / "checkpoints" / "last.ckpt"
    broken.parent.mkdir()
    data = (trained_run / "checkpoints" / "last.ckpt").read_bytes()
    broken.write_bytes(data[: len(data) // 2])  # a copy interrupted half-way
    new_run = tmp_path / "never"
    out = cli("train.py", [f"ckpt_path={broken}", f"hydra.run.dir={new_run}", *TINY])
    assert out.returncode == 1
    assert f"error: ckpt_path: {broken} cannot be read as a checkpoint (truncated" in out.stderr
    assert "Traceback" not in out.stderr and not new_run.exists()
    with pytest.raises(ConfigError, match="cannot be read as a checkpoint"):  # not "config_resolved.yaml not found"
        evaluate(compose_config([f"ckpt_path={broken}"], tmp_path / "eval", config_name="eval"))


def test_a_checkpoint_outside_a_run_that_does_not_fit_names_the_differing_parameters(in_process_ckpt, tmp_path,
                                                                                     capsys):
    """A checkpoint outside a run directory (nothing to compare the command with) and another model size: the
    differing parameters are named. (Resuming a run with another model size names the key:
    test_runs_resume.py::test_a_resume_refuses_to_change_the_model_or_the_tasks_geometry.)"""
    loose = tmp_path / "copied.ckpt"
    loose.write_bytes(in_process_ckpt.read_bytes())
    line = preflight_error([f"ckpt_path={loose}", *TINY, "model.d_model=48"], capsys)
    assert line.startswith("error: ckpt_path: ") and "does not match the composed model" in line
    assert "shape differs: net." in line and "32) vs (" in line and "48)" in line


def test_set_up_failure_writes_no_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(["task.batch_size=5000"])  # larger than the training split: fails in fit set-up
    with pytest.raises(Exception, match="batch"):
        train(cfg)
    assert ckpts(tmp_path) == []


def test_typed_trainer_key_is_named(make_cfg):
    with pytest.raises(ConfigError, match=r"trainer.max_steps: expected an integer .* got 'abc'"):
        train(make_cfg(["trainer.max_steps=abc"]))
    with pytest.raises(ConfigError, match="trainer.limit_val_batches"):
        train(make_cfg(["trainer.limit_val_batches=all"]))


@pytest.mark.slow  # a CLI run; the fast set names trainer keys in-process (test_messages)
def test_typed_trainer_key_prints_one_line(tmp_path):
    out = cli("train.py", ["trainer.max_steps=abc", f"hydra.run.dir={tmp_path / 'run'}", *TINY])
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-2] == (
        "error: trainer.max_steps: expected an integer number of optimizer steps (-1: no limit), got 'abc'")
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()  # refused before the run directory


class Diverge(L.Callback):
    """The injected fault: the weights turn NaN after step 4 (as a diverging learning rate would)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 4:
            with torch.no_grad():
                next(module.parameters()).fill_(float("nan"))


def test_nan_stops_and_keeps_the_last_finite_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(["trainer.max_steps=20", "callbacks.model_checkpoint.every_n_train_steps=2"])
    with injected_callbacks(Diverge()), pytest.raises(NonFiniteError) as caught:
        train(cfg)
    assert caught.value.what == "train/loss" and caught.value.step == 5
    assert error_summary(caught.value).startswith("error: train/loss: not finite at step 5")  # train.py's line
    assert "last finite checkpoint" in caught.value.kept and "(step 4)" in caught.value.kept
    assert ckpts(tmp_path) == ["last.ckpt"]  # no interrupted.ckpt of the diverged state
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())


@pytest.mark.slow  # a CLI run to divergence; the fast set injects the NaN in-process and checks the same line
def test_diverging_lr_exits_non_zero_naming_the_step(tmp_path):
    run = tmp_path / "run"
    out = cli("train.py", ["optimizer.lr=1e39", "scheduler=constant", "trainer.max_steps=50", f"hydra.run.dir={run}",
                           *TINY])
    assert out.returncode == 1
    assert "error: train/loss: not finite at step " in out.stderr
    assert ckpts(run) == []


@pytest.mark.slow  # two CLI runs; the fast set resumes in place in-process (test_runs_resume.py: resume(), csv/resume1)
def test_resume_in_place_continues_the_same_run_dir(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    logs_before = sorted(p.name for p in tmp_path.iterdir())
    out = cli("train.py", [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=6", "logger=csv",
                           "trainer.log_every_n_steps=1", "test=false", *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming in place: {run}" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == logs_before  # no second run directory
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert ckpts(run) == ["last.ckpt"]  # no last-v1.ckpt, no interrupted.ckpt
    assert (run / ".hydra" / "overrides.yaml").read_text() == overrides  # the original record is kept
    assert len(list((run / ".hydra").glob("resume-*/overrides.yaml"))) == 1
    first, resumed = (run / "csv" / "metrics.csv").read_text(), (run / "csv" / "resume1" / "metrics.csv").read_text()
    assert "train/loss" in first and "train/loss" in resumed
    assert "resuming in place" in (run / "train.log").read_text()  # the run's log is appended


def test_atomic_save_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_atomically({"step": 1}, path)

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomically({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class FillingDisk:
    """Files opened for writing on a disk that fills up once ``room`` is set: a write beyond it fails with ENOSPC, as
    on a full filesystem (where torch's zip writer reports ``RuntimeError: ... unexpected pos``)."""

    def __init__(self):
        self.room: int | None = None

    def open(self, path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)
        return self.File(handle, self) if "w" in mode else handle

    class File:
        def __init__(self, handle, disk):
            self.handle, self.disk = handle, disk

        def write(self, data):
            if self.disk.room is not None:
                if len(data) > self.disk.room:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.disk.room -= len(data)
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()


def test_a_full_disk_names_the_checkpoint_and_keeps_the_last_complete_one(make_cfg, tmp_path, monkeypatch):
    """The disk fills after the step-2 checkpoint: the run stops with the documented line for the step-4 save, and
    checkpoints/ holds the complete step-2 last.ckpt, no partial file."""
    from longseq.utils import checkpoint
    from longseq.utils.console import error_summary

    disk = FillingDisk()
    monkeypatch.setattr(checkpoint, "open", disk.open, raising=False)  # save_atomically's open

    class FillDisk(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3:
                disk.room = 4096

    cfg = make_cfg(["trainer.max_steps=6", "callbacks.model_checkpoint.every_n_train_steps=2"])
    with injected_callbacks(FillDisk()), pytest.raises(OSError) as caught:
        train(cfg)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert error_summary(caught.value) == (f"error: {last}: could not write this checkpoint at step 4 (OSError: "
                                           "[Errno 28] No space left on device)")
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no .tmp, no interrupted.ckpt
    assert torch.load(last, weights_only=False)["global_step"] == 2


def test_train_false_returns_test_metrics_without_optimized_metric(in_process_ckpt, make_cfg, tmp_path):
    cfg = make_cfg(["train=false", f"ckpt_path={in_process_ckpt}"])
    metrics = train(cfg)
    assert 0 < metrics["test/bpd"] < 6 and "val/bpd" not in metrics
    assert runner.metric_value(metrics, "val/bpd", trained=False) is None
    assert not (tmp_path / "checkpoints").exists()  # nothing trained: the run dir holds no checkpoint of its own
    assert math.isfinite(metrics["test/bpd"])
