"""Gather-free products over the causal LogSparse levels (Combiner paper §4.2): ``logsparse`` and
``combiner_logsparse`` share them.

Query p uses, for every set bit l of p, one candidate of level l: the last key of the aligned block
before it (``logsparse``: key ``((p >> l) << l) - 1``) or that block's summary (``combiner_logsparse``).
At level l cut the sequence into pairs of blocks of ``b = 2^l`` positions: the queries with bit l set are
exactly the odd block of each pair, and they all read ONE candidate, attached to the even block before
them. A level is therefore a broadcast between a ``(N, pairs, b, C)`` view of the queries and
``(N, pairs, C)`` candidate rows: no index table, no gathered ``(N, L, K, D)`` copy, and a hand-written
backward that accumulates into one gradient buffer (autograd through per-level views would allocate and
clear a full ``(N, L, C)`` gradient per level). Forward and backward use three products:

- ``level_scores(a, x)``: ``(N, K, L)`` scores of each query against its candidate of every level;
- ``level_mix(w, x)``: ``(N, L, C)`` rows ``sum_l w[l, p] * candidate_l(p)``;
- ``level_mix_transposed(w, a)``: the adjoint of ``level_mix`` in the candidates.

A level's candidates are either positions of ``x`` (``summaries[l] is None``: the last row of every even
block) or a tensor of per-block rows ``summaries[l]`` ``(N, P_l, C)`` (P_l even blocks, in order). Score
slot 0 is self when ``with_self``; slot ``with_self + l`` is level l; unused slots hold ``fill``. Any
length works: the last pair may be incomplete (its odd block cut short by the end of the sequence).
``summarized_blocks`` views the even blocks themselves (the members a ``combiner_logsparse`` summary pools),
laid out like the summary rows.

The per-group products are ``row_dots`` (rows against one vector) and ``add_mixed`` / ``mixed`` (a weighted sum
of rows): a batched bmm for large blocks, one row at a time for small ones, where CPU bmm's per-matrix overhead
dominates. ``row_pair_dots`` (the self slot) works a chunk of positions at a time, so no (N, L, C) temporary is
made (measured: docs/cpu_engine_measurements.md, *log_levels*).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.geometry import num_log_levels
from longseq.attention.ops.masks import NEG_INF

Summaries = Sequence[torch.Tensor | None] | None


def level_views(x: torch.Tensor, level: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views of ``x`` ``(N, L, *C)`` at ``level``: ``[(odd-block rows (N, P, b', *C), last even-block row (N, P, *C))]``.

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
    if start < L:
        views.append((x[:, start:].unsqueeze(1), x[:, start - 1].unsqueeze(1)))
    return views


def summary_views(rows: torch.Tensor, level: int, length: int) -> list[torch.Tensor]:
    """Per-even-block rows ``(N, P, *C)`` laid out like the second element of ``level_views``'s pairs."""
    b = 1 << level
    n_pairs = length // (2 * b)
    views = [rows[:, :n_pairs]] if n_pairs else []
    if n_pairs * 2 * b + b < length:
        views.append(rows[:, n_pairs : n_pairs + 1])
    return views


def summary_count(length: int, level: int) -> int:
    """How many level-``level`` blocks some query summarizes: one per complete block pair, plus the even block of an
    incomplete last pair whose odd block is not empty (the rows ``summary_views`` expects)."""
    b = 1 << level
    n_pairs = length // (2 * b)
    return n_pairs + int(n_pairs * 2 * b + b < length)


def summarized_blocks(x: torch.Tensor, level: int) -> torch.Tensor:
    """One strided view ``(N, P, b, *C)`` of the even blocks at ``level`` whose summaries the odd blocks read
    (``P = summary_count``), from ``x`` ``(N, L, *C)``; row p is the even block of pair p, in ``summary_views``'s
    order. A view (the incomplete pair's even block is a whole block too), so in-place updates write ``x``."""
    length, b = x.shape[1], 1 << level
    count = summary_count(length, level)
    if count == 0:  # unfold needs one whole window
        return x[:, :0].unsqueeze(2).expand(x.shape[0], 0, b, *x.shape[2:])
    if x.device.type == "xla":  # XLA has no unfold (a CPU fallback, and a copy): the blocks of its views, joined
        views = [view for view, _ in summarized_block_views(x, level)]
        return views[0] if len(views) == 1 else torch.cat(views, 1)
    # unfold rather than as_strided: the same view, and torch.compile traces it (storage_offset() breaks the graph).
    # Windows of b at a stride of 2b may count the even block of a pair whose odd block is empty: [:count] drops it.
    return x.unfold(1, b, 2 * b)[:, :count].movedim(-1, 2)


