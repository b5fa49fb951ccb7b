"""``PatienceFromMinSteps`` (issue 44): no run stops before ``trainer.min_steps``, and patience counts from there (or
from a later ``patience_from``, before which only a solved run stops)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping

from longseq.callbacks.early_stopping import PatienceFromMinSteps


class FlatMetric(L.LightningModule):
    """A one-weight model whose ``val/acc`` is the number it is given at every validation (``values`` by validation
    index, the last one repeated): the fake metric the stopping rule reads."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.values, self.validations = values, 0

    def training_step(self, batch, batch_idx):
        return (self.weight - batch[0]).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.log("val/acc", self.values[min(self.validations, len(self.values) - 1)])
            self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(200, 1), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(1, 1), batch_size=1)


def stop_step(callback: EarlyStopping, values: list[float], min_steps: int, every: int = 2, cap: int = 60) -> int:
    """Train ``FlatMetric(values)`` with validation every ``every`` steps under ``callback``; the step it ended at."""
    model = FlatMetric(values)
    trainer = L.Trainer(min_steps=min_steps, max_steps=cap, min_epochs=0, val_check_interval=every,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(model)
    return trainer.global_step


def rule(cls, patience: int = 3, threshold: float | None = None, mode: str = "max", **kwargs) -> EarlyStopping:
    return cls(monitor="val/acc", mode=mode, min_delta=0.01, patience=patience, stopping_threshold=threshold,
               check_on_train_epoch_end=False, **kwargs)


@pytest.mark.parametrize("min_steps,patience", [(12, 3), (20, 2), (6, 4)])
def test_a_flat_run_stops_patience_validations_after_min_steps_never_before(min_steps, patience, one_thread):
    """A metric that never improves: Lightning's rule stops at min_steps itself once patience has run out before it
    (the guard protects nothing); this one judges from min_steps on, so the run ends patience validations later."""
    flat = [0.5]
    ours = stop_step(rule(PatienceFromMinSteps, patience), flat, min_steps)
    assert ours >= min_steps and ours == min_steps + 2 * patience
    if min_steps > 2 * patience:  # Lightning's own patience ran out before min_steps
        assert stop_step(rule(EarlyStopping, patience), flat, min_steps) == min_steps


def test_an_improving_run_goes_on_and_a_solved_one_stops_at_min_steps_at_the_earliest(one_thread):
    """Gains past min_steps keep the run going; a metric at the threshold from the first validation stops the run at
    min_steps, not before it."""
    climbing = [0.1 * i for i in range(1, 10)]  # +0.1 every validation (every 2 steps) up to step 18, then flat
    assert stop_step(rule(PatienceFromMinSteps, 2), climbing, 8) == 18 + 2 * 2
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.9), [0.95], 10) == 10
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.9), [0.95], 0) == 2  # no min_steps: the first check


def test_from_min_steps_only_a_solved_run_stops_and_a_plateau_is_judged_from_patience_from(one_thread):
    """With patience_from after min_steps: a flat run goes on past min_steps and stops patience validations after
    patience_from; one at the threshold stops at min_steps; one that reaches it later stops there; with patience_from
    at the cap, an unsolved run trains to the cap whatever its curve."""
    flat, climbing = [0.5], [0.1 * i for i in range(1, 10)]  # climbing: 0.9 at step 18, then flat
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.85, patience_from=30), flat, 6) == 30 + 2 * 2
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.85, patience_from=30), [0.95], 6) == 6
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.85, patience_from=30), climbing, 6) == 18
    assert stop_step(rule(PatienceFromMinSteps, 2, threshold=0.95, patience_from=60), climbing, 6) == 60


@pytest.mark.parametrize("mode,flat,solved", [("max", 0.5, 0.95), ("min", 2.0, 0.05)])
def test_inside_the_window_a_non_finite_or_solved_metric_stops_in_either_mode(mode, flat, solved, one_thread):
    """Before patience_from the stops that need no history still apply: a NaN metric stops the run at min_steps
    (check_finite), as a solved one does in either direction; a flat one goes on to patience_from."""
    threshold = 0.9 if mode == "max" else 0.1

    def judged(values):
        return stop_step(rule(PatienceFromMinSteps, 2, threshold, mode, patience_from=30), values, 6)

    assert judged([float("nan")]) == 6 and judged([solved]) == 6 and judged([flat]) == 30 + 2 * 2


def test_a_metric_that_is_never_logged_fails_at_min_steps_under_strict(one_thread):
    """strict=True (Lightning's default) names a monitored metric that is never logged at the first validation it
    judges (min_steps), not at patience_from: a misnamed metric would otherwise cost the whole run."""
    callback = PatienceFromMinSteps(monitor="val/typo", mode="max", patience=2, check_on_train_epoch_end=False,
                                    patience_from=30)
    with pytest.raises(RuntimeError, match="val/typo"):
        stop_step(callback, [0.5], 6, cap=20)  # the cap before patience_from: only a check from min_steps raises


def test_the_recall_study_stops_with_it(tmp_path):
    from conftest import compose_config

    for experiment in ("recall/mqar", "recall/needle"):
        cfg = compose_config([f"experiment={experiment}"], tmp_path, fast=False)
        assert cfg.callbacks.early_stopping._target_ == "longseq.callbacks.early_stopping.PatienceFromMinSteps"
