"""Hydra submitit launchers: a 2-job submitit_local multirun end to end, the report over it; slurm composes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT, compose_config

from longseq.report.runs import load_runs
from longseq.report.table import aggregate


@pytest.mark.slow  # a multirun in subprocesses (the project marks those slow: make test-slow)
def test_submitit_local_multirun_of_two_jobs_and_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = [sys.executable, "train.py", "-m", "hydra/launcher=submitit_local", "seed=1,2", "tags=[launcher]",
               f"hydra.sweep.dir={sweep}", "logger=csv", "callbacks.samples.n_samples=0",
               "callbacks.attention_maps.enabled=false", "hydra.launcher.timeout_min=10", *FAST]
    env = {**os.environ, "PROJECT_ROOT": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert runs == ["0", "1"]
    assert list((sweep / ".submitit").glob("*/*_result.pkl"))  # the jobs went through submitit
    values = []
    for job, seed in (("0", 1), ("1", 2)):
        record = json.loads((sweep / job / "metrics.json").read_text())
        assert record["status"] == "completed"
        values.append(record["metrics"]["test/bpd"])
        ckpt = Path(record["metrics"]["ckpt_path"])
        assert ckpt.parent == sweep / job / "checkpoints" and ckpt.is_file()
        assert f"seed={seed}" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
    report = aggregate(load_runs([sweep]))
    assert report.by == [] and report.left_out.empty  # only the seed varies: one group of two runs
    assert report.table["n"].tolist() == [2]
    assert report.table["mean"].iloc[0] == pytest.approx(sum(values) / 2)


def test_submitit_slurm_composes_with_partition_gpus_time() -> None:
    cfg = compose_config(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                          "hydra.launcher.gpus_per_node=8", "hydra.launcher.tasks_per_node=8",
                          "hydra.launcher.timeout_min=1440", "trainer=ddp", "trainer.devices=8"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node, launcher.timeout_min) == ("gpu", 8, 8, 1440)
    assert launcher.submitit_folder.endswith("/.submitit/%j")
    assert launcher.max_num_timeout > 0  # time-outs requeue; the requeued job resumes (test_runs_resume.py)
    local = compose_config(["hydra/launcher=submitit_local"]).hydra.launcher
    assert local._target_.endswith("submitit_launcher.LocalLauncher") and local.timeout_min == 60
