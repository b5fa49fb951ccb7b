"""One ``flex_attention`` call of a layout (``FlexCall``) and the index rules the variants' layouts share.

A variant's flex layout is a list of calls; each call attends its queries, in the call's own order of positions,
to ``[the L keys ; R region summaries]`` under a ``mask_mod`` read from the geometry by index arithmetic (segment
index, row / column, log level, block table), never from an ``(L, L + R)`` dense mask. The calls of one ``group``
share one softmax (merged exactly by their log-sum-exps, ``engine.merge_by_lse``); the groups' outputs are averaged
(``combiner_mixture plans=average``). A call knows its mask only: the summaries are the variant's own
(``Attention.flex_summaries``), so one call object serves every layer and every model with the same geometry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from longseq.attention.ops.geometry import Grid


@dataclass(frozen=True, eq=False)
class FlexCall:
    """One ``flex_attention`` call of a layout, in its own order of positions.

    Attributes:
        direct: ``direct(b, h, q, kv) -> bool`` for call-order indices ``q``, ``kv`` in ``[0, L)`` (0-d tensors under
            the mask's vmap, broadcast index grids in ``block_masks.build_block_mask``): the query attends key ``kv``
            directly. None: the call has no direct keys; its KV is the R summaries alone.
        order: ``(L,)`` long, the position of each call-order index (None = sequence order).
        n_regions: R, the summaries appended after the keys (``Attention.flex_summaries`` makes them).
        usable: ``usable(b, h, q, r) -> bool``: the query may use summary ``r`` in ``[0, R)``.
        members: ``members() -> (R, L)`` bool, the positions (sequence order) each summary pools (tests only).
        anchors: ``anchors() -> (R,)`` long, the position whose own query summarizes each region (row-major axial),
            None for pooled regions (tests only).
        heads: how many heads the mask distinguishes (BigBird's per-head random blocks; 1 = shared).
        family: ``Partition.family`` of the call's regions (1 = horizontal; tests only).
        group: calls of one group share one softmax; the groups' outputs are averaged.
        summary_order: ``(R,)`` long, the row of the variant's summaries (``Attention.flex_summaries``) that each
            summary slot of the KV takes (None: the same order). The order of the summaries in KV only decides how
            many tiles a call visits, never its result.
        summaries: ``summaries(qs, k, v, real) -> (k_bar, v_bar, occupied)`` for a call of a layout that depends on
            the batch (``Attention.flex_data_calls``: its regions are this batch's clusters); None: the variant's
            ``flex_summaries``.
        fallback: the direct keys a query takes when padding leaves its group nothing (``ops.padding``'s rule 3);
            None: ``direct`` itself.
    """

    direct: Callable | None
    order: torch.Tensor | None = None
    n_regions: int = 0
    usable: Callable | None = None
    members: Callable | None = None
    anchors: Callable | None = None
    heads: int = 1
    family: int = 0
    group: int = 0
    summary_order: torch.Tensor | None = None
    summaries: Callable | None = None
    fallback: Callable | None = None

    def kv_len(self, L: int, direct_only: bool = False) -> int:
        """KV length of the call: [L keys ;] R summaries (the keys alone with ``direct_only``)."""
        keys = L if self.direct is not None else 0
        return keys if direct_only else keys + self.n_regions

    def mask_mod(self, L: int, real: torch.Tensor | None = None, occupied: torch.Tensor | None = None,
                 direct_only: bool = False, also: Callable | None = None) -> Callable:
        """The call's ``mask_mod(b, h, q, kv)`` over ``[L keys ; R summaries ; tile padding]``; with ``real``
        ``(B, L)`` (call order) and ``occupied`` ``(B, R)`` (``(B, H, R)`` for per-head regions) the per-document
        padding masks; ``direct_only`` keeps the fallback keys alone (``fallback``, else ``direct``); ``also`` a
        per-batch condition of the variant (``Attention.flex_call_mask``) that every allowed slot must meet too. KV
        slots past ``kv_len`` (the padding that makes KV a whole number of tiles) are never attended."""
        R = 0 if direct_only else self.n_regions
        direct, usable = (self.fallback or self.direct) if direct_only else self.direct, self.usable
        keys = L if direct is not None else 0

        def mask_mod(b, h, q, kv):
            ok = None
            if keys:
                key = kv.clamp(max=L - 1)
                ok = direct(b, h, q, key) & (kv < L)
                if real is not None:
                    ok = ok & real[b, key]
            if R:
                region = (kv - keys).clamp(min=0, max=R - 1)
                use = usable(b, h, q, region) & (kv >= keys) & (kv < keys + R)
                if occupied is not None:
                    use = use & (occupied[b, region] if occupied.dim() == 2 else occupied[b, h, region])
                ok = use if ok is None else ok | use
            return ok if also is None else ok & also(b, h, q, kv)

        return mask_mod


# ------------------------------------------------------------------------------------------------
# Index rules shared by the layouts (each written once).
# ------------------------------------------------------------------------------------------------
def same_block(m: int, causal: bool) -> Callable:
    """Direct mask of a sequence-order call: the query's own block of ``m`` positions (a segment, a grid row), up to
    and including itself when ``causal``."""
    def own_block(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    return own_block


def own_column(n: int, causal: bool) -> Callable:
    """Direct mask of a column-order call on an ``n``-row grid: same column, earlier rows (causal) or other rows (self
    is attended in the sequence-order call)."""
    def column(b, h, q, kv):  # column order: column = index // n, row = index % n
        same = (q // n) == (kv // n)
        return same & ((kv % n) < (q % n) if causal else (kv % n) != (q % n))

    return column


def column_order(grid: Grid, device) -> torch.Tensor:
    """(L,) the position at each column-order index ``t = c * n + r`` (position ``r * m + c``)."""
    t = torch.arange(grid.length, device=device)
    return (t % grid.n_rows) * grid.n_cols + t // grid.n_rows


def column_major(x: torch.Tensor) -> torch.Tensor:
    """``(..., n, m, .)`` row layout -> ``(..., m * n, .)`` in column order (index ``c * n + r``)."""
    return x.transpose(-3, -2).flatten(-3, -2)


def interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Summaries of two region kinds per slot along ``dim`` (>= 0), side by side: index ``2 * slot + kind`` (one
    tile of slots, not two bands)."""
    return torch.stack([a, b], dim + 1).flatten(dim, dim + 1)


def grid_views(grid: Grid, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None):
    """Row layouts ``(B, H, n, m, .)`` of scaled q, k, v and ``real`` ``(B, 1, n, m)`` bool (None unpadded)."""
    rows = [x.unflatten(-2, (grid.n_rows, grid.n_cols)) for x in (qs, k, v)]
    return rows, None if real is None else real.view(-1, 1, grid.n_rows, grid.n_cols)
