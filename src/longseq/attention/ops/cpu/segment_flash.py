"""``combiner_fixed`` on the CPU engine: the whole layer, summaries included, as one autograd Function whose joint
softmax is fused CPU flash calls merged by log-sum-exps (``segment_flash_attention``; the plan of summary chunks:
``summary_plan``). Runs when ``ops.dispatch`` picks ``cpu_flash`` (CPU, no key padding, at least two segments, one
head size for q and v); the explicit path it equals is ``CombinerFixedAttention.forward``'s joint SDPA.

It replaced a single joint SDPA, which it beats on CPU (measured: docs/cpu_engine_measurements.md,
*segment_flash*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.cpu.kernels import flash_attention, flash_attention_backward
from longseq.attention.ops.masks import NEG_INF

# Query chunks of the causal summary part (``summary_plan``).
SUMMARY_CHUNKS = 16


@dataclass(frozen=True)
class SummaryChunk:
    """Segments ``[first, stop)`` attend summaries ``[0, usable)`` under ``mask`` ``((stop - first) * m, usable)``
    (cast to the queries' dtype where used, e.g. under autocast)."""

    first: int
    stop: int
    usable: int
    mask: torch.Tensor


def summary_plan(uses: torch.Tensor, causal: bool, m: int, like: torch.Tensor) -> tuple[SummaryChunk, ...]:
    """How ``_CombinerFixedFlash`` splits the queries' attention to the summaries: chunks of consecutive segments,
    each against the summaries ``[0, usable)`` its segments may use, with an additive float mask (0 = may use,
    -inf = not; the flash kernel takes no bool mask) in the dtype of ``like``. ``uses`` ``(n, n)`` bool: segment g
    may use summary g'.

    Causal: segment g may use g' < g, so a chunk of segments ``[first, stop)`` needs only the first ``stop - 1``
    summaries; ``SUMMARY_CHUNKS`` chunks skip about half the (L, n) logits, which the kernel would otherwise
    compute and mask (measured: the summary part's fwd+bwd ~45% faster at L = 16384, ~55% at 65536, than one
    call over all n). Segment 0's rows have no summary (all -inf). Bidirectional: one chunk, own segment masked.
    """
    n = uses.shape[0]
    if not causal:
        bounds = [(0, n, n)]
    else:
        step = -(-n // SUMMARY_CHUNKS)
        bounds = [(first, min(first + step, n), min(first + step, n) - 1) for first in range(0, n, step)]
    plan = []
    for first, stop, usable in bounds:
        allowed = uses[first:stop, :usable].repeat_interleave(m, 0)  # (rows, usable)
        mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, NEG_INF)
        plan.append(SummaryChunk(first, stop, usable, mask))
    return tuple(plan)


def segment_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_features: torch.Tensor | None,
                            k_features: torch.Tensor | None, plan: tuple[SummaryChunk, ...], reduce: str, causal: bool,
                            scale: float, dropout: float) -> torch.Tensor:
    """Combiner-Fixed without key padding: ``(BH, n, m, D)`` q (unscaled), k, v -> ``(BH, n, m, D)``; see
    ``_CombinerFixedFlash`` for the arguments."""
    return _CombinerFixedFlash.apply(q, k, v, q_features, k_features, plan, reduce, causal, scale, dropout)


@autocast_function
class _CombinerFixedFlash(torch.autograd.Function):
    """Combiner-Fixed without key padding, summaries included, as one Function with a hand-written backward.

    - summaries: ``q_bar`` / ``k_bar`` pool each segment (max keeps its argmax, mean), ``v_bar`` is the
      one-query softmax of ``q_bar`` over the segment's keys (small ``(BH, n, m)`` weights, batched
      matrix-vector products);
    - the joint softmax over [own segment ; usable summaries] is fused CPU flash-attention calls merged exactly
      by their log-sum-exps (the merge of ``grid_flash._GridFlash``): the own segment
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

        own_out, lse = flash_attention(q, k, v, 0.0, causal, scale=scale)  # (BH, n, m, D), lse (BH, n, m)
        lse = lse.contiguous()
        out = torch.empty_like(own_out, memory_format=torch.contiguous_format)
        for chunk in plan:
            rows = slice(chunk.first, chunk.stop)
            if chunk.usable == 0:  # causal segment 0 alone: no summary
                out[:, rows] = own_out[:, rows]
                continue
            part_out, part_lse = flash_attention(q[:, rows].reshape(BH, 1, -1, D), k_bar[:, None, : chunk.usable],
                                       v_bar[:, None, : chunk.usable], 0.0, False, attn_mask=chunk.mask.to(q.dtype),
                                       scale=scale)
            part_out, part_lse = part_out.view(BH, -1, m, D), part_lse.view(BH, -1, m)
            if causal and chunk.first == 0:
                part_lse[:, 0] = NEG_INF  # segment 0: the kernel's row for a fully masked query is not used
            joint_lse = torch.logaddexp(lse[:, rows], part_lse)
            # in place on the (strided) rows, not out= them: torch.compile traces it (out= breaks the graph)
            out[:, rows].copy_(part_out).mul_((part_lse - joint_lse).exp_().unsqueeze(-1))
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
        grad_out = grad_out.contiguous()
        own_grad_q, own_grad_k, own_grad_v = flash_attention_backward(grad_out, q, k, v, out, lse, 0.0, ctx.causal,
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
            part_grad_q, part_grad_k, part_grad_v = flash_attention_backward(
                flat[0], flat[1], k_bar[:, None, : chunk.usable], v_bar[:, None, : chunk.usable], flat[2],
                lse[:, rows].reshape(BH, 1, -1), 0.0, False, attn_mask=chunk.mask.to(q.dtype), scale=ctx.scale)
            grad_q[:, rows].copy_(own_grad_q[:, rows]).add_(part_grad_q.view(BH, -1, m, D))
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
