"""The task's LightningModule and datamodule from a composed config: what ``runner.train`` and ``eval.py`` run,
and what the checks before a run build on the meta device (``checkpoint.check_model``)."""

from __future__ import annotations

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf


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
