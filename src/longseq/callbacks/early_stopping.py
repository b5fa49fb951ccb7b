"""``PatienceFromMinSteps``: early stopping whose rule starts at ``trainer.min_steps``.

Lightning's ``EarlyStopping`` judges every validation, and ``trainer.min_steps`` only defers the stop it asks for: with
validation every 100 steps, patience 5 and ``min_steps`` 600, a run that has not improved since step 100 is told to
stop at step 600, exactly ``min_steps``, so the guard protects nothing (issue 44: four recall arms stopped at exactly
``min_steps`` at L = 1,024). Lightning has no setting for where patience starts. Here a validation before
``min_steps`` is not judged at all (no best, no patience, no threshold), so the earliest stop is ``min_steps`` when the
metric already meets ``stopping_threshold`` there, and ``min_steps + patience`` validations otherwise.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping


class PatienceFromMinSteps(EarlyStopping):
    """``EarlyStopping`` (same arguments) that judges only the validations at or after ``trainer.min_steps``
    (optimizer steps, ``trainer.global_step``)."""

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        if trainer.global_step < (trainer.min_steps or 0):
            return
        super()._run_early_stopping_check(trainer)
