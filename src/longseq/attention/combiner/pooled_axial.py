"""Combiner axial family with pooled regions: ``combiner_axial_vertical``, ``combiner_axial_horizontal``
and ``combiner_mixture`` (Ren et al. 2021 §4.3 / appendix C; official ``_AxialMixtureAtt``).

Grid view: ``L = n * m`` positions on ``n`` rows of ``m = block_size`` columns, ``p = r * m + c``.
All three share one direct part for query ``(r, c)``:

- causal: own row up to and including self (``c' <= c``) + own column strictly above (``r' < r``);
- bidirectional: own row (all columns) + own column (other rows); self once.

Regions (each one joint-softmax logit; summary key = pooled keys, summary value = inner softmax of
the pooled query over the region's keys; empty regions are masked):

- vertical, for every other column ``c' != c``: causal ``V(c') = {(r', c') : r' < r}`` (column
  prefix, the official running-max layout); bidirectional the column without row r, split into
  above (``r' < r``) and below (``r' > r``).
- horizontal (``combiner_axial_horizontal``, ``horizontal_regions=whole``): for every earlier row
  ``r' < r`` (bidirectional: every other row) ONE region ``{(r', c') : c' != c}``; its pooled key is
  the pool of the row without column c, its inner softmax runs over the row with column c masked.
  ``horizontal_regions=split`` (and the mixture) use the official halves ``HL(r') = {c' < c}`` and
  ``HR(r') = {c' > c}``.
- ``combiner_mixture``: direct + vertical + split horizontal, ONE softmax over
  ``[D1 | D2 | V | HL | HR]`` (width ``3n + 2m`` causal). A position outside the query's row and
  column lies in one vertical AND one horizontal region — the intended double coverage; the joint
  softmax learns the mixing. ``plans=average`` instead averages the two factorizations, each with
  its own softmax over ``[direct | vertical]`` and ``[direct | horizontal]`` (paper §3.3: a mixture
  of M partition plans with uniform weights 1/M).

Pooling (``summary``): ``max`` (official JAX running max), ``mean``, ``deepsets_max``,
``deepsets_mean`` via ``RegionSummary``; queries are scaled by 1/sqrt(D) once, before pooling.
Prefix regions are pooled inclusively and shifted by one (official order), so no inner softmax ever
runs over an empty set. Weight dropout applies to the joint weights only (the official layer has none).

Key padding (LRA, ``key_padding_mask`` (B, L), True = pad): padded keys get no direct weight and are
left out of every pooled query/key (running pools skip them) and inner softmax; a region (or prefix)
without a real key is masked; a query left with nothing (only a padded one can be) falls back to its
unpadded direct keys. The padded path uses the same layouts with per-document masks (``(B, 1, ...)``);
``attention_matrix`` builds each document's reference from ``Partition.without_padding``.

Fast path: row-layout ``(B, H, n, m, ·)`` and column-layout ``(B, H, m, n, ·)`` logits from batched
matmuls, each kept in its own layout and normalized by one shared max and sum
(``_JointGroupsAttention``, explicit backward) — ``O(L (n + m))`` memory, no concatenation. Training
with weight dropout concatenates the logits in the row layout and runs one softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.combiner.axial import to_grid
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.geometry import Grid, check_block_size
from longseq.attention.ops.joint_softmax import LogitGroup, joint_groups_attention, with_padding_fallback
from longseq.attention.ops.masks import NEG_INF, causal_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention

VERTICAL, HORIZONTAL = 0, 1
PLANS = ("joint", "average")
HORIZONTAL_REGIONS = ("whole", "split")


class PooledAxialAttention(PooledCombiner, Attention):
    """Shared machinery of the pooled axial variants; subclasses choose the region families.

    Key padding (LRA, ``key_padding_mask`` (B, L), True = pad): padded keys leave the direct part,
    every region's pooled query/key (running pools included) and its inner softmax; a region without a
    real key is masked; a (padded) query left with nothing falls back to its unpadded direct keys.

    Args:
        block_size: m, the row length (columns); must divide L.
        summary: region pooling, one of ``max`` (default), ``mean``, ``deepsets_max``, ``deepsets_mean``.
    """

    use_vertical = True
    horizontal_regions: str | None = "split"
    plans = "joint"
    supports_padding_mask = True

    def __init__(self, *, causal: bool, block_size: int, summary: str = "max", **common) -> None:
        self.block_size = check_block_size(block_size, common.get("seq_len"))
        super().__init__(causal=causal, **common)
        self.summary_kind = summary
        self.summary = RegionSummary(summary, self.head_dim)
        self.has_parameters = self.summary.has_parameters

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, summary={self.summary_kind}"

    # -- summaries along one axis (fast path) ----------------------------------------------------
    def prefix_summaries(self, q, k, v, reverse: bool = False):
        """Summaries of the strict prefixes ``[0, t)`` (suffixes ``(t, T)`` if ``reverse``) along axis -2.

        q (scaled), k, v: ``(..., T, D)``. Returns summary keys and values ``(..., T, D)``; the empty
        region (t = 0, or T-1 when reversed) gets zeros, which callers mask.
        """
        if reverse:
            k_bar, v_bar = self.prefix_summaries(q.flip(-2), k.flip(-2), v.flip(-2))
            return k_bar.flip(-2), v_bar.flip(-2)
        T = q.shape[-2]
        q_pool = self.running_pool(q, self.summary.prefix_queries)
        k_pool = self.running_pool(k, self.summary.prefix_keys)
        later = ~causal_mask(T, q.device)
        inclusive = (q_pool @ k.transpose(-1, -2)).masked_fill(later, NEG_INF).softmax(-1) @ v
        # Inclusive prefix [0, t] shifted by one = strict prefix [0, t): never an empty inner softmax.
        return shift_forward(k_pool), shift_forward(inclusive)

    def running_pool(self, x: torch.Tensor, prefix) -> torch.Tensor:
        """Inclusive running pool of ``x`` ``(..., T, D)`` along axis -2 (``prefix`` of ``RegionSummary``).

        Plain max with autograd runs its ``cummax`` on a contiguous last axis: CPU ``cummax`` along a strided
        axis is about 3x slower. Without autograd ``summary.running_max`` scans axis -2 in place (no index
        tensor, no transposed copy). (Feature maps act on D, so the other kinds scan in place.)
        """
        if self.summary_kind == "max" and torch.is_grad_enabled() and x.requires_grad:
            return prefix(x.transpose(-1, -2).contiguous(), -1).transpose(-1, -2)
        return prefix(x, -2)

    def pool_excluding_own(self, x, prefix) -> torch.Tensor:
        """For each t along axis -2 (T >= 2), the pool of all positions except t, ``(..., T, D)``."""
        before_incl = self.running_pool(x, prefix)
        if self.summary.reduce == "max":
            after_incl = self.running_pool(x.flip(-2), prefix).flip(-2)
            fill = torch.full_like(x[..., :1, :], NEG_INF)
            before = torch.cat([fill, before_incl[..., :-1, :]], -2)
            after = torch.cat([after_incl[..., 1:, :], fill], -2)
            return torch.maximum(before, after)
        T = x.shape[-2]
        counts = torch.arange(1, T + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
        sums = before_incl * counts  # running means -> running sums (of the pooled features)
        own = sums - shift_forward(sums)
        return (sums[..., -1:, :] - own) / (T - 1)

    def excluding_own_summaries(self, q, k, v):
        """Summary of "the whole axis except t" for each t along axis -2: keys, values ``(..., T, D)``."""
        T = q.shape[-2]
        q_pool = self.pool_excluding_own(q, self.summary.prefix_queries)
        k_pool = self.pool_excluding_own(k, self.summary.prefix_keys)
        own = torch.eye(T, dtype=torch.bool, device=q.device)
        probs = (q_pool @ k.transpose(-1, -2)).masked_fill(own, NEG_INF).softmax(-1)
        return k_pool, probs @ v

    # -- summaries under key padding (``real`` = True for a real key, broadcastable to (..., T)) ----
    def masked_running_pool(self, features: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Inclusive running pool of featurized ``(..., T, D)`` over the real positions only.

        Before the first real position max gives -inf and mean gives 0; callers mask those.
        """
        keep = real.unsqueeze(-1)
        if self.summary.reduce == "max":
            filled = features.masked_fill(~keep, NEG_INF)
            return torch.cummax(filled.transpose(-1, -2).contiguous(), -1).values.transpose(-1, -2)
        count = real.cumsum(-1).clamp(min=1).unsqueeze(-1).to(features.dtype)
        return (features * keep).cumsum(-2) / count

    def padded_prefix_summaries(self, q, k, v, real, reverse: bool = False):
        """``prefix_summaries`` over real keys only: q (scaled), k, v ``(..., T, D)``, real ``(..., T)``.

        Returns summary keys and values ``(..., T, D)`` of the strict prefixes and ``occupied``
        ``(..., T)``: the prefix holds a real key (else its summary is zeros and must be masked).
        """
        if reverse:
            k_bar, v_bar, occupied = self.padded_prefix_summaries(q.flip(-2), k.flip(-2), v.flip(-2), real.flip(-1))
            return k_bar.flip(-2), v_bar.flip(-2), occupied.flip(-1)
        T = q.shape[-2]
        seen = real.cumsum(-1) > 0  # (..., T): the inclusive prefix holds a real key
        q_pool = self.masked_running_pool(self.summary.query_features(q), real).masked_fill(~seen.unsqueeze(-1), 0.0)
        k_pool = self.masked_running_pool(self.summary.key_features(k), real).masked_fill(~seen.unsqueeze(-1), 0.0)
        later = ~causal_mask(T, q.device)
        # A prefix without a real key keeps its padded keys: any finite row will do, its summary is masked.
        blocked = later | (~real.unsqueeze(-2) & seen.unsqueeze(-1))  # (..., T[t], T[j])
        inclusive = (q_pool @ k.transpose(-1, -2)).masked_fill(blocked, NEG_INF).softmax(-1) @ v
        occupied = torch.cat([torch.zeros_like(seen[..., :1]), seen[..., :-1]], -1)
        return shift_forward(k_pool), shift_forward(inclusive), occupied

    def padded_excluding_own_summaries(self, q, k, v, real):
        """``excluding_own_summaries`` over real keys only; also returns ``occupied`` ``(..., T)``."""
        T = q.shape[-2]
        others = real.sum(-1, keepdim=True) - real.long()  # (..., T): real positions besides t
        occupied = others > 0

        def pool(features):
            if self.summary.reduce == "max":
                before = self.masked_running_pool(features, real)
                after = self.masked_running_pool(features.flip(-2), real.flip(-1)).flip(-2)
                fill = torch.full_like(before[..., :1, :], NEG_INF)
                before_t = torch.cat([fill, before[..., :-1, :]], -2)  # positions < t
                after_t = torch.cat([after[..., 1:, :], fill], -2)  # positions > t
                pooled = torch.maximum(before_t, after_t)
            else:
                kept = features * real.unsqueeze(-1)
                pooled = (kept.sum(-2, keepdim=True) - kept) / others.clamp(min=1).unsqueeze(-1).to(features.dtype)
            return pooled.masked_fill(~occupied.unsqueeze(-1), 0.0)

        q_pool, k_pool = pool(self.summary.query_features(q)), pool(self.summary.key_features(k))
        own = torch.eye(T, dtype=torch.bool, device=q.device)
        blocked = (own | ~real.unsqueeze(-2)) & occupied.unsqueeze(-1)  # an empty region keeps a finite row
        probs = (q_pool @ k.transpose(-1, -2)).masked_fill(blocked, NEG_INF).softmax(-1)
        return k_pool, probs @ v, occupied

    def padded_logit_groups(self, qr, qc, kr, vr, real):
        """``logit_groups`` under key padding, ``real`` ``(B, 1, n, m)`` bool (True = real key).

        Masks gain a batch axis: padded keys leave the direct groups (which keep their unpadded mask as
        ``fallback``), summaries pool and average over real keys only, regions without one are masked.
        """
        n, m = qr.shape[2], qr.shape[3]
        device = qr.device
        rows, cols = torch.arange(n, device=device), torch.arange(m, device=device)
        kc, vc = (x.transpose(2, 3).contiguous() for x in (kr, vr))  # column layout (B, H, m, n, D)
        real_col = real.transpose(2, 3)  # (B, 1, m, n)
        other_col = cols[None, :, None] != cols[None, None, :]  # (1, m[c], m[c'])
        if self.causal:
            earlier_row = rows[None, :, None] > rows[None, None, :]  # (1, n[r], n[r']) r' < r
            own_row = cols[None, :, None] >= cols[None, None, :]
        else:
            earlier_row = rows[None, :, None] != rows[None, None, :]
            own_row = torch.ones(1, m, m, dtype=torch.bool, device=device)
        direct = [
            LogitGroup("col", kc, vc, earlier_row & real_col.unsqueeze(-2), fallback=earlier_row),
            LogitGroup("row", kr, vr, own_row & real.unsqueeze(-2), fallback=own_row),
        ]

        def by_row(occupied_col):  # (B,1,m[c'],n[r]) -> (B,1,n[r],1,m[c']): region (r, c') holds a real key
            return occupied_col.transpose(2, 3).unsqueeze(-2)

        def by_col(occupied_row):  # (B,1,n[r'],m[c]) -> (B,1,m[c],1,n[r'])
            return occupied_row.transpose(2, 3).unsqueeze(-2)

        vertical = []
        if self.use_vertical:
            for reverse in ((False,) if self.causal else (False, True)):
                k_bar, v_bar, occupied = self.padded_prefix_summaries(qc, kc, vc, real_col, reverse=reverse)
                mask = other_col & by_row(occupied)
                vertical.append(LogitGroup("row", k_bar.transpose(2, 3), v_bar.transpose(2, 3), mask))

        horizontal = []
        if self.horizontal_regions == "split":
            for reverse in (False, True):
                k_bar, v_bar, occupied = self.padded_prefix_summaries(qr, kr, vr, real, reverse=reverse)
                mask = earlier_row & by_col(occupied)
                horizontal.append(LogitGroup("col", k_bar.transpose(2, 3), v_bar.transpose(2, 3), mask))
        elif self.horizontal_regions == "whole" and m > 1:
            k_bar, v_bar, occupied = self.padded_excluding_own_summaries(qr, kr, vr, real)
            mask = earlier_row & by_col(occupied)
            horizontal.append(LogitGroup("col", k_bar.transpose(2, 3), v_bar.transpose(2, 3), mask))
        return direct, vertical, horizontal

    # -- fast path ------------------------------------------------------------------------------
    def logit_groups(self, qr, qc, kr, vr) -> tuple[list[LogitGroup], list[LogitGroup], list[LogitGroup]]:
        """Direct, vertical and horizontal groups for row-layout q (scaled), k, v ``(B, H, n, m, D)``
        and the column-layout scaled queries ``qc`` ``(B, H, m, n, D)``."""
        n, m = qr.shape[2], qr.shape[3]
        device = qr.device
        rows, cols = torch.arange(n, device=device), torch.arange(m, device=device)
        kc, vc = (x.transpose(2, 3).contiguous() for x in (kr, vr))  # column layout (B, H, m, n, D)
        other_col = cols[None, :, None] != cols[None, None, :]  # (1, m[c], m[c']) query col vs region col
        if self.causal:
            earlier_row = rows[None, :, None] > rows[None, None, :]  # (1, n[r], n[r']) r' < r
            direct = [
                LogitGroup("col", kc, vc, earlier_row),  # own column strictly above
                LogitGroup("row", kr, vr, cols[None, :, None] >= cols[None, None, :]),  # own row up to self
            ]
        else:
            earlier_row = rows[None, :, None] != rows[None, None, :]  # "other row" in both directions
            direct = [LogitGroup("col", kc, vc, earlier_row), LogitGroup("row", kr, vr, None)]

        vertical = []
        if self.use_vertical:
            k_above, v_above = self.prefix_summaries(qc, kc, vc)  # (B,H,m[c'],n[r],D): rows < r of c'
            has_above = (rows > 0)[:, None, None]
            vertical.append(LogitGroup("row", k_above.transpose(2, 3), v_above.transpose(2, 3), other_col & has_above))
            if not self.causal:
                k_below, v_below = self.prefix_summaries(qc, kc, vc, reverse=True)
                has_below = (rows < n - 1)[:, None, None]
                vertical.append(LogitGroup("row", k_below.transpose(2, 3), v_below.transpose(2, 3), other_col & has_below))

        horizontal = []
        if self.horizontal_regions == "split":
            k_left, v_left = self.prefix_summaries(qr, kr, vr)  # (B,H,n[r'],m[c],D): row r', cols < c
            k_right, v_right = self.prefix_summaries(qr, kr, vr, reverse=True)
            has_left, has_right = (cols > 0)[:, None, None], (cols < m - 1)[:, None, None]
            horizontal.append(LogitGroup("col", k_left.transpose(2, 3), v_left.transpose(2, 3), earlier_row & has_left))
            horizontal.append(LogitGroup("col", k_right.transpose(2, 3), v_right.transpose(2, 3), earlier_row & has_right))
        elif self.horizontal_regions == "whole" and m > 1:  # m = 1: the region {c' != c} is empty
            k_whole, v_whole = self.excluding_own_summaries(qr, kr, vr)  # (B,H,n[r'],m[c],D)
            horizontal.append(LogitGroup("col", k_whole.transpose(2, 3), v_whole.transpose(2, 3), earlier_row))
        return direct, vertical, horizontal

    def joint_softmax(self, groups: list[LogitGroup], qr, qc) -> torch.Tensor:
        """One softmax over the concatenated groups' logits -> output ``(B, H, n, m, D)``."""
        if not (self.training and self.dropout > 0):
            return joint_groups_attention(groups, qr, qc)
        logits = torch.cat([g.logits(qr, qc) for g in groups], -1)
        weights = self.weight_dropout(logits.softmax(-1))
        out = None
        for group, w in zip(groups, weights.split([g.width for g in groups], -1)):
            part = group.apply(w)
            out = part if out is None else out + part
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled -> (B, H, L, D); ``key_padding_mask`` (B, L) bool, True = padded key."""
        L = q.shape[-2]
        self.check_length(L)
        grid = Grid.of(L, self.block_size)
        qr, kr, vr = to_grid(self.scale(q), grid), to_grid(k, grid), to_grid(v, grid)
        qc = qr.transpose(2, 3).contiguous()  # column layout (B, H, m, n, D)
        if key_padding_mask is None:
            direct, vertical, horizontal = self.logit_groups(qr, qc, kr, vr)
        else:
            real = ~key_padding_mask.to(device=q.device, dtype=torch.bool).view(-1, 1, grid.n_rows, grid.n_cols)
            direct, vertical, horizontal = self.padded_logit_groups(qr, qc, kr, vr, real)
        if self.plans == "average":
            plans = [direct + vertical, direct + horizontal]
        else:
            plans = [direct + vertical + horizontal]
        if key_padding_mask is not None:
            plans = [with_padding_fallback(groups) for groups in plans]
        if self.plans == "average":
            out = 0.5 * (self.joint_softmax(plans[0], qr, qc) + self.joint_softmax(plans[1], qr, qc))
        else:
            out = self.joint_softmax(plans[0], qr, qc)
        return out.flatten(2, 3)

    # -- explicit partition and dense reference ---------------------------------------------------
    def partition(self, L: int, device=None) -> Partition:
        """Direct set and every non-empty region, built by broadcasting over grid coordinates.

        Candidate regions are indexed by a grid position ``a = (ra, ca)`` per region kind; members
        are tested on key coordinates ``(rj, cj)``, usability on query coordinates ``(ri, ci)``.
        """
        grid = Grid.of(L, self.block_size)
        rows, cols = grid.rows(device), grid.cols(device)
        r0, c0, r1, c1 = rows[:, None], cols[:, None], rows[None, :], cols[None, :]
        if self.causal:
            direct = ((r1 == r0) & (c1 <= c0)) | ((c1 == c0) & (r1 < r0))
            earlier = r1 < r0  # (query row on axis 0, region row on axis 1)
        else:
            direct = (r1 == r0) | (c1 == c0)
            earlier = r1 != r0
        kinds = []  # (members (A, L) with region a on axis 0, usable (L, A) with query on axis 0, family)
        if self.use_vertical:
            same_row_other_col = (r0 == r1) & (c0 != c1)  # query (r, c) uses regions stored at row r, c' != c
            kinds.append(((c1 == c0) & (r1 < r0), same_row_other_col, VERTICAL))
            if not self.causal:
                kinds.append(((c1 == c0) & (r1 > r0), same_row_other_col, VERTICAL))
        same_col_earlier_row = (c0 == c1) & earlier
        if self.horizontal_regions == "split":
            kinds.append(((r1 == r0) & (c1 < c0), same_col_earlier_row, HORIZONTAL))
            kinds.append(((r1 == r0) & (c1 > c0), same_col_earlier_row, HORIZONTAL))
        elif self.horizontal_regions == "whole":
            kinds.append(((r1 == r0) & (c1 != c0), same_col_earlier_row, HORIZONTAL))
        if kinds:
            members = torch.cat([mem for mem, _, _ in kinds], 0)
            usable = torch.cat([use for _, use, _ in kinds], 1)
            family = torch.cat([torch.full((L,), f, dtype=torch.long, device=device) for _, _, f in kinds])
        else:
            members = torch.zeros(0, L, dtype=torch.bool, device=device)
            usable = torch.zeros(L, 0, dtype=torch.bool, device=device)
            family = torch.zeros(0, dtype=torch.long, device=device)
        anchor = torch.full_like(family, -1)
        return Partition.from_candidates(direct, members, usable, family, anchor)

    def plans_of(self, part: Partition) -> list[Partition]:
        """The softmax plans whose outputs are averaged: ``[part]``, or its vertical and horizontal plans
        (``plans=average``)."""
        return [part.plan(f) for f in (VERTICAL, HORIZONTAL)] if self.plans == "average" else [part]

    def decoding_plans(self, part: Partition) -> list[torch.Tensor] | None:
        return [part.family == f for f in (VERTICAL, HORIZONTAL)] if self.plans == "average" else None

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) dense effective weights, built from ``partition`` (not from ``forward``): the mean over
        ``plans_of`` of each plan's ``RegionSummary.matrix``.

        With ``key_padding_mask`` each document (and each plan of ``plans=average``) gets its own
        partition from ``Partition.without_padding``: a loop over the batch, reference path only.
        """
        L = q.shape[-2]
        self.check_length(L)
        plans, qs = self.plans_of(self.partition(L, q.device)), self.scale(q)
        if key_padding_mask is None:
            return sum(self.summary.matrix(plan, qs, k) for plan in plans) / len(plans)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([
            sum(self.summary.matrix(plan.without_padding(pad), qs[b : b + 1], k[b : b + 1]) for plan in plans) / len(plans)
            for b, pad in enumerate(pads)
        ])


