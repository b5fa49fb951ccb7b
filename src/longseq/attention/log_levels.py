"""Gather-free products over the causal LogSparse pattern (Combiner paper §4.2), for ``logsparse``.

Query p attends to itself and, for every set bit l of p, to key ``j_l(p) = ((p >> l) << l) - 1``. At
level l cut the sequence into pairs of blocks of ``b = 2^l`` positions: the queries with bit l set are
exactly the odd block of each pair, and they all use ONE key, the last position of the even block
before them. A level is therefore a broadcast between a ``(N, pairs, b, C)`` view of the queries and a
``(N, pairs, C)`` view of the keys: no index table and no gathered ``(N, L, K, D)`` copy (which cost
2 GB and most of the time at L = 16384). Forward and backward use three products, each one pass over
half the sequence per level:

- ``level_scores(a, x)``: ``(N, K, L)`` scores ``a_p . x_{j_l(p)}`` (sampled dense-dense product);
- ``level_mix(w, x)``: ``(N, L, C)`` rows ``sum_l w[l, p] x_{j_l(p)}`` (weights times key rows);
- ``level_mix_transposed(w, a)``: ``(N, L, C)`` rows ``sum_{p, l: j_l(p) = j} w[l, p] a_p`` (its adjoint).

Score slot 0 is self (when ``with_self``), slot ``1 + l`` level l; a slot a query does not use holds
``fill``. Any length works (the last, incomplete pair of a level is handled as its own view).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def num_levels(length: int) -> int:
    """Number of levels l with 2^l < length (bit length of L - 1)."""
    return max(length - 1, 0).bit_length()


def level_views(x: torch.Tensor, level: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views of ``x`` ``(N, L, *C)`` at ``level``: ``[(queries (N, P, b', *C), their keys (N, P, *C))]``.

    The first entry covers the complete block pairs (``b' = 2^level``); a second one the incomplete last
    pair whose odd block is cut short by the end of the sequence. Views, so in-place updates write ``x``.
    """
    L, b = x.shape[1], 1 << level
    n_pairs = L // (2 * b)
    views = []
    if n_pairs:
        pairs = x[:, : n_pairs * 2 * b].unflatten(1, (n_pairs, 2, b))
        views.append((pairs[:, :, 1], pairs[:, :, 0, b - 1]))
    start = n_pairs * 2 * b + b  # first query of the incomplete pair's odd block
    if start < x.shape[1]:
        views.append((x[:, start:].unsqueeze(1), x[:, start - 1].unsqueeze(1)))
    return views


def level_scores(a: torch.Tensor, x: torch.Tensor, with_self: bool, fill: float) -> torch.Tensor:
    """``(N, L, C)`` queries ``a`` and keys ``x`` -> ``(N, with_self + levels, L)`` dot products; unused slots = fill."""
    N, L, _ = a.shape
    levels = num_levels(L)
    scores = a.new_full((N, int(with_self) + levels, L), fill)
    if with_self:
        scores[:, 0] = (a * x).sum(-1)
    for level in range(levels):
        slot = scores[:, int(with_self) + level]
        for (queries, _), (_, keys), (out, _) in zip(level_views(a, level), level_views(x, level),
                                                     level_views(slot, level)):
            out.copy_((queries @ keys.unsqueeze(-1)).squeeze(-1))  # (N, P, b, C) @ (N, P, C, 1)
    return scores


def level_mix(w: torch.Tensor, x: torch.Tensor, with_self: bool) -> torch.Tensor:
    """Weights ``w`` ``(N, with_self + levels, L)`` and key rows ``x`` ``(N, L, C)`` -> ``(N, L, C)``."""
    out = w[:, 0].unsqueeze(-1) * x if with_self else torch.zeros_like(x)
    for level in range(num_levels(x.shape[1])):
        slot = w[:, int(with_self) + level]
        for (rows, _), (weights, _), (_, keys) in zip(level_views(out, level), level_views(slot, level),
                                                     level_views(x, level)):
            rows.addcmul_(weights.unsqueeze(-1), keys.unsqueeze(-2))  # (N, P, b, 1) * (N, P, 1, C)
    return out


def level_mix_transposed(w: torch.Tensor, a: torch.Tensor, with_self: bool) -> torch.Tensor:
    """Adjoint of ``level_mix`` in ``x``: ``(N, K, L)`` weights and query rows ``a`` ``(N, L, C)`` -> ``(N, L, C)``."""
    out = w[:, 0].unsqueeze(-1) * a if with_self else torch.zeros_like(a)
    for level in range(num_levels(a.shape[1])):
        slot = w[:, int(with_self) + level]
        for (rows, _), (weights, _), (_, keys) in zip(level_views(a, level), level_views(slot, level),
                                                     level_views(out, level)):
            keys.add_((weights.unsqueeze(-2) @ rows).squeeze(-2))  # (N, P, 1, b) @ (N, P, b, C)
    return out


class LevelScores(torch.autograd.Function):
    """``level_scores`` with fill -inf (attention logits), differentiable in both inputs."""

    @staticmethod
    def forward(ctx, a, x, with_self):
        ctx.save_for_backward(a, x)
        ctx.with_self = with_self
        return level_scores(a, x, with_self, NEG_INF)

    @staticmethod
    def backward(ctx, grad):
        a, x = ctx.saved_tensors
        grad = grad.contiguous()  # a broadcast (zero-stride) grad would make every slot view alias
        return level_mix(grad, x, ctx.with_self), level_mix_transposed(grad, a, ctx.with_self), None


class LevelMix(torch.autograd.Function):
    """``level_mix`` differentiable in the weights and the key rows."""

    @staticmethod
    def forward(ctx, w, x, with_self):
        ctx.save_for_backward(w, x)
        ctx.with_self = with_self
        return level_mix(w, x, with_self)

    @staticmethod
    def backward(ctx, grad):
        w, x = ctx.saved_tensors
        grad = grad.contiguous()
        # unused slots get gradient 0 (their weight is 0; -inf there would turn the softmax backward into NaN)
        return level_scores(grad, x, ctx.with_self, 0.0), level_mix_transposed(w, grad, ctx.with_self), None


__all__ = ["LevelMix", "LevelScores", "level_mix", "level_mix_transposed", "level_scores", "level_views", "num_levels"]
