"""End-to-end training: every task on fixtures, eval round trip, resume, DDP on CPU, W&B offline, multirun.

SIGTERM / kill -9 are in test_runs_interrupts.py, checkpoint and NaN faults in test_runs_checkpoints.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose_config, injected_callbacks
from dataset_files import write_cifar10_fixture, write_imagenet64_fixture

from longseq.runner import evaluate, train


def test_digits_trains_and_tests_best_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null"])
    metrics = train(cfg)
    assert 0 < metrics["test/bpd"] < 8
    assert metrics["val/bpd_best"] <= metrics["val/bpd"] + 1e-6
    assert Path(metrics["ckpt_path"]).name == "best.ckpt"
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "config_resolved.yaml").is_file()


@pytest.mark.parametrize("task,writer,extra", [
    ("cifar10", write_cifar10_fixture, ["task.data.verify_checksums=false", "task.data.val_size=4", "task.data.download=false"]),
    ("imagenet64", write_imagenet64_fixture, ["task.data.train_batches=2", "task.data.val_size=2"]),
])
def test_fast_dev_run_on_fixture(task, writer, extra, make_cfg, tmp_path):
    data_dir = tmp_path / "data"
    writer(data_dir)
    cfg = make_cfg([f"task={task}", f"paths.data_dir={data_dir}", "task.batch_size=2", "task.data.num_workers=0",
                    "trainer.fast_dev_run=true", *extra])
    metrics = train(cfg)
    assert 0 < metrics["test/bpd"] < 12  # 256 levels: uniform is 8 bits/dim


def test_fast_dev_run_digits(make_cfg, tmp_path):
    metrics = train(make_cfg(["trainer.fast_dev_run=true"]))
    assert 0 < metrics["test/bpd"] < 6


def test_eval_round_trip_reproduces_test_bpd_and_saves_it_in_its_run_dir(make_cfg, tmp_path):
    metrics = train(compose_config(["trainer.max_steps=4"], tmp_path / "run"))
    ecfg = compose_config([f"ckpt_path={metrics['ckpt_path']}", "trainer.limit_test_batches=1"], tmp_path / "eval", config_name="eval")
    evaluated = evaluate(ecfg)
    assert evaluated["test/bpd"] == pytest.approx(metrics["test/bpd"], rel=1e-5)
    record = json.loads((tmp_path / "eval" / "metrics.json").read_text())  # not only on the console
    assert record["status"] == "completed" and record["metrics"]["test/bpd"] == pytest.approx(evaluated["test/bpd"])


def test_a_run_shorter_than_its_warm_up_says_so(make_cfg, caplog):
    """``trainer.max_steps=3`` with the cosine schedule's 30 warm-up steps never reaches ``optimizer.lr``."""
    train(make_cfg(["trainer.max_steps=3", "scheduler.warmup_steps=30", "test=false"]))
    (warning,) = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert warning == ("scheduler.warmup_steps=30 is longer than this run (3 optimizer steps): the learning rate never "
                       "finishes its warm-up (the last step's learning rate is 0.0003, 10% of optimizer.lr=0.003); lower "
                       "scheduler.warmup_steps "
                       "or raise trainer.max_steps")
    caplog.clear()
    train(make_cfg(["trainer.max_steps=3", "scheduler.warmup_steps=3", "test=false"]))
    assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]


def test_resume_continues_at_same_step_with_optimizer_state(make_cfg, tmp_path):
    train(compose_config(["trainer.max_steps=5", "test=false"], tmp_path / "a"))
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 5

    import lightning as L

    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, module):
            seen["step"] = trainer.global_step
            seen["exp_avg"] = next(iter(trainer.optimizers[0].state.values()))["exp_avg"].clone()

    second = compose_config(["trainer.max_steps=8", "test=false", f"ckpt_path={last}"], tmp_path / "b")
    with injected_callbacks(Probe()):
        train(second)
    assert seen["step"] == 5
    saved_exp_avg = next(iter(saved["optimizer_states"][0]["state"].values()))["exp_avg"]
    torch.testing.assert_close(seen["exp_avg"], saved_exp_avg)
    assert torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8


def test_ddp_cpu_metrics_equal_a_single_process_eval_of_the_same_weights(make_cfg, tmp_path, caplog):
    # max_steps ends fit before any validation: the reported val/bpd comes from the final validation.
    cfg = make_cfg(["trainer=ddp_cpu", "trainer.max_steps=2", "task.batch_size=8", "trainer.limit_val_batches=2",
                    "trainer.limit_test_batches=2"])
    metrics = train(cfg)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert metrics["ckpt_path"] == str(last)
    assert "no checkpoint saved" not in caplog.text
    for split in ("val", "test"):
        ecfg = compose_config([f"ckpt_path={last}", f"split={split}", "trainer.limit_val_batches=2",
                               "trainer.limit_test_batches=2"], tmp_path / f"eval_{split}", config_name="eval")
        assert evaluate(ecfg)[f"{split}/bpd"] == pytest.approx(metrics[f"{split}/bpd"], rel=1e-6)


def test_wandb_offline_writes_run_files(make_cfg, tmp_path):
    cfg = make_cfg(["logger=wandb", "logger.wandb.offline=true", "trainer.max_steps=2"])
    train(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))


def test_csv_logger_writes_metrics_and_samples(make_cfg, tmp_path):
    cfg = make_cfg(["logger=csv", "trainer.max_steps=44", "task.sample_every_n_epochs=1", "callbacks.samples.n_samples=4"])
    train(cfg)
    text = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "val/bpd" in text and "train/loss" in text and "test/bpd" in text
    assert list((tmp_path / "samples").glob("samples_step*.png"))
    assert list((tmp_path / "csv").glob("samples_step*.png"))


def run_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


TINY_CLI = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1", "extras.print_config=false", "trainer.enable_progress_bar=false"]


@pytest.mark.slow  # ~40 s: a CLI multirun
def test_multirun_gives_two_run_dirs_and_two_wandb_runs(tmp_path):
    out = run_cli(["-m", "seed=1,2", "trainer.max_steps=2", "logger=wandb", "logger.wandb.offline=true",
                   f"paths.log_dir={tmp_path}", *TINY_CLI], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.glob("train/multiruns/*/*") if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        assert len(list((job / "wandb").glob("offline-run-*"))) == 1
        assert (job / "checkpoints" / "last.ckpt").is_file()