def shift_forward(x: torch.Tensor) -> torch.Tensor:
    """Move ``(..., T, D)`` one step along axis -2 (zeros at t = 0, last entry dropped)."""
    return F.pad(x[..., :-1, :], (0, 0, 1, 0))


@register_attention("combiner_axial_vertical")
class CombinerAxialVertical(PooledAxialAttention):
    """Direct part + vertical column regions only (logit width n + 2m causal); ``O(L (n + m) D)``."""

    use_vertical = True
    horizontal_regions = None


@register_attention("combiner_axial_horizontal")
class CombinerAxialHorizontal(PooledAxialAttention):
    """Direct part + one region per earlier row without the query's column (width 2n + m causal).

    Args:
        horizontal_regions: ``whole`` (default, the paper's ``{(r', c') : c' != c}``) or ``split``
            (the mixture's left/right halves, two logits per row).
    """

    use_vertical = False

    def __init__(self, *, horizontal_regions: str = "whole", **kwargs) -> None:
        if horizontal_regions not in HORIZONTAL_REGIONS:
            raise AttentionConfigError(
                f"attention.horizontal_regions={horizontal_regions!r} is not valid; choose one of {HORIZONTAL_REGIONS}"
            )
        self.horizontal_regions = horizontal_regions
        super().__init__(**kwargs)


@register_attention("combiner_mixture")
class CombinerMixture(PooledAxialAttention):
    """Vertical + split horizontal regions over one direct part (width 3n + 2m causal); ``O(L (n + m) D)``.

    Args:
        plans: ``joint`` (default, the official single softmax over both factorizations) or
            ``average`` (mean of the vertical and the horizontal factorization's outputs, each
            normalized separately — the paper's §3.3 mixture of partition plans, uniform weights).
    """

    use_vertical = True
    horizontal_regions = "split"

    def __init__(self, *, plans: str = "joint", **kwargs) -> None:
        if plans not in PLANS:
            raise AttentionConfigError(f"attention.plans={plans!r} is not valid; choose one of {PLANS}")
        self.plans = plans
        super().__init__(**kwargs)
