"""Token-level likelihood metrics as torchmetrics objects, so DDP reduces sums, not averages."""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric


class MeanNLL(Metric):
    """Mean negative log-likelihood per scored token, in nats times ``scale``.

    ``scale=1/ln 2`` gives bits per dim (images) or bits per character (bytes); ``exp`` of the nat
    value gives perplexity (see ``Perplexity``). ``update(nll_sum, n_tokens)`` takes the summed NLL.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nll_sum: torch.Tensor, n_tokens: int | torch.Tensor) -> None:
        self.nll_sum += nll_sum.detach().to(torch.float64)
        self.count += torch.as_tensor(n_tokens, device=self.count.device)

    def compute(self) -> torch.Tensor:
        return (self.nll_sum / self.count.clamp(min=1) * self.scale).float()


class BitsPerDim(MeanNLL):
    """Mean NLL / ln 2 over sub-pixels (image density) or bytes/characters (bpc)."""

    def __init__(self) -> None:
        super().__init__(scale=1.0 / math.log(2.0))
