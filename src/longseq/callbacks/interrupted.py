"""``InterruptedCheckpoint``: save ``interrupted.ckpt`` when fit stops on an exception (SIGTERM, Ctrl-C, a crash)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from longseq.utils.errors import NonFiniteError

log = logging.getLogger(__name__)


class InterruptedCheckpoint(Callback):
    """Write ``<dirpath>/<filename>.ckpt`` when fit raises, but only after this process took an optimizer step.

    A failure during set-up (bad data, a bad ``ckpt_path``, a batch that does not divide over devices) has
    trained nothing, so it leaves no checkpoint: resuming from untrained weights would silently restart from
    scratch. A ``NonFiniteError`` leaves none either (the state that produced the NaN is not worth resuming;
    ``last.ckpt`` holds the last finite one).

    Unlike Lightning's ``OnExceptionCheckpoint`` this callback does not turn ``fit(ckpt_path=None)`` into an
    automatic resume from ``last`` (and so does not warn about it on every run).
    """

    def __init__(self, dirpath: str, filename: str = "interrupted") -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.start_step: int | None = None
        self.stale_since: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step  # > 0 when resuming
        # An interrupted.ckpt of an earlier attempt: retired once this run has saved a newer last.ckpt, so
        # it cannot be resumed by mistake beside the newer best / last.
        self.stale_since = self.path.stat().st_mtime if self.path.is_file() else None

    def on_train_batch_end(self, trainer: L.Trainer, *args, **kwargs) -> None:
        self.retire_superseded(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.retire_superseded(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # after last.ckpt's final write
        self.retire_superseded(trainer)

    def retire_superseded(self, trainer: L.Trainer) -> None:
        """Delete the earlier attempt's ``interrupted.ckpt`` once ``last.ckpt`` was written by this run after
        at least one step past where it started (its state is then newer; rank 0 only)."""
        if self.stale_since is None or not trainer.is_global_zero or trainer.global_step <= (self.start_step or 0):
            return
        last = self.path.with_name("last.ckpt")
        if last.is_file() and last.stat().st_mtime > self.stale_since and self.path.is_file():
            self.path.unlink()
            self.stale_since = None
            log.info(f"retired {self.path} of the earlier attempt: {last} is newer")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.start_step is None or trainer.global_step <= self.start_step or trainer.fast_dev_run:
            log.info(f"no optimizer step taken: not writing {self.path.name}")
            return
        if isinstance(exception, NonFiniteError):
            return
        try:
            trainer.save_checkpoint(self.path)
        except Exception as error:  # noqa: BLE001 - the failure that stopped fit is the one to report, not this one
            # (an unwritable or full checkpoints/ fails both; raising here would hide the primary failure)
            log.error(f"could not write {self.path} ({type(error).__name__}: {error}) after the failure that "
                      f"stopped training: {type(exception).__name__}: {exception}")
            return
        log.info(f"saved {self.path} at step {trainer.global_step} ({type(exception).__name__})")
