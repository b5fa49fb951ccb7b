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
  a residual, ``LayerNorm`` (eps 1e-6 as Flax's), ``Linear(H*D -> H*D)`` back to heads (no biases, as in
  JAX). The official residual is the layer input ``x(r', c)``; the attention contract only sees ``q, k, v``,
  so the row-mate's raw key ``k(r', c)`` (flattened over heads) stands in for it — a documented
  deviation. Needs ``n_heads`` and ``head_dim``.
- ``none``: the raw key ``k(r', c)`` of the row-mate (TF option).
- ``wsum``: ``Σ_c' P_row(r', c)[c'] k(r', c')``, the row keys averaged with the same row weights (TF).

Fast path (no weight dropout): ``v̄`` is one fused SDPA call with rows folded into the head axis;
the joint softmax never builds the ``(m + n)``-wide logits. On the ``cpu_flash`` backend (CPU, causal) it is two
flash calls (own row; column layout for the summaries) merged exactly by their log-sum-exps
(``ops.cpu.grid_flash.causal_row_column_flash``); otherwise ``joint_groups_attention`` keeps both logit blocks in the
layout their batched matmul produces and normalizes them with one shared max and sum. Training with
weight dropout uses the explicit concatenated softmax.

``attention_matrix`` is the dense reference built from ``partition`` (``ops.partition.Partition``, regions
anchored at the row-mate), independently of the fast path; incremental decoding runs on the same partition
(``ops.decoding.PartitionDecoder``): a row's summary for column c is made once, when the row completes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.combiner import key_map
from longseq.attention.ops.cpu.grid_flash import causal_row_column_flash
from longseq.attention.ops.decoding import PartitionDecoder
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import (
    FlexCall,
    column_major,
    column_order,
    grid_views,
    own_column,
    same_block,
)
from longseq.attention.ops.flex.regions import RegionTable
from longseq.attention.ops.geometry import BlockGrid, Grid
from longseq.attention.ops.joint_softmax import LogitGroup, joint_groups_attention
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention

ROW_SUMMARIES = ("proj", "none", "wsum")
FLAX_LAYER_NORM_EPS = 1e-6  # flax.linen.LayerNorm's default epsilon (the official layer); torch's is 1e-5


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
# ------------------------------------------------------------------------------------------------
@register_attention("combiner_axial")
class CombinerAxialRowMajor(BlockGrid, PartitionDecoder, Attention):
    """Row-major Combiner-Axial (see module docstring); cost ``O(L (n + m) D)``, memory ``O(L (n + m))``.

    Args:
        block_size: m, the row length (columns); must divide L.
        row_summary: ``proj`` (learned, default), ``none`` or ``wsum`` — how a row summary's key is made.
    """

    def __init__(self, *, causal: bool, block_size: int, row_summary: str = "proj", **common) -> None:
        super().__init__(causal=causal, block_size=block_size, **common)
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
            self.summary_norm = nn.LayerNorm(width, eps=FLAX_LAYER_NORM_EPS)
            self.summary_out = nn.Linear(width, width, bias=False)

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
        norm = self.summary_norm
        dropout = self.dropout if self.training else 0.0
        # Official residual is the layer input x(r', c); only q, k, v reach us, so k(r', c) stands in.
        keys = key_map.reference_key_map(merge_heads(vbar), merge_heads(k_mate), self.summary_in.weight,
                                         norm.weight, norm.bias, self.summary_out.weight, norm.eps, dropout)
        return split_heads(keys, H)

    def summary_keys_recomputed(self, vbar: torch.Tensor, k_mate: torch.Tensor,
                                k_wsum: torch.Tensor | None) -> torch.Tensor:
        """``summary_keys``, its learned map recomputed in the backward instead of kept (the flex layout): the map's
        activations were 3 of the 11 outputs' worth that the layer kept for its backward at H 8
        (``ops.flex.flex_kept_for_backward``), and the recomputation is two ``(L, H D) x (H D, H D)`` products."""
        if self.row_summary != "proj" or not torch.is_grad_enabled():
            return self.summary_keys(vbar, k_mate, k_wsum)
        return checkpoint(self.summary_keys, vbar, k_mate, k_wsum, use_reentrant=False)

    # Key padding (LRA): padded keys get no direct weight and are left out of every row summary's inner
    # softmax. A row's summary for column c is made by its row-mate (r', c); where that row-mate is padding,
    # the row's first real position makes it instead (its query and key stand in), so padded contents never
    # enter a summary and every real key stays reachable (full support). A row without a real key is
    # masked; a padded query with nothing left falls back to its unpadded direct keys.
    supports_padding_mask = True
    cpu_flash = CpuFlash(causal_only=True)  # the causal joint softmax of ``forward_fused``

    def cpu_flash_geometry(self, length: int) -> str | None:
        if self.grid(length).n_rows < 2:
            return f"a single row (L = {length} = attention.block_size) has no row summaries"
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled -> (B, H, L, D); ``key_padding_mask`` (B, L) bool, True = padded key."""
        L = q.shape[-2]
        self.check_length(L)
        grid = Grid.of(L, self.block_size)
        n, m = grid.n_rows, grid.n_cols
        if key_padding_mask is None and not (self.training and self.dropout > 0):
            cpu_flash = self.backend_for(q, k, v) == "cpu_flash"
            return self.forward_fused(to_grid(q, grid), to_grid(k, grid), to_grid(v, grid), cpu_flash).flatten(2, 3)
        qr, kr, vr = to_grid(self.scale(q), grid), to_grid(k, grid), to_grid(v, grid)  # (B,H,n,m,D)
        joint_mask = self.joint_mask(n, m, q.device)  # (n, m, m + n), True = may attend
        row_logits = qr @ kr.transpose(-1, -2)  # (B,H,n,m[c],m[c'])
        inner_logits = row_logits  # unmasked: an earlier row is entirely in the past
        if key_padding_mask is not None:
            pad = key_padding_mask.to(device=q.device, dtype=torch.bool).view(-1, 1, n, 1, m)  # (B,1,n,1,m)
            empty_row = pad.all(-1, keepdim=True)  # its regions are masked below; any finite inner row will do
            inner_logits = row_logits.masked_fill(pad & ~empty_row, NEG_INF)
            direct_only = joint_mask.clone()
            direct_only[..., m:] = False
            unusable_row = empty_row.view(-1, 1, 1, 1, n).expand(-1, 1, n, m, n)  # (B,1,n[r],m[c],n[r'])
            joint_mask = joint_mask & ~torch.cat([pad.expand(-1, 1, n, m, m), unusable_row], -1)
            joint_mask = torch.where(joint_mask.any(-1, keepdim=True), joint_mask, direct_only)
        row_probs = inner_logits.softmax(-1)
        summary_v = row_probs @ vr  # (B,H,n[r'],m[c],D)
        k_wsum = row_probs @ kr if self.row_summary == "wsum" else None
        summary_k = self.summary_keys(summary_v, kr, k_wsum)
        if key_padding_mask is not None:  # a padded row-mate's summary is made by the row's first real position
            real = ~pad.view(-1, n, m)
            cols = torch.arange(m, device=q.device)
            anchor = torch.where(real, cols, real.int().argmax(-1, keepdim=True))  # (B, n, m[c]) -> column
            summary_v, summary_k = (x.gather(3, anchor[:, None, :, :, None].expand_as(x)) for x in (summary_v, summary_k))

        # Column layout: query (r, c) meets summary (r', c) of its own column c. Batched matmuls get
        # contiguous operands: strided batches make CPU bmm copy matrix by matrix.
        q_col = qr.transpose(2, 3).contiguous()
        summary_logits = q_col @ summary_k.transpose(2, 3).contiguous().transpose(-1, -2)  # (B,H,m,n,n)
        logits = torch.cat([row_logits, summary_logits.transpose(2, 3)], -1)  # (B,H,n,m,m+n)
        logits.masked_fill_(~joint_mask, NEG_INF)  # in place: cat's backward does not need its output
        weights = self.weight_dropout(logits.softmax(-1))
        direct_w, summary_w = weights.split([m, n], -1)
        out = direct_w @ vr
        summary_out = summary_w.transpose(2, 3).contiguous() @ summary_v.transpose(2, 3).contiguous()
        return (out + summary_out.transpose(2, 3)).flatten(2, 3)

    def forward_fused(self, qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, cpu_flash: bool = False) -> torch.Tensor:
        """Dropout-free fast path on row layouts ``(B, H, n, m, D)`` (q NOT scaled) -> ``(B, H, n, m, D)``.

        The unmasked row attention that makes ``v̄`` is one fused SDPA call (rows folded into the
        head axis, 4-D). The joint softmax is ``causal_row_column_flash`` with ``cpu_flash`` (the CPU engine, causal:
        two fused flash calls, the 1/sqrt(D) passed as their ``scale``), else ``joint_groups_attention`` (two groups)
        (explicit weights, no concatenation). Neither builds the ``(..., m + n)`` logits.
        """
        B, H, n, m, D = qr.shape
        scale = 1.0 / math.sqrt(D)
        rows4 = [x.reshape(B * H, n, m, x.shape[-1]) for x in (qr, kr, vr)]
        summary_v = F.scaled_dot_product_attention(*rows4, scale=scale).view(B, H, n, m, -1)
        k_wsum = None
        if self.row_summary == "wsum":
            k_wsum = F.scaled_dot_product_attention(*rows4[:2], rows4[1], scale=scale).view(B, H, n, m, D)
        summary_k = self.summary_keys(summary_v, kr, k_wsum)
        if cpu_flash:
            return causal_row_column_flash(qr, kr, vr, summary_k, summary_v)
        qr = self.scale(qr)
        rows, cols = torch.arange(n, device=qr.device), torch.arange(m, device=qr.device)
        if self.causal:
            own_row = cols[:, None] >= cols[None, :]  # (m[c], m[c']): own-row columns up to self
            other_rows = rows[:, None] > rows[None, :]  # (n[r], n[r']): strictly earlier rows
        else:
            own_row, other_rows = None, rows[:, None] != rows[None, :]
        # two groups of one joint softmax: own row (row layout), the summaries of the other rows seen from
        # the query's column (column layout)
        groups = [LogitGroup("row", kr, vr, own_row),
                  LogitGroup("col", summary_k.transpose(2, 3), summary_v.transpose(2, 3), other_rows)]
        return joint_groups_attention(groups, qr, qr.transpose(2, 3).contiguous())

    # -- the flex layout (``ops.flex``) ------------------------------------------------------------------------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """Own row in sequence order; in column order, the summaries of the other (earlier) rows seen from the
        query's own column (region = row r' summarized by the anchor query (r', c)), merged by log-sum-exp. The
        column call has no direct keys: its KV is the L anchored summaries in column order."""
        grid = self.grid(length)
        order = column_order(grid, device)

        def members():
            rows = grid.rows(device)
            return rows[order].unsqueeze(1) == rows.unsqueeze(0)

        regions = None
        if self.row_summary != "wsum":  # slot c n + r': row r' from its row-mate (r', c) = order[slot]
            m = grid.n_cols
            regions = RegionTable.of(order // m * m, 1, m, anchor=order, reduce="anchor",
                                     heads_last=self.row_summary == "proj", device=device)
            if self.row_summary == "proj":
                key_map.register()  # with the layout, outside any traced step
        return [FlexCall(same_block(grid.n_cols, self.causal)),
                FlexCall(None, order, length, own_column(grid.n_rows, self.causal), members, lambda: order,
                         regions=regions)]

    def flex_fused_kv(self, index: int, keys: torch.Tensor, values: torch.Tensor):
        """The fused column call's KV: the anchored row summaries with the row-mates' keys, then (``proj``) the learned
        key map over them (heads-last layouts: the map reads and writes them without a copy), as one operation
        (``combiner.key_map``: one launch forward, two backward) unless its dropout is active or its width is over the
        kernels' (``key_map.MAX_WIDTH``)."""
        if self.row_summary != "proj":
            return keys, values
        dropout_active = self.training and self.dropout > 0
        if key_map.registered() and key_map.supports(self.summary_in.in_features) and not dropout_active:
            norm = self.summary_norm
            return key_map.summary_key_map(keys, values, self.summary_in.weight, norm.weight, norm.bias,
                                           self.summary_out.weight, norm.eps)
        return self.summary_keys_recomputed(values, keys, None), values

    def flex_summaries(self, index: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       real: torch.Tensor | None, state=None):
        """The anchored row summaries ``(B, H, L, .)`` in column order (slot ``c * n + r'``): unpadded, one SDPA of
        every query over its own row (``forward_fused``'s); padded, the masked row softmax with padded anchors
        replaced by their row's first real position (``ops.padding``)."""
        grid = self.grid(qs.shape[-2])
        n, m = grid.n_rows, grid.n_cols
        (qr, kr, vr), real_r = grid_views(grid, qs, k, v, real)
        if real_r is None:
            rows4 = [x.reshape(-1, n, m, x.shape[-1]) for x in (qr, kr, vr)]
            summary_v = F.scaled_dot_product_attention(*rows4, scale=1.0).view(*vr.shape)
            k_wsum = None
            if self.row_summary == "wsum":
                k_wsum = F.scaled_dot_product_attention(*rows4[:2], rows4[1], scale=1.0).view(*kr.shape)
            summary_k = self.summary_keys_recomputed(summary_v, kr, k_wsum)
            return column_major(summary_k), column_major(summary_v), None
        pad = ~real_r.unsqueeze(-2)  # (B, 1, n, 1, m)
        empty_row = pad.all(-1, keepdim=True)  # its regions are masked; any finite inner row will do
        probs = (qr @ kr.transpose(-1, -2)).masked_fill(pad & ~empty_row, NEG_INF).softmax(-1)
        summary_v = probs @ vr
        summary_k = self.summary_keys_recomputed(summary_v, kr, probs @ kr if self.row_summary == "wsum" else None)
        # a padded anchor's summary is made by its row's first real position (ops.padding)
        real_rows = real_r[:, 0]
        anchor = torch.where(real_rows, torch.arange(m, device=qs.device), real_rows.int().argmax(-1, keepdim=True))
        summary_v, summary_k = (x.gather(3, anchor[:, None, :, :, None].expand_as(x)) for x in (summary_v, summary_k))
        occupied = real_rows.any(-1, keepdim=True).expand(-1, n, m)  # (B, n[r'], m[c])
        return column_major(summary_k), column_major(summary_v), column_major(occupied.unsqueeze(-1)).squeeze(-1)

    def joint_mask(self, n: int, m: int, device) -> torch.Tensor:
        """(n, m, m + n) bool, True = may attend: [own-row columns (causal: up to self) ; usable rows' summaries]."""
        rows, cols = torch.arange(n, device=device), torch.arange(m, device=device)
        own_col = cols[None, :, None] >= cols[None, None, :]  # (1, m[c], m[c'])
        if not self.causal:
            own_col = torch.ones_like(own_col)
        usable_row = rows[:, None, None] > rows[None, None, :] if self.causal else rows[:, None, None] != rows[None, None, :]
        return torch.cat([own_col.expand(n, m, m), usable_row.expand(n, m, n)], -1)

    # -- explicit partition and dense reference ---------------------------------------------------
    def partition(self, L: int, device=None) -> Partition:
        """Direct set and regions: region ``(r', c)`` = row r' summarized from column c (anchor (r', c))."""
        grid = Grid.of(L, self.block_size)
        rows, cols = grid.rows(device), grid.cols(device)
        same_row = rows[:, None] == rows[None, :]
        direct = same_row & (cols[None, :] <= cols[:, None]) if self.causal else same_row
        members = same_row  # candidate region at anchor position a: the whole row of a
        earlier = rows[None, :] < rows[:, None] if self.causal else rows[None, :] != rows[:, None]
        usable = (cols[:, None] == cols[None, :]) & earlier  # (query i, anchor a)
        anchor = torch.arange(L, device=device)
        family = torch.zeros(L, dtype=torch.long, device=device)
        return Partition.from_candidates(direct, members, usable, family, anchor)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) dense effective weights, built from ``partition`` (not from ``forward``).

        With ``key_padding_mask`` each document gets ``partition(L).without_padding(pad)``: a loop over the
        batch on this small-L reference path only.
        """
        L = q.shape[-2]
        self.check_length(L)
        part = self.partition(L, q.device)
        if key_padding_mask is None:
            return self.partition_matrix(part, q, k, v)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([self.partition_matrix(part.without_padding(pad), q[b : b + 1], k[b : b + 1], v[b : b + 1])
                          for b, pad in enumerate(pads)])

    def decoding_partition(self, length: int, device=None) -> Partition:
        return self.partition(length, device)

    def region_summaries(self, q, k, v, member, anchor_q, anchor_k):
        """Row summaries seen from one column (decoding; once, when the row completes): the anchor's query
        attends its whole row, ``v_bar`` the row attention's output, ``k_bar`` from ``summary_keys``."""
        weights = (k @ anchor_q.unsqueeze(-1)).squeeze(-1).masked_fill(~member, NEG_INF).softmax(-1).unsqueeze(-2)
        summary_v = (weights @ v).squeeze(-2)
        return self.summary_keys(summary_v, anchor_k, (weights @ k).squeeze(-2)), summary_v

    def partition_matrix(self, part: Partition, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dense weights ``(B, H, L, L)`` of one partition whose regions are rows summarized by their anchor's query."""
        qs = self.scale(q)
        summary_q = qs[..., part.anchor, :]
        inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~part.members, NEG_INF).softmax(-1)
        summary_k = self.summary_keys(inner @ v, k[..., part.anchor, :], inner @ k)
        return part.effective_matrix(qs, k, summary_q, summary_k)
