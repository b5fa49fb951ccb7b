"""A resumed run trains with the optimizer and schedule settings of its own config, from the resumed step.

Lightning builds the optimizers and schedulers from the config (``configure_optimizers``) and then loads their
states from the checkpoint, hyperparameters included: without this callback ``ckpt_path=<run> optimizer.lr=1e-5``
kept the learning rate (and betas, weight decay ...) the run was trained with. ``ResumedOptimization`` notes the
configured settings when fit starts (after ``configure_optimizers``, before the restore) and, when training starts
from a checkpoint, writes them into the restored parameter groups (the optimizer's moment estimates stay) and puts
each scheduler at the resumed step of this run's schedule around the configured learning rates: the logged
``train/lr`` is the new ``optimizer.lr`` times the schedule's factor at that step. What it applied is logged once.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import lightning as L
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

log = logging.getLogger(__name__)

NOT_SETTINGS = ("params", "lr", "initial_lr")  # the parameters, and the learning rate (handled with the schedule)


def base_lr(group: dict[str, Any]) -> float:
    """The learning rate a parameter group's schedule scales (``initial_lr`` once a scheduler is attached)."""
    return group.get("initial_lr", group["lr"])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return False


def scheduler_step(config: Any, trainer: L.Trainer) -> int:
    """How many times Lightning has stepped the scheduler of ``config`` by the resumed point."""
    count = trainer.global_step if config.interval == "step" else trainer.current_epoch
    return count // max(1, int(config.frequency or 1))


def place_schedule(scheduler: LRScheduler, fresh: dict[str, Any], step: int) -> None:
    """Put ``scheduler`` at ``step`` of the schedule ``fresh`` (its state as this run built it, at step 0, around the
    configured learning rates). A ``LambdaLR`` (every ``conf/scheduler``) computes a step's factor from that step
    alone, so one step from ``step - 1`` lands there; any other scheduler is replayed from step 0."""
    scheduler.load_state_dict(copy.deepcopy(fresh))
    for group, lr in zip(scheduler.optimizer.param_groups, fresh["_last_lr"]):
        group["lr"] = lr
    steps = step
    if isinstance(scheduler, LambdaLR):
        scheduler.last_epoch, steps = step - 1, 1
    with warnings.catch_warnings():  # stepping without an optimizer step in between is the point here
        warnings.filterwarnings("ignore", message=r"(Detected call of|Seems like) `(lr_scheduler|optimizer)\.step")
        for _ in range(steps):
            scheduler.step()


class ResumedOptimization(L.Callback):
    """Apply this run's optimizer and schedule settings to the optimizer and schedulers restored from
    ``ckpt_path`` (module docstring). Added by ``runner.train`` when it resumes."""

    def __init__(self) -> None:
        self.configured: list[list[dict[str, Any]]] = []
        self.fresh: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.configured = [[{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                            for group in optimizer.param_groups] for optimizer in trainer.optimizers]
        self.fresh = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is None or not self.configured:
            return
        changed: dict[str, tuple[Any, Any]] = {}
        for optimizer, configured in zip(trainer.optimizers, self.configured):
            for group, settings in zip(optimizer.param_groups, configured):
                for key, value in settings.items():
                    if key not in NOT_SETTINGS and not same(group.get(key), value):
                        changed.setdefault(key, (group.get(key), value))
                        group[key] = copy.deepcopy(value)
                old, new = base_lr(group), base_lr(settings)
                if not same(old, new):
                    changed.setdefault("lr", (old, new))
                    group["lr"] = new
                    if "initial_lr" in group or "initial_lr" in settings:
                        group["initial_lr"] = new
        for config, fresh in zip(trainer.lr_scheduler_configs, self.fresh):
            if changed or isinstance(config.scheduler, LambdaLR):  # exact either way; a replay only when needed
                place_schedule(config.scheduler, fresh, scheduler_step(config, trainer))
        if changed and trainer.is_global_zero:
            self.report(trainer, changed)

    @staticmethod
    def report(trainer: L.Trainer, changed: dict[str, tuple[Any, Any]]) -> None:
        group = trainer.optimizers[0].param_groups[0]
        applied = ", ".join(f"optimizer.{k} {fmt(old)} -> {fmt(new)}" for k, (old, new) in changed.items())
        schedule = ""
        if trainer.lr_scheduler_configs:
            factor = group["lr"] / base_lr(group) if base_lr(group) else float("nan")
            schedule = (f"; train/lr is {group['lr']:.4g} = optimizer.lr x {factor:.4g}, the schedule's factor at "
                        f"step {trainer.global_step}")
        log.info(f"resume: from step {trainer.global_step} the optimizer runs with {applied}{schedule}")


def fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
