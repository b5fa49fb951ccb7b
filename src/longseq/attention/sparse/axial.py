"""Sparse axial pattern (Combiner §4.3): same row or same column of the block grid."""

from __future__ import annotations

import torch

from longseq.attention.ops.cpu.grid_flash import causal_row_column_flash
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import FlexCall, column_order, own_column, same_block
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import NEG_INF, causal_mask, full_mask, other_blocks_mask
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention
from longseq.attention.sparse.kernels import column_part, matmul, softmax_over_parts


@register_attention("axial")
class AxialAttention(BlockGrid, SparseAttention):
    """Sparse axial pattern (Combiner §4.3): same row ∪ same column on the ``n x m`` grid; O(L (n + m)).

    m = ``block_size`` columns, row-major (p = r*m + c). Causal: intersected with j <= i (own row up to
    self, own column in earlier rows). Row logits (B, H, n, m, m) and column logits (B, H, m, n, n) come
    from batched matmuls in the two layouts and share one softmax per query; self is counted once (in
    the row part). The length must be a multiple of ``block_size`` (rejected otherwise). On the ``cpu_flash``
    backend (causal, no weight dropout) the joint softmax is two fused CPU flash calls (``ops.cpu.grid_flash``).
    """

    cpu_flash = CpuFlash(causal_only=True, key_padding=True)  # padding: ``SparseAttention``'s extra channel

    def cpu_flash_geometry(self, length: int) -> str | None:
        if self.grid(length).n_rows < 2:
            return f"a single row (L = {length} = attention.block_size) has no column part"
        return None

    def __init__(self, *, causal: bool, block_size: int = 8, **base) -> None:
        super().__init__(causal=causal, block_size=block_size, **base)

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """Own row in sequence order + own column in column order, merged by log-sum-exp."""
        grid = self.grid(length)
        return [FlexCall(same_block(grid.n_cols, self.causal)),
                FlexCall(own_column(grid.n_rows, self.causal), column_order(grid, device))]

    def pattern(self, length: int) -> torch.Tensor:
        grid = self.grid(length)
        r, c = grid.rows(), grid.cols()
        allowed = (r.unsqueeze(1) == r.unsqueeze(0)) | (c.unsqueeze(1) == c.unsqueeze(0))
        return allowed & causal_mask(length) if self.causal else allowed

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = self.grid(L)
        n, m = grid.n_rows, grid.n_cols
        if self.backend_for(q, k, v) == "cpu_flash":  # own row + own column above: two fused flash calls
            qg, kg, vg = (x.reshape(B, H, n, m, D) for x in (q, k, v))
            return causal_row_column_flash(qg, kg, vg, kg, vg).reshape(B, H, L, D)
        qg, kg, vg = (x.reshape(B, H, n, m, D) for x in (self.scale(q), k, v))
        row_mask, col_mask = self.cached("masks", L, q.device, lambda: self.masks(n, m, q.device))
        row_logits = matmul(qg, kg.transpose(-1, -2)).masked_fill(~row_mask, NEG_INF)  # (B, H, n, m, m)
        col_logits, col_apply = column_part(qg, kg, vg, col_mask)  # (B, H, n, m, n)
        w_row, w_col = softmax_over_parts(self, [row_logits, col_logits])
        return (matmul(w_row, vg) + col_apply(w_col)).reshape(B, H, L, D)

    def masks(self, n: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row mask (m, m) over (query col, key col); column mask (n, n) over (query row, key row), self excluded."""
        return full_mask(m, self.causal, device), other_blocks_mask(n, self.causal, device)
