"""Distributed runs on CPU, through ``train.py`` as a user starts them: every logger x every strategy that runs in
spawned or separate processes, with and without a validation during fit.

Each run must exit 0 and keep what its ranks wrote: the training rows of ``csv/metrics.csv`` beside the final
``val/bpd`` and ``test/bpd``, ``metrics.json`` completed with those values, and ``eval.py`` on the run's checkpoints
reproducing them. The fast suite runs the case that crashed (``trainer=ddp_cpu``, no validation before
``trainer.max_steps``, every logger at once: ``logger=many_loggers``); the slow suite runs the whole matrix.
FSDP needs a GPU in Lightning: on CPU it is a configuration error (``test_messages.py``).
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, compose_config

from longseq.runner import evaluate

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "extras.print_config=false",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.samples.n_samples=0",
        "callbacks.attention_maps.enabled=false", "seed=7", "trainer.max_steps=20", "trainer.log_every_n_steps=5"]
STRATEGIES = {
    "ddp_cpu": ["trainer=ddp_cpu"],  # ddp_spawn: the fit runs in spawned workers, the final evaluation in the launcher
    "ddp": ["trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true"],  # Lightning starts train.py again
}
LOGGERS = {
    "none": ["logger=none"],  # still csv/metrics.csv: extras.csv_metrics
    "csv": ["logger=csv"],
    "tensorboard": ["logger=tensorboard"],
    "wandb": ["logger=wandb", "logger.wandb.offline=true"],
    "many_loggers": ["logger=many_loggers", "logger.wandb.offline=true"],
}
VALIDATION = {
    "after_fit": [],  # max_steps ends fit before the first epoch's validation: the final weights are validated after it
    "during_fit": ["trainer.val_check_interval=10", "trainer.check_val_every_n_epoch=null"],
}


def train_cli(args: list[str], run: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "train.py", *TINY, *args, f"hydra.run.dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=540)


def evaluated(ckpt: str | Path, split: str, where: Path) -> float:
    """What ``eval.py ckpt_path=<ckpt> split=<split>`` reports (one process, every example once)."""
    cfg = compose_config([f"ckpt_path={ckpt}", f"split={split}", "trainer.enable_progress_bar=false"], where,
                         config_name="eval")
    return evaluate(cfg)[f"{split}/bpd"]


def check_distributed_run(strategy: str, logger: str, validation: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = train_cli([*STRATEGIES[strategy], *LOGGERS[logger], *VALIDATION[validation]], run)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "error:" not in out.stderr
    record = json.loads((run / "metrics.json").read_text())
    assert record["status"] == "completed", record
    reported = record["metrics"]
    rows = list(csv.DictReader((run / "csv" / "metrics.csv").open()))
    trained = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in trained] == [4, 9, 14, 19]  # every 5 steps: nothing the ranks wrote was lost
    validated = [r for r in rows if r.get("val/bpd")]
    # Lightning logs a validation during fit at the step before its count (9, 19); the final weights' at step 20
    assert [int(r["step"]) for r in validated] == ([9, 19] if validation == "during_fit" else [20])
    (tested,) = [r for r in rows if r.get("test/bpd")]
    assert int(tested["step"]) == 20
    assert float(validated[-1]["val/bpd"]) == pytest.approx(reported["val/bpd"], rel=1e-6)
    assert float(tested["test/bpd"]) == pytest.approx(reported["test/bpd"], rel=1e-6)
    assert evaluated(run / "checkpoints" / "last.ckpt", "val", tmp_path / "eval_val") == pytest.approx(
        reported["val/bpd"], rel=1e-5)
    assert evaluated(reported["ckpt_path"], "test", tmp_path / "eval_test") == pytest.approx(
        reported["test/bpd"], rel=1e-5)
    if logger in ("tensorboard", "many_loggers"):
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    if logger in ("wandb", "many_loggers"):
        assert len(list((run / "wandb").glob("offline-run-*"))) == 1


FAST_CASE = ("ddp_cpu", "many_loggers", "after_fit")


@pytest.mark.slow  # ~60 s of DDP runs; the fast set checks DDP's metrics against one process (test_train)
def test_ddp_cpu_final_evaluation_keeps_the_training_rows_for_every_logger(tmp_path):
    """The issue's run: ``trainer=ddp_cpu trainer.max_steps=20`` ends before any validation; the launcher validates
    the final weights and tests them. It used to rewrite metrics.csv with its own header (training rows lost) and
    fail a run that had trained."""
    check_distributed_run(*FAST_CASE, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,logger,validation", [
    case for case in itertools.product(sorted(STRATEGIES), sorted(LOGGERS), sorted(VALIDATION)) if case != FAST_CASE])
def test_every_logger_and_strategy_keeps_the_training_rows_and_reports_the_final_metric(strategy, logger,
                                                                                        validation, tmp_path):
    check_distributed_run(strategy, logger, validation, tmp_path)
