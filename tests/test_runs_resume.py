"""Runs that never collide and resume with one command: unique locked run dirs, override replay, requeue.

CLI runs as a user starts them (``train.py`` in subprocesses, tiny model on digits), plus the pieces they use
(``rundir`` locks, ``resume.replay``, ``resolve_ckpt_path``) called directly.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import CONF, FAST, ROOT, compose_config, injected_callbacks
from omegaconf import OmegaConf

from longseq import runner
from longseq.preflight.command import preflight_train
from longseq.utils import rundir
from longseq.utils.checkpoint import resolve_ckpt_path, save_atomically
from longseq.utils.errors import ConfigError
from longseq.utils.resume import replay, resume_requeued

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "extras.print_config=false", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "callbacks.attention_maps.enabled=false",
        "callbacks.samples.n_samples=0"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
ENV.pop("HYDRA_FULL_ERROR", None)
STAMP = re.compile(r"^\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}$")


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=300)


def saved_step(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"] if path.is_file() else -1


def wait_for(condition, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def interrupt_after_step(args: list[str], ckpt: Path, step: int = 2) -> None:
    """Start ``train.py args`` and SIGTERM it once ``ckpt`` holds ``step``: it exits 143 with interrupted.ckpt."""
    proc = start(args)
    wait_for(lambda: saved_step(ckpt) >= step, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]


# --- unique, locked run directories -----------------------------------------------------------------------


def test_generated_run_and_sweep_dirs_carry_a_per_process_suffix(tmp_path):
    cfg = compose_config([f"paths.log_dir={tmp_path}"])
    run, sweep = Path(cfg.hydra.run.dir), Path(cfg.hydra.sweep.dir)
    assert run.parent == tmp_path / "train" / "runs" and STAMP.match(run.name)
    assert sweep.parent == tmp_path / "train" / "multiruns" and STAMP.match(sweep.name)
    assert run.name.endswith("_" + rundir.run_suffix()) and sweep.name.endswith("_" + rundir.run_suffix())


def test_the_tasks_of_one_distributed_launch_share_a_suffix(monkeypatch):
    monkeypatch.setattr(rundir, "_SUFFIX", None)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert rundir.run_suffix() == "4711-0"  # every srun task composes the same run dir
    monkeypatch.setattr(rundir, "_SUFFIX", None)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    first = rundir.run_suffix()
    monkeypatch.setattr(rundir, "_SUFFIX", None)
    assert re.fullmatch("[0-9a-f]{6}", first) and rundir.run_suffix() != first  # one process: its own token


@pytest.mark.slow  # two concurrent CLI runs; the fast set checks the suffix and the lock in-process
def test_two_runs_started_in_the_same_second_get_their_own_dirs_and_scores(tmp_path):
    # The timestamp is pinned (the same second for both); the suffix is what the default run dir appends.
    pinned = f"hydra.run.dir={tmp_path}/runs/2026-01-01_00-00-00_${{run_suffix:}}"
    procs = [start([pinned, f"seed={seed}", "trainer.max_steps=3", *TINY]) for seed in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(STAMP.match(r.name) for r in runs)
    printed = []
    for out, _ in outs:
        (line,) = [x for x in out.splitlines() if x.startswith("tested checkpoint: ")]
        run = Path(line.removeprefix("tested checkpoint: ")).parent.parent
        score = float(re.search(r"test/bpd=([0-9.]+)", out).group(1))
        record = json.loads((run / "metrics.json").read_text())
        assert record["status"] == "completed"
        assert record["metrics"]["test/bpd"] == pytest.approx(score, abs=1e-4)  # its own score, from its own dir
        printed.append((run, score))
    assert printed[0][0] != printed[1][0] and printed[0][1] != printed[1][1]
    assert not list(tmp_path.rglob(".lock"))  # released at the end


@pytest.mark.slow  # two concurrent CLI runs; the fast set checks the lock in-process (test_lock_is_exclusive_...)
def test_second_live_run_on_one_run_dir_exits_naming_it_and_the_first_is_unharmed(tmp_path):
    run = tmp_path / "run"
    first = start([f"hydra.run.dir={run}", "seed=1", "trainer.max_steps=100000",
                   "callbacks.model_checkpoint.every_n_train_steps=2", *TINY])
    try:
        wait_for(lambda: saved_step(run / "checkpoints" / "last.ckpt") >= 2, first)  # training
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        second = cli([f"hydra.run.dir={run}", "seed=2", "trainer.max_steps=3", *TINY])
        assert second.returncode == 1
        assert f"error: hydra.run.dir: {run} is in use by another live run (pid {first.pid} on " in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # still training
        assert (run / ".hydra" / "overrides.yaml").read_text() == overrides  # nothing of the second's written
        assert json.loads((run / ".lock").read_text())["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 143  # its own orderly SIGTERM exit, with its checkpoint
    assert saved_step(run / "checkpoints" / "interrupted.ckpt") >= 2
    assert "seed=2" not in (run / ".hydra" / "overrides.yaml").read_text()
    assert not (run / ".lock").exists()


def test_lock_is_exclusive_reentrant_and_a_stale_one_is_taken_over(tmp_path, caplog):
    busy = tmp_path / "busy"
    busy.mkdir()
    fd = os.open(busy / ".lock", os.O_RDWR | os.O_CREAT)  # another holder: its own open file description
    os.write(fd, json.dumps({"pid": 4242, "host": "node7", "started": "t"}).encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ConfigError, match=rf"hydra.sweep.dir: {busy} is in use by another live run "
                                              r"\(pid 4242 on node7"):
            rundir.acquire(busy, "hydra.sweep.dir")
        assert rundir.live_holder(busy)["pid"] == 4242
    finally:
        os.close(fd)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".lock").write_text(json.dumps({"pid": int(dead.stdout), "host": "vm", "started": "t"}))
    try:
        assert rundir.live_holder(stale) is None
        rundir.acquire(stale)
        rundir.acquire(stale)  # re-entrant in the same process
        assert f"taking over the stale lock of {stale} (pid {int(dead.stdout)}" in caplog.text
        assert json.loads((stale / ".lock").read_text())["pid"] == os.getpid()
    finally:
        rundir.release(stale)
    assert not (stale / ".lock").exists()


def test_resuming_a_run_that_is_still_running_fails_naming_ckpt_path(tmp_path, capsys):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    save_atomically({"global_step": 2, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, json.dumps({"pid": 4242, "host": "node7", "started": "t"}).encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(SystemExit) as stop:
            preflight_train(["train.py", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"], CONF)
    finally:
        os.close(fd)
    assert stop.value.code == 1
    assert (f"error: ckpt_path: {run} is still being written by a live run (pid 4242 on node7"
            in capsys.readouterr().err)


# --- one-command resume --------------------------------------------------------------------------------------


def test_replay_puts_the_commands_overrides_on_top_of_the_saved_ones():
    saved = ["model.d_model=32", "trainer.max_steps=60", "+trainer.gradient_clip_val=1.0", "attention=local",
             "ckpt_path=/old/run/last.ckpt"]
    given = ["trainer.max_steps=80", "trainer.gradient_clip_val=0.5", "logger=csv", "ckpt_path=/new/last.ckpt"]
    result, kept, changed = replay(saved, given)
    assert kept == ["model.d_model=32", "attention=local"]
    assert result == ["model.d_model=32", "attention=local", "trainer.max_steps=80",
                      "++trainer.gradient_clip_val=0.5", "logger=csv", "ckpt_path=/new/last.ckpt"]
    assert changed == ["trainer.max_steps=80 (was trainer.max_steps=60)",
                       "++trainer.gradient_clip_val=0.5 (was +trainer.gradient_clip_val=1.0)", "logger=csv (new)"]


@pytest.mark.slow  # two CLI runs; the fast set replays in-process (test_preflight_replays_...)
def test_ckpt_path_alone_resumes_with_the_runs_overrides_and_its_max_steps(tmp_path):
    run = tmp_path / "run"
    trained_with = [f"hydra.run.dir={run}", "trainer.max_steps=40", "optimizer.lr=0.002", "seed=7",
                    "callbacks.model_checkpoint.every_n_train_steps=2", "test=false", *TINY]
    interrupt_after_step(trained_with, run / "checkpoints" / "last.ckpt")
    interrupted = run / "checkpoints" / "interrupted.ckpt"
    step = saved_step(interrupted)
    assert 2 <= step < 40

    out = cli([f"ckpt_path={interrupted}"])  # nothing else typed
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resume: replaying {run / '.hydra' / 'overrides.yaml'}: trainer.max_steps=40 optimizer.lr=0.002" in out.stderr
    assert f"resuming in place: {run}" in out.stderr
    assert saved_step(run / "checkpoints" / "last.ckpt") == 40  # the original max_steps
    resolved = OmegaConf.load(run / "config_resolved.yaml")
    assert (resolved.model.d_model, resolved.optimizer.lr, resolved.seed) == (32, 0.002, 7)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]  # interrupted retired
    assert "retired" in (run / "train.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_directory_as_ckpt_path_resolves_or_lists_what_it_holds(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    for name, step in (("best.ckpt", 4), ("last.ckpt", 6), ("interrupted.ckpt", 9)):
        save_atomically({"global_step": step, "state_dict": {}}, ckpts / name)
    assert resolve_ckpt_path(tmp_path / "run") == ckpts / "best.ckpt"
    assert resolve_ckpt_path(ckpts, resume=True) == ckpts / "interrupted.ckpt"  # the newest state
    assert f"ckpt_path: {ckpts} is a directory: using {ckpts / 'interrupted.ckpt'}" in capsys.readouterr().err
    other = tmp_path / "other"
    save_atomically({"global_step": 1, "state_dict": {}}, other / "epoch=3.ckpt")
    with pytest.raises(ConfigError, match=r"ckpt_path: .*other is a directory without best.ckpt or last.ckpt .*"
                                          r"it holds \['epoch=3.ckpt'\]: pass one of them"):
        resolve_ckpt_path(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="it holds no .ckpt file"):
        resolve_ckpt_path(tmp_path / "empty", resume=True)


@pytest.mark.slow  # a CLI training run + eval; the fast set resolves directories in-process
def test_eval_of_a_checkpoints_directory_uses_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert cli([f"hydra.run.dir={run}", "trainer.max_steps=2", "test=false", *TINY]).returncode == 0
    out = subprocess.run([sys.executable, "eval.py", f"ckpt_path={run / 'checkpoints'}",
                          f"hydra.run.dir={tmp_path / 'eval'}", "trainer.limit_test_batches=1",
                          "trainer.enable_progress_bar=false"],
                         cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"using {run / 'checkpoints' / 'last.ckpt'} (no best.ckpt)" in out.stderr
    assert re.search(r"^test/bpd: [0-9.]+$", out.stdout, re.M)


# --- requeue ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two CLI multiruns; the fast set runs the same code path in-process (below)
def test_a_requeued_launcher_job_resumes_in_place(tmp_path):
    """What a SLURM requeue does: the same job (same sweep dir, same overrides) starts again after a kill."""
    sweep = tmp_path / "sweep"
    job = ["-m", f"hydra.sweep.dir={sweep}", "seed=3", "trainer.max_steps=40", "test=false",
           "callbacks.model_checkpoint.every_n_train_steps=2", *TINY]
    interrupt_after_step(job, sweep / "0" / "checkpoints" / "last.ckpt")
    step = saved_step(sweep / "0" / "checkpoints" / "interrupted.ckpt")
    assert 2 <= step < 40
    assert json.loads((sweep / "0" / "metrics.json").read_text())["status"] == "interrupted"

    out = cli(job)  # the requeued attempt: the very same command
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"requeued job: resuming in place from {sweep / '0' / 'checkpoints' / 'interrupted.ckpt'} (step {step})" \
        in out.stderr
    assert saved_step(sweep / "0" / "checkpoints" / "last.ckpt") == 40
    assert not (sweep / "0" / "checkpoints" / "interrupted.ckpt").exists()
    assert json.loads((sweep / "0" / "metrics.json").read_text())["status"] == "completed"
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith(".")) == ["0", "multirun.yaml"]


class Crash(L.Callback):
    """The injected fault: the job dies after optimizer step 5 (as a preempted or timed-out job does)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 5:
            raise RuntimeError("node lost")


