"""The console and the loggers of a run: progress bar, logged metrics, final samples, fdr, train=false, W&B resume;
every README Quick start command and debug=limit|fdr|overfit|profiler on the default task."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import lightning as L
import pytest
from conftest import ROOT, compose_config, injected_callbacks

from longseq.callbacks.progress import StepProgressBar
from longseq.runner import train
from longseq.utils.resume import WANDB_RUN_DIR


def test_step_progress_bar_counts_optimizer_steps_to_max_steps(make_cfg):
    cfg = make_cfg(["trainer.max_steps=5", "trainer.enable_progress_bar=true"])
    seen = {}

    class Probe(L.Callback):
        def on_train_end(self, trainer, module):
            bar = next(c for c in trainer.callbacks if isinstance(c, StepProgressBar)).train_progress_bar
            seen.update(total=bar.total, n=bar.n, desc=bar.desc, postfix=bar.postfix)

    with injected_callbacks(Probe()):
        train(cfg)
    assert (seen["total"], seen["n"]) == (5, 5)
    assert seen["desc"].startswith("train") and "tokens/s=" in seen["postfix"]


def test_lr_grad_norm_tokens_per_s_are_logged_and_a_final_sample_grid_is_saved(make_cfg, tmp_path):
    train(make_cfg(["logger=csv", "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                    "callbacks.samples.n_samples=4", "task.sample_every_n_epochs=1000"]))
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/loss"} <= set(header)
    assert [p.name for p in (tmp_path / "samples").glob("*.png")] == ["samples_step3.png"]


def test_fast_dev_run_writes_no_checkpoint(make_cfg, tmp_path):
    metrics = train(make_cfg(["debug=fdr"]))
    assert math.isfinite(metrics["test/bpd"])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_wandb_run_is_resumed_by_id_in_place(make_cfg, tmp_path):
    train(make_cfg(["logger=wandb", "logger.wandb.offline=true", "trainer.max_steps=2", "test=false"]))
    first = list((tmp_path / "wandb").glob("offline-run-*"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    train(compose_config(["logger=wandb", "logger.wandb.offline=true", "trainer.max_steps=3", "test=false",
                          f"ckpt_path={last}"], tmp_path))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(first) == 1 and len(runs) == 2
    # one W&B run id, resumed (a run resumed within the same second gets a "-1" suffix on its directory)
    assert len({re.match(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)", p.name).group(1) for p in runs}) == 1


@pytest.mark.slow  # ~25 s of CLI runs; test_transformer_xl evaluates XL and TRAMS in-process
def test_xl_trams_evaluation_without_training_exits_zero(make_cfg, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("def f(x):\n    return x + 1\n" * 200).encode())
    xl = [f"task.data.path={corpus}", "trainer=cpu", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
          "model.d_inner=64", "model.tgt_len=8", "task.batch_size=4", "task.data.eval_batch_size=2"]
    metrics = train(compose_config(["task=enwik8", "model=transformer_xl", "trainer.max_steps=2", "test=false",
                                    "memory.mem_len=8", *xl], tmp_path / "xl"))
    assert math.isfinite(metrics["val/bpc"])
    run = tmp_path / "trams"
    out = subprocess.run(
        [sys.executable, "train.py", "experiment=enwik8/xl_trams", f"task.module.init_from={tmp_path / 'xl' / 'checkpoints' / 'last.ckpt'}",
         *xl, "memory.eval_tgt_len=8", "memory.eval_mem_len=8", "memory.pool=16", "memory.recent_keep=4",
         "memory.topk=4", "trainer.limit_test_batches=2", "extras.print_config=false",
         "trainer.enable_progress_bar=false", f"hydra.run.dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test/bpc=" in out.stdout and "test/trams_bpc=" in out.stdout
    assert "last checkpoint:" not in out.stdout and "tested checkpoint:" not in out.stdout  # no path that does not exist
    assert not (run / "checkpoints").exists()


def test_config_summary_lists_the_top_level_choices_only(tmp_path):
    """The image task's own sample grid (a nested ``callbacks/samples`` choice) is not a choice the user made."""
    from longseq.utils.config import config_summary

    choices = dict(compose_config(["task=cifar10", "attention=combiner", "partition=axial"], tmp_path).hydra.runtime.choices)
    assert any(key.startswith("callbacks/samples") for key in choices)
    assert config_summary(choices, ["seed=1"]) == ("config: logger=none callbacks=default trainer=default scheduler=cosine "
                                                   "optimizer=adamw model=transformer partition=axial attention=combiner "
                                                   "task=cifar10\noverrides: seed=1")


