"""What ``train.py`` and ``eval.py`` do, importable and testable: build objects from config, run, report.

Entry points stay thin (lightning-hydra-template style): they compose the config and call ``train``
or ``evaluate``. Both return a dict of final metrics.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from longseq.utils.config import register_resolvers

log = logging.getLogger(__name__)

RESOLVED_CONFIG = "config_resolved.yaml"


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (None or empty -> [])."""
    if not group:
        return []
    return [hydra.utils.instantiate(node) for node in group.values() if node and "_target_" in node]


def build_module(cfg: DictConfig) -> L.LightningModule:
    """The task's LightningModule with the backbone, attention, optimizer and schedule from ``cfg``."""
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if cfg.get(k) else None
             for k in ("model", "attention", "optimizer", "scheduler")}
    spec = OmegaConf.to_container(cfg.task.module, resolve=True)
    module_cls = hydra.utils.get_class(spec.pop("_target_"))
    # Called directly (not through hydra.utils.instantiate) so configuration errors surface with
    # their own type and message instead of an InstantiationException wrapper.
    return module_cls(**spec, **plain)


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule:
    return hydra.utils.instantiate(cfg.task.data)


def build_trainer(cfg: DictConfig, callbacks: list, loggers: list[Logger]) -> L.Trainer:
    return hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)


def close_loggers() -> None:
    """Finish the W&B run if one is open, so each multirun job gets its own run."""
    try:
        import wandb
    except ImportError:  # pragma: no cover - wandb is a dependency
        return
    if wandb.run is not None:
        wandb.finish()


def metric_value(metrics: dict[str, Any], name: str | None) -> float | None:
    """The metric a sweeper optimizes; NaN-safe (an Optuna trial must not crash the sweep)."""
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} was not logged; available: {sorted(metrics)}")
    value = float(metrics[name])
    return value if math.isfinite(value) else float("inf")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit (optionally resuming ``cfg.ckpt_path``) then test the best checkpoint; returns final metrics.

    Everything the run writes goes under ``cfg.paths.output_dir`` (the Hydra run directory).
    """
    register_resolvers()
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # Resolved copy of the config next to the checkpoints: eval.py rebuilds the run from it.
    (output_dir / RESOLVED_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg)
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    trainer = build_trainer(cfg, callbacks, loggers)
    try:
        for logger in loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
            if isinstance(logger, WandbLogger):
                logger.experiment.config.update({"output_dir": str(output_dir)}, allow_val_change=True)
        if cfg.get("train", True):
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            monitor = cfg.task.get("monitor")
            if monitor and monitor not in trainer.callback_metrics and not trainer.interrupted:
                log.warning(f"no validation ran during fit (trainer.max_steps ended it first); validating the final weights for {monitor}")
                trainer.validate(module, datamodule=datamodule, verbose=False)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if cfg.get("test", True):
            ckpt = best_checkpoint(trainer)
            if ckpt is None:
                log.warning("no checkpoint saved (callbacks disabled?): testing the current weights")
            trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
            if ckpt:
                metrics["ckpt_path"] = ckpt  # type: ignore[assignment]
        last = Path(output_dir) / "checkpoints" / "last.ckpt"
        if last.exists():
            log.info(f"last checkpoint: {last}")
        return metrics
    except SIGTERMException:
        # Preempted: OnExceptionCheckpoint has written checkpoints/interrupted.ckpt; resume from it.
        log.warning(f"SIGTERM received: saved {output_dir / 'checkpoints' / 'interrupted.ckpt'}; exiting with 143")
        raise SystemExit(143) from None
    finally:
        close_loggers()


def best_checkpoint(trainer: L.Trainer) -> str | None:
    """Path of the best-validation checkpoint, falling back to the last one; None when nothing was saved."""
    cb = trainer.checkpoint_callback
    if cb is None or getattr(trainer, "fast_dev_run", False):
        return None
    return cb.best_model_path or cb.last_model_path or None


def load_run_config(ckpt_path: str | Path, run_dir: str | Path | None = None) -> DictConfig:
    """The resolved config a checkpoint was trained with (``<run>/config_resolved.yaml``)."""
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path} does not exist")
    run_dir = Path(run_dir) if run_dir else ckpt_path.resolve().parent.parent
    path = run_dir / RESOLVED_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: pass run_dir=<the training run directory that holds {RESOLVED_CONFIG}>"
        )
    return OmegaConf.load(path)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test ``cfg.ckpt_path`` on its own task (val or test split) with the run's saved config."""
    register_resolvers()
    run_cfg = load_run_config(cfg.ckpt_path, cfg.get("run_dir"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(run_cfg.task.data)
    module_cls = hydra.utils.get_class(run_cfg.task.module._target_)
    module = module_cls.load_from_checkpoint(cfg.ckpt_path, map_location="cpu", weights_only=False)
    loggers = instantiate_group(cfg.get("logger"))
    trainer = build_trainer(cfg, [], loggers)
    try:
        run = trainer.validate if cfg.get("split", "test") == "val" else trainer.test
        run(module, datamodule=datamodule)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}
    finally:
        close_loggers()


def set_float32_precision() -> None:
    """Allow TF32 matmuls on Ampere+ GPUs (no effect on CPU)."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
