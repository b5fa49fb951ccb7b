"""The task's LightningModule and datamodule from a composed config: what ``runner.train`` and ``eval.py`` run,
and what the checks before a run build (``checkpoint.check_model`` on the meta device, ``preflight``'s data check).

Both are called directly (not through ``hydra.utils.instantiate``) so configuration errors surface with their own
type and message instead of an ``InstantiationException`` wrapper."""

from __future__ import annotations

import re

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

from longseq.utils.errors import ConfigError


def build_module(cfg: DictConfig) -> L.LightningModule:
    """The task's LightningModule with the backbone, attention, optimizer and schedule from ``cfg``."""
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if cfg.get(k) else None
             for k in ("model", "attention", "optimizer", "scheduler")}
    spec = OmegaConf.to_container(cfg.task.module, resolve=True)
    module_cls = hydra.utils.get_class(spec.pop("_target_"))
    return module_cls(**spec, **plain)


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule:
    """The task's datamodule from ``cfg.task.data``; a key its class does not take (``+task.data.bogus=1``) is a
    ``ConfigError`` naming ``task.data.<key>``."""
    spec = OmegaConf.to_container(cfg.task.data, resolve=True)
    target = spec.pop("_target_")
    datamodule_cls = hydra.utils.get_class(target)
    try:
        return datamodule_cls(**spec)
    except TypeError as exc:
        unknown = re.search(r"unexpected keyword argument '(?P<key>\w+)'", str(exc))
        if unknown is None:
            raise
        raise ConfigError(f"task.data.{unknown['key']}", f"is not an argument of {target}") from None
