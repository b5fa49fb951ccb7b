"""Learning-rate schedules by optimizer step (``_partial_`` targets of ``conf/scheduler``)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up for ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def warmup_constant(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Linear warm-up then a constant learning rate (``total_steps`` is accepted for a uniform call)."""
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
