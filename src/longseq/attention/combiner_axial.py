"""Combiner-Axial, row-major (``combiner_axial``; Ren et al. 2021 §4, official ``axial_rowmajor``).

Grid view: ``L = n * m`` positions on ``n`` rows of ``m = block_size`` columns, ``p = r * m + c``.
Query ``(r, c)`` attends

- directly to its own row: columns ``c' <= c`` when causal (self included), the whole row otherwise;
- to one summary per other row ``r'`` (``r' < r`` when causal, ``r' != r`` otherwise), *seen from
  its own column*: the summary value is the plain unmasked row attention of the row-mate query
  ``q(r', c)`` over row ``r'``, ``v̄(r', c) = Σ_c' P_row(r', c)[c'] v(r', c')``.

One softmax runs over ``[direct logits ; summary logits]`` (width ``m + n``), so row ``r'`` gives
key ``(r', c')`` the effective weight ``w(i, r') * P_row(r', c)[c']``: every allowed key gets
positive weight at ``O(L (n + m))`` cost.

The summary key ``k̄(r', c)`` is chosen by ``row_summary``:

- ``proj`` (default; the official learned key): ``Linear(H*D -> H*D)`` of the flattened ``v̄``, plus
  a residual, ``LayerNorm``, ``Linear(H*D -> H*D)`` back to heads (no biases, as in JAX). The
  official residual is the layer input ``x(r', c)``; the attention contract only sees ``q, k, v``,
  so the row-mate's raw key ``k(r', c)`` (flattened over heads) stands in for it — a documented
  deviation. Needs ``n_heads`` and ``head_dim``.
- ``none``: the raw key ``k(r', c)`` of the row-mate (TF option).
- ``wsum``: ``Σ_c' P_row(r', c)[c'] k(r', c')``, the row keys averaged with the same row weights (TF).

This module also holds what the whole axial family shares: ``RegionPartition`` (the explicit
direct set and regions, for tests and figures) and ``effective_matrix`` (the dense reference that
``attention_matrix`` uses; it is built from the partition, independently of the fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.geometry import Grid
from longseq.attention.registry import register_attention

ROW_SUMMARIES = ("proj", "none", "wsum")
NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------------
# Shared by the axial family: explicit partitions and the dense effective matrix.
# ------------------------------------------------------------------------------------------------
@dataclass
class RegionPartition:
    """The partition a Combiner variant applies, as dense index sets (small L, tests and figures).

    Attributes:
        direct: ``(L, L)`` bool, query i attends key j directly.
        members: ``(R, L)`` bool, the positions each (non-empty) region summarizes.
        usable: ``(L, R)`` bool, query i may use region R (one joint-softmax logit).
        family: ``(R,)`` long, which factorization a region belongs to (0 = rows or vertical,
            1 = horizontal); within one family regions used by a query are disjoint.
        anchor: ``(R,)`` long, the position whose own query summarizes the region (row-major),
            or -1 for pooled regions (max/mean/DeepSets of the region's queries).
    """

    direct: torch.Tensor
    members: torch.Tensor
    usable: torch.Tensor
    family: torch.Tensor
    anchor: torch.Tensor

    def allowed(self, family: int | None = None) -> torch.Tensor:
        """(L, L) bool: keys reached directly or through a usable region (of ``family`` if given)."""
        usable = self.usable if family is None else self.usable & (self.family == family)
        return self.direct | ((usable.double() @ self.members.double()) > 0)

    @classmethod
    def from_candidates(cls, direct, members, usable, family, anchor) -> "RegionPartition":
        """Drop the empty candidate regions (e.g. "rows above row 0") and keep the rest."""
        keep = members.any(-1)
        return cls(direct, members[keep], usable[:, keep], family[keep], anchor[keep])


def grid_coordinates(grid: Grid, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(L,) row and column of every position, for building partitions by broadcasting."""
    return grid.rows(device), grid.cols(device)


def effective_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    direct: torch.Tensor,
    members: torch.Tensor,
    usable: torch.Tensor,
    summary_q: torch.Tensor,
    summary_k: torch.Tensor,
) -> torch.Tensor:
    """Dense effective weights of one joint softmax over direct keys and region summaries.

    Args:
        q: scaled queries ``(B, H, L, D)``; k: keys ``(B, H, L, D)``.
        direct ``(L, L)``, members ``(R, L)``, usable ``(L, R)``: the partition (bool).
        summary_q, summary_k: ``(B, H, R, D)`` each region's summary query and key.
    Returns:
        ``(B, H, L, L)``: ``w_direct + Σ_R w(i, R) p(j | R)`` with ``p(j | R)`` the region's own
        softmax of ``summary_q · k_j`` over its members.
    """
    inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~members, NEG_INF).softmax(-1)  # (B,H,R,L)
    direct_logits = (q @ k.transpose(-1, -2)).masked_fill(~direct, NEG_INF)
    region_logits = (q @ summary_k.transpose(-1, -2)).masked_fill(~usable, NEG_INF)
    weights = torch.cat([direct_logits, region_logits], -1).softmax(-1)
    L = q.shape[-2]
    return weights[..., :L] + weights[..., L:] @ inner