def summarized_block_views(x: torch.Tensor, level: int) -> list[tuple[torch.Tensor, slice]]:
    """``summarized_blocks`` as views on every device, for writing into ``x``: ``[(view (N, P', b, *C), rows)]`` where
    ``rows`` are the view's P' rows of ``summarized_blocks`` (the complete pairs, then the incomplete one). Slices
    and reshapes only, which XLA keeps as views (an in-place update through its unfold, a copy, was lost: the
    gradients of k and v came out wrong)."""
    length, b = x.shape[1], 1 << level
    n_pairs = length // (2 * b)
    views = []
    if n_pairs:
        views.append((x[:, : n_pairs * 2 * b].unflatten(1, (n_pairs, 2, b))[:, :, 0], slice(0, n_pairs)))
    if summary_count(length, level) > n_pairs:
        start = n_pairs * 2 * b
        views.append((x[:, start : start + b].unsqueeze(1), slice(n_pairs, n_pairs + 1)))
    return views


def candidate_views(x: torch.Tensor, summaries: Summaries, level: int, length: int) -> list[torch.Tensor]:
    """Level ``level``'s candidate rows aligned with ``level_views``: positions of ``x`` or ``summaries[level]``."""
    rows = None if summaries is None else summaries[level]
    if rows is None:
        return [keys for _, keys in level_views(x, level)]
    return summary_views(rows, level, length)


# Up to this many rows per group a batched matrix-vector bmm is dominated by per-matrix overhead (measured on CPU at
# L = 16384, N = 8, C = 64: a (P, 1, 2) @ (P, 2, C) bmm is ~8x slower than two fused multiply-adds, the dot
# products of 8 rows ~2x slower than 8 multiply-sums); the rows are then taken one by one.
SMALL_MIX = 4
SMALL_DOTS = 8


