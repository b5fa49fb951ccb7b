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

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step  # > 0 when resuming

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.start_step is None or trainer.global_step <= self.start_step or trainer.fast_dev_run:
            log.info(f"no optimizer step taken: not writing {self.path.name}")
            return
        if isinstance(exception, NonFiniteError):
            return
        trainer.save_checkpoint(self.path)
        log.info(f"saved {self.path} at step {trainer.global_step} ({type(exception).__name__})")
