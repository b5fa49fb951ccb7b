"""``longseq::summary_kv`` and its backward as ``torch.library.triton_op``s: the launchers of
``ops.flex.summary_kernels`` (traced into by ``torch.compile``, so a compiled step launches the kernels itself), the
CPU kernels (``ops.flex.regions``'s reference and its autograd backward) and the autograd formula that joins them.
``register`` runs when a layout with regions is built (``block_masks``), outside any traced region; Triton is
imported then, not with this module."""

from __future__ import annotations

import importlib.util

import torch

from longseq.attention.ops.flex import regions
from longseq.attention.ops.flex.regions import REDUCES, FusedKV, RegionTable, reference_summary_kv

BLOCK_J = 64  # KV slots a copying program writes
BLOCK_T = 32  # positions a program of the backward's position pass sums
MEMBERS = 64  # members a region program loads at once (fewer for smaller regions)


def _meta(q: torch.Tensor, v: torch.Tensor, max_count: int, pool: int) -> dict:
    import triton
    import triton.language as tl

    return dict(D=q.shape[-1], DV=v.shape[-1], BLOCK_D=triton.next_power_of_2(q.shape[-1]),
                BLOCK_DV=triton.next_power_of_2(v.shape[-1]),
                BLOCK_M=min(MEMBERS, max(16, triton.next_power_of_2(max(max_count, 1)))), POOL=pool,
                ACC=tl.float64 if q.dtype == torch.float64 else tl.float32)


def _empty_kv(x: torch.Tensor, kv_len: int, heads_last: bool) -> torch.Tensor:
    """An uninitialized KV ``(B, H, KV, .)`` like ``x``; ``heads_last``: a view of ``(B, KV, H, .)`` storage."""
    B, H, _, D = x.shape
    return x.new_empty(B, kv_len, H, D).transpose(1, 2) if heads_last else x.new_empty(B, H, kv_len, D)


def launch_forward(q, k, v, start, stride, count, skip, anchor, slot_source, dst, scale: float, pool: int,
                   max_count: int, heads_last: bool):
    """The forward kernel: the call's KV ``(B, H, KV, D)``, ``(B, H, KV, Dv)`` (``summary_kernels.summary_kv_forward``)."""
    import triton
    from torch.library import wrap_triton

    from longseq.attention.ops.flex import summary_kernels as kernels

    B, H, L, _ = q.shape
    R, KV, C = start.shape[0], slot_source.shape[0], dst.shape[1]
    k_out, v_out = _empty_kv(k, KV, heads_last), _empty_kv(v, KV, heads_last)
    n_copy = triton.cdiv(KV, BLOCK_J)
    wrap_triton(kernels.summary_kv_forward)[(n_copy + R, B * H)](
        q, k, v, k_out, v_out, start, stride, count, skip, anchor, slot_source, dst, H, L, R, KV, C, n_copy, scale,
        *q.stride(), *k.stride(), *v.stride(), *k_out.stride()[:3], *v_out.stride()[:3], BLOCK_J=BLOCK_J,
        **_meta(q, v, max_count, pool))
    return k_out, v_out


def launch_backward(q, k, v, start, stride, count, skip, anchor, dst, key_slot, indptr, indices, dk_kv, dv_kv,
                    scale: float, pool: int, max_count: int):
    """The backward's two kernels: ``(dq, dk, dv)`` ``(B, H, L, .)`` of ``q``, ``k``, ``v`` from the KV's gradients
    (``dq`` the summaries' part only: FlexAttention's own query gradient is added by autograd)."""
    import triton
    from torch.library import wrap_triton

    from longseq.attention.ops.flex import summary_kernels as kernels

    B, H, L, D = q.shape
    Dv, R, C = v.shape[-1], start.shape[0], dst.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_bar, dq_bar, dk_bar = (q.new_empty(B, H, R, D, dtype=acc) for _ in range(3))
    dv_bar = q.new_empty(B, H, R, Dv, dtype=acc)
    q_arg, k_arg = (q.new_empty(B, H, R, D, dtype=torch.int32) for _ in range(2))
    lse, delta = (q.new_empty(B, H, R, dtype=acc) for _ in range(2))
    meta = _meta(q, v, max_count, pool)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dk_kv.stride(), *dv_kv.stride())
    if R:  # no region: the position pass alone (the keys' own gradients, in sequence order)
        wrap_triton(kernels.summary_kv_backward_regions)[(R, B * H)](
            q, k, v, dk_kv, dv_kv, start, stride, count, skip, anchor, dst, q_bar, q_arg, k_arg, dq_bar, dk_bar,
            dv_bar, lse, delta, H, R, C, scale, *strides, **meta)
    dq, dk = q.new_empty(B, H, L, D), k.new_empty(B, H, L, D)
    dv = v.new_empty(B, H, L, Dv)
    meta.pop("BLOCK_M")
    wrap_triton(kernels.summary_kv_backward_positions)[(triton.cdiv(L, BLOCK_T), B * H)](
        q, k, v, dk_kv, dv_kv, dq, dk, dv, key_slot, indptr, indices, q_bar, q_arg, k_arg, dq_bar, dk_bar, dv_bar,
        lse, delta, H, L, R, *strides, BLOCK_T=BLOCK_T, **meta)
    return dq, dk, dv