def test_requeued_job_resumes_from_its_newest_checkpoint_in_process(tmp_path, caplog):
    """train.py's path for a launcher job (resume_requeued, then runner.train), attempt after attempt."""
    job = ["trainer.max_steps=8", "callbacks.model_checkpoint.every_n_train_steps=2", "test=false", *TINY[-2:]]
    cfg = compose_config(job, tmp_path)
    assert resume_requeued(cfg, tmp_path, multirun=True).get("ckpt_path") is None  # first attempt: nothing to resume
    with injected_callbacks(Crash()), pytest.raises(RuntimeError, match="node lost"):
        runner.train(cfg)
    ckpts = tmp_path / "checkpoints"
    assert (saved_step(ckpts / "last.ckpt"), saved_step(ckpts / "interrupted.ckpt")) == (4, 5)

    assert resume_requeued(compose_config(job, tmp_path), tmp_path, multirun=False).get("ckpt_path") is None
    other = resume_requeued(compose_config([*job, "optimizer.lr=0.01"], tmp_path), tmp_path, multirun=True)
    assert other.get("ckpt_path") is None and "holds checkpoints of another configuration" in caplog.text

    cfg = resume_requeued(compose_config(job, tmp_path), tmp_path, multirun=True)  # the requeued attempt
    assert cfg.ckpt_path == str(ckpts / "interrupted.ckpt")
    runner.train(cfg)
    assert saved_step(ckpts / "last.ckpt") == 8
    assert not (ckpts / "interrupted.ckpt").exists()  # retired: last.ckpt is newer
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "completed"


