"""Every error names the key the user typed: ``error: <key | file:line>: <message>`` (docs/troubleshooting.md).

One test per message that used to print ``error: <ExceptionType>:`` (or a raw Lightning message). Each runs the
real ``runner.train`` in-process on the composed config (they fail while building, before any step) and prints
the console line through ``error_summary`` after ``name_user_key``, as ``train.py`` does; one goes through the
``train.py`` CLI end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning as L
import pytest
from conftest import ROOT, compose_config, injected_callbacks
from devices import without_gpu, without_torch_xla

from longseq.runner import train
from longseq.utils.console import error_summary
from longseq.utils.errors import key_and_message, name_user_key, user_key


def console_line(overrides: list[str], tmp_path) -> str:
    """The ``error:`` line ``train.py`` prints for ``overrides`` (the run must fail)."""
    cfg = compose_config(overrides, tmp_path)
    with pytest.raises(Exception) as info:
        train(cfg)
    return error_summary(name_user_key(info.value, cfg))


# AttentionConfigError: the attention's own validation, raised while the model is built.
@pytest.mark.parametrize("overrides,line", [
    (["attention=sparse"], "error: attention: sparse needs partition=<name>; valid: ['axial'"),
    (["attention=combiner", "partition=axial", "partition.block_size=7"],
     "error: attention.block_size: 7 does not tile sequence length 64; valid values: [1, 2, 4, 8, 16, 32, 64]"),
    (["attention=local", "attention.window=0"], "error: attention.window: must be an integer >= 1, got 0"),
    (["attention=fnet"], "error: attention: 'fnet' cannot be causal (attention.causal=true)"),
    (["+attention.bogus=1"], "error: attention.bogus: attention 'full' does not accept attention.bogus; valid keys:"),
])
def test_attention_config_errors_name_their_key(overrides, line, tmp_path):
    assert console_line(overrides, tmp_path).startswith(line)


def test_bidirectional_attention_on_a_causal_task_names_attention_causal(tmp_path):
    assert console_line(["attention.causal=false"], tmp_path).startswith(
        "error: attention.causal: DensityTask needs causal attention")


def test_batch_size_names_the_key_typed_and_is_checked_before_ddp_spawns(tmp_path, monkeypatch):
    """``task.data.batch_size`` is ``${task.batch_size}``: the user typed ``task.batch_size``. The check runs in the
    launching process, so ``trainer=ddp_cpu`` starts no worker for a batch that cannot divide."""
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: pytest.fail("fit (and its spawned workers) started"))
    line = console_line(["trainer=ddp_cpu", "task.batch_size=3"], tmp_path)
    assert line == ("error: task.batch_size: 3 (global batch) must be a positive multiple of devices x "
                    "accumulate_grad_batches = 2 x 1 = 2")


def test_accumulation_batch_error_names_task_batch_size(tmp_path):
    line = console_line(["task.batch_size=10", "trainer.accumulate_grad_batches=4"], tmp_path)
    assert line.startswith("error: task.batch_size: 10 (global batch) must be a positive multiple")


def test_a_message_naming_an_interpolated_key_is_pointed_at_the_typed_one(tmp_path):
    cfg = compose_config([], tmp_path)
    assert user_key(cfg, "task.data.batch_size") == "task.batch_size"
    assert user_key(cfg, "task.data.seed") == "task.data.seed"  # a plain value: itself
    exc = name_user_key(ValueError("task.data.batch_size=7 (global batch) must be even"), cfg)
    assert error_summary(exc) == "error: task.batch_size: 7 (global batch) must be even"


def test_missing_dataset_names_the_data_key(tmp_path):
    """The message says ``task.data.data_dir``, which is ``${paths.data_dir}``: the key the user typed."""
    line = console_line(["task=cifar10", "task.data.download=false", f"paths.data_dir={tmp_path / 'none'}"], tmp_path)
    assert line.startswith("error: paths.data_dir: CIFAR-10 not found under ")


def test_unknown_trainer_key_names_trainer_key(tmp_path):
    line = console_line(["+trainer.max_step=3"], tmp_path)
    assert line.startswith("error: trainer.max_step: is not an argument of lightning.pytorch.Trainer "
                           "(did you mean trainer.max_steps?); valid keys: accelerator,")
    assert console_line(["+trainer.bogus=1"], tmp_path).startswith("error: trainer.bogus: is not an argument")


def test_seq_len_on_a_fixed_geometry_task_is_rejected(tmp_path):
    assert console_line(["task.seq_len=100"], tmp_path) == (
        "error: task.seq_len: 100 does not fit task=digits: its images are 8 x 8 x 1 = 64 tokens (a fixed "
        "geometry); drop the override (or use task.seq_len=64)")


def test_messages_without_a_key_keep_their_type():
    assert error_summary(RuntimeError("CUDA out of memory")) == "error: RuntimeError: CUDA out of memory"
    assert key_and_message(ValueError("no key in /data/task.data/x here")) is None
    assert key_and_message(RuntimeError("attention.window is bad")) is None  # torch internals: not the user's key


@pytest.mark.slow  # a CLI run; the composition errors are checked in-process
def test_cli_prints_the_key_form_and_exits_1(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "attention=fnet", f"hydra.run.dir={tmp_path}",
                          "extras.print_config=false"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 1
    assert "error: attention: 'fnet' cannot be causal (attention.causal=true)" in out.stderr
    assert "AttentionConfigError" not in out.stderr


def test_nonfinite_advice_names_loss_and_weight_scale_and_warns_when_already_diverging(tmp_path):
    """The NaN message points to a checkpoint with its loss and max |w|; a checkpoint saved while the loss was already
    far above the run's recent median is flagged, and an earlier healthy best.ckpt is offered instead."""
    import torch

    from longseq.callbacks.nonfinite import resume_advice

    def save(name, step, weight, losses):
        torch.save({"global_step": step, "state_dict": {"w": torch.tensor([weight, -1.0])},
                    "callbacks": {"NonFiniteGuard": {"recent_losses": [[i + 1, v] for i, v in enumerate(losses)]}}},
                   tmp_path / name)

    save("best.ckpt", 20, 3.0, [2.5] * 20)
    save("last.ckpt", 40, -22648.0, [2.5] * 38 + [9e4, 2.5e6])
    advice = resume_advice(tmp_path)
    assert advice.startswith(f"the last finite checkpoint {tmp_path / 'last.ckpt'} (step 40) has loss 2.5e+06 and "
                             "max |w| 2.265e+04; warning: it was already diverging (its loss is 1e+06 x the median 2.5")
    assert advice.endswith(f"resume from the best checkpoint instead: {tmp_path / 'best.ckpt'} (step 20) has loss 2.5 "
                           "and max |w| 3, with a lower optimizer.lr")
    save("last.ckpt", 40, 3.5, [2.5] * 38 + [2.4, 2.3])
    assert resume_advice(tmp_path).endswith("(step 40) has loss 2.3 and max |w| 3.5; resume from it with a lower "
                                            "optimizer.lr")


