"""Sparse Transformer "fixed" pattern (Child et al. 2019): own block plus the last cells of every block."""

from __future__ import annotations

import torch

from longseq.attention.base import AttentionConfigError, check_int_knob
from longseq.attention.ops.flex.calls import FlexCall, same_block
from longseq.attention.ops.geometry import BlockGrid, Grid
from longseq.attention.ops.masks import causal_mask, full_mask, other_blocks_mask
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention


@register_attention("fixed")
class FixedAttention(BlockGrid, SparseAttention):
    """Sparse Transformer "fixed" pattern on the ``n x m`` grid (m = ``block_size``); O(L (m + n c)).

    Query i attends to its own block (row) and to the last ``summary_cells`` (c) cells of every block.
    Causal: own block up to self plus the summary cells of earlier blocks. Bidirectional: whole own
    block plus the summary cells of every other block. The length must be a multiple of
    ``block_size`` (rejected otherwise). One 4-D SDPA call: per block, keys = [own block ; all n*c
    summary cells] with a boolean mask.
    """

    def __init__(self, *, causal: bool, block_size: int = 8, summary_cells: int = 1, **base) -> None:
        super().__init__(causal=causal, block_size=block_size, **base)
        self.summary_cells = check_int_knob(summary_cells, "attention.summary_cells")
        if summary_cells > self.block_size:
            raise AttentionConfigError(
                f"attention.summary_cells={summary_cells} must be <= attention.block_size={self.block_size}"
            )

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """Own block, and the other blocks' summary cells as regions of one key each (``FlexCall.key_regions``), both
        in sequence order, merged by log-sum-exp. Every later query attends those n c cells, so as direct keys their
        one or two key tiles were one serial loop over every query tile in FlexAttention's backward; as regions they
        are laid out once per ``copy_rows(L)`` queries (``FlexCall.summary_copies``)."""
        grid = self.grid(length)
        n, m, c, causal = grid.n_rows, grid.n_cols, self.summary_cells, self.causal
        cells = (torch.arange(n, device=device).view(n, 1) * m + m - c + torch.arange(c, device=device)).flatten()

        def usable(b, h, q, r):  # cell r lies in row r // c
            return (r // c < q // m) if causal else (r // c != q // m)

        def members():
            return torch.nn.functional.one_hot(cells, length).bool()

        def summary_cells(qs, k, v, real):
            return k[..., cells, :], v[..., cells, :], None if real is None else real[:, cells]

        return [FlexCall(same_block(m, causal)),
                FlexCall(None, n_regions=n * c, usable=usable, members=members, summaries=summary_cells,
                         key_regions=True)]

    def pattern(self, length: int) -> torch.Tensor:
        grid = self.grid(length)
        same_block = grid.rows().unsqueeze(1) == grid.rows().unsqueeze(0)
        summary = (grid.cols() >= grid.n_cols - self.summary_cells).unsqueeze(0)
        allowed = same_block | summary
        return allowed & causal_mask(length) if self.causal else allowed

    def block_mask(self, grid: Grid, device) -> torch.Tensor:
        """(n, m, m + n*c) bool: [own block ; summary cells of every block] for each block's queries."""
        n, m, c = grid.n_rows, grid.n_cols, self.summary_cells
        own = full_mask(m, self.causal, device)
        # own block's summary cells are already direct keys; causal adds only earlier blocks
        other = other_blocks_mask(n, self.causal, device)
        summary = other.repeat_interleave(c, 1).view(n, 1, n * c).expand(n, m, n * c)
        return torch.cat([own.expand(n, m, m), summary], -1)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = self.grid(L)
        n, m, c = grid.n_rows, grid.n_cols, self.summary_cells
        qb, kb, vb = (x.reshape(B * H, n, m, D) for x in (self.scale(q), k, v))
        k_sum = kb[:, :, m - c :].reshape(B * H, 1, n * c, D).expand(-1, n, -1, -1)
        v_sum = vb[:, :, m - c :].reshape(B * H, 1, n * c, D).expand(-1, n, -1, -1)
        mask = self.cached("block", L, q.device, lambda: self.block_mask(grid, q.device))
        out = self.sdpa(qb, torch.cat([kb, k_sum], 2), torch.cat([vb, v_sum], 2), mask)
        return out.reshape(B, H, L, D)
