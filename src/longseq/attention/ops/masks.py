"""The one mask convention of the attention package: boolean masks mean **True = may attend**.

``NEG_INF`` is the logit of a key a query may not attend (``logits.masked_fill(~allowed, NEG_INF)``), and
``causal_mask`` the lower triangle every causal variant and reference starts from.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def causal_mask(length: int, device: torch.device | str | None = None, offset: int = 0) -> torch.Tensor:
    """(L, L + offset) bool, True where key j <= query i + offset (queries are the last L of L + offset positions
    when ``offset`` > 0, as in a decoding step after ``offset`` cached positions)."""
    return torch.ones(length, length + offset, dtype=torch.bool, device=device).tril(offset)


def future_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, L) bool, True where key j > query i: the complement of ``causal_mask`` (what a causal query may NOT see)."""
    return ~causal_mask(length, device)