def test_every_checkpoint_carries_the_guards_recent_losses(make_cfg, tmp_path):
    from longseq.callbacks.nonfinite import checkpoint_health

    train(make_cfg(["trainer.max_steps=3", "test=false"]))
    info = checkpoint_health(tmp_path / "checkpoints" / "last.ckpt")
    assert info["step"] == 3 and 0 < info["loss"] < 10 and info["diverging"] is False and info["max_abs_weight"] > 0


def test_an_unwritable_checkpoints_folder_reports_the_primary_failure(make_cfg, tmp_path):
    """checkpoints/ stops being a writable folder mid-run: the error is the failed last.ckpt save that stopped
    training, not the follow-up failure to write interrupted.ckpt."""
    import shutil

    class BreakFolder(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 3:
                shutil.rmtree(tmp_path / "checkpoints")
                (tmp_path / "checkpoints").write_text("not a folder")

    cfg = make_cfg(["trainer.max_steps=6", "callbacks.model_checkpoint.every_n_train_steps=2"])
    with injected_callbacks(BreakFolder()), pytest.raises(Exception) as info:
        train(cfg)
    assert error_summary(info.value).startswith(f"error: {tmp_path / 'checkpoints' / 'last.ckpt'}: could not write this "
                                                "checkpoint at step 4 (FileExistsError: ")


@pytest.mark.parametrize("overrides,line", [
    (["attention=nope"], "error: attention: no option 'nope'; available: axial, bigbird,"),
    (["attention.window=3"], "error: attention.window: not a key of this config (a new key needs +attention.window=3); "
                             "attention has backend, causal, name"),
    (["trainer.max_step=3"], "error: trainer.max_step: not a key of this config (did you mean trainer.max_steps? a new "
                             "key needs +trainer.max_step=3); trainer has accelerator,"),
    (["attention=sparse", "partition=axal"], "error: partition: no option 'axal' (did you mean partition=axial?)"),
    (["seed=1,2"], "error: seed: 1,2 is ambiguous: a list is seed=[1,2], a string seed='1,2', a sweep needs -m"),
])
def test_composition_errors_print_one_line_naming_the_key(overrides, line, capsys, monkeypatch):
    """What Hydra itself prints over several lines (an unknown key or option, an ambiguous value) is checked by
    ``train.py`` before the run starts and printed in the same ``error: <key>:`` form."""
    from conftest import CONF

    from longseq.preflight.command import check_composition

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        check_composition(["train.py", *overrides], CONF, "train")
    assert info.value.code == 1
    assert capsys.readouterr().err.startswith(line)
    check_composition(["train.py", "attention=combiner", "partition=axial"], CONF, "train")  # a good command passes


def test_eval_composition_errors_name_the_key(capsys, monkeypatch):
    from conftest import CONF

    from longseq.preflight.command import check_composition

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit):
        check_composition(["eval.py", "ckpt_path=x.ckpt", "splt=val"], CONF, "eval")
    assert capsys.readouterr().err.startswith("error: splt: not a key of this config (did you mean split? a new key "
                                              "needs +splt=val); the config has ckpt_path,")