def test_preflight_replays_the_runs_overrides_under_the_commands_own(tmp_path, capsys):
    run = tmp_path / "run"
    small = [o for o in FAST if not o.startswith("trainer.max_steps=")]
    trained_with = [*small, "trainer.max_steps=2", "optimizer.lr=0.002", "model.n_heads=4", "test=false"]
    runner.train(compose_config(trained_with, run, fast=False))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(trained_with))  # as Hydra records them
    ckpt = run / "checkpoints" / "last.ckpt"
    argv, checked = preflight_train(["train.py", f"ckpt_path={ckpt}", "trainer.max_steps=5",
                                     f"paths.log_dir={run / 'logs'}"], CONF)  # compose_config's log_dir
    replayed = [o for o in trained_with if o != "trainer.max_steps=2"]
    assert checked and argv[1:len(replayed) + 1] == replayed  # model.n_heads=4 too: the model must match
    assert argv[len(replayed) + 1:len(replayed) + 4] == ["trainer.max_steps=5", f"paths.log_dir={run / 'logs'}",
                                                        f"ckpt_path={ckpt}"]
    assert argv[-2] == f"hydra.run.dir={run}" and argv[-1].startswith("hydra.output_subdir=.hydra/resume-")
    err = capsys.readouterr().err
    assert f"resume: replaying {run / '.hydra' / 'overrides.yaml'}: {' '.join(replayed)}" in err
    assert ("resume: this command changes trainer.max_steps 2 -> 5 (optimizer and scheduler settings apply from the "
            "resumed step)") in err


