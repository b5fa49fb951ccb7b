"""Sparse Transformer "strided" pattern (Child et al. 2019): the previous block_size positions plus every
block_size-th earlier one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.ops.flex.calls import FlexCall, column_order, own_column
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.joint_softmax import LogitGroup, joint_groups_attention
from longseq.attention.ops.masks import NEG_INF, other_blocks_mask
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention
from longseq.attention.sparse.kernels import column_part, matmul, softmax_over_parts


def shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Row r of the result is row r - shift of ``x`` (B, H, n, m, D); zeros where that row does not exist."""
    if shift == 0:
        return x
    n = x.shape[2]
    if shift > 0:
        return F.pad(x, (0, 0, 0, 0, shift, 0))[:, :, :n]
    return F.pad(x, (0, 0, 0, 0, 0, -shift))[:, :, -shift:]


@register_attention("strided")
class StridedAttention(BlockGrid, SparseAttention):
    """Sparse Transformer "strided" pattern with stride l = ``block_size``; O(L (l + L / l)).

    Causal: the previous l positions including self (``0 <= i - j < l``) plus every l-th earlier
    position (``(i - j) % l == 0``). Bidirectional: ``|i - j| < l`` plus every position with
    ``(i - j) % l == 0``. On the ``n x l`` grid the second part is the query's column, so the forward
    is a band part (blocks of l queries against their neighbouring blocks) and a column part (other
    rows only, so no key is counted twice), joined in one softmax. The length must be a multiple of
    ``block_size`` (rejected otherwise).
    """

    def __init__(self, *, causal: bool, block_size: int = 8, **base) -> None:
        super().__init__(causal=causal, block_size=block_size, **base)

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """The band ``|i - j| < l`` (causal ``0 <= i - j < l``) in sequence order + the rest of ``(i - j) % l == 0`` (the
        query's column of the ``n x l`` grid, other / earlier rows) in column order, merged by log-sum-exp."""
        grid = self.grid(length)
        l, causal = grid.n_cols, self.causal

        def band(b, h, q, kv):
            d = q - kv
            return (d >= 0) & (d < l) if causal else d.abs() < l

        return [FlexCall(band), FlexCall(own_column(grid.n_rows, causal), column_order(grid, device))]

    def pattern(self, length: int) -> torch.Tensor:
        l = self.grid(length).n_cols
        d = torch.arange(length).unsqueeze(1) - torch.arange(length).unsqueeze(0)
        if self.causal:
            return (d >= 0) & ((d < l) | (d % l == 0))
        return (d.abs() < l) | (d % l == 0)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = self.grid(L)
        n, l = grid.n_rows, grid.n_cols
        qg, kg, vg = (x.reshape(B, H, n, l, D) for x in (self.scale(q), k, v))
        ahead = 0 if self.causal else 1
        band_mask, col_mask = self.cached("masks", L, q.device, lambda: self.masks(n, l, q.device))
        # the band of row r lies in rows r-1, r (and r+1): one (l x l) product per neighbour row,
        # shifted views of K and V instead of a concatenated (2l or 3l)-wide copy
        shifts = [1, 0] + ([-1] if ahead else [])
        k_rows, v_rows = [shift_rows(kg, s) for s in shifts], [shift_rows(vg, s) for s in shifts]
        if not (self.training and self.dropout > 0):
            # No (..., 2l + n) concatenation: each part keeps its layout, one shared max and sum.
            kc, vc = (x.transpose(2, 3) for x in (kg, vg))
            groups = [LogitGroup("row", kr, vr, mask) for kr, vr, mask in zip(k_rows, v_rows, band_mask.split(l, -1))]
            groups.append(LogitGroup("col", kc, vc, col_mask))
            return joint_groups_attention(groups, qg, qg.transpose(2, 3).contiguous()).reshape(B, H, L, D)
        band_logits = [
            matmul(qg, kr.transpose(-1, -2)).masked_fill(~mask, NEG_INF)
            for kr, mask in zip(k_rows, band_mask.split(l, -1))
        ]
        col_logits, col_apply = column_part(qg, kg, vg, col_mask)
        *w_band, w_col = softmax_over_parts(self, band_logits + [col_logits])
        out = col_apply(w_col)
        for w, vr in zip(w_band, v_rows):
            out = out + matmul(w, vr)
        return out.reshape(B, H, L, D)

    def masks(self, n: int, l: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Band mask (n, l, keys) from positions; column mask (n, n) over rows, own row excluded."""
        ahead = 0 if self.causal else 1
        blk = torch.arange(n, device=device).view(n, 1, 1)
        i = blk * l + torch.arange(l, device=device).view(1, l, 1)
        j = (blk - 1) * l + torch.arange((2 + ahead) * l, device=device).view(1, 1, -1)
        d = i - j
        band = (d < l) & (j >= 0) & (j < n * l) & ((d >= 0) if self.causal else (d > -l))
        return band, other_blocks_mask(n, self.causal, device)
