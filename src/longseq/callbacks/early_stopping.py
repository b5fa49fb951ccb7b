"""``PatienceFromMinSteps``: early stopping whose rule starts at ``trainer.min_steps`` (or a later ``patience_from``).

Lightning's ``EarlyStopping`` judges every validation, and ``trainer.min_steps`` only defers the stop it asks for: with
validation every 100 steps, patience 5 and ``min_steps`` 600, a run that has not improved since step 100 is told to
stop at step 600, exactly ``min_steps``, so the guard protects nothing (issue 44: four recall arms stopped at exactly
``min_steps`` at L = 1,024). Lightning has no setting for where patience starts. Here a validation before
``min_steps`` is not judged at all (no best, no patience, no threshold), so the earliest stop is ``min_steps`` when the
metric already meets ``stopping_threshold`` there, and ``min_steps + patience`` validations otherwise.

``patience_from`` (a step after ``min_steps``) separates the two kinds of stop: from ``min_steps`` a run that is solved
(``stopping_threshold``), diverged (``divergence_threshold``) or not finite (``check_finite``) stops, and only from
``patience_from`` on is a plateau judged, so a run that learns late is not cut off while a solved one does not spend
the rest of the budget. The recall study sets it to the step cap: with the pairs scattered, the short control left
chance at step 2,700 and ``combiner_fixed`` climbed to 0.20 by step 5,300, both after a patience rule from step 600
had stopped them at chance (docs/results.md, the recall study of issue 44).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping


class PatienceFromMinSteps(EarlyStopping):
    """``EarlyStopping`` (same arguments) that judges nothing before ``trainer.min_steps`` (optimizer steps,
    ``trainer.global_step``), only the stops that need no history (solved, diverged, not finite) before
    ``patience_from`` (None: ``trainer.min_steps``), and the whole rule, its patience counted from there, from it on."""

    def __init__(self, *args, patience_from: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.patience_from = patience_from

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step < (trainer.min_steps or 0):
            return
        current = trainer.callback_metrics.get(self.monitor)
        if (self.patience_from is not None and step < self.patience_from and current is not None
                and not self.ends_without_history(current.squeeze())):
            return  # a plateau is not judged yet: no best, no patience
        super()._run_early_stopping_check(trainer)  # a missing metric: Lightning's own `strict` error or skip

    def ends_without_history(self, current: torch.Tensor) -> bool:
        """Whether ``current`` alone stops the run: the criteria Lightning judges before it updates its best and its
        patience (not finite, at ``stopping_threshold``, past ``divergence_threshold``)."""
        return bool((self.check_finite and not torch.isfinite(current))
                    or (self.stopping_threshold is not None and self.monitor_op(current, self.stopping_threshold))
                    or (self.divergence_threshold is not None
                        and self.monitor_op(-current, -self.divergence_threshold)))
