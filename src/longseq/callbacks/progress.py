"""What a run prints while it trains: the step bar (``StepProgressBar``) and the model summary
(``CompactModelSummary``), both calm when stdout is a file (SLURM logs, ``> train.log``, CI).

``console_callbacks`` adds them to a Trainer's callbacks; ``longseq.runner.build_trainer`` calls it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

log = logging.getLogger(__name__)


class _Discard(io.TextIOBase):
    """A stream that drops what it is given: tqdm bars keep counting (the lines read their state) but never
    draw into a log file."""

    def write(self, text: str) -> int:
        return len(text)


LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps over the whole run instead of batches per epoch.

    Reads ``train 120/300 [00:14<00:21, ...] epoch=2, train/loss=1.9, val/bpd=2.3, tokens/s=9.1k``; a
    resumed run starts at its restored step. ``max_steps=-1`` uses Lightning's estimate of the total steps.

    ``lines`` (default: when stdout is not a terminal): no bar is drawn, so a log file holds no carriage
    returns or cursor escapes. Instead one plain line per ``line_interval_s`` seconds of training (and the first
    and last step) reads ``train: 120/300 (40%) [00:14<00:21, 8.5it/s, epoch=2, train/loss=1.9, ...]``, and
    each validation during fit prints ``validation at step 120: val/bpd=2.3012, ...``. On a terminal, log
    records are written above the bar (``tqdm.contrib.logging``) instead of being glued to it.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False,
                 lines: bool | None = None, line_interval_s: float = 30.0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.lines = (not sys.stdout.isatty()) if lines is None else lines
        self.line_interval_s = line_interval_s
        self.last_line_time = -math.inf
        self.redirect: contextlib.ExitStack | None = None

    @property
    def train_description(self) -> str:
        return "train"

    # ------------------------------------------------------------------ bars that draw nowhere in lines mode

    def quiet(self, make_bar):
        """``make_bar()`` with stdout swapped for ``_Discard`` in lines mode (Lightning's bars write to the
        ``sys.stdout`` of the moment they are built)."""
        if not self.lines:
            return make_bar()
        with contextlib.redirect_stdout(_Discard()):
            return make_bar()

    def init_sanity_tqdm(self):
        return self.quiet(super().init_sanity_tqdm)

    def init_train_tqdm(self):
        return self.quiet(super().init_train_tqdm)

    def init_validation_tqdm(self):
        return self.quiet(super().init_validation_tqdm)

    def init_test_tqdm(self):
        return self.quiet(super().init_test_tqdm)

    def init_predict_tqdm(self):
        return self.quiet(super().init_predict_tqdm)

    # ------------------------------------------------------------------------------------------ training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        bar.reset(total=None if total == float("inf") else int(total))
        bar.initial = trainer.global_step
        bar.n = trainer.global_step
        if not self.lines and self.redirect is None and not bar.disable:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.redirect = contextlib.ExitStack()
            self.redirect.enter_context(logging_redirect_tqdm())

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
            if self.lines:
                now = time.monotonic()
                if n == bar.initial + 1 or n == bar.total or now - self.last_line_time >= self.line_interval_s:
                    self.last_line_time = now
                    self.write_line(self.status_line(bar))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.stop_redirect()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.stop_redirect()

    def stop_redirect(self) -> None:
        if self.redirect is not None:
            self.redirect.close()
            self.redirect = None

    # ---------------------------------------------------------------------------------------- validation

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.lines and not trainer.sanity_checking and trainer.state.fn == "fit" and not self.is_disabled:
            metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k.startswith("val")}
            if metrics:
                shown = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
                self.write_line(f"validation at step {trainer.global_step}: {shown}")

    # --------------------------------------------------------------------------------------------- text

    @staticmethod
    def status_line(bar) -> str:
        """The bar's state as one line of text (no bar graphic)."""
        state = dict(bar.format_dict)
        state["bar_format"] = LINE_FORMAT if state.get("total") else LINE_FORMAT_NO_TOTAL
        return bar.format_meter(**state)

    @staticmethod
    def write_line(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        metrics = {"epoch": trainer.current_epoch}
        for key, value in super().get_metrics(trainer, pl_module).items():
            if key == "v_num":
                continue
            if key == "train/tokens_per_s":
                key, value = "tokens/s", f"{float(value) / 1000:.1f}k"
            metrics[key] = value
        return metrics


class CompactModelSummary(ModelSummary):
    """Lightning's plain-text model summary (no box drawing), without the FLOPs column and total when nothing
    was counted: Lightning counts FLOPs only for a module with an ``example_input_array``, which the tasks do
    not set, so the column would be all zeros."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        if not total_flops:
            summary_data = [(name, column) for name, column in summary_data if name != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        if not total_flops:
            table = table.rsplit("\n", 1)[0]  # the "0  Total Flops" line
        log.info("model summary\n" + table)


def console_callbacks(trainer_cfg: Any, callbacks: list) -> list:
    """``callbacks`` plus the step bar (``trainer.enable_progress_bar``) and the compact model summary
    (``trainer.enable_model_summary``), unless the callbacks already hold a progress bar / summary."""
    callbacks = list(callbacks)
    if trainer_cfg.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StepProgressBar())
    if trainer_cfg.get("enable_model_summary", True) and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(CompactModelSummary())
    return callbacks
