"""``PatienceFromMinSteps``: early stopping whose rule starts at ``trainer.min_steps`` (or a later ``patience_from``).

Lightning's ``EarlyStopping`` judges every validation, and ``trainer.min_steps`` only defers the stop it asks for: with
validation every 100 steps, patience 5 and ``min_steps`` 600, a run that has not improved since step 100 is told to
stop at step 600, exactly ``min_steps``, so the guard protects nothing (issue 44: four recall arms stopped at exactly
``min_steps`` at L = 1,024). Lightning has no setting for where patience starts. Here a validation before
``min_steps`` is not judged at all (no best, no patience, no threshold), so the earliest stop is ``min_steps`` when the
metric already meets ``stopping_threshold`` there, and ``min_steps + patience`` validations otherwise.

``patience_from`` (a step after ``min_steps``) separates the two stops: from ``min_steps`` a run that meets the
threshold (solved) may stop, and only from ``patience_from`` on is a plateau judged, so a run that learns late is not
cut off while a solved one does not spend the rest of the budget. The recall study sets it to the step cap (every arm
trains to the cap unless it solves the task): its arms' curves at L = 256 left chance between steps 1,500 and 3,100,
after a patience rule from step 600 had stopped them (docs/results.md, the recall study).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping


class PatienceFromMinSteps(EarlyStopping):
    """``EarlyStopping`` (same arguments) that judges nothing before ``trainer.min_steps`` (optimizer steps,
    ``trainer.global_step``), only ``stopping_threshold`` before ``patience_from`` (None: ``trainer.min_steps``), and
    the whole rule, its patience counted from there, after it."""

    def __init__(self, *args, patience_from: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.patience_from = patience_from

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step < (trainer.min_steps or 0):
            return
        if self.patience_from is not None and step < self.patience_from:
            current = trainer.callback_metrics.get(self.monitor)
            if (current is None or self.stopping_threshold is None
                    or not self.monitor_op(current.squeeze(), self.stopping_threshold)):
                return  # a plateau is not judged yet: no best, no patience
        super()._run_early_stopping_check(trainer)