# --- bad inputs refused before the run directory exists (docs/troubleshooting.md) --------------------------
# Each is injected as a new user types it. train.py's pre-flight (preflight.command.preflight_train ->
# preflight.train.check_train_config) and eval.py's (preflight.command.check_composition ->
# preflight.evaluate.check_eval_config) run before Hydra makes a run directory: exit 1,
# one error line naming the key, and nothing under paths.log_dir.
TRAIN_REFUSALS = [
    pytest.param(["trainer.devices=0"], "error: trainer.devices: expected a number of devices >= 1, -1 (all), 'auto' "
                                        "or a list of device ids, got 0"),
    pytest.param(["trainer=gpu"], "error: trainer.accelerator: 'gpu' asks for a device this machine does not have "
                                  "(present: cpu); use trainer=cpu", marks=without_gpu),
    pytest.param(["trainer=tpu"], "error: trainer.accelerator: 'tpu' needs torch_xla, which is not installed in this "
                                  "environment; install it with the torch it was built for: make xla-check builds "
                                  ".venv-xla", marks=without_torch_xla),
    pytest.param(["trainer.precision=bf17"], "error: trainer.precision: 'bf17' is not a precision Lightning knows; "
                                             "valid: transformer-engine, transformer-engine-float16, 16-true, "
                                             "16-mixed, bf16-true, bf16-mixed, 32-true, 64-true"),
    pytest.param(["trainer.max_steps=-5"], "error: trainer.max_steps: expected an integer number of optimizer steps "
                                           "(-1: no limit), got -5"),
    pytest.param(["seed=abc"], "error: seed: expected an integer from 0 to 4294967295 (or null: unseeded), got 'abc'"),
    pytest.param(["partition=axial"], "error: partition: attention=full takes no partition, so partition=axial would "
                                      "be ignored"),
    pytest.param(["trainer=ddp_cpu", "task.batch_size=3"], "error: task.batch_size: 3 (global batch) must be a "
                                                           "positive multiple"),
    # the model's own checks, on a model built on the meta device
    pytest.param(["optimizer.lr=-1"], "error: optimizer.lr: must be a finite number in (0, inf), got -1"),
    pytest.param(["attention=fnet"], "error: attention: 'fnet' cannot be causal (attention.causal=true)"),
]