def to_grid(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, H, L, D) -> row layout (B, H, n, m, D) (a view)."""
    return x.unflatten(-2, (grid.n_rows, grid.n_cols))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, ..., D) -> (B, ..., H*D): the per-position vector the official proj acts on."""
    return x.movedim(1, -2).flatten(-2)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, ..., H*D) -> (B, H, ..., D), inverse of ``merge_heads``."""
    return x.unflatten(-1, (n_heads, -1)).movedim(-2, 1)


# ------------------------------------------------------------------------------------------------
# Row-major Combiner-Axial.
# ------------------------------------------------------------------------------------------------
@register_attention("combiner_axial")
class CombinerAxialRowMajor(Attention):
    """Row-major Combiner-Axial (see module docstring); cost ``O(L (n + m) D)``, memory ``O(L (n + m))``.

    Args:
        block_size: m, the row length (columns); must divide L.
        row_summary: ``proj`` (learned, default), ``none`` or ``wsum`` — how a row summary's key is made.
    """

    def __init__(self, *, causal: bool, block_size: int, row_summary: str = "proj", **common) -> None:
        if int(block_size) < 1:
            raise AttentionConfigError(f"attention.block_size must be a positive integer, got {block_size}")
        self.block_size = int(block_size)
        super().__init__(causal=causal, **common)
        if row_summary not in ROW_SUMMARIES:
            raise AttentionConfigError(
                f"attention.row_summary={row_summary!r} is not valid; choose one of {ROW_SUMMARIES}"
            )
        self.row_summary = row_summary
        self.has_parameters = row_summary == "proj"
        if row_summary == "proj":
            if self.n_heads is None or self.head_dim is None:
                raise AttentionConfigError(
                    "attention.row_summary=proj learns a summary key map and needs n_heads and head_dim "
                    "(the model passes them); use attention.row_summary=none or wsum otherwise"
                )
            width = self.n_heads * self.head_dim
            self.summary_in = nn.Linear(width, width, bias=False)
            self.summary_norm = nn.LayerNorm(width)
            self.summary_out = nn.Linear(width, width, bias=False)

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, row_summary={self.row_summary}"

    def summary_keys(self, vbar: torch.Tensor, k_mate: torch.Tensor, k_wsum: torch.Tensor | None) -> torch.Tensor:
        """Summary keys ``(B, H, ..., D)`` from summary values, the row-mates' keys and the wsum keys."""
        if self.row_summary == "none":
            return k_mate
        if self.row_summary == "wsum":
            return k_wsum
        H = vbar.shape[1]
        if H * vbar.shape[-1] != self.summary_in.in_features:
            raise AttentionConfigError(
                f"attention '{self.name}' was built for n_heads*head_dim={self.summary_in.in_features}, "
                f"got H={H}, D={vbar.shape[-1]}"
            )
        hidden = self.summary_in(merge_heads(vbar))
        hidden = nn.functional.dropout(hidden, self.dropout, self.training)
        # Official residual is the layer input x(r', c); only q, k, v reach us, so k(r', c) stands in.
        hidden = self.summary_norm(hidden + merge_heads(k_mate))
        return split_heads(self.summary_out(hidden), H)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, L, D) unscaled -> (B, H, L, D)."""
        L = q.shape[-2]
        self.check_length(L)
        grid = Grid.of(L, self.block_size)
        n, m = grid.n_rows, grid.n_cols
        qr, kr, vr = to_grid(self.scale(q), grid), to_grid(k, grid), to_grid(v, grid)  # (B,H,n,m,D)

        row_logits = qr @ kr.transpose(-1, -2)  # (B,H,n,m[c],m[c'])
        row_probs = row_logits.softmax(-1)  # unmasked: an earlier row is entirely in the past
        summary_v = row_probs @ vr  # (B,H,n[r'],m[c],D)
        k_wsum = row_probs @ kr if self.row_summary == "wsum" else None
        summary_k = self.summary_keys(summary_v, kr, k_wsum)

        # Column layout: query (r, c) meets summary (r', c) of its own column c. Batched matmuls get
        # contiguous operands: strided batches make CPU bmm copy matrix by matrix.
        q_col = qr.transpose(2, 3).contiguous()
        summary_logits = q_col @ summary_k.transpose(2, 3).contiguous().transpose(-1, -2)  # (B,H,m,n,n)
        logits = torch.cat([row_logits, summary_logits.transpose(2, 3)], -1)  # (B,H,n,m,m+n)
        # Masks go in place on the fresh concatenation (cat's backward does not need its output).
        logits.masked_fill_(self.joint_mask(n, m, q.device), NEG_INF)
        weights = self.weight_dropout(logits.softmax(-1))
        direct_w, summary_w = weights.split([m, n], -1)
        out = direct_w @ vr
        summary_out = summary_w.transpose(2, 3).contiguous() @ summary_v.transpose(2, 3).contiguous()
        return (out + summary_out.transpose(2, 3)).flatten(2, 3)

    def joint_mask(self, n: int, m: int, device) -> torch.Tensor:
        """(n, m, m + n) bool, True = masked: later own-row columns (causal) and unusable rows."""
        rows, cols = torch.arange(n, device=device), torch.arange(m, device=device)
        later_col = cols[None, :, None] < cols[None, None, :]  # (1, m[c], m[c'])
        if not self.causal:
            later_col = torch.zeros_like(later_col)
        unusable_row = rows[:, None, None] <= rows[None, None, :] if self.causal else rows[:, None, None] == rows[None, None, :]
        return torch.cat([later_col.expand(n, m, m), unusable_row.expand(n, m, n)], -1)

    # -- explicit partition and dense reference ---------------------------------------------------
    def partition(self, L: int, device=None) -> RegionPartition:
        """Direct set and regions: region ``(r', c)`` = row r' summarized from column c (anchor (r', c))."""
        grid = Grid.of(L, self.block_size)
        rows, cols = grid_coordinates(grid, device)
        same_row = rows[:, None] == rows[None, :]
        direct = same_row & (cols[None, :] <= cols[:, None]) if self.causal else same_row
        members = same_row  # candidate region at anchor position a: the whole row of a
        earlier = rows[None, :] < rows[:, None] if self.causal else rows[None, :] != rows[:, None]
        usable = (cols[:, None] == cols[None, :]) & earlier  # (query i, anchor a)
        anchor = torch.arange(L, device=device)
        family = torch.zeros(L, dtype=torch.long, device=device)
        return RegionPartition.from_candidates(direct, members, usable, family, anchor)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, L, L) dense effective weights, built from ``partition`` (not from ``forward``)."""
        L = q.shape[-2]
        self.check_length(L)
        part = self.partition(L, q.device)
        qs = self.scale(q)
        summary_q = qs[..., part.anchor, :]
        inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~part.members, NEG_INF).softmax(-1)
        summary_k = self.summary_keys(inner @ v, k[..., part.anchor, :], inner @ k)
        return effective_matrix(qs, k, part.direct, part.members, part.usable, summary_q, summary_k)