# --- what a resuming command changes ------------------------------------------------------------------------------


def csv_rows(path: Path, column: str) -> dict[int, float]:
    """``{step: value}`` of one column of a Lightning ``metrics.csv`` (rows without it skipped)."""
    import csv

    with path.open() as f:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(f) if row.get(column)}


def schedule_factor(total_steps: int, **kwargs) -> callable:
    """The factor ``conf/scheduler/cosine.yaml``'s schedule gives each step (``warmup_cosine``'s own lambda)."""
    from longseq.tasks.schedules import warmup_cosine

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return warmup_cosine(optimizer, total_steps, **kwargs).lr_lambdas[0]


def trained_run_dir(run: Path, overrides: list[str]) -> None:
    """A finished in-process run at ``run`` with Hydra's record of its overrides (what train.py leaves)."""
    runner.train(compose_config(overrides, run, fast=False))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))


def resume(argv: list[str], run: Path) -> tuple[list[str], bool]:
    """train.py for a resuming command, in-process: the pre-flight, then the job it hands to Hydra, and Hydra's record
    of it (``.hydra/resume-<time>/overrides.yaml``, which the next resume replays)."""
    rewritten, checked = preflight_train(["train.py", *argv, f"paths.log_dir={run / 'logs'}"], CONF)  # compose_config's
    job = [a for a in rewritten[1:] if not a.startswith("hydra.")]
    runner.train(compose_config(job, run, fast=False), checked=checked)
    record = run / ".hydra" / f"resume-{len(list((run / '.hydra').glob('resume-*'))):04d}" / "overrides.yaml"
    record.parent.mkdir()
    record.write_text(OmegaConf.to_yaml(job))
    return rewritten, checked


