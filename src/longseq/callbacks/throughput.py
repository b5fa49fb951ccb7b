"""``TokenThroughput``: global training tokens per second, logged as ``train/tokens_per_s``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


def batch_tokens(batch: Any) -> int:
    """Tokens in one batch: the element count of its first tensor with >= 2 dims (the (B, L) model input)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() if batch.dim() >= 2 else 0
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_tokens(item)
        if n:
            return n
    return 0


class TokenThroughput(Callback):
    """Tokens/s over all ranks, an exponential moving average of the wall time between training batches.

    Time spent in validation or checkpointing between two batches is excluded (the clock restarts after
    validation). Shown in the progress bar and sent to every logger with the other step metrics.
    """

    def __init__(self, smoothing: float = 0.9) -> None:
        self.smoothing = smoothing
        self.rate: float | None = None
        self._tick: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._tick is None:
            self._tick = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        elapsed, self._tick = now - (self._tick or now), now
        tokens = batch_tokens(batch) * trainer.world_size
        if elapsed <= 0 or not tokens:
            return
        rate = tokens / elapsed
        self.rate = rate if self.rate is None else self.smoothing * self.rate + (1 - self.smoothing) * rate
        pl_module.log("train/tokens_per_s", self.rate, prog_bar=True, sync_dist=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tick = None  # the next batch starts a fresh interval