def test_error_summary_is_one_line_naming_the_key_file_or_step():
    from longseq.utils.console import error_summary
    from longseq.utils.errors import ConfigError, DataError, NonFiniteError

    assert error_summary(ConfigError("optimizer.lr", "must be > 0,\n got -1")) == "error: optimizer.lr: must be > 0, got -1"
    assert error_summary(DataError("a.tsv", "expected 2 columns", line=4)) == "error: a.tsv:4: expected 2 columns"
    assert error_summary(NonFiniteError("train/loss", 7, "loss=nan")) == "error: train/loss: not finite at step 7 (loss=nan)"
    worker = RuntimeError("\n\n-- Process 0 terminated with the following error:\nTraceback (most recent call last):\n"
                          '  File "x.py", line 1\nlongseq.utils.errors.NonFiniteError: train/loss: not finite at step 3\n')
    assert error_summary(worker) == "error: train/loss: not finite at step 3"  # the worker's own key, not its type
    worker = RuntimeError("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                          "ValueError: task.batch_size=3 (global batch) must be even\n")
    assert error_summary(worker) == "error: task.batch_size: 3 (global batch) must be even"
    # A datamodule is built through hydra.utils.instantiate, which wraps its constructor's error: unwrapped.
    from hydra.errors import InstantiationException

    wrapped = InstantiationException("Error in call to target 'X'")
    wrapped.__cause__ = DataError("corpus.txt", "the corpus file (task.data.path) is empty")
    assert error_summary(wrapped) == "error: corpus.txt: the corpus file (task.data.path) is empty"


def test_bench_warns_when_another_process_keeps_the_cpu_busy():
    from io import StringIO

    from rich.console import Console

    from longseq.bench.run import BUSY_CORES, other_cpu_load, warn_if_busy

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load = other_cpu_load(seconds=1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert load > BUSY_CORES  # the spinning process alone keeps about one core busy
    out = StringIO()
    warn_if_busy(Console(file=out, width=80), load, "before the run")  # a piped console: rich's 80 columns
    assert "warning" in out.getvalue() and "not reliable" in out.getvalue()
    assert out.getvalue().count("\n") == 1  # one line, never broken mid-sentence
    quiet = StringIO()
    warn_if_busy(Console(file=quiet, width=200), 0.0, "before the run")
    assert quiet.getvalue() == ""


def test_wandb_run_id_is_read_from_run_dirs_with_a_same_second_suffix():
    assert WANDB_RUN_DIR.match("offline-run-20261123_211251-21ava8er-1").group(1) == "21ava8er"
    assert WANDB_RUN_DIR.match("run-20261123_211251-abc123").group(1) == "abc123"
    assert WANDB_RUN_DIR.match("latest-run") is None


# README commands on the default task, in-process (one torch import), at a tiny size and a few steps: the overrides
# below come first, so each command's own overrides win (model.n_layers=6 stays 6 layers).
TINY_RUN = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.max_steps=2",
            "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "extras.print_config=false", "callbacks.samples.n_samples=0", "callbacks.attention_maps.enabled=false"]


def readme_quick_start() -> list[list[str]]:
    """The commands of README's "Quick start" block, as argument lists (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].split() for line in block.strip().splitlines() if line.strip()]


def test_every_readme_quick_start_command_runs_on_the_default_task(tmp_path, one_thread):
    """Each ``python train.py`` / ``eval.py`` line of README's Quick start, short: training lines train and test, the
    resume line continues the first run, the eval lines evaluate and sample its checkpoint, ``--cfg job`` composes.
    Multirun lines (``-m``) compose here; they run end to end in ``test_readme_multirun_commands_run`` (slow)."""
    from longseq.runner import evaluate, sample

    commands = readme_quick_start()
    assert commands[0][:2] == ["make", "install"] and len(commands) >= 12
    first = None
    # python lines only: the make lines (make bench) compose in tests/test_docs.py
    for n, command in enumerate(c for c in commands[1:] if c[0] == "python"):
        script, args = command[1], command[2:]
        run = tmp_path / f"run{n}"
        args = [a.replace("logs/train/runs/<run>", str(first)) for a in args]
        if script == "eval.py":
            mode = "sample" if "mode=sample" in args else "evaluate"
            extra = ["sample.n=2", "sample.completions=1", "sample.k=1"] if mode == "sample" else []
            cfg = compose_config([*args, "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", *extra],
                                 run, config_name="eval")
            if mode == "sample":
                assert {"samples.png", "completions.png"} <= set(sample(cfg)), command
            else:
                assert math.isfinite(evaluate(cfg)["test/bpd"]), command
        elif "-m" in args or "--cfg" in args:
            # the first job of a sweep (seed=1,2,3 -> seed=1) / the printed job
            overrides = [re.sub(r"=([^\[\],]+),.*$", r"=\1", a) for a in args if a not in ("-m", "--cfg", "job")]
            cfg = compose_config(overrides, run)
            assert cfg.task.name in ("digits", "cifar10"), command
        else:
            steps = ["trainer.max_steps=4"] if any(a.startswith("ckpt_path=") for a in args) else []
            metrics = train(compose_config([*TINY_RUN, *args, *steps], run, fast=False))
            assert math.isfinite(metrics["test/bpd"]), command
            first = first or run
    assert first is not None and (first / "checkpoints" / "best.ckpt").is_file()


@pytest.mark.parametrize("debug", ["limit", "fdr", "overfit", "profiler"])
def test_debug_modes_run_on_the_default_task(debug, tmp_path, one_thread):
    """``python train.py debug=<mode>`` with the debug config's own batch limits (debug=limit once failed on digits:
    a 5 % fraction of 3 validation batches); a tiny model and a few steps keep it short."""
    # debug=overfit drops the callbacks (callbacks: null): no callbacks.* keys to override there
    small = [o for o in TINY_RUN if o.startswith(("model.", "extras.", "callbacks." * (debug != "overfit") or "model."))]
    metrics = train(compose_config([*small, f"debug={debug}", "trainer.max_steps=3"], tmp_path, fast=False))
    assert math.isfinite(metrics["test/bpd"])


@pytest.mark.slow
def test_readme_multirun_commands_run(tmp_path):
    """The Quick start's ``-m`` lines through the CLI (a 3-seed multirun, a 2-trial Optuna search), tiny and short."""
    tiny = [o for o in TINY_RUN if "val_check" not in o and "check_val" not in o]
    for command in (c for c in readme_quick_start() if "-m" in c):
        extra = ["hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2"] if any(
            a.startswith("hparams_search=") for a in command) else []
        out = subprocess.run([sys.executable, *command[1:], *tiny, *extra, f"paths.log_dir={tmp_path}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert out.returncode == 0, (command, out.stderr[-3000:])


def test_the_results_line_holds_the_headline_metrics_and_points_at_the_rest(tmp_path):
    """A recall run's final metrics (per-bucket accuracies ...) made a 1,000-character ``results:`` line; it now
    holds the task's monitored metric (last, best, test) and the losses, and names the file with all of them."""
    from longseq.runner import results_line

    metrics = {"val/acc": 0.91, "val/acc_best": 0.93, "test/acc": 0.9, "val/loss": 0.4, "test/loss": 0.41,
               "ckpt_path": "x.ckpt", **{f"test/acc_gap/{i}": 0.5 for i in range(40)}}
    line = results_line(metrics, "val/acc", tmp_path)
    assert line == ("results: val/acc=0.9100, val/acc_best=0.9300, test/acc=0.9000, val/loss=0.4000, test/loss=0.4100 "
                    f"(all 45 metrics: {tmp_path / 'metrics.json'})")
    assert results_line({"val/bpd": 2.0, "test/bpd": 2.1}, "val/bpd", tmp_path) == "results: val/bpd=2.0000, test/bpd=2.1000"
