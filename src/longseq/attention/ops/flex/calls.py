"""One ``flex_attention`` call of a layout (``FlexCall``) and the index rules the variants' layouts share.

A variant's flex layout is a list of calls; each call attends its queries, in the call's own order of positions,
to ``[the L keys ; R region summaries]`` under a ``mask_mod`` read from the geometry by index arithmetic (segment
index, row / column, log level, block table), never from an ``(L, L + R)`` dense mask. The calls of one ``group``
share one softmax (merged exactly by their log-sum-exps, ``engine.merge_by_lse``); the groups' outputs are averaged
(``combiner_mixture plans=average``). A call knows its mask only: the summaries are the variant's own
(``Attention.flex_summaries``), so one call object serves every layer and every model with the same geometry.

Summaries that every query may use are "hot" key tiles: FlexAttention's backward computes each key tile's dK and dV
in one program that loops over every query tile visiting it, so at L = 65,536 the summary tiles of
``combiner_fixed`` are one serial loop over all 512 query tiles (the rest of the layer's backward is a few query
tiles per key tile). The summaries are therefore laid out once per ``copy_rows(L)`` queries (a quarter of the
sequence, between 1,024 and 4,096; ``FlexCall.summary_copies``): each copy is visible to its own query rows only, so
no loop is longer than a quarter of the query tiles (from 4,096 on) or 32 tiles; the softmax is unchanged (a query sees exactly one copy of each summary) and
autograd sums the copies' gradients. A call with many summaries, few of them hot, copies only those
(``FlexCall.copy_from``: ``combiner_logsparse``'s blocks of a tile or more, whose users span many query tiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from longseq.attention.ops.geometry import Grid

if TYPE_CHECKING:
    from longseq.attention.ops.flex.regions import RegionTable

TILE = 128  # FlexAttention's default tile (queries x keys); ``tile_size`` shrinks it for short sequences
COPY_ROWS = 32 * TILE  # at most this many query rows (in a call's order) share one copy of its summaries,
MIN_COPY_ROWS = 8 * TILE  # at least this many (a sequence of up to 8 tiles keeps one copy: its loops are short),
COPY_SHARE = 1 / 4  # and between the two a copy per quarter of the sequence: no loop over more than a quarter of the
# query tiles from 4,096 on (#43: at 4,096 combiner_fixed's summary tile was one loop over all 32 query tiles)
COPY_KEY_SHARE = 1 / 4  # the copies add at most this share of L key slots (memory, not tiles: a query visits its own
# copy only); past it a call keeps one copy (every summary of combiner_logsparse would be 16 L at 65,536; its big ones
# in copies are L / 8 causal, L / 4 bidirectional)


def tile_size(L: int) -> int:
    """The flex tile for a length-L sequence: ``TILE`` (128), or the next power of two >= L (at least 16, the
    kernels' smallest) when the whole sequence is shorter than one tile."""
    return min(TILE, max(16, 1 << max(L - 1, 1).bit_length()))


def copy_rows(L: int) -> int:
    """Query rows that share one copy of a call's hot summaries at length L: a quarter of the sequence in whole
    tiles, within ``[MIN_COPY_ROWS, COPY_ROWS]`` (``FlexCall.summary_copies``)."""
    return min(COPY_ROWS, max(MIN_COPY_ROWS, int(L * COPY_SHARE) // TILE * TILE))


def whole_tiles(length: int, tile: int) -> int:
    """``length`` rounded up to a whole number of tiles (KV slots past a call's keys are masked)."""
    return -(-length // tile) * tile


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
        summaries: ``summaries(qs, k, v, real) -> (k_bar, v_bar, occupied)``: the call's own summaries (a layout
            that depends on the batch, ``Attention.flex_data_calls``: this batch's clusters; ``nsa``: block 0's keys,
            one a region, so their tiles are copied as summaries are); None: the variant's ``flex_summaries``.
        fallback: the direct keys a query takes when padding leaves its group nothing (``ops.padding``'s rule 3);
            None: ``direct`` itself.
        copy_from: the summaries (in KV order) from this one on are the hot ones, laid out in copies
            (``summary_copies``); the ones before it sit once, before the copies (0: every summary is copied).
        key_regions: the regions are single keys (``summaries`` returns the keys themselves): direct keys that every
            query may use, laid out as regions so that their tiles are copied (``nsa``'s block 0, the sparse
            ``fixed`` pattern's summary cells); inspection counts them as direct keys.
        regions: the summaries as pooled regions (``regions.RegionTable``, rows in the order ``flex_summaries`` gives
            them), so the summaries and this call's KV are one fused operation on CUDA (``regions.summary_kv``);
            None: the variant's ``flex_summaries`` (also the reference, and the path under key padding).
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
    copy_from: int = 0
    key_regions: bool = False
    regions: RegionTable | None = None
    sequence_order: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        """``sequence_order`` ``(L,)`` long: the call-order index of each position, ``order``'s inverse (None with
        it), made once with the call: results come back to sequence order by ``index_select``, whose backward keeps
        only this index."""
        if self.order is not None:
            inverse = torch.empty_like(self.order).scatter_(0, self.order, torch.arange(len(self.order),
                                                                                        device=self.order.device))
            object.__setattr__(self, "sequence_order", inverse)

    def summary_copies(self, L: int) -> tuple[int, int, int]:
        """How the call's hot summaries (``copy_from`` on) sit in its KV at length L: ``(copies, slots, rows)``,
        ``copies`` blocks of ``slots`` slots each (the hot summaries padded to whole tiles), copy ``c`` visible to the
        queries ``[c rows, (c + 1) rows)`` in the call's order, after the ``cold_slots`` of the others (the module
        docstring says why). ``(1, R, L)``: every summary once, up to ``COPY_ROWS`` queries and where the copies
        would add more than ``COPY_KEY_SHARE`` L slots."""
        R = self.n_regions
        hot = R - self.copy_from
        rows = copy_rows(L)
        copies = -(-L // rows)
        slots = whole_tiles(hot, tile_size(L))
        if not hot or copies == 1 or copies * slots > L * COPY_KEY_SHARE:
            return 1, R, L
        return copies, slots, rows

    def cold_slots(self, L: int) -> int:
        """KV slots of the summaries laid out once before the copies: ``copy_from`` padded to whole tiles (so no tile
        holds both where L, the keys before them, is whole tiles); 0 without copies (every summary in one block of R
        slots, ``summary_copies``)."""
        return whole_tiles(self.copy_from, tile_size(L)) if self.summary_copies(L)[0] > 1 else 0

    def kv_len(self, L: int, direct_only: bool = False) -> int:
        """KV length of the call: [L keys ;] its summaries' slots (``summary_copies``; the keys alone with
        ``direct_only``)."""
        keys = L if self.direct is not None else 0
        if direct_only:
            return keys
        copies, slots, _ = self.summary_copies(L)
        return keys + self.cold_slots(L) + copies * slots

    def summary_kv(self, x: torch.Tensor, L: int) -> torch.Tensor:
        """The summaries' slots of the KV from the R summaries ``x`` ``(B, H, R, D)``: the cold ones padded to their
        slots, then each copy of the hot ones padded to its slots (zeros, masked) -> ``(B, H, cold_slots + copies *
        slots, D)`` (``summary_copies``)."""
        copies, slots, _ = self.summary_copies(L)
        if copies == 1:
            return x
        pad = torch.nn.functional.pad
        hot = pad(x[..., self.copy_from :, :], (0, 0, 0, slots - (x.shape[-2] - self.copy_from)))
        hot = hot.unsqueeze(-3).expand(*x.shape[:-2], copies, slots, x.shape[-1]).flatten(-3, -2)
        if not self.copy_from:
            return hot
        return torch.cat([pad(x[..., : self.copy_from, :], (0, 0, 0, self.cold_slots(L) - self.copy_from)), hot], -2)

    def summary_columns(self, mask: torch.Tensor, L: int) -> torch.Tensor:
        """A mask's summary columns ``(..., cold_slots + copies * slots)`` -> ``(..., R)``: whether the query may use
        each summary, in any copy for the hot ones (each query sees one copy; inspection and tests)."""
        copies, slots, _ = self.summary_copies(L)
        if copies == 1:
            return mask[..., : self.n_regions]
        hot = mask[..., self.cold_slots(L) :].unflatten(-1, (copies, slots)).any(-2)
        return torch.cat([mask[..., : self.copy_from], hot[..., : self.n_regions - self.copy_from]], -1)

    def mask_mod(self, L: int, real: torch.Tensor | None = None, occupied: torch.Tensor | None = None,
                 direct_only: bool = False, also: Callable | None = None) -> Callable:
        """The call's ``mask_mod(b, h, q, kv)`` over ``[L keys ; R summaries ; tile padding]``; with ``real``
        ``(B, L)`` (call order) and ``occupied`` ``(B, R)`` (``(B, H, R)`` for per-head regions) the per-document
        padding masks; ``direct_only`` keeps the fallback keys alone (``fallback``, else ``direct``); ``also`` a
        per-batch condition of the variant (``Attention.flex_call_mask``) that every allowed slot must meet too. KV
        slots past ``kv_len`` (the padding that makes KV a whole number of tiles) are never attended. Copies of the
        summaries (``summary_copies``) are a re-indexing: a cold slot, or a hot one of the query's own copy, reads as
        the summary's slot in one copy, ``L + r`` (``also`` sees that index too); any other copy's slot, and the
        padding after the cold ones, as nothing."""
        R = 0 if direct_only else self.n_regions
        direct, usable = (self.fallback or self.direct) if direct_only else self.direct, self.usable
        keys = L if direct is not None else 0
        copies, slots, rows = self.summary_copies(L)
        cold, first_hot = self.cold_slots(L), self.copy_from

        def mask_mod(b, h, q, kv):
            own_copy = None
            if R and copies > 1:
                slot = kv - keys
                in_copy = slot - cold  # >= 0: a hot slot, copy in_copy // slots
                own_copy = (in_copy < 0) | (in_copy // slots == q // rows)
                summary = torch.where(in_copy >= 0, first_hot + in_copy % slots, torch.where(slot < first_hot, slot, R))
                kv = torch.where(slot >= 0, keys + summary, kv)
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
            if own_copy is not None:
                ok = ok & own_copy
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