def row_dots(rows: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``(N, P, b, C)`` rows against one vector per group ``(N, P, C)`` -> ``(N, P, b)`` dot products.

    Large b: the vector times the transposed rows (~2-3x faster on CPU than ``rows @ vector``)."""
    b = rows.shape[-2]
    if b <= SMALL_DOTS:
        out = vectors.new_empty(rows.shape[:-1])
        for t in range(b):
            out[..., t] = (rows[..., t, :] * vectors).sum(-1)
        return out
    return (vectors.unsqueeze(-2) @ rows.transpose(-1, -2)).squeeze(-2)


# Positions per chunk of ``row_pair_dots``: its (chunk, C) product stays a few MB, where one (N, L, C) temporary
# of 32 MB or more would be a fresh mapping that page-faults on every call.
DOT_CHUNK_ELEMENTS = 1 << 20


def row_pair_dots(a: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out (N, L) = sum_c a[..., c] * x[..., c]`` for rows ``(N, L, C)``, a chunk of positions at a time."""
    step = max(1, DOT_CHUNK_ELEMENTS // (a.shape[0] * a.shape[-1]))
    for start in range(0, a.shape[1], step):
        chunk = slice(start, start + step)
        out[:, chunk] = (a[:, chunk] * x[:, chunk]).sum(-1)
    return out


def add_mixed(target: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``target (N, P, C) += sum_t weights[..., t] * rows[..., t, :]`` in place (``weights`` ``(N, P, b)``)."""
    if weights.shape[-1] <= SMALL_MIX:
        for t in range(weights.shape[-1]):
            target.addcmul_(weights[..., t : t + 1], rows[..., t, :])
        return target
    return target.add_((weights.unsqueeze(-2) @ rows).squeeze(-2))


def mixed(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``sum_t weights[..., t] * rows[..., t, :]``: weights ``(N, P, b)`` over rows ``(N, P, b, C)`` -> ``(N, P, C)``."""
    if weights.shape[-1] <= SMALL_MIX:
        return add_mixed(rows[..., 0, :] * weights[..., :1], weights[..., 1:], rows[..., 1:, :])
    return (weights.unsqueeze(-2) @ rows).squeeze(-2)


def level_scores(a: torch.Tensor, x: torch.Tensor, with_self: bool, fill: float, summaries: Summaries = None) -> torch.Tensor:
    """``(N, L, C)`` queries ``a`` against their candidates -> ``(N, with_self + levels, L)``; unused slots = fill."""
    N, L, _ = a.shape
    levels = num_log_levels(L)
    scores = a.new_full((N, int(with_self) + levels, L), fill)
    if with_self:
        row_pair_dots(a, x, scores[:, 0])
    for level in range(levels):
        slot = scores[:, int(with_self) + level]
        for (queries, _), keys, (out, _) in zip(level_views(a, level), candidate_views(x, summaries, level, L),
                                                level_views(slot, level)):
            out.copy_(row_dots(queries, keys))  # (N, P, b, C) against (N, P, C)
    return scores


def level_mix(w: torch.Tensor, x: torch.Tensor, with_self: bool, summaries: Summaries = None) -> torch.Tensor:
    """Weights ``w`` ``(N, with_self + levels, L)`` over the candidates (positions of ``x`` ``(N, L, C)`` or
    ``summaries``) -> ``(N, L, C)``."""
    L = w.shape[-1]
    out = w[:, 0].unsqueeze(-1) * x if with_self else x.new_zeros(x.shape[0], L, x.shape[-1])
    for level in range(num_log_levels(L)):
        slot = w[:, int(with_self) + level]
        for (rows, _), (weights, _), keys in zip(level_views(out, level), level_views(slot, level),
                                                 candidate_views(x, summaries, level, L)):
            rows.addcmul_(weights.unsqueeze(-1), keys.unsqueeze(-2))  # (N, P, b, 1) * (N, P, 1, C)
    return out


def level_mix_transposed(w: torch.Tensor, a: torch.Tensor, with_self: bool,
                         summaries: Summaries = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Adjoint of ``level_mix`` in its candidates: weights ``(N, K, L)`` and rows ``a`` ``(N, L, C)`` ->
    (gradient of the position candidates ``(N, L, C)``, gradient of each ``summaries[l]`` or None)."""
    L = a.shape[1]
    out = w[:, 0].unsqueeze(-1) * a if with_self else torch.zeros_like(a)
    grads: list[torch.Tensor | None] = []
    for level in range(num_log_levels(L)):
        slot = w[:, int(with_self) + level]
        rows = None if summaries is None else summaries[level]
        grad = None if rows is None else a.new_zeros(rows.shape[0], rows.shape[1], a.shape[-1])
        targets = [keys for _, keys in level_views(out, level)] if grad is None else summary_views(grad, level, L)
        for (queries, _), (weights, _), target in zip(level_views(a, level), level_views(slot, level), targets):
            add_mixed(target, weights, queries)  # (N, P, b) over (N, P, b, C)
        grads.append(grad)
    return out, grads


@autocast_function
class LevelScores(torch.autograd.Function):
    """``level_scores`` with fill -inf (attention logits), differentiable in ``a``, ``x`` and the summaries.

    ``apply(a, x, with_self, *summaries)``: one summary tensor or None per level (none given = positions).
    """

    @staticmethod
    def forward(ctx, a, x, with_self, *summaries):
        ctx.save_for_backward(a, x, *[s for s in summaries if s is not None])
        ctx.with_self, ctx.present = with_self, [s is not None for s in summaries]
        return level_scores(a, x, with_self, NEG_INF, summaries or None)

    @staticmethod
    def backward(ctx, grad):
        a, x, summaries = _saved(ctx)
        grad = grad.contiguous()  # a broadcast (zero-stride) grad would make every slot view alias
        grad_x, grad_summaries = level_mix_transposed(grad, a, ctx.with_self, summaries)
        return level_mix(grad, x, ctx.with_self, summaries), grad_x, None, *grad_summaries[: len(ctx.present)]


@autocast_function
class LevelMix(torch.autograd.Function):
    """``level_mix`` differentiable in the weights, ``x`` and the summaries; ``apply(w, x, with_self, *summaries)``."""

    @staticmethod
    def forward(ctx, w, x, with_self, *summaries):
        ctx.save_for_backward(w, x, *[s for s in summaries if s is not None])
        ctx.with_self, ctx.present = with_self, [s is not None for s in summaries]
        return level_mix(w, x, with_self, summaries or None)

    @staticmethod
    def backward(ctx, grad):
        w, x, summaries = _saved(ctx)
        grad = grad.contiguous()
        # unused slots get gradient 0 (their weight is 0; -inf there would turn the softmax backward into NaN)
        grad_w = level_scores(grad, x, ctx.with_self, 0.0, summaries)
        grad_x, grad_summaries = level_mix_transposed(w, grad, ctx.with_self, summaries)
        return grad_w, grad_x, None, *grad_summaries[: len(ctx.present)]


def _saved(ctx) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]:
    """Unpack (first, x, per-level summaries with None where a level uses positions) from a Function's context."""
    first, x, *present = ctx.saved_tensors
    if not ctx.present:
        return first, x, None
    it = iter(present)
    return first, x, [next(it) if has else None for has in ctx.present]


__all__ = ["LevelMix", "LevelScores", "add_mixed", "level_mix", "level_mix_transposed", "level_scores", "level_views",
           "mixed", "row_dots", "row_pair_dots", "summarized_block_views", "summarized_blocks",
           "summary_count"]
