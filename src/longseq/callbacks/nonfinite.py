"""``NonFiniteGuard``: stop training at the first NaN/Inf loss or gradient norm, before the update is applied."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from longseq.utils.errors import NonFiniteError


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

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        norm = total_grad_norm(pl_module).to(pl_module.device)
        pl_module.log("train/grad_norm", norm)
        loss = self.loss if self.loss is not None else torch.zeros((), device=norm.device)
        # One host sync per step for both checks. Under DDP only the (all-reduced, identical) gradient norm
        # decides, so every rank stops at the same step; a rank-local NaN loss makes it NaN everywhere.
        checks = torch.stack([loss.float().reshape(()), norm.float()]).isfinite().tolist()
        loss_ok = checks[0] or trainer.world_size > 1
        norm_ok = checks[1] or not self.check_grad_norm or str(trainer.precision) == "16-mixed"
        if loss_ok and norm_ok:
            return
        step = trainer.global_step + 1  # the step this update would complete (1-based, as in the progress bar)
        what = "train/loss" if not checks[0] else "train/grad_norm"
        raise NonFiniteError(what, step, f"loss={float(loss)}, grad_norm={float(norm)}")