RESUMABLE = [o for o in FAST if not o.startswith("trainer.max_steps=")] + [
    "optimizer.lr=0.002", "scheduler.warmup_steps=2", "scheduler.min_lr_ratio=0.1", "trainer.log_every_n_steps=1",
    "test=false", "callbacks.samples.n_samples=0", "callbacks.attention_maps.enabled=false"]


def test_a_resume_trains_with_the_commands_learning_rate_from_the_resumed_step(tmp_path, capsys, caplog):
    """``ckpt_path=<run> optimizer.lr=1e-5``: the logged ``train/lr`` is 1e-5 x the schedule's factor from the resumed
    step on (it used to stay the checkpoint's); the steps before it keep the old rate, the optimizer its moments."""
    caplog.set_level("INFO", logger="longseq.callbacks.resume")
    run = tmp_path / "run"
    trained_run_dir(run, [*RESUMABLE, "trainer.max_steps=4"])
    before = csv_rows(run / "csv" / "metrics.csv", "train/lr")
    old = schedule_factor(4, warmup_steps=2, min_lr_ratio=0.1)
    assert before == pytest.approx({step: 0.002 * old(step) for step in range(4)})

    resume([f"ckpt_path={run}", "trainer.max_steps=8", "optimizer.lr=1e-5", "scheduler.min_lr_ratio=0.5"], run)
    err = capsys.readouterr().err
    assert ("resume: this command changes optimizer.lr 0.002 -> 1e-05, scheduler.min_lr_ratio 0.1 -> 0.5, "
            "trainer.max_steps 4 -> 8 (optimizer and scheduler settings apply from the resumed step)") in err
    after = csv_rows(run / "csv" / "resume1" / "metrics.csv", "train/lr")
    new = schedule_factor(8, warmup_steps=2, min_lr_ratio=0.5)
    assert after == pytest.approx({step: 1e-5 * new(step) for step in range(4, 8)}, rel=1e-6)
    (applied,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: from step")]
    assert applied == (f"resume: from step 4 the optimizer runs with optimizer.lr 0.002 -> 1e-05; train/lr is "
                       f"{1e-5 * new(4):.4g} = optimizer.lr x {new(4):.4g}, the schedule's factor at step 4")


def test_a_resume_applies_optimizer_hyperparameters_and_keeps_the_rest_exact(tmp_path):
    """Weight decay and betas from the command reach the restored parameter groups (the no-decay group keeps 0);
    a resume that changes nothing continues the schedule exactly where the checkpoint left it."""
    run = tmp_path / "run"
    trained_run_dir(run, [*RESUMABLE, "trainer.max_steps=2"])
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.setdefault(trainer.global_step, [dict(g) for g in trainer.optimizers[0].param_groups])

    with injected_callbacks(Probe()):
        resume([f"ckpt_path={run}", "trainer.max_steps=3", "optimizer.weight_decay=0.3", "optimizer.betas=[0.8,0.9]"],
               run)
        decay, no_decay = seen[2]
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
        assert list(decay["betas"]) == list(no_decay["betas"]) == [0.8, 0.9]
        resume([f"ckpt_path={run}", "trainer.max_steps=4"], run)  # only longer: the learning rate is the schedule's
    factor = schedule_factor(4, warmup_steps=2, min_lr_ratio=0.1)
    assert seen[3][0]["lr"] == 0.002 * factor(3)  # bit for bit what the schedule gives that step
    assert seen[3][0]["weight_decay"] == 0.3  # the run's own settings now: replayed from its last resume


@pytest.mark.parametrize("override,key,old,new", [
    ("model.d_model=64", "model.d_model", "32", "64"),
    ("attention=local", "attention.name", "full", "local"),
    ("task.seq_len=32", "task.seq_len", "64", "32"),
])
def test_a_resume_refuses_to_change_the_model_or_the_tasks_geometry(override, key, old, new, tmp_path, capsys):
    run = tmp_path / "run"
    trained_run_dir(run, [*RESUMABLE, "trainer.max_steps=2"])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        preflight_train(["train.py", f"ckpt_path={run}", override], CONF)
    assert stop.value.code == 1
    (line,) = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error: ")]
    assert line.startswith(f"error: {key}: cannot change when resuming: {run / 'checkpoints' / 'last.ckpt'} was "
                           f"trained with {key}={old} and this command gives {new}")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_resuming_a_completed_run_says_so_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    trained_run_dir(run, [*RESUMABLE, "trainer.max_steps=2"])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        preflight_train(["train.py", f"ckpt_path={run}"], CONF)
    assert stop.value.code == 0
    err = capsys.readouterr().err
    assert (f"resume: {run} is complete: last.ckpt is at step 2 of trainer.max_steps=2 and its results are in "
            f"{run / 'metrics.json'}; nothing to train") in err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no csv/resume1, no re-test


def test_a_sigterm_mid_epoch_saves_interrupted_ckpt_and_the_resume_continues_in_place(tmp_path):
    """test_runs_interrupts.py's CLI case in this process (that one is in the slow suite): a real SIGTERM at step 2,
    through Lightning's handler (which calls the recorder installed here first, so a process without Lightning's
    handler records the signal instead of dying), ends the run with exit code 143 and interrupted.ckpt mid-epoch; the
    resume from it continues in the same directory at the saved step."""
    run = tmp_path / "run"
    overrides = [*RESUMABLE, "trainer.max_steps=40"]
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))  # Hydra writes it at the job's start

    class Terminate(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    received = []
    original_handler = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with injected_callbacks(Terminate()), pytest.raises(SystemExit) as stop:
            runner.train(compose_config(overrides, run, fast=False))
    finally:
        signal.signal(signal.SIGTERM, original_handler)
    assert stop.value.code == 143 and received == [signal.SIGTERM]
    interrupted = run / "checkpoints" / "interrupted.ckpt"
    step = saved_step(interrupted)
    assert step >= 2 and torch.load(interrupted, weights_only=False)["epoch"] == 0  # 22 steps an epoch: mid-epoch

    resume([f"ckpt_path={interrupted}", f"trainer.max_steps={step + 3}"], run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no second run directory
    assert saved_step(run / "checkpoints" / "last.ckpt") == step + 3
    assert min(csv_rows(run / "csv" / "resume1" / "metrics.csv", "train/loss")) == step  # the count continues
