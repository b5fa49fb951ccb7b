"""Shared LightningModule plumbing: building the backbone, optimizer and schedule from config."""

from __future__ import annotations

import logging
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from longseq.models.transformer import Transformer

log = logging.getLogger(__name__)


def to_dict(node: Any) -> Any:
    """Resolved plain container from an OmegaConf node (or the value itself)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


class SequenceTask(L.LightningModule):
    """Base of every task: owns the backbone built from ``model`` + ``attention`` and the optimizer.

    Subclasses define the loss, metrics and the causal requirement (``requires_causal``).
    """

    requires_causal: bool | None = None  # True: LM/density; False: encoders; None: either

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 vocab_size: int, seq_len: int, out_dim: int | None = None,
                 image_shape: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        model, attention = to_dict(model), to_dict(attention)
        if self.requires_causal is not None and bool(attention.get("causal", False)) != self.requires_causal:
            kind = "causal" if self.requires_causal else "bidirectional"
            raise ValueError(
                f"{type(self).__name__} needs {kind} attention but attention '{attention.get('name')}' has "
                f"attention.causal={attention.get('causal')}; set attention.causal={str(self.requires_causal).lower()} "
                "or pick an attention that supports it"
            )
        model = {k: v for k, v in model.items() if k != "_target_"}
        self.net = Transformer(vocab_size=vocab_size, seq_len=seq_len, attention=attention,
                               image_shape=image_shape, out_dim=out_dim, **model)

    def on_train_start(self) -> None:
        # A line in the run's log file marks that signal handlers are installed (used by the SIGTERM test).
        log.info(f"training started at step {self.global_step}")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        """AdamW-style optimizer with weight decay on matrices only, plus a per-step schedule."""
        decay, no_decay = [], []
        for name, p in self.trainer.model.named_parameters():  # the wrapped model under FSDP
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "token" not in name and "pos" not in name else no_decay).append(p)
        opt_cfg = dict(to_dict(self.hparams.optimizer))
        wd = opt_cfg.pop("weight_decay", 0.0)
        make_opt = hydra.utils.instantiate(opt_cfg)
        optimizer = make_opt([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}])
        if not self.hparams.scheduler:
            return optimizer
        make_sched = hydra.utils.instantiate(to_dict(self.hparams.scheduler))
        scheduler = make_sched(optimizer, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