def refusal(check, capsys) -> str:
    """The console of a pre-flight that must refuse: exit 1, one ``error:`` line (returned), no traceback."""
    with pytest.raises(SystemExit) as stop:
        check()
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [text for text in err.splitlines() if text.startswith("error: ")]
    return line


@pytest.mark.parametrize("overrides,line", TRAIN_REFUSALS)
def test_train_refuses_a_bad_value_before_the_run_directory_exists(overrides, line, tmp_path, capsys, monkeypatch):
    from conftest import CONF

    from longseq.preflight.command import preflight_train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    logs = tmp_path / "logs"
    assert refusal(lambda: preflight_train(["train.py", *overrides, f"paths.log_dir={logs}"], CONF, "train"),
                   capsys).startswith(line)
    assert not logs.exists()


@pytest.mark.parametrize("overrides,line", [
    (["split=train2"], "error: split: 'train2' is not valid; choose one of ('test', 'val')"),
    ([], "error: ckpt_path: is required: python eval.py ckpt_path=<run>/checkpoints/best.ckpt"),
    (["seed=abc"], "error: seed: expected an integer"),
    (["trainer.precision=bf17"], "error: trainer.precision: 'bf17' is not a precision Lightning knows"),
])
def test_eval_refuses_a_bad_value_before_the_run_directory_exists(overrides, line, tmp_path, capsys, monkeypatch):
    from conftest import CONF

    from longseq.preflight.command import check_composition
    from longseq.preflight.evaluate import check_eval_config

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    ckpt = tmp_path / "last.ckpt"
    ckpt.touch()
    given = [f"ckpt_path={ckpt}"] if overrides else []
    argv = ["eval.py", *given, *overrides, f"paths.log_dir={tmp_path / 'logs'}"]
    assert refusal(lambda: check_composition(argv, CONF, "eval", check=check_eval_config), capsys).startswith(line)
    assert not (tmp_path / "logs").exists()


def cli_refusal(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, script, *args, "extras.print_config=false"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.slow  # CLI subprocesses; test_preflight's CLI test runs the same path
def test_cli_refusals_leave_no_run_directory_and_print_no_traceback(tmp_path):
    """End to end, as a user runs them: an eval split that does not exist (it used to evaluate the test split and exit
    0) and a log folder that cannot be created (it used to print a traceback). Nothing is written under either."""
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the log folder should be")
    out = cli_refusal("train.py", [f"paths.log_dir={blocked / 'logs'}"])
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines()[-2].startswith(
        f"error: paths.log_dir: cannot create the run directory {blocked}/logs/train/runs/")
    assert "Traceback" not in out.stderr and blocked.read_text() == "a file where the log folder should be"
    ckpt = tmp_path / "best.ckpt"
    ckpt.touch()
    out = cli_refusal("eval.py", [f"ckpt_path={ckpt}", "split=train2", f"paths.log_dir={tmp_path / 'logs'}"])
    assert out.returncode == 1
    assert out.stderr.splitlines()[-2] == "error: split: 'train2' is not valid; choose one of ('test', 'val')"
    assert "Traceback" not in out.stderr and not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script,overrides,line", [
    *(pytest.param("train.py", *case.values, marks=case.marks) for case in TRAIN_REFUSALS),
    ("eval.py", [], "error: ckpt_path: is required"),
])
def test_every_cli_refusal_leaves_no_run_directory(script, overrides, line, tmp_path):
    out = cli_refusal(script, [*overrides, f"paths.log_dir={tmp_path / 'logs'}"])
    assert out.returncode == 1
    assert out.stderr.splitlines()[-2].startswith(line)
    assert "Traceback" not in out.stderr and not (tmp_path / "logs").exists()


def test_a_setting_lightning_refuses_names_its_trainer_key(make_cfg):
    """What no check of ours covers is Lightning's own refusal, named by the trainer key its message names first."""
    from longseq.utils.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        train(make_cfg(["trainer.strategy=fsdp", "trainer.accelerator=cpu"]))
    assert error_summary(info.value).startswith("error: trainer.strategy: The strategy `fsdp` requires a GPU "
                                                "accelerator")
