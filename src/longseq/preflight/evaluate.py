"""``check_eval_config``: every check an ``eval.py`` config passes or fails before its run directory exists: the
checkpoint (given, a file that loads, inside a training run directory), ``mode`` and ``split``, the seed, the
trainer (Lightning's own checks too), every ``sample.*`` knob with ``mode=sample`` whatever the task, and with
``mode=evaluate`` the data files of the checkpoint's task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from longseq.preflight.train import check_data_files, check_seed
from longseq.preflight.trainer import check_trainer_types, check_with_lightning
from longseq.tasks.sampling import check_can_sample, check_sample_options
from longseq.utils.checkpoint import load_run_config, read_checkpoint, resolve_ckpt_path
from longseq.utils.errors import ConfigError

EVAL_MODES = ("evaluate", "sample")  # eval.py mode=
EVAL_SPLITS = ("test", "val")  # eval.py split=


def check_eval_mode(mode: Any) -> str:
    """``mode`` of ``eval.py`` when valid, else a ``ConfigError`` naming the key and the valid values."""
    if mode not in EVAL_MODES:
        raise ConfigError("mode", f"{mode!r} is not valid; choose one of {EVAL_MODES}")
    return mode


def check_eval_config(cfg: DictConfig) -> None:
    """Raise the first error of an ``eval.py`` config that names the key (or file) to fix. ``eval.py`` runs it
    before Hydra makes its run directory (``preflight.command.check_composition``); ``runner.evaluate`` and
    ``runner.sample`` run it for in-process callers."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.get("ckpt_path"):
        raise ConfigError("ckpt_path", "is required: python eval.py ckpt_path=<run>/checkpoints/best.ckpt (a run "
                                       "directory stands for its best.ckpt, else last.ckpt)")
    if not Path(cfg.ckpt_path).exists():
        read_checkpoint(cfg.ckpt_path)  # names the missing file and what its folder holds
    mode = check_eval_mode(cfg.get("mode", "evaluate"))
    if cfg.get("split", "test") not in EVAL_SPLITS:
        raise ConfigError("split", f"{cfg.split!r} is not valid; choose one of {EVAL_SPLITS}")
    check_seed(cfg.get("seed"))
    check_trainer_types(cfg.trainer)
    if mode == "sample":
        check_sample_options(cfg.get("sample") or {})
    ckpt = resolve_ckpt_path(cfg.ckpt_path, announce=False)
    read_checkpoint(ckpt)  # random bytes, a truncated file: named now, not after the run directory exists
    run_cfg = load_run_config(ckpt, cfg.get("run_dir"))  # a checkpoint outside a training run directory
    target = OmegaConf.select(run_cfg, "task.module._target_")
    if mode == "sample" and target:
        check_can_sample(hydra.utils.get_class(str(target)))
    check_with_lightning(cfg)
    if mode == "evaluate":
        check_data_files(run_cfg)
