"""``NonFiniteGuard``: stop training at the first NaN/Inf loss or gradient norm, before the update is applied,
and say whether the checkpoint it leaves is worth resuming (``resume_advice``)."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from longseq.utils.errors import NonFiniteError

log = logging.getLogger(__name__)

RECENT_STEPS = 200  # losses kept (and saved in every checkpoint) for the "already diverging" test
DIVERGING_FACTOR = 10.0  # a checkpoint whose loss exceeds 10 x the recent median (and the median by > 1) was diverging


def total_grad_norm(module: torch.nn.Module) -> torch.Tensor:
    """L2 norm over every parameter gradient of ``module`` (a 0-d tensor; 0 when there are no gradients)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))


class NonFiniteGuard(Callback):
    """Raise ``NonFiniteError`` naming the step when the loss or the (pre-clipping) gradient norm is NaN/Inf.

    The check runs in ``on_before_optimizer_step``, so the diverged update never reaches the weights and the
    checkpoints on disk stay finite. Under DDP the gradients are already all-reduced there, so every rank sees
    the same norm and stops together (a rank-local NaN loss makes every rank's gradients NaN). Logs the
    gradient norm as ``train/grad_norm`` (every ``log_every_n_steps``, like all step metrics).

    With ``16-mixed`` precision an Inf gradient is the loss scaler's business (it skips the step), so only
    the loss is checked there.
    """

    def __init__(self, check_grad_norm: bool = True) -> None:
        self.check_grad_norm = check_grad_norm
        self.loss: torch.Tensor | None = None
        # (step, loss) of the last RECENT_STEPS finite steps; saved in every checkpoint (``state_dict``), so the
        # checkpoint a NaN points to can tell whether it was written while the loss was already blowing up.
        self.recent: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)

    def state_dict(self) -> dict:
        return {"recent_losses": [list(item) for item in self.recent]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.recent = deque(((int(s), float(v)) for s, v in state_dict.get("recent_losses", [])), maxlen=RECENT_STEPS)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        norm = total_grad_norm(pl_module).to(pl_module.device)
        pl_module.log("train/grad_norm", norm)
        loss = self.loss if self.loss is not None else torch.zeros((), device=norm.device)
        # One host sync per step for both checks. Under DDP only the (all-reduced, identical) gradient norm
        # decides, so every rank stops at the same step; a rank-local NaN loss makes it NaN everywhere.
        values = torch.stack([loss.float().reshape(()), norm.float()]).tolist()
        checks = [math.isfinite(v) for v in values]
        loss_ok = checks[0] or trainer.world_size > 1
        norm_ok = checks[1] or not self.check_grad_norm or str(trainer.precision) == "16-mixed"
        step = trainer.global_step + 1  # the step this update would complete (1-based, as in the progress bar)
        if loss_ok and norm_ok:
            if checks[0]:
                self.recent.append((step, values[0]))
            return
        what = "train/loss" if not checks[0] else "train/grad_norm"
        raise NonFiniteError(what, step, f"loss={float(loss)}, grad_norm={float(norm)}")


def checkpoint_health(path: str | Path) -> dict:
    """What a checkpoint holds for resuming: ``step``, ``max_abs_weight`` (max |w|), and, when its run had a
    ``NonFiniteGuard``, ``loss`` (of the last step before the save), ``median`` (of the steps before that, up to
    ``RECENT_STEPS``) and ``diverging`` (``loss`` > ``DIVERGING_FACTOR`` x ``median`` and above it by > 1)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    weights = [v for v in state.get("state_dict", {}).values() if torch.is_tensor(v) and v.is_floating_point()]
    info: dict = {"step": state.get("global_step", "?"),
                  "max_abs_weight": max((float(v.abs().max()) for v in weights if v.numel()), default=float("nan"))}
    guard = next((v for k, v in (state.get("callbacks") or {}).items() if "NonFiniteGuard" in str(k)), None)
    recent = [float(v) for _, v in (guard or {}).get("recent_losses", [])]
    if recent:
        info["loss"] = recent[-1]
        if len(recent) > 1:
            median = statistics.median(recent[:-1])
            info["median"] = median
            info["diverging"] = recent[-1] > DIVERGING_FACTOR * median and recent[-1] - median > 1.0
    return info


def describe_checkpoint(path: Path, info: dict) -> str:
    text = f"{path} (step {info['step']}) has "
    if "loss" in info:
        text += f"loss {info['loss']:.4g} and "
    return text + f"max |w| {info['max_abs_weight']:.4g}"


def resume_advice(checkpoints: str | Path) -> str:
    """The ``kept`` part of a ``NonFiniteError``: which checkpoint to resume from, with its loss and weight scale,
    warning when the newest finite one was written while the run was already diverging (then the best
    checkpoint is offered when it was not)."""
    checkpoints = Path(checkpoints)
    last, best = checkpoints / "last.ckpt", checkpoints / "best.ckpt"
    if not last.is_file():
        return "no checkpoint was written before it"
    info = checkpoint_health(last)
    text = f"the last finite checkpoint {describe_checkpoint(last, info)}"
    if not info.get("diverging"):
        return text + "; resume from it with a lower optimizer.lr"
    warning = (f"; warning: it was already diverging (its loss is {info['loss'] / info['median']:.3g} x the median "
               f"{info['median']:.4g} of the steps before it)")
    log.warning(text + warning)
    if best.is_file():
        best_info = checkpoint_health(best)
        if not best_info.get("diverging") and best_info["step"] != info["step"]:
            return (text + warning + f"; resume from the best checkpoint instead: {describe_checkpoint(best, best_info)}"
                    ", with a lower optimizer.lr")
    return text + warning + "; start again with a lower optimizer.lr rather than resuming it"
