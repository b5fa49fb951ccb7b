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
``deepsets_mean`` via ``RegionSummary``; every kind is positively homogeneous, so pooling the queries scaled by
1/sqrt(D) (explicit path) or unscaled with the kernels' ``scale`` (fused path) is the same. Prefix regions are
pooled inclusively and shifted by one (official order), so no inner softmax ever runs over an empty set.
Running max pools are blocked scans with ``cummax``'s gradient (``ops.running_max``). Weight dropout applies to
the joint weights only (the official layer has none).

Key padding (LRA, ``key_padding_mask`` (B, L), True = pad): padded keys get no direct weight and are
left out of every pooled query/key (running pools skip them) and inner softmax; a region (or prefix)
without a real key is masked; a query left with nothing (only a padded one can be) falls back to its
unpadded direct keys. The padded path uses the same layouts with per-document masks (``(B, 1, ...)``);
``attention_matrix`` builds each document's reference from ``Partition.without_padding``.

Fused path (``forward_flash``; the ``cpu_flash`` backend: CPU, no key padding, no weight dropout, not bf16/fp16
training): every block of keys is ONE fused flash call on a window of the grid — own row and the vertical summaries in row layout, own
column and the horizontal summaries in column layout (transposed views: the kernels take any strides) — and the
blocks are merged exactly by their log-sum-exps (``ops.cpu.grid_flash.grid_flash_attention``; backward = each
block's flash backward with the joint output and log-sum-exp). Each region family's inner softmax is one fused
SDPA over the pooled queries. Nothing of width ``3n + 2m`` is built. An earlier attempt with per-group masked
flash calls was slower than the explicit softmax; what this one does differently, each measured: no layout copy
(transposed views ran as fast as contiguous operands), heads in groups under ``HEAD_GROUP_BYTES`` (a fresh
buffer of 32 MiB or more page-faults, ~14 ms each), running max by blocked scans instead of ``cummax``.
(Timings against full and the explicit path: docs/cpu_engine_measurements.md, *combiner/pooled_axial.py*.)

Explicit path (the ``explicit`` backend, and ``auto`` under key padding, weight dropout in training, bf16/fp16
training — the CPU flash backward runs about twice as long in bf16 as in fp32 while bf16 speeds up batched
matmuls — a value width other than D, non-CPU devices): row-layout ``(B, H, n, m, ·)`` and column-layout ``(B, H, m, n, ·)`` logits from batched matmuls, each
kept in its own layout and normalized by one shared max and sum (``_JointGroupsAttention``, explicit backward) —
``O(L (n + m))`` memory, no concatenation. Training with weight dropout concatenates the logits in the row
layout and runs one softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.combiner.axial import to_grid
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.cpu.grid_flash import FlashPart, grid_flash_attention
from longseq.attention.ops.cpu.memory import FRESH_MAP_BYTES, heads_per_group
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import (
    FlexCall,
    column_major,
    column_order,
    grid_views,
    interleave,
    own_column,
    same_block,
)
from longseq.attention.ops.flex.regions import RegionTable
from longseq.attention.ops.geometry import BlockGrid, Grid
from longseq.attention.ops.joint_softmax import LogitGroup, joint_groups_attention, with_padding_fallback
from longseq.attention.ops.masks import NEG_INF, causal_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.ops.running_max import maxes_excluding_own, running_maxes
from longseq.attention.registry import register_attention

VERTICAL, HORIZONTAL = 0, 1
PLANS = ("joint", "average")
HORIZONTAL_REGIONS = ("whole", "split")
# The fused path runs on groups of heads of at most this many bytes per (heads, L, D) tensor (``ops.cpu.memory``: a
# fresh 32 MiB block page-faults, ~14 ms). Mixture fwd+bwd, L = 16384, 8 heads, one thread: 2.05 s in groups of
# 8 MiB (2 heads), 2.08 s at 4 MiB, 2.15 s at 16 MiB, 2.36 s with all heads at once.
HEAD_GROUP_BYTES = FRESH_MAP_BYTES // 4


class PooledAxialAttention(BlockGrid, PooledCombiner, Attention):
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
    cpu_flash = CpuFlash(half_precision_training=False)  # ``forward_fused``: no key padding, no weight dropout

    def __init__(self, *, causal: bool, block_size: int, summary: str = "max", **common) -> None:
        super().__init__(causal=causal, block_size=block_size, **common)
        self.summary_kind = summary
        self.summary = RegionSummary(summary, self.head_dim)
        self.has_parameters = self.summary.has_parameters

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
        """Inclusive running pool of ``x`` ``(..., T, D)`` along axis -2 (``prefix`` of ``RegionSummary``)."""
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
        if self.backend_for(q, k, v, key_padding_mask) == "cpu_flash":
            return self.forward_fused(q, k, v, grid)
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

    # -- fused flash path (CPU, no key padding, no weight dropout, no half-precision training) --------
    def forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, H, L, D) unscaled -> (B, H, L, D) through ``forward_flash``, in groups of heads (heads are
        independent) whose ``(heads, L, D)`` tensors stay under ``HEAD_GROUP_BYTES``."""
        B, H, L, D = q.shape
        rows = [x.reshape(B * H, grid.n_rows, grid.n_cols, x.shape[-1]) for x in (q, k, v)]
        group = heads_per_group(B * H, L * D * q.element_size(), HEAD_GROUP_BYTES)
        outs = [self.forward_flash(*heads) for heads in zip(*(x.split(group) for x in rows))]
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).view(B, H, L, -1)

    def pools(self, q: torch.Tensor, k: torch.Tensor, dim: int, reverse: bool = False):
        """Inclusive running pools of the query and key features along ``dim`` (suffix pools if ``reverse``)."""
        features = self.summary.query_features(q), self.summary.key_features(k)
        if self.summary.reduce == "max":
            return running_maxes(features, dim, reverse)
        shape = [1] * q.dim()
        shape[dim] = q.shape[dim]
        counts = torch.arange(1, q.shape[dim] + 1, device=q.device, dtype=q.dtype).view(shape)  # members so far
        if reverse:
            return tuple(x.flip(dim).cumsum(dim).div_(counts).flip(dim) for x in features)
        return tuple(x.cumsum(dim).div_(counts) for x in features)

    def pools_excluding_own(self, q: torch.Tensor, k: torch.Tensor, dim: int):
        """For each position along ``dim`` (length >= 2), the pool of all the others, of query and key features."""
        features = self.summary.query_features(q), self.summary.key_features(k)
        if self.summary.reduce == "max":
            return maxes_excluding_own(features, dim)
        return tuple((x.sum(dim, keepdim=True) - x) / (x.shape[dim] - 1) for x in features)

    def forward_flash(self, qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor) -> torch.Tensor:
        """The joint softmax as fused CPU flash calls: row layouts ``(BH, n, m, D)`` in (q NOT scaled) and out.

        Every block of keys is one ``FlashPart`` of ``grid_flash_attention`` (merged exactly by log-sum-exps):
        own row (row layout, causal) and own column (column layout, the earlier rows: causal on rows shifted
        by one); vertical summaries (row layout, stored by region row: the prefix pooled at row r - 1 serves
        row r; ``c' != c`` a diagonal mask); horizontal summaries (column layout, shifted by one row, and by
        one column for the split halves). Each region family's inner softmax is one fused SDPA over the
        pooled queries (causal for prefixes, masked for suffixes and whole rows). Pooled queries come from
        unscaled q, 1/sqrt(D) is the kernels' ``scale`` (every pooling here is positively homogeneous).
        """
        BH, n, m, D = qr.shape
        scale = 1.0 / math.sqrt(D)
        causal = self.causal
        tensors, layouts = [], []

        def operand(x: torch.Tensor, layout: str) -> int:
            tensors.append(x)
            layouts.append(layout)
            return len(tensors) - 1

        def exclude_diagonal(T: int) -> torch.Tensor:  # (T, T) additive: every key but the query's own position
            return torch.zeros(T, T, dtype=qr.dtype, device=qr.device).fill_diagonal_(NEG_INF)

        def suffix(T: int) -> torch.Tensor:  # (T, T) additive: keys at or after the query's position
            later_or_self = causal_mask(T, qr.device).T
            return torch.zeros(T, T, dtype=qr.dtype, device=qr.device).masked_fill_(~later_or_self, NEG_INF)

        whole = (0, n, 0, m)
        rows_after_first, rows_before_last = (1, n, 0, m), (0, n - 1, 0, m)
        q_row, k_row, v_row = (operand(x, "row") for x in (qr, kr, vr))
        direct = [FlashPart("row", whole, whole, (q_row, k_row, v_row), causal=causal)]
        vertical, horizontal = [], []
        if n == 1:  # a single row: no other row, no region
            return grid_flash_attention(direct, tensors, layouts, scale)
        # own column: the same q, k, v seen in column layout (transposed views, no copies)
        if causal:
            direct.append(FlashPart("col", rows_after_first, rows_before_last, (q_row, k_row, v_row), causal=True))
        else:
            direct.append(FlashPart("col", whole, whole, (q_row, k_row, v_row), mask=exclude_diagonal(n)))

        if self.use_vertical and m > 1:  # region V(c') of query (r, c), c' != c: column c' above r (bidir: also below)
            other_col = exclude_diagonal(m)
            by_column = [x.transpose(1, 2) for x in (kr, vr)]  # (BH, m, n, D) views
            q_bar, k_bar = self.pools(qr, kr, 1)  # (BH, n, m, D): column c' down to and including row r
            # the inner softmax runs per column; its output follows the query's strides, i.e. stays in row layout
            v_bar = F.scaled_dot_product_attention(q_bar.transpose(1, 2), *by_column, is_causal=True, scale=scale)
            vertical.append(FlashPart("row", rows_after_first, rows_before_last,
                                      (q_row, operand(k_bar, "row"), operand(v_bar, "col")), mask=other_col))
            if not causal:
                q_bar, k_bar = self.pools(qr, kr, 1, reverse=True)
                v_bar = F.scaled_dot_product_attention(q_bar.transpose(1, 2), *by_column, attn_mask=suffix(n),
                                                       scale=scale)
                vertical.append(FlashPart("row", rows_before_last, rows_after_first,
                                          (q_row, operand(k_bar, "row"), operand(v_bar, "col")), mask=other_col))

        if self.horizontal_regions is not None and m > 1:  # regions of earlier (bidir: other) rows, column layout
            if causal:
                earlier = {"causal": True}
                rows_q, rows_k = (1, n), (0, n - 1)
            else:
                earlier = {"mask": exclude_diagonal(n)}
                rows_q = rows_k = (0, n)
            if self.horizontal_regions == "split":  # HL(r') = row r' left of c, HR(r') = right of c
                q_bar, k_bar = self.pools(qr, kr, 2)
                v_bar = F.scaled_dot_product_attention(q_bar, kr, vr, is_causal=True, scale=scale)
                horizontal.append(FlashPart("col", (*rows_q, 1, m), (*rows_k, 0, m - 1),
                                            (q_row, operand(k_bar, "row"), operand(v_bar, "row")), **earlier))
                q_bar, k_bar = self.pools(qr, kr, 2, reverse=True)
                v_bar = F.scaled_dot_product_attention(q_bar, kr, vr, attn_mask=suffix(m), scale=scale)
                horizontal.append(FlashPart("col", (*rows_q, 0, m - 1), (*rows_k, 1, m),
                                            (q_row, operand(k_bar, "row"), operand(v_bar, "row")), **earlier))
            else:  # whole: row r' without column c
                q_bar, k_bar = self.pools_excluding_own(qr, kr, 2)
                v_bar = F.scaled_dot_product_attention(q_bar, kr, vr, attn_mask=exclude_diagonal(m), scale=scale)
                horizontal.append(FlashPart("col", (*rows_q, 0, m), (*rows_k, 0, m),
                                            (q_row, operand(k_bar, "row"), operand(v_bar, "row")), **earlier))

        if self.plans == "average":
            return 0.5 * (grid_flash_attention(direct + vertical, tensors, layouts, scale)
                          + grid_flash_attention(direct + horizontal, tensors, layouts, scale))
        return grid_flash_attention(direct + vertical + horizontal, tensors, layouts, scale)

    # -- the flex layout (``ops.flex``) ------------------------------------------------------------------------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """In sequence order the own row and the vertical regions of the query's row (column c' above / below row r:
        slots ``(r, c')`` row-major); in column order the own column and the horizontal regions of the query's
        column (row r' without column c, or its halves left / right of c: slots ``(r', c)`` column-major); merged by
        log-sum-exp (``plans=average``: each plan's pair its own softmax, the two averaged)."""
        grid = self.grid(length)
        n, m, causal = grid.n_rows, grid.n_cols, self.causal
        vertical, horizontal = self.use_vertical, self.horizontal_regions
        average = self.plans == "average"
        order = column_order(grid, device)
        rows, cols = grid.rows(device), grid.cols(device)
        own_row, own_col = same_block(m, causal), own_column(n, causal)

        calls = []
        if vertical:  # slots (r, c') row-major; bidirectional: (above, below) interleaved
            v_kinds = 1 if causal else 2

            def usable_vertical(b, h, q, s):
                slot, kind = s // v_kinds, s % v_kinds
                ok = (slot // m == q // m) & (slot % m != q % m)
                r = q // m
                return ok & torch.where(kind == 0, r >= 1, r <= n - 2)  # the column above / below row r is not empty

            def members_vertical():
                slot = torch.arange(length * v_kinds, device=device) // v_kinds
                kind = torch.arange(length * v_kinds, device=device) % v_kinds
                r, c = (slot // m).unsqueeze(1), (slot % m).unsqueeze(1)
                side = torch.where(kind.unsqueeze(1) == 0, rows.unsqueeze(0) < r, rows.unsqueeze(0) > r)
                return (cols.unsqueeze(0) == c) & side

            calls.append(FlexCall(own_row, None, length * v_kinds, usable_vertical, members_vertical,
                                  regions=self.flex_region_table(grid, VERTICAL, device)))
            if average:  # the vertical plan's own column; the horizontal plan's own row
                calls += [FlexCall(own_col, order), FlexCall(own_row, group=1)]
        else:
            calls.append(FlexCall(own_row))
        if horizontal is None:
            return calls + [FlexCall(own_col, order)]
        h_kinds = 2 if horizontal == "split" else 1

        def usable_horizontal(b, h, t, s):  # column order: query t = c * n + r, slot = c * n + r'
            slot, kind = s // h_kinds, s % h_kinds
            ok = own_col(b, h, t, slot)
            c = t // n
            if horizontal == "split":
                return ok & torch.where(kind == 0, c >= 1, c <= m - 2)  # the left / right half is not empty
            return ok & (m > 1)  # the row without column c

        def members_horizontal():
            s = torch.arange(length * h_kinds, device=device)
            position = order[s // h_kinds]  # the slot's (r', c)
            r, c = rows[position].unsqueeze(1), cols[position].unsqueeze(1)
            same_row = rows.unsqueeze(0) == r
            if horizontal == "split":
                side = torch.where((s % h_kinds).unsqueeze(1) == 0, cols.unsqueeze(0) < c, cols.unsqueeze(0) > c)
                return same_row & side
            return same_row & (cols.unsqueeze(0) != c)

        return calls + [FlexCall(own_col, order, length * h_kinds, usable_horizontal, members=members_horizontal,
                                 family=HORIZONTAL, group=1 if average else 0,
                                 regions=self.flex_region_table(grid, HORIZONTAL, device))]

    def flex_region_table(self, grid: Grid, family: int, device) -> RegionTable | None:
        """``flex_summaries``'s regions as strided position ranges, in its row order (None for the DeepSets pools,
        which keep the variant's own summaries). Vertical, slot ``(r, c')`` row-major: column c' above row r (start c',
        stride m, r members) and, bidirectional, below it (interleaved). Horizontal, slot ``(r', c)`` column-major: row
        r' left and right of column c (interleaved), or the whole row without column c (``skip``)."""
        if not self.summary.poolable:
            return None
        n, m = grid.n_rows, grid.n_cols
        slot = torch.arange(grid.length)
        if family == VERTICAL:
            r, c = slot // m, slot % m
            kinds = [(c, m, r, None)]
            if not self.causal:
                kinds.append(((r + 1) * m + c, m, n - 1 - r, None))
        else:
            c, r = slot // n, slot % n
            if self.horizontal_regions == "whole":
                kinds = [(r * m, 1, torch.full_like(r, m), r * m + c)]
            else:
                kinds = [(r * m, 1, c, None), (r * m + c + 1, 1, m - 1 - c, None)]
        columns = [torch.stack([torch.as_tensor(x if x is not None else -1).expand(grid.length) for x in kind])
                   for kind in kinds]
        start, stride, count, skip = torch.stack(columns, -1).flatten(1)  # kinds interleaved per slot
        return RegionTable.of(start, stride, count, skip, reduce=self.summary.reduce, device=device)

    def flex_summaries(self, index: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       real: torch.Tensor | None, state=None):
        """Call 0's vertical summaries (row-major slots) or the column call's horizontal ones (column-major slots).
        Unpadded, the prefix regions are the fused path's: running pools and one causal SDPA per region kind
        (``running_summaries``, nothing of size n x n or m x m is kept for the backward); whole rows without the
        query's column (``combiner_axial_horizontal``'s default) the explicit ``excluding_own_summaries``; padded, the
        explicit padded pools."""
        grid = self.grid(qs.shape[-2])
        (qr, kr, vr), real_r = grid_views(grid, qs, k, v, real)
        if index == 0 and self.use_vertical:  # column c' above (below) row r, stored at (r, c')
            qc, kc, vc = (x.transpose(2, 3) for x in (qr, kr, vr))  # (B, H, m, n, .): columns
            directions = (False,) if self.causal else (False, True)
            if real_r is None:
                parts = [(*self.running_summaries(qc, kc, vc, reverse), None) for reverse in directions]
            else:
                parts = [self.padded_prefix_summaries(qc, kc, vc, real_r.transpose(2, 3), reverse)
                         for reverse in directions]
            parts = [(k_bar.transpose(2, 3).flatten(2, 3), v_bar.transpose(2, 3).flatten(2, 3),
                      None if occupied is None else occupied[:, 0].transpose(-1, -2).flatten(-2, -1))
                     for k_bar, v_bar, occupied in parts]
        else:  # row r' left (right) of column c, or without it, stored at (r', c)
            if self.horizontal_regions == "split":
                if real_r is None:
                    parts = [(*self.running_summaries(qr, kr, vr, reverse), None) for reverse in (False, True)]
                else:
                    parts = [self.padded_prefix_summaries(qr, kr, vr, real_r, reverse) for reverse in (False, True)]
            elif real_r is None:  # the explicit form: its fused form (pools + SDPA with the own column masked) gave
                # wrong gradients compiled on an H200 (torch 2.11; 0.3 relative; right on CPU, cause not isolated)
                parts = [(*self.excluding_own_summaries(qr, kr, vr), None)]
            else:
                parts = [self.padded_excluding_own_summaries(qr, kr, vr, real_r)]
            parts = [(column_major(k_bar), column_major(v_bar),
                      None if occupied is None else column_major(occupied[:, 0].unsqueeze(-1)).squeeze(-1))
                     for k_bar, v_bar, occupied in parts]
        if len(parts) == 1:
            return parts[0]
        (k0, v0, o0), (k1, v1, o1) = parts
        return interleave(k0, k1, 2), interleave(v0, v1, 2), None if o0 is None else interleave(o0, o1, 1)

    def running_summaries(self, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reverse: bool = False):
        """Summary keys and values ``(..., T, .)`` of the strict prefixes ``[0, t)`` (suffixes ``(t, T)`` if
        ``reverse``) along axis -2 of scaled q, k, v: inclusive running pools (``pools``) and ONE causal SDPA over
        the pooled queries, shifted by one (the empty region gets zeros, which callers mask)."""
        if reverse:
            k_bar, v_bar = self.running_summaries(*(x.flip(-2) for x in (qs, k, v)))
            return k_bar.flip(-2), v_bar.flip(-2)
        q_pool, k_pool = self.pools(qs, k, -2)
        inclusive = _sdpa_grid(q_pool, k, v, is_causal=True)
        return shift_forward(k_pool), shift_forward(inclusive)

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


def _sdpa_grid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA on grid layouts ``(B, H, A, T, .)`` (scaled queries, ``scale=1``): the leading axes folded into SDPA's 4-D
    batch and heads, so the fused kernels take them (5-D inputs fall back to the math path)."""
    lead = q.shape[:-2]
    # flatten, not reshape: column layouts (transposed views) stay views, so nothing is copied for the backward
    out = F.scaled_dot_product_attention(*(x.flatten(0, -4) for x in (q, k, v)), scale=1.0, **kwargs)
    return out.view(*lead, *out.shape[-2:])


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
