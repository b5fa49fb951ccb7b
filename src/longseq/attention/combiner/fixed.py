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

Fast path (CPU, no key padding, one head size for q and v): ``_CombinerFixedFlash``, one autograd Function with a
hand-written backward. The joint softmax is the own-segment flash attention merged exactly, by log-sum-exps,
with flash attention of query chunks against the summaries they may use (causal: a prefix, so about half the
(L, n) summary logits are never computed); no [own segment ; summaries] key/value concatenation is built.
Measured against the single joint SDPA it replaces (B=1, H=8, D=64, m=128, fp32, causal fwd+bwd, one thread,
CPU time): 0.70x the time at L = 16384, and t(65536) / t(16384) = 6.2. Otherwise (key padding, a value width
other than D, tests probing with one-hot values, non-CPU tensors) one SDPA over the concatenated keys with the
joint mask runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import NEG_INF, causal_mask
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
            self._mask_cache[key] = mask.unsqueeze(0).contiguous()
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
        if key_padding_mask is None and segment_flash_applies(qb, vb):
            features = [self.summary.query_features(qb), self.summary.key_features(kb)]
            features = [None if f is x else f for f, x in zip(features, (qb, kb))]  # identity: pool q, k themselves
            out = _CombinerFixedFlash.apply(qb, kb, vb, *features, self.summary_plan(n, m, q), self.summary.reduce,
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

    def summary_plan(self, n: int, m: int, like: torch.Tensor) -> tuple[SummaryChunk, ...]:
        """How ``_CombinerFixedFlash`` splits the queries' attention to the summaries: chunks of consecutive segments,
        each against the summaries ``[0, usable)`` its segments may use, with an additive float mask (0 = may use,
        -inf = not; the flash kernel takes no bool mask) in the dtype of ``like``.

        Causal: segment g may use g' < g, so a chunk of segments ``[first, stop)`` needs only the first ``stop - 1``
        summaries; ``SUMMARY_CHUNKS`` chunks skip about half the (L, n) logits, which the kernel would otherwise
        compute and mask (measured: the summary part's fwd+bwd ~45% faster at L = 16384, ~55% at 65536, than one
        call over all n). Segment 0's rows have no summary (all -inf). Bidirectional: one chunk, own segment masked.
        """
        key = ("plan", n, m, str(like.device), like.dtype, self.causal)
        if key not in self._mask_cache:
            uses = self.joint_mask(n, m, like.device)[0, :, 0, m:]  # (n, n): segment g may use summary g'
            if not self.causal:
                bounds = [(0, n, n)]
            else:
                step = -(-n // SUMMARY_CHUNKS)
                bounds = [(first, min(first + step, n), min(first + step, n) - 1) for first in range(0, n, step)]
            plan = []
            for first, stop, usable in bounds:
                allowed = uses[first:stop, :usable].repeat_interleave(m, 0)  # (rows, usable)
                mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, NEG_INF)
                plan.append(SummaryChunk(first, stop, usable, mask))
            self._mask_cache[key] = tuple(plan)
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


def segment_flash_applies(qb: torch.Tensor, vb: torch.Tensor) -> bool:
    """Whether ``_CombinerFixedFlash`` can run: CPU kernels (they return the log-sum-exp public SDPA hides), at
    least two segments (else there is no summary part) and one head size for q and v (tests probe with
    v = identity); otherwise the joint SDPA over ``[own segment ; summaries]`` runs."""
    return qb.device.type == "cpu" and qb.shape[1] > 1 and vb.shape[-1] == qb.shape[-1]


# Query chunks of the causal summary part (``CombinerFixedAttention.summary_plan``).
SUMMARY_CHUNKS = 16


@dataclass(frozen=True)
class SummaryChunk:
    """Segments ``[first, stop)`` attend summaries ``[0, usable)`` under ``mask`` ``((stop - first) * m, usable)``
    (cast to the queries' dtype where used, e.g. under autocast)."""

    first: int
    stop: int
    usable: int
    mask: torch.Tensor


@autocast_function
class _CombinerFixedFlash(torch.autograd.Function):
    """Combiner-Fixed without key padding, summaries included, as one Function with a hand-written backward.

    - summaries: ``q_bar`` / ``k_bar`` pool each segment (max keeps its argmax, mean), ``v_bar`` is the
      one-query softmax of ``q_bar`` over the segment's keys (small ``(BH, n, m)`` weights, batched
      matrix-vector products);
    - the joint softmax over [own segment ; usable summaries] is fused CPU flash-attention calls merged exactly
      by their log-sum-exps (the merge of ``ops.joint_softmax._CausalRowColumnFlash``): the own segment
      ``(BH, n, m, D)`` (segments in the heads slot, ``is_causal`` when causal), and per ``SummaryChunk`` its
      queries in one head against the summaries they may use. Causal segment 0 has no summary: its summary
      log-sum-exp is -inf, so the merge keeps its own-segment row. The backward calls each part's flash backward
      with the JOINT output and log-sum-exp, which is exactly the joint softmax's gradient restricted to that part.

    Why (measured, L = 16384, m = 128, fp32, CPU): one SDPA over the concatenated ``(BH, n, m, m + n)`` keys
    computes every masked logit (the kernel skips nothing for a mask, and its causal skip gains nothing at a
    per-head length of 128), copies keys and values into the concatenation and zero-fills its gradients. Here
    the summary chunks skip the unusable summaries, nothing is concatenated, and the backward adds the
    summary, pooling and inner gradients into the flash kernels' own gradient buffers.

    Inputs: ``q, k, v`` ``(BH, n, m, D)`` (q unscaled); ``q_features, k_features``: the DeepSets features of
    q / k to pool (same shape), or None to pool q / k themselves; ``plan`` the ``SummaryChunk``s covering the n
    segments in order; ``reduce`` ``"max"`` / ``"mean"``; ``causal``; ``scale`` = 1/sqrt(D); ``dropout`` on the
    inner weights p(j|R). Output ``(BH, n, m, D)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_features, k_features, plan, reduce, causal, scale, dropout):
        BH, n, m, D = q.shape
        q_pool, q_index = _pool(q if q_features is None else q_features, reduce)
        k_bar, k_index = _pool(k if k_features is None else k_features, reduce)
        q_bar = q_pool.mul_(scale)  # every summary kind is positively homogeneous: pool, then scale
        weights = (k @ q_bar.unsqueeze(-1)).squeeze(-1).softmax(-1)  # (BH, n, m): p(j|R)
        kept = None
        if dropout > 0:
            kept = torch.empty_like(weights).bernoulli_(1 - dropout).div_(1 - dropout)
        applied = weights if kept is None else weights * kept
        v_bar = (applied.unsqueeze(-2) @ v).squeeze(-2)  # (BH, n, D)

        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        own_out, lse = flash(q, k, v, 0.0, causal, scale=scale)  # (BH, n, m, D), lse (BH, n, m)
        lse = lse.contiguous()
        out = torch.empty_like(own_out, memory_format=torch.contiguous_format)
        for chunk in plan:
            rows = slice(chunk.first, chunk.stop)
            if chunk.usable == 0:  # causal segment 0 alone: no summary
                out[:, rows] = own_out[:, rows]
                continue
            part_out, part_lse = flash(q[:, rows].reshape(BH, 1, -1, D), k_bar[:, None, : chunk.usable],
                                       v_bar[:, None, : chunk.usable], 0.0, False, attn_mask=chunk.mask.to(q.dtype),
                                       scale=scale)
            part_out, part_lse = part_out.view(BH, -1, m, D), part_lse.view(BH, -1, m)
            if causal and chunk.first == 0:
                part_lse[:, 0] = NEG_INF  # segment 0: the kernel's row for a fully masked query is not used
            joint_lse = torch.logaddexp(lse[:, rows], part_lse)
            torch.mul(part_out, (part_lse - joint_lse).exp_().unsqueeze(-1), out=out[:, rows])
            if causal and chunk.first == 0:
                out[:, 0] = 0.0
            out[:, rows].addcmul_(own_out[:, rows], (lse[:, rows] - joint_lse).exp_().unsqueeze(-1))
            lse[:, rows] = joint_lse
        ctx.save_for_backward(q, k, v, q_features, k_features, q_bar, k_bar, v_bar, weights, kept, q_index, k_index,
                              out, lse)
        ctx.plan, ctx.reduce, ctx.causal, ctx.scale = plan, reduce, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (q, k, v, q_features, k_features, q_bar, k_bar, v_bar, weights, kept, q_index, k_index, out,
         lse) = ctx.saved_tensors
        BH, n, m, D = q.shape
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        own_grad_q, own_grad_k, own_grad_v = flash_backward(grad_out, q, k, v, out, lse, 0.0, ctx.causal,
                                                            scale=ctx.scale)
        # the kernel hands gradients back in its (B, L, H, D) memory layout: the sums below write row-major
        # buffers (one pass each) instead of leaving the caller's reshape a copy per input
        grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
        grad_k_bar, grad_v_bar = torch.zeros_like(k_bar), torch.zeros_like(v_bar)
        for chunk in ctx.plan:
            rows = slice(chunk.first, chunk.stop)
            if chunk.usable == 0:
                grad_q[:, rows] = own_grad_q[:, rows]
                continue
            flat = [x[:, rows].reshape(BH, 1, -1, x.shape[-1]) for x in (grad_out, q, out)]
            part_grad_q, part_grad_k, part_grad_v = flash_backward(
                flat[0], flat[1], k_bar[:, None, : chunk.usable], v_bar[:, None, : chunk.usable], flat[2],
                lse[:, rows].reshape(BH, 1, -1), 0.0, False, attn_mask=chunk.mask.to(q.dtype), scale=ctx.scale)
            torch.add(part_grad_q.view(BH, -1, m, D), own_grad_q[:, rows], out=grad_q[:, rows])
            grad_k_bar[:, : chunk.usable] += part_grad_k.squeeze(1)
            grad_v_bar[:, : chunk.usable] += part_grad_v.squeeze(1)

        # inner softmax v_bar = p(.|R) @ v, p = softmax(k @ q_bar)
        applied = weights if kept is None else weights * kept
        grad_v = torch.addcmul(own_grad_v, applied.unsqueeze(-1), grad_v_bar.unsqueeze(-2),
                               out=torch.empty_like(v, memory_format=torch.contiguous_format))
        grad_weights = (v @ grad_v_bar.unsqueeze(-1)).squeeze(-1)
        if kept is not None:
            grad_weights.mul_(kept)
        grad_logits = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
        grad_k = torch.addcmul(own_grad_k, grad_logits.unsqueeze(-1), q_bar.unsqueeze(-2),
                               out=torch.empty_like(k, memory_format=torch.contiguous_format))
        grad_q_bar = (grad_logits.unsqueeze(-2) @ k).squeeze(-2).mul_(ctx.scale)

        grad_q_features = _pool_backward(grad_q if q_features is None else None, q, grad_q_bar, q_index, ctx.reduce)
        grad_k_features = _pool_backward(grad_k if k_features is None else None, k, grad_k_bar, k_index, ctx.reduce)
        return (grad_q, grad_k, grad_v, None if q_features is None else grad_q_features,
                None if k_features is None else grad_k_features, None, None, None, None, None)


def _pool(x: torch.Tensor, reduce: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pool ``(BH, n, m, D)`` over each segment -> ``(BH, n, D)`` and, for max, the argmax along m (the one member
    a pooled coordinate's gradient goes to)."""
    if reduce == "max":
        return x.max(-2)
    return x.mean(-2), None


def _pool_backward(into: torch.Tensor | None, like: torch.Tensor, grad: torch.Tensor, index: torch.Tensor | None,
                   reduce: str) -> torch.Tensor:
    """Add the gradient ``(BH, n, D)`` of a segment pool to the members' gradient ``into`` ``(BH, n, m, D)`` in place
    (a fresh zero buffer shaped like ``like`` when None) and return it."""
    if into is None:
        into = torch.zeros_like(like)
    if reduce == "max":
        return into.scatter_add_(-2, index.unsqueeze(-2), grad.unsqueeze(-2))
    return into.add_(grad.unsqueeze(-2) / like.shape[-2])


__all__ = ["CombinerFixedAttention"]
