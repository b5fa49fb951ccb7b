"""TRAMS: training-free memory selection for Transformer-XL (Yu et al., 2023), as the released code does it.

Each layer keeps a FIFO pool of up to ``M`` cached states. At every segment, separately for every batch row
and head, the ``recent_keep`` newest memory slots are always kept and the ``topk`` best of the older slots are
added, ranked by a query-independent score of the reformulated key ``K' = W_Q^(h)T k`` (a ``d_model`` vector):
because ``q . k = x . K'`` (``x`` = the query token's layer input, ``W_Q^(h)`` = the head's ``(D, d_model)``
query rows), a long ``K'`` pointing the way the inputs usually point gets large scores from any query.

- ``score="code"``: ``||K'|| * |sum K'|`` (what the released code computes; reproduces its numbers).
- ``score="paper"``: ``cos<K', 1> * ||K'|| = sum K' / sqrt(d_model)`` (the paper's formula; signed).

Kept indices stay in time order. The pool itself is never changed by the selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORES = ("code", "paper")
POSITIONS = ("compressed", "original")


@dataclass(frozen=True)
class TramsSpec:
    """Selection knobs: keep ``recent_keep`` newest memory slots plus the ``topk`` best older ones
    (m = recent_keep + topk keys per head); ``positions``: ``compressed`` = distances counted over the kept
    keys as if contiguous (the released code), ``original`` = each kept key keeps its true distance."""

    recent_keep: int
    topk: int
    score: str = "code"
    positions: str = "compressed"

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"memory.score={self.score!r} is not valid; choose one of {SCORES}")
        if self.positions not in POSITIONS:
            raise ValueError(f"memory.positions={self.positions!r} is not valid; choose one of {POSITIONS}")
        if self.recent_keep < 0 or self.topk < 0:
            raise ValueError(f"memory.recent_keep={self.recent_keep} and memory.topk={self.topk} "
                             "must be >= 0")


def query_weights(qkv_weight: torch.Tensor, n_heads: int, d_head: int) -> torch.Tensor:
    """The per-head query matrices ``(H, D, d_model)`` out of a fused ``(3*H*D, d_model)`` q/k/v weight."""
    return qkv_weight[: n_heads * d_head].view(n_heads, d_head, -1)


def reformulated_keys(keys: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``K' = W_Q^(h)T k``: keys ``(B, H, J, D)``, ``w_q`` ``(H, D, d)`` -> ``(B, H, J, d)`` (memory heavy;
    the scores below never build it)."""
    return torch.einsum("bhjD,hDd->bhjd", keys, w_q)


def key_scores(keys: torch.Tensor, w_q: torch.Tensor, score: str = "code") -> torch.Tensor:
    """Query-independent score of every key, ``(B, H, J, D) -> (B, H, J)``, without materializing ``K'``:
    ``||K'||^2 = k^T (W_Q W_Q^T) k`` and ``sum K' = k . (W_Q 1)``."""
    coordinate_sum = torch.einsum("bhjD,hD->bhj", keys, w_q.sum(-1))
    if score == "paper":
        return coordinate_sum / w_q.shape[-1] ** 0.5
    gram = w_q @ w_q.transpose(1, 2)  # (H, D, D)
    squared_norm = torch.einsum("bhjD,hDE,bhjE->bhj", keys, gram, keys).clamp(min=0)
    return squared_norm.sqrt() * coordinate_sum.abs()


def kept_indices(scores: torch.Tensor, topk: int, key_len: int) -> torch.Tensor:
    """Indices of the kept keys per (batch row, head), in time order, ``(B, H, topk + key_len - C)``.

    ``scores`` ``(B, H, C)`` rank the ``C`` candidates (the oldest ``C`` of ``key_len`` keys); the top
    ``topk`` of them (sorted ascending) come first, then every key from ``C`` on (recent memory + segment).
    """
    B, H, C = scores.shape
    chosen = scores.topk(topk, dim=-1).indices.sort(dim=-1).values
    always = torch.arange(C, key_len, device=scores.device).expand(B, H, key_len - C)
    return torch.cat([chosen, always], dim=-1)


def gather_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, K, D)`` rows ``index`` ``(B, H, L)`` -> ``(B, H, L, D)``."""
    return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
