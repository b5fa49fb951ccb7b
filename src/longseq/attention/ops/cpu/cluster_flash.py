"""The causal k-means partition (``routing``, ``combiner_routing``) on the CPU engine: its joint softmax as two or
three fused CPU flash calls merged by their log-sum-exps (``cluster_slots_flash``, ``_ClusterSlotsFlash``).

Runs when ``ops.dispatch`` picks ``cpu_flash`` (CPU, causal, no key padding, no weight dropout, one head size for
q, k and v); the explicit path it equals is ``CausalClusterSlots.logits`` / ``cluster_output`` and the variants'
joint softmax, about 3x slower on CPU (measured: docs/cpu_engine_measurements.md, *cluster_flash*).
"""

from __future__ import annotations

import math

import torch

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.cpu.kernels import flash_attention, flash_attention_backward
from longseq.attention.ops.masks import NEG_INF


def cluster_slots_flash(slots, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_blk: torch.Tensor,
                        v_blk: torch.Tensor, summary_keys: torch.Tensor | None = None,
                        summary_values: torch.Tensor | None = None) -> torch.Tensor:
    """The joint softmax of the causal k-means partition from fused CPU flash calls -> ``(B, H, L, D)``.

    ``slots``: the partition's ``ops.clustering.CausalClusterSlots``. q (NOT scaled), k, v ``(B, H, L, D)``; k_blk,
    v_blk ``(B, H, K, S, D)`` key cluster blocks (as ``CausalClusterSlots.logits``). Optional summaries
    (``combiner_routing``) ``(B, H, n - 1, K, D)``: for every segment g >= 1 the K summary keys and values a query
    of segment g sees, its own routed cluster's masked (that cluster it sees directly). Dropout-free; see
    ``_ClusterSlotsFlash`` for how.
    """
    B, H, L, D = q.shape
    K, S = k_blk.shape[2:4]
    M = slots.segment_len
    device = q.device
    # flat row indices: slot (b, h, c, s) holds query row (b, h, slot_query); routed query (b, h, i) its slot
    heads = torch.arange(B * H, device=device).view(B, H, 1)
    slot_rows = (slots.slot_query.view(B, H, K * S) + heads * L).view(-1)
    query_slot = (torch.where(slots.routed, slots.slot, 0) + heads * (K * S)).view(-1)
    slot_segment = torch.where(slots.slot_used, slots.slot_query // M, 0).view(B * H, K, S)  # 0: no keys
    own_route = slots.slot.div(S, rounding_mode="floor").view(B * H, L // M, M)  # K: overflow, no own cluster
    tensors = [q, k, v, k_blk, v_blk]
    if summary_keys is not None:
        tensors += [summary_keys, summary_values]
    index = (slot_rows, query_slot, slots.routed.view(-1), slot_segment, own_route)
    out = _ClusterSlotsFlash.apply(index, M, 1.0 / math.sqrt(D), *tensors)
    return out.view(B, H, L, D)


def _fold(x: torch.Tensor, block: int) -> torch.Tensor:
    """(..., D) -> (N, 1, block, D): every run of ``block`` rows one flash "batch" with a single head, so the
    kernel's (batch, seq, head, D) output and gradient layouts are the input's own row order (no copies)."""
    return x.reshape(-1, 1, block, x.shape[-1])


@autocast_function
class _ClusterSlotsFlash(torch.autograd.Function):
    """Causal k-means joint softmax as two or three fused CPU flash-attention calls merged by their log-sum-exps.

    - own segment: every segment one kernel batch ``(BH n, 1, M, D)`` (``_fold``), plain ``is_causal``;
    - own cluster, earlier segments: queries in slot order, every cluster one batch ``(BH K, 1, S, D)`` against
      its key cluster block, an additive mask keeping the members of earlier segments (member t lies in segment
      t // (M / K)); empty slots and slots of segment 0 have no key;
    - (optional) cluster summaries: queries of segments >= 1 ``(BH, n - 1, M, D)`` against their segment's K
      summaries, the query's own routed cluster masked.
    A part whose row has no key gets log-sum-exp -inf (the kernel reports 0 there), so it weighs nothing in the
    merge. Backward calls each part's flash backward with the JOINT output and log-sum-exp: exactly the joint
    softmax's gradient restricted to that part (a row without keys there has zero weights, so zero gradient).
    Same idea as ``grid_flash._GridFlash``, with the slot gather and the per-query masks of this
    partition.

    Inputs: ``index`` = (slot_rows (BH*K*S,), query_slot (BH*L,), routed (BH*L,), slot_segment (BH, K, S),
    own_route (BH, n, M)), ``M``, ``scale``, then q, k, v ``(B, H, L, D)``, k_blk, v_blk ``(B, H, K, S, D)``
    and optionally summary keys / values ``(B, H, n - 1, K, D)``. Output ``(BH, L, D)`` in position order.
    """

    @staticmethod
    def forward(ctx, index, M, scale, q, k, v, k_blk, v_blk, *summaries):
        slot_rows, query_slot, routed, slot_segment, own_route = index
        B, H, L, D = q.shape
        K, S = k_blk.shape[2:4]
        BH, n = B * H, L // M
        zero, neg_inf = q.new_zeros(()), q.new_full((), NEG_INF)

        out, lse_seg = flash_attention(_fold(q, M), _fold(k, M), _fold(v, M), 0.0, True, scale=scale)
        out, lse_seg = out.view(BH, L, D), lse_seg.view(BH, L)  # the own segment holds self: lse finite

        q_slot = _fold(q.reshape(BH * L, D).index_select(0, slot_rows), S)
        member_segment = torch.arange(S, device=q.device) // (M // K)
        slot_mask = torch.where(member_segment < slot_segment.view(-1, 1, S, 1), zero, neg_inf)  # (BH*K, 1, S, S)
        out_slot, lse_slot = flash_attention(q_slot, _fold(k_blk, S), _fold(v_blk, S), 0.0, False, attn_mask=slot_mask,
                                   scale=scale)
        lse_slot = lse_slot.view(-1).masked_fill_(slot_segment.view(-1) == 0, NEG_INF)
        lse_cluster = lse_slot.index_select(0, query_slot).masked_fill_(~routed, NEG_INF).view(BH, L)
        out_cluster = out_slot.view(-1, D).index_select(0, query_slot).view(BH, L, D)  # overflow rows: weight 0
        total = torch.logaddexp(lse_seg, lse_cluster)
        summary_tensors = ()
        if summaries and n > 1:
            k_sum, v_sum = (x.reshape(BH, n - 1, K, D) for x in summaries)
            summary_mask = torch.where(own_route[:, 1:].unsqueeze(-1) == torch.arange(K, device=q.device), neg_inf, zero)
            q_later = q.reshape(BH, n, M, D)[:, 1:]  # queries of segments >= 1
            out_sum, lse_sum = flash_attention(q_later, k_sum, v_sum, 0.0, False, attn_mask=summary_mask, scale=scale)
            lse_sum = lse_sum.reshape(BH, L - M)
            total[:, M:] = torch.logaddexp(total[:, M:], lse_sum)
            summary_tensors = (k_sum, v_sum, summary_mask)
        out.mul_((lse_seg - total).exp_().unsqueeze(-1))
        out.addcmul_(out_cluster, (lse_cluster - total).exp_().unsqueeze(-1))
        if summary_tensors:
            out[:, M:].addcmul_(out_sum.reshape(BH, L - M, D), (lse_sum - total[:, M:]).exp_().unsqueeze(-1))
        ctx.M, ctx.scale, ctx.summary_shapes = M, scale, [x.shape for x in summaries]
        ctx.save_for_backward(slot_rows, query_slot, routed, q, k, v, q_slot, k_blk, v_blk, slot_mask, out, total,
                              *summary_tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        slot_rows, query_slot, routed, q, k, v, q_slot, k_blk, v_blk, slot_mask, out, total, *summary = ctx.saved_tensors
        M, scale = ctx.M, ctx.scale
        B, H, L, D = q.shape
        BH, n, S = B * H, L // M, k_blk.shape[3]
        grad_out = grad_out.contiguous()

        # own cluster: the joint output, log-sum-exp and incoming gradient in slot order
        in_slots = [x.reshape(BH * L, -1).index_select(0, slot_rows) for x in (grad_out, out, total.unsqueeze(-1))]
        grad_slot, grad_k_blk, grad_v_blk = flash_attention_backward(
            _fold(in_slots[0], S), q_slot, _fold(k_blk, S), _fold(v_blk, S), _fold(in_slots[1], S),
            in_slots[2].view(-1, 1, S), 0.0, False, attn_mask=slot_mask, scale=scale)
        grad_q = grad_slot.view(-1, D).index_select(0, query_slot).masked_fill_(~routed.unsqueeze(-1), 0.0)

        grad_seg, grad_k, grad_v = flash_attention_backward(_fold(grad_out, M), _fold(q, M), _fold(k, M), _fold(v, M),
                                                  _fold(out, M), total.view(-1, 1, M), 0.0, True, scale=scale)
        grad_q = grad_q.view(BH, n, M, D).add_(grad_seg.view(BH, n, M, D))
        grad_summaries = ()
        if summary:
            k_sum, v_sum, summary_mask = summary
            later = lambda x: x.reshape(BH, n, M, *x.shape[2:])[:, 1:]  # noqa: E731  rows of segments >= 1
            grad_later, grad_k_sum, grad_v_sum = flash_attention_backward(
                later(grad_out), later(q.reshape(BH, L, D)), k_sum, v_sum, later(out), later(total), 0.0, False,
                attn_mask=summary_mask, scale=scale)
            grad_q[:, 1:].add_(grad_later)
            grad_summaries = tuple(g.reshape(shape) for g, shape in zip((grad_k_sum, grad_v_sum), ctx.summary_shapes))
        elif ctx.summary_shapes:  # a single segment: no summary is used
            grad_summaries = tuple(k.new_zeros(shape) for shape in ctx.summary_shapes)
        return (None, None, None, grad_q.view(B, H, L, D), grad_k.view(B, H, L, D), grad_v.view(B, H, L, D),
                grad_k_blk.view(k_blk.shape), grad_v_blk.view(v_blk.shape), *grad_summaries)