def _reference(q, k, v, start, stride, count, skip, anchor, slot_source, scale, pool):
    regions = RegionTable(start, stride, count, skip, anchor, reduce=REDUCES[pool])
    fused = FusedKV(regions, q.shape[-2], slot_source, *(torch.empty(0, dtype=torch.int32),) * 4)
    return reference_summary_kv(q, k, v, fused, scale)


def register() -> bool:
    """Register the two operations once per process; False (and nothing registered) where Triton is missing, so the
    engine keeps the variants' own summaries (``regions.fused_applies``)."""
    if regions._REGISTERED["ok"] is not None:
        return regions._REGISTERED["ok"]
    regions._REGISTERED["ok"] = importlib.util.find_spec("triton") is not None
    if regions._REGISTERED["ok"]:
        _define()
    return regions._REGISTERED["ok"]


def _define() -> None:
    from torch.library import triton_op

    @triton_op("longseq::summary_kv", mutates_args={})
    def summary_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, stride: torch.Tensor,
                   count: torch.Tensor, skip: torch.Tensor, anchor: torch.Tensor, slot_source: torch.Tensor,
                   dst: torch.Tensor, key_slot: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                   scale: float, pool: int, max_count: int, heads_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_forward(q, k, v, start, stride, count, skip, anchor, slot_source, dst, scale, pool, max_count,
                              heads_last)

    @triton_op("longseq::summary_kv_backward", mutates_args={})
    def summary_kv_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                            stride: torch.Tensor, count: torch.Tensor, skip: torch.Tensor, anchor: torch.Tensor,
                            slot_source: torch.Tensor, dst: torch.Tensor, key_slot: torch.Tensor,
                            indptr: torch.Tensor, indices: torch.Tensor, dk_kv: torch.Tensor, dv_kv: torch.Tensor,
                            scale: float, pool: int, max_count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_backward(q, k, v, start, stride, count, skip, anchor, dst, key_slot, indptr, indices, dk_kv,
                               dv_kv, scale, pool, max_count)

    @summary_kv.register_kernel("cpu")
    def _(q, k, v, start, stride, count, skip, anchor, slot_source, dst, key_slot, indptr, indices, scale, pool,
          max_count, heads_last):
        with torch.no_grad():
            keys, values = _reference(q, k, v, start, stride, count, skip, anchor, slot_source, scale, pool)
        if heads_last:  # the layout the CUDA kernel writes
            keys, values = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (keys, values))
        return keys, values

    @summary_kv_backward.register_kernel("cpu")
    def _(q, k, v, start, stride, count, skip, anchor, slot_source, dst, key_slot, indptr, indices, dk_kv, dv_kv,
          scale, pool, max_count):
        # torch.func's vjp: an operation's kernel runs below autograd, where torch.autograd.grad sees no graph
        _, vjp = torch.func.vjp(lambda *x: _reference(*x, start, stride, count, skip, anchor, slot_source, scale,
                                                      pool), q, k, v)
        return vjp((dk_kv, dv_kv))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:13])
        ctx.scale, ctx.pool, ctx.max_count = inputs[13:16]

    def backward(ctx, dk_kv, dv_kv):
        grads = summary_kv_backward(*ctx.saved_tensors, dk_kv, dv_kv, ctx.scale, ctx.pool, ctx.max_count)
        return (*grads, *([None] * 14))

    summary_kv.register_autograd(backward, setup_context=setup_context)
