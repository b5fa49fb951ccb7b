"""Sinkhorn Transformer (Tay et al. 2020): block-local attention plus one softly sorted key block, O(L b + n_b^2).

The sequence is cut into n_b blocks of b positions. A parameter-free SortNet scores block pairs,
``R[g, j] = mean(q in block g) . mean(k in block j) / sqrt(D)`` (the mean-pooled block representations
of lucidrains' ``AttentionSortNet``). The soft permutation ``P`` is
- bidirectional: Sinkhorn balancing of ``R / temperature`` in log space, ``sinkhorn_iters`` rounds of
  column- then row-normalization (the last step normalizes rows, so every row of P sums to 1);
- causal: a row softmax of ``R / temperature`` over earlier blocks ``j < g`` only, with the query
  representation of block g taken from the blocks before it (cumulative mean of q over blocks < g), so
  nothing in or after block g steers the sort. Column normalization would couple every row (every block,
  the future included), so the causal variant uses the plain softmax, as LRA's sinkhorn model does.
  Block 0 has no earlier block and attends to its own block only.
Every query in block g attends, in ONE softmax, to its own block's keys (causal: up to itself) and to
the b keys of the sorted block ``sum_j P[g, j] K_j`` with values ``sum_j P[g, j] V_j``.
No Gumbel noise (deterministic) and no SortCut.

``attention_matrix`` spreads each weight on a sorted slot s over the original keys ``(j, s)`` with
``P[g, j]``: the result is exact (``forward == P @ v``) and its rows sum to 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import NEG_INF, causal_mask, other_blocks_mask
from longseq.attention.registry import register_attention


@register_attention("sinkhorn")
class SinkhornAttention(BlockGrid, Attention):
    """Sorted-block attention (see the module docstring).

    Args:
        block_size: b; the length must be a multiple of it.
        sinkhorn_iters: balancing rounds (bidirectional; lucidrains 5).
        temperature: tau of the sort logits (lucidrains 0.75).
    """

    def __init__(
        self, *, causal: bool, block_size: int = 64, sinkhorn_iters: int = 5, temperature: float = 0.75, **common
    ) -> None:
        super().__init__(causal=causal, block_size=block_size, **common)
        self.sinkhorn_iters = check_int_knob(sinkhorn_iters, "attention.sinkhorn_iters", minimum=0)
        if not temperature > 0:
            raise AttentionConfigError(f"attention.temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def sort_matrix(self, q_blk: torch.Tensor, k_blk: torch.Tensor) -> torch.Tensor:
        """Soft block permutation ``(B, H, n, n)`` from blocks ``(B, H, n, b, D)`` (q already scaled)."""
        n = q_blk.shape[2]
        q_rep, k_rep = q_blk.mean(3), k_blk.mean(3)  # (B, H, n, D)
        if self.causal:
            count = torch.arange(1, n + 1, device=q_rep.device, dtype=q_rep.dtype).view(n, 1)
            running = q_rep.cumsum(2) / count
            q_rep = torch.cat([torch.zeros_like(running[:, :, :1]), running[:, :, :-1]], 2)  # blocks < g
            logits = (q_rep @ k_rep.transpose(-1, -2)) / self.temperature
            earlier = other_blocks_mask(n, True, q_rep.device)
            earlier[0, 0] = True  # block 0 has no earlier block: placeholder row, its slot is masked later
            return logits.masked_fill(~earlier, NEG_INF).softmax(-1)
        log_p = (q_rep @ k_rep.transpose(-1, -2)) / self.temperature
        for _ in range(self.sinkhorn_iters):  # a handful of rounds on (n, n)
            log_p = log_p - log_p.logsumexp(-2, keepdim=True)
            log_p = log_p - log_p.logsumexp(-1, keepdim=True)
        return log_p.softmax(-1)  # row-normalized (identity on rows if the loop ran)

    def _parts(self, q, k, v):
        """Blocks and keys: q_blk ``(B, H, n, b, D)``, keys/values ``(B, H, n, 2b, D)``, mask ``(n, b, 2b)``, P."""
        B, H, L, D = q.shape
        self.check_length(L)
        b = self.block_size
        n = L // b
        q_blk, k_blk, v_blk = (x.view(B, H, n, b, x.shape[-1]) for x in (self.scale(q), k, v))
        sort = self.sort_matrix(q_blk, k_blk)
        k_sorted = (sort @ k_blk.reshape(B, H, n, b * D)).view(B, H, n, b, D)
        v_sorted = (sort @ v_blk.reshape(B, H, n, -1)).view(v_blk.shape)
        keys, values = torch.cat([k_blk, k_sorted], 3), torch.cat([v_blk, v_sorted], 3)
        mask = torch.ones(n, b, 2 * b, dtype=torch.bool, device=q.device)
        if self.causal:
            mask[:, :, :b] = causal_mask(b, q.device)
            mask[0, :, b:] = False
        return q_blk, keys, values, mask, sort

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = q.shape
        q_blk, keys, values, mask, _ = self._parts(q, k, v)
        n = q_blk.shape[2]
        fold = lambda x: x.reshape(B * H, n, x.shape[3], x.shape[4])  # noqa: E731  blocks in the SDPA "heads" slot
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(fold(q_blk), fold(keys), fold(values), attn_mask=mask, dropout_p=p, scale=1.0)
        return out.reshape(B, H, L, v.shape[-1])  # CUDA's SDPA output is (B, L, H, D)-strided: no view

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = q.shape
        q_blk, keys, _, mask, sort = self._parts(q, k, v)
        n, b = q_blk.shape[2], self.block_size
        w = (q_blk @ keys.transpose(-1, -2)).masked_fill(~mask, NEG_INF).softmax(-1)  # (B, H, n, b, 2b)
        w_own, w_sorted = w.split(b, -1)
        # weight on sorted slot s of block g goes to key (j, s) with P[g, j]
        spread = torch.einsum("bhgqs,bhgj->bhgqjs", w_sorted, sort).reshape(B, H, n, b, L)
        own = torch.zeros_like(spread).view(B, H, n, b, n, b)
        own[:, :, torch.arange(n, device=q.device), :, torch.arange(n, device=q.device)] = w_own.permute(2, 0, 1, 3, 4)
        return (spread + own.view(B, H, n, b, L)).view(B, H, L, L)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, block_size={self.block_size}, sinkhorn_iters={self.sinkhorn_iters}"
