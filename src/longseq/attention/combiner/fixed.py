"""Combiner-Fixed (Ren et al. 2021, §4.1): direct attention inside the own segment, one summary per other segment.

The sequence is cut into n = L / m segments of length m (``block_size``), segment g = row g of the
row-major grid. For a query in segment g:

- causal (official JAX ``_SelfAttSqrtn``): direct keys = own segment up to and including self;
  regions = every EARLIER segment g' < g;
- bidirectional (clean partition, not the TF double counting): direct keys = the whole own segment;
  regions = every OTHER segment g' != g.

A region's summary key is the pooled key of the segment, its value the local expectation
v_bar = sum_t softmax_t(q_bar . k_t) v_t with q_bar the pooled (scaled) queries of the segment. Each
query runs ONE softmax over [direct logits ; summary logits]; regions a query may not use are masked.
Cost O(L (m + n) D) time, O(L (m + n)) memory.

Backends (``attention.backend``, ``ops.dispatch``): ``explicit`` is one SDPA over the concatenated
[own segment ; summaries] keys with the joint mask (any device, key padding, any value width); ``cpu_flash`` is
``ops.cpu.segment_flash`` (one autograd Function, own-segment flash attention merged by log-sum-exps with flash
attention of query chunks against the summaries they may use; no concatenation), on CPU without key padding, at
least two segments and one head size for q and v.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.cpu.segment_flash import SummaryChunk, segment_flash_attention, summary_plan
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import FlexCall, same_block
from longseq.attention.ops.flex.regions import RegionTable
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import cacheable, causal_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention


@register_attention("combiner_fixed")
class CombinerFixedAttention(BlockGrid, PooledCombiner, Attention):
    """Combiner-Fixed, causal or bidirectional.

    Args:
        causal: autoregressive partition (earlier segments only) or the bidirectional clean partition.
        block_size: segment length m; must divide the sequence length.
        summary: region pooling, one of ``max`` (default, official), ``mean``, ``deepsets_max``,
            ``deepsets_mean`` (the DeepSets kinds learn two D x D maps and need ``head_dim``).
        seq_len, n_heads, head_dim, dropout: see ``Attention``. Dropout acts on the inner summary
            weights p(j|R) only, as in the official JAX layer (the joint softmax stays fused).
    """

    def __init__(self, *, causal: bool, block_size: int, summary: str = "max", **common) -> None:
        super().__init__(causal=causal, block_size=block_size, **common)
        self.summary = RegionSummary(summary, self.head_dim)
        self.has_parameters = self.summary.has_parameters
        self._mask_cache: dict[tuple, torch.Tensor | tuple[SummaryChunk, ...]] = {}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, summary={self.summary.kind}"

    # -- backends (``ops.dispatch``): the CPU engine takes weight dropout (on the inner weights), not key padding
    cpu_flash = CpuFlash(dropout=True)

    def cpu_flash_geometry(self, length: int) -> str | None:
        if self.grid(length).n_rows < 2:
            return f"a single segment (L = {length} = attention.block_size) has no summary part"
        return None

    # -- geometry (the n x m segment grid: ``BlockGrid.grid``) -----------------------------------------
    def joint_mask(self, n: int, m: int, device: torch.device) -> torch.Tensor:
        """(1, n, m, m + n) bool, True = may attend: [own-segment keys ; the n segment summaries] per segment."""
        key = (n, m, str(device), self.causal)
        if key not in self._mask_cache:
            segment = torch.arange(n, device=device)
            if self.causal:
                within = causal_mask(m, device)
                uses = segment.unsqueeze(1) > segment.unsqueeze(0)  # (g, g'): g' < g
            else:
                within = torch.ones(m, m, dtype=torch.bool, device=device)
                uses = segment.unsqueeze(1) != segment.unsqueeze(0)
            mask = torch.cat([within.expand(n, m, m), uses.unsqueeze(1).expand(n, m, n)], -1)
            self._mask_cache[key] = cacheable(mask.unsqueeze(0).contiguous())
        return self._mask_cache[key]

    def partition(self, length: int, device: torch.device | None = None) -> Partition:
        """The partition (for tests, ``attention_matrix`` and decoding): direct = own segment (causal: up to
        self); regions = the n segments; query i uses segment g' < g (causal) or g' != g."""
        grid = self.grid(length)
        seg = grid.rows(device)  # (L,)
        pos = torch.arange(length, device=device)
        same = seg.unsqueeze(1) == seg.unsqueeze(0)
        direct = same & (pos.unsqueeze(1) >= pos.unsqueeze(0)) if self.causal else same
        regions = torch.arange(grid.n_rows, device=device).unsqueeze(1) == seg.unsqueeze(0)  # (n, L)
        other = torch.arange(grid.n_rows, device=device).unsqueeze(0)  # (1, n)
        region_allowed = other < seg.unsqueeze(1) if self.causal else other != seg.unsqueeze(1)
        return Partition.from_candidates(direct, regions, region_allowed)

    # -- the contract -----------------------------------------------------------------------------
    # Key padding (LRA): padded keys get no direct weight, are left out of every region's pooled query/key
    # and of its local expectation, and a region with no real key is masked. A query left with nothing to
    # attend to (only possible when its whole segment and every usable region are padding) falls back to
    # its unpadded own-segment keys, so no row is NaN.
    supports_padding_mask = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D) (v may have its own last width);
        ``key_padding_mask`` (B, L) bool, True = padded key."""
        B, H, L, D = q.shape
        grid = self.grid(L)
        n, m = grid.n_rows, grid.n_cols
        scale = 1.0 / math.sqrt(D)
        # fold (B, H) into one batch axis and put segments in SDPA's "heads" slot: 4-D inputs keep
        # the fused CPU kernel (a 5-D layout silently falls back to the math path)
        qb = q.reshape(B * H, n, m, D)
        kb = k.reshape(B * H, n, m, D)
        vb = v.reshape(B * H, n, m, v.shape[-1])
        drop = self.dropout if self.training else 0.0
        if self.backend_for(q, k, v, key_padding_mask) == "cpu_flash":
            features = [self.summary.query_features(qb), self.summary.key_features(kb)]
            features = [None if f is x else f for f, x in zip(features, (qb, kb))]  # identity: pool q, k themselves
            out = segment_flash_attention(qb, kb, vb, *features, self.summary_plan(n, m, q), self.summary.reduce,
                                          self.causal, scale, drop)
            return out.reshape(B, H, L, -1)

        # every summary kind is positively homogeneous: pool the unscaled queries, scale the n pooled rows
        if key_padding_mask is None:
            q_bar = self.summary.pool_queries(qb, -2) * scale  # (BH, n, D)
            k_bar = self.summary.pool_keys(kb, -2)  # (BH, n, D)
            inner_mask, joint_mask = None, self.joint_mask(n, m, q.device)
        else:
            real = (~key_padding_mask.bool()).view(B, 1, n, m).expand(B, H, n, m).reshape(B * H, n, m)
            occupied = real.any(-1)  # (BH, n): the region has a real key
            q_bar = self.summary.masked_reduce(self.summary.query_features(qb), real) * scale
            k_bar = self.summary.masked_reduce(self.summary.key_features(kb), real)
            # an empty region gets any finite inner row (all keys); its summary is masked in the joint mask
            inner_mask = (real | ~occupied.unsqueeze(-1)).unsqueeze(-2)  # (BH, n, 1, m)
            joint_mask = self.padded_joint_mask(real, occupied, n, m, q.device)
        # v_bar = sum_t softmax_t(q_bar . k_t) v_t: one query per segment, through the fused kernel too
        v_bar = F.scaled_dot_product_attention(q_bar.unsqueeze(-2), kb, vb, attn_mask=inner_mask, dropout_p=drop,
                                               scale=1.0).squeeze(-2)  # (BH, n, Dv)
        # every segment sees the same n summaries; which ones it may use is the mask's business
        keys = torch.cat([kb, k_bar.unsqueeze(1).expand(-1, n, -1, -1)], -2)  # (BH, n, m + n, D)
        values = torch.cat([vb, v_bar.unsqueeze(1).expand(-1, n, -1, -1)], -2)  # (BH, n, m + n, Dv)
        out = F.scaled_dot_product_attention(qb * scale, keys, values, attn_mask=joint_mask, scale=1.0)
        return out.reshape(B, H, L, -1)

    # -- the flex layout (``ops.flex``): one call over [keys ; the n segment summaries] ---------------------------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        grid = self.grid(length)
        n, m, causal = grid.n_rows, grid.n_cols, self.causal

        def usable(b, h, q, r):
            return r < q // m if causal else r != q // m

        def members():
            return grid.rows(device).unsqueeze(0) == torch.arange(n, device=device).unsqueeze(1)

        regions = None
        if self.summary.poolable:  # segment g: positions g m .. g m + m - 1
            regions = RegionTable.of(torch.arange(n) * m, 1, m, reduce=self.summary.reduce, device=device)
        return [FlexCall(same_block(m, causal), None, n, usable, members, regions=regions)]

    def flex_summaries(self, index: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       real: torch.Tensor | None, state=None):
        """Each segment's pooled key and local expectation ``(B, H, n, .)`` (``RegionSummary.region_summaries`` over
        the segments' real members); ``occupied`` ``(B, n)`` under padding."""
        B, L = qs.shape[0], qs.shape[-2]
        n, m = self.grid(L).n_rows, self.block_size
        member = None if real is None else real.view(B, 1, n, m)
        k_bar, v_bar = self.summary.region_summaries(*(x.unflatten(-2, (n, m)) for x in (qs, k, v)), member)
        return k_bar, v_bar, None if member is None else member.any(-1)[:, 0]

    def summary_plan(self, n: int, m: int, like: torch.Tensor) -> tuple[SummaryChunk, ...]:
        """The CPU engine's summary chunks (``ops.cpu.segment_flash.summary_plan``), cached per geometry, device
        and dtype."""
        key = ("plan", n, m, str(like.device), like.dtype, self.causal)
        if key not in self._mask_cache:
            uses = self.joint_mask(n, m, like.device)[0, :, 0, m:]  # (n, n): segment g may use summary g'
            self._mask_cache[key] = summary_plan(uses, self.causal, m, like)
        return self._mask_cache[key]

    def padded_joint_mask(self, real: torch.Tensor, occupied: torch.Tensor, n: int, m: int,
                          device: torch.device) -> torch.Tensor:
        """(BH, n, m, m + n) bool: the joint mask minus padded direct keys and empty regions, with the
        own-segment fallback for rows left empty."""
        base = self.joint_mask(n, m, device)  # (1, n, m, m + n)
        usable = torch.cat([real.unsqueeze(2).expand(-1, n, m, m), occupied[:, None, None, :].expand(-1, n, m, n)], -1)
        mask = base & usable
        direct_only = base.clone()
        direct_only[..., m:] = False
        return torch.where(mask.any(-1, keepdim=True), mask, direct_only)


__all__ = ["CombinerFixedAttention"]
