"""``RunCheckpoint``: best.ckpt on validation, last.ckpt on validation and on a step/time interval."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from longseq.utils.errors import ConfigError, NonFiniteError

log = logging.getLogger(__name__)


def all_finite(module: torch.nn.Module) -> bool:
    """True when every parameter of ``module`` is finite (one fused reduction per tensor)."""
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (best by ``monitor`` + ``last`` at every validation) plus a periodic
    ``last.ckpt`` so a kill -9 loses at most ``every_n_train_steps`` steps or ``train_time_interval`` seconds.

    Lightning's own ``every_n_train_steps`` / ``train_time_interval`` replace the validation trigger and defer
    to validation when the monitored metric is missing; here they only refresh ``last.ckpt`` and the
    validation trigger stays. Checkpoints are never versioned (``last-v1.ckpt``): a resumed run continues its
    own files. Weights with a NaN/Inf are never written (``NonFiniteError`` instead), so ``last.ckpt`` and
    ``best.ckpt`` always hold the last finite state.

    Args:
        every_n_train_steps: also write ``last.ckpt`` every N optimizer steps (None/0: off).
        train_time_interval: also write ``last.ckpt`` when this many seconds of training passed since the
            previous periodic write (None/0: off). Ranks follow rank 0's clock.
        Everything else goes to ``ModelCheckpoint``.
    """

    def __init__(self, *args, every_n_train_steps: int | None = None, train_time_interval: float | None = None,
                 **kwargs) -> None:
        kwargs.setdefault("enable_version_counter", False)
        kwargs.setdefault("save_on_train_epoch_end", False)  # saves follow validation; on_train_end writes last
        super().__init__(*args, **kwargs)
        for key, value, kind in (("every_n_train_steps", every_n_train_steps, int),
                                 ("train_time_interval", train_time_interval, (int, float))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or value < 0):
                what = "an integer number of steps" if kind is int else "a number of seconds"
                raise ConfigError(f"callbacks.model_checkpoint.{key}", f"must be {what} >= 0 (null or 0: off), got "
                                                                       f"{value!r}")
        self.periodic_steps = int(every_n_train_steps or 0)
        self.periodic_seconds = float(train_time_interval or 0)
        self._last_periodic = time.monotonic()
        self._periodic_step = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if trainer.is_global_zero and trainer.ckpt_path is None and self.dirpath:  # known only after set-up
            old = sorted(p.name for p in Path(self.dirpath).glob("*.ckpt"))
            if old:
                log.warning(f"{self.dirpath} already holds {old} from an earlier run; this run overwrites them "
                            f"(to continue that run instead: ckpt_path={Path(self.dirpath) / 'last.ckpt'})")

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath) -> None:  # noqa: N802 - overrides a private hook
        """Replaced by the warning in ``on_fit_start``: resuming in place is the normal case, not a mistake."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_periodic = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if self._should_skip_saving_checkpoint(trainer) or not self.save_last:
            return
        step_due = self.periodic_steps > 0 and trainer.global_step % self.periodic_steps == 0
        time_due = False
        if self.periodic_seconds > 0:
            time_due = trainer.strategy.broadcast(time.monotonic() - self._last_periodic >= self.periodic_seconds)
        if not (step_due or time_due):
            return
        self._last_periodic, self._periodic_step = time.monotonic(), trainer.global_step
        marker = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        # A validation at this same step must still write best.ckpt: do not mark the step as saved.
        self._last_global_step_saved = marker

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write ``last.ckpt`` of the final weights when fit ends between two saves (max_steps mid-epoch)."""
        if (not self._should_skip_saving_checkpoint(trainer) and self.save_last
                and self._periodic_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if not all_finite(trainer.lightning_module):
            raise NonFiniteError("weights", trainer.global_step, f"{Path(filepath).name} not written")
        try:
            super()._save_checkpoint(trainer, filepath)
        except OSError as error:  # a full or unwritable checkpoints/: name the file and the step, keep the cause
            raise OSError(error.errno, f"could not write this checkpoint at step {trainer.global_step} "
                                       f"({type(error).__name__}: {error})", str(filepath)) from error
