"""``StepProgressBar``: one training bar over optimizer steps (``step/max_steps``), with tokens/s."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps over the whole run instead of batches per epoch.

    Reads ``train 120/300 [00:14<00:21, ...] epoch=2, train/loss=1.9, val/bpd=2.3, tokens/s=9.1k``; a
    resumed run starts at its restored step. ``max_steps=-1`` uses Lightning's estimate of the total steps.
    """

    @property
    def train_description(self) -> str:
        return "train"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        bar.reset(total=None if total == float("inf") else int(total))
        bar.initial = trainer.global_step
        bar.n = trainer.global_step

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        """Keep the step count across epochs (the base class resets the bar every epoch)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar.disable:
            return
        n = trainer.global_step
        if n != bar.n and self._should_update(n, bar.total or n):
            bar.n = n
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        metrics = {"epoch": trainer.current_epoch}
        for key, value in super().get_metrics(trainer, pl_module).items():
            if key == "v_num":
                continue
            if key == "train/tokens_per_s":
                key, value = "tokens/s", f"{float(value) / 1000:.1f}k"
            metrics[key] = value
        return metrics
