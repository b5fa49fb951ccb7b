"""Triton kernels of the fused region summaries (``ops.flex.regions.summary_kv``): one launch computes every
region's summary key and local expectation and writes them, with the call's keys, into the KV of its flex call; two
launches compute the backward (a pass over the regions, then one over the positions).

A region is an arithmetic progression of positions, ``start + i * stride`` for ``i < count``, without the position
``skip`` (-1: none). For region r with members t (``q``, ``k``, ``v`` one head's rows ``(L, D)``):

    q_bar = scale * pool_t q_t,   k_bar = pool_t k_t
    p_t = softmax_t(k_t . q_bar),  v_bar = sum_t p_t v_t

``POOL``: 0 the maximum over the members (per feature), 1 their mean, 2 the region's ``anchor`` position alone
(``combiner_axial``: the row-mate's query and key). The forward runs one program per region (the pools, then an
online softmax over the members) and one program per ``BLOCK_J`` KV slots that copies the call's keys and values
(``slot_source``: a position, or a zero slot); a summary program writes its result to every slot that holds a copy
of it (``dst``). The backward's region pass recomputes the pools (with the first member holding each maximum), the
log-sum-exp and ``delta = sum_t p_t (v_t . dv_bar)``, and stores per region what the position pass needs; the
position pass walks each position's regions (a CSR table, ``indptr`` / ``indices``) and sums its gradients without
atomics:

    dv_t = dV[slot(t)] + sum_r p_rt dv_bar_r
    dk_t = dK[slot(t)] + sum_r ds_rt q_bar_r + [t holds k_bar_r] dk_bar_r       (mean: dk_bar_r / |r|)
    dq_t = sum_r [t holds q_bar_r] dq_bar_r,  dq_bar_r = scale * sum_t ds_rt k_t   (mean: / |r|)
    ds_rt = p_rt (v_t . dv_bar_r - delta_r)

Everything accumulates in ``ACC`` (fp32, or fp64 for fp64 inputs). Every tensor is read and written through its
strides. Tested under ``TRITON_INTERPRET=1`` against the reference in ``ops.flex.regions`` and compiled for sm90 on
the CPU (tests/attention/test_fused_summaries.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)  # a finite "minus infinity": an empty chunk's max stays finite (no exp(-inf + inf))


@triton.jit
def _batch_head(H, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The program's (batch, head) from its second grid axis and its feature ranges: ``(bh, b, h, d, dv, d_ok,
    dv_ok)``."""
    bh = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    return bh, bh // H, bh % H, d, dv, d < D, dv < DV


@triton.jit
def _pools(qb, kb, sql, sqd, skl, skd, first, step, n, left_out, at, d, d_ok,
           BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, POOL: tl.constexpr, ACC: tl.constexpr):
    """A region's pooled query and key ``(BLOCK_D,)``, the positions holding them (max: the first member with the
    maximum; anchor: the anchor; mean: -1) and its member count."""
    if POOL == 2:
        q_pool = tl.load(qb + at * sql + d * sqd, mask=d_ok, other=0.0).to(ACC)
        k_pool = tl.load(kb + at * skl + d * skd, mask=d_ok, other=0.0).to(ACC)
        q_arg = tl.zeros([BLOCK_D], dtype=tl.int32) + at
        k_arg = tl.zeros([BLOCK_D], dtype=tl.int32) + at
        size = tl.zeros([1], dtype=tl.int32) + n
    else:
        if POOL == 1:
            q_pool = tl.zeros([BLOCK_D], dtype=ACC)
            k_pool = tl.zeros([BLOCK_D], dtype=ACC)
        else:
            q_pool = tl.full([BLOCK_D], NEG_BIG, dtype=ACC)
            k_pool = tl.full([BLOCK_D], NEG_BIG, dtype=ACC)
        q_arg = tl.full([BLOCK_D], -1, dtype=tl.int32)
        k_arg = tl.full([BLOCK_D], -1, dtype=tl.int32)
        size = tl.zeros([1], dtype=tl.int32)
        for i0 in range(0, n, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            pos = first + i * step
            ok = (i < n) & (pos != left_out)
            mask = ok[:, None] & d_ok[None, :]
            if POOL == 1:
                q_pool += tl.sum(tl.load(qb + pos[:, None] * sql + d[None, :] * sqd, mask=mask, other=0.0).to(ACC), 0)
                k_pool += tl.sum(tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=mask, other=0.0).to(ACC), 0)
            else:
                qq = tl.load(qb + pos[:, None] * sql + d[None, :] * sqd, mask=mask, other=NEG_BIG).to(ACC)
                kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=mask, other=NEG_BIG).to(ACC)
                q_chunk, q_at = tl.max(qq, 0, return_indices=True, return_indices_tie_break_left=True)
                k_chunk, k_at = tl.max(kk, 0, return_indices=True, return_indices_tie_break_left=True)
                q_arg = tl.where(q_chunk > q_pool, first + (i0 + q_at) * step, q_arg)
                k_arg = tl.where(k_chunk > k_pool, first + (i0 + k_at) * step, k_arg)
                q_pool = tl.maximum(q_pool, q_chunk)
                k_pool = tl.maximum(k_pool, k_chunk)
            size += tl.sum(ok.to(tl.int32), 0)
        if POOL == 1:
            q_pool = q_pool / tl.maximum(size, 1).to(ACC)
            k_pool = k_pool / tl.maximum(size, 1).to(ACC)
        else:  # an empty region pools to 0 (its summary is masked; 0 keeps products finite)
            q_pool = tl.where(size > 0, q_pool, 0.0)
            k_pool = tl.where(size > 0, k_pool, 0.0)
    return q_pool, k_pool, q_arg, k_arg, size


@triton.jit
def _softmax_stats(kb, vb, skl, skd, svl, svd, first, step, n, left_out, q_bar, dv_bar, d, d_ok, dv, dv_ok,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """Online over the members: the softmax's running max and sum of ``k_t . q_bar``, the weighted values
    ``sum p v`` (unnormalized) and ``sum p (v . dv_bar)`` (unnormalized; ``dv_bar`` zeros in the forward)."""
    run_max = tl.full([1], NEG_BIG, dtype=ACC)
    run_sum = tl.zeros([1], dtype=ACC)
    run_dot = tl.zeros([1], dtype=ACC)
    acc = tl.zeros([BLOCK_DV], dtype=ACC)
    for i0 in range(0, n, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        pos = first + i * step
        ok = (i < n) & (pos != left_out)
        kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        vv = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=ok[:, None] & dv_ok[None, :],
                     other=0.0).to(ACC)
        logits = tl.where(ok, tl.sum(kk * q_bar[None, :], 1), NEG_BIG)
        new_max = tl.maximum(run_max, tl.max(logits, 0))
        weights = tl.where(ok, tl.exp(logits - new_max), 0.0)
        rescale = tl.exp(run_max - new_max)
        run_sum = run_sum * rescale + tl.sum(weights, 0)
        run_dot = run_dot * rescale + tl.sum(weights * tl.sum(vv * dv_bar[None, :], 1), 0)
        acc = acc * rescale + tl.sum(weights[:, None] * vv, 0)
        run_max = new_max
    return run_max, run_sum, run_dot, acc


@triton.jit
def summary_kv_forward(
    q, k, v, k_out, v_out,
    start, stride, count, skip, anchor, slot_source, dst,
    H, L, R, KV, C, n_copy, scale,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    skob, skoh, skol, svob, svoh, svol,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, POOL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh, b, h, d, dv, d_ok, dv_ok = _batch_head(H, D, DV, BLOCK_D, BLOCK_DV)
    qb = q + b * sqb + h * sqh
    kb = k + b * skb + h * skh
    vb = v + b * svb + h * svh
    kout = k_out + b.to(tl.int64) * skob + h * skoh
    vout = v_out + b.to(tl.int64) * svob + h * svoh
    if pid < n_copy:  # the call's keys and values in its order, zeros in the empty slots
        j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
        j_ok = j < KV
        src = tl.load(slot_source + j, mask=j_ok, other=L + R)
        is_key = j_ok & (src < L)
        write = j_ok & ((src < L) | (src == L + R))
        pos = tl.where(is_key, src, 0)
        keys = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=is_key[:, None] & d_ok[None, :], other=0.0)
        values = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=is_key[:, None] & dv_ok[None, :], other=0.0)
        tl.store(kout + j[:, None] * skol + d[None, :], keys, mask=write[:, None] & d_ok[None, :])
        tl.store(vout + j[:, None] * svol + dv[None, :], values, mask=write[:, None] & dv_ok[None, :])
    else:
        r = pid - n_copy
        first = tl.load(start + r)
        step = tl.load(stride + r)
        n = tl.load(count + r)
        left_out = tl.load(skip + r)
        at = tl.load(anchor + r)
        q_pool, k_pool, q_arg, k_arg, size = _pools(qb, kb, sql, sqd, skl, skd, first, step, n, left_out, at, d,
                                                    d_ok, BLOCK_D, BLOCK_M, POOL, ACC)
        no_grad = tl.zeros([BLOCK_DV], dtype=ACC)
        run_max, run_sum, run_dot, acc = _softmax_stats(kb, vb, skl, skd, svl, svd, first, step, n, left_out,
                                                        q_pool * scale, no_grad, d, d_ok, dv, dv_ok, BLOCK_DV,
                                                        BLOCK_M, ACC)
        v_bar = acc / tl.maximum(run_sum, 1e-30)
        for c in range(0, C):
            slot = tl.load(dst + r * C + c)
            tl.store(kout + slot * skol + d, k_pool, mask=d_ok & (slot >= 0))
            tl.store(vout + slot * svol + dv, v_bar, mask=dv_ok & (slot >= 0))


@triton.jit
def summary_kv_backward_regions(
    q, k, v, dk_kv, dv_kv,
    start, stride, count, skip, anchor, dst,
    q_bar_out, q_arg_out, k_arg_out, dq_bar_out, dk_bar_out, dv_bar_out, lse_out, delta_out,
    H, R, C, scale,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    sdkb, sdkh, sdkl, sdkd, sdvb, sdvh, sdvl, sdvd,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, POOL: tl.constexpr, ACC: tl.constexpr,
):
    r = tl.program_id(0)
    bh, b, h, d, dv, d_ok, dv_ok = _batch_head(H, D, DV, BLOCK_D, BLOCK_DV)
    qb = q + b * sqb + h * sqh
    kb = k + b * skb + h * skh
    vb = v + b * svb + h * svh
    dkb = dk_kv + b.to(tl.int64) * sdkb + h * sdkh
    dvb = dv_kv + b.to(tl.int64) * sdvb + h * sdvh
    # the summary's gradients: the sum over the slots that hold a copy of it
    dk_bar = tl.zeros([BLOCK_D], dtype=ACC)
    dv_bar = tl.zeros([BLOCK_DV], dtype=ACC)
    for c in range(0, C):
        slot = tl.load(dst + r * C + c)
        dk_bar += tl.load(dkb + slot * sdkl + d * sdkd, mask=d_ok & (slot >= 0), other=0.0).to(ACC)
        dv_bar += tl.load(dvb + slot * sdvl + dv * sdvd, mask=dv_ok & (slot >= 0), other=0.0).to(ACC)
    first = tl.load(start + r)
    step = tl.load(stride + r)
    n = tl.load(count + r)
    left_out = tl.load(skip + r)
    at = tl.load(anchor + r)
    q_pool, k_pool, q_arg, k_arg, size = _pools(qb, kb, sql, sqd, skl, skd, first, step, n, left_out, at, d, d_ok,
                                                BLOCK_D, BLOCK_M, POOL, ACC)
    q_bar = q_pool * scale
    run_max, run_sum, run_dot, acc = _softmax_stats(kb, vb, skl, skd, svl, svd, first, step, n, left_out, q_bar,
                                                    dv_bar, d, d_ok, dv, dv_ok, BLOCK_DV, BLOCK_M, ACC)
    lse = run_max + tl.log(tl.maximum(run_sum, 1e-30))
    delta = run_dot / tl.maximum(run_sum, 1e-30)
    # dq_bar = scale * sum_t ds_t k_t
    dq_bar = tl.zeros([BLOCK_D], dtype=ACC)
    for i0 in range(0, n, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        pos = first + i * step
        ok = (i < n) & (pos != left_out)
        kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        vv = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=ok[:, None] & dv_ok[None, :],
                     other=0.0).to(ACC)
        weights = tl.where(ok, tl.exp(tl.sum(kk * q_bar[None, :], 1) - lse), 0.0)
        ds = weights * (tl.sum(vv * dv_bar[None, :], 1) - delta)
        dq_bar += tl.sum(ds[:, None] * kk, 0)
    dq_bar = dq_bar * scale
    if POOL == 1:
        dq_bar = dq_bar / tl.maximum(size, 1).to(ACC)
        dk_bar = dk_bar / tl.maximum(size, 1).to(ACC)
    row = bh.to(tl.int64) * R + r
    tl.store(q_bar_out + row * D + d, q_bar, mask=d_ok)
    tl.store(dq_bar_out + row * D + d, dq_bar, mask=d_ok)
    tl.store(dk_bar_out + row * D + d, dk_bar, mask=d_ok)
    tl.store(dv_bar_out + row * DV + dv, dv_bar, mask=dv_ok)
    tl.store(q_arg_out + row * D + d, q_arg, mask=d_ok)
    tl.store(k_arg_out + row * D + d, k_arg, mask=d_ok)
    tl.store(lse_out + row + tl.arange(0, 1), lse)
    tl.store(delta_out + row + tl.arange(0, 1), delta)


@triton.jit
def summary_kv_backward_positions(
    q, k, v, dk_kv, dv_kv, dq_out, dk_out, dv_out,
    key_slot, indptr, indices,
    q_bar_in, q_arg_in, k_arg_in, dq_bar_in, dk_bar_in, dv_bar_in, lse_in, delta_in,
    H, L, R,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    sdkb, sdkh, sdkl, sdkd, sdvb, sdvh, sdvl, sdvd,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr, POOL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh, b, h, d, dv, d_ok, dv_ok = _batch_head(H, D, DV, BLOCK_D, BLOCK_DV)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < L
    mask_d = t_ok[:, None] & d_ok[None, :]
    mask_dv = t_ok[:, None] & dv_ok[None, :]
    kk = tl.load(k + b * skb + h * skh + t[:, None] * skl + d[None, :] * skd, mask=mask_d, other=0.0).to(ACC)
    vv = tl.load(v + b * svb + h * svh + t[:, None] * svl + dv[None, :] * svd, mask=mask_dv, other=0.0).to(ACC)
    # the keys' own slots (a call with direct keys): their gradients as FlexAttention left them
    slot = tl.load(key_slot + t, mask=t_ok, other=-1)
    own = t_ok & (slot >= 0)
    dk = tl.load(dk_kv + b.to(tl.int64) * sdkb + h * sdkh + slot[:, None] * sdkl + d[None, :] * sdkd,
                 mask=own[:, None] & d_ok[None, :], other=0.0).to(ACC)
    dvv = tl.load(dv_kv + b.to(tl.int64) * sdvb + h * sdvh + slot[:, None] * sdvl + dv[None, :] * sdvd,
                  mask=own[:, None] & dv_ok[None, :], other=0.0).to(ACC)
    dq = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    first = tl.load(indptr + t, mask=t_ok, other=0)
    degree = tl.load(indptr + t + 1, mask=t_ok, other=0) - first
    most = tl.max(degree, 0)
    base = bh.to(tl.int64) * R
    for e in range(0, most):
        live = t_ok & (e < degree)
        r = tl.load(indices + first + e, mask=live, other=0)
        row = base + r
        live_d = live[:, None] & d_ok[None, :]
        live_dv = live[:, None] & dv_ok[None, :]
        q_bar = tl.load(q_bar_in + row[:, None] * D + d[None, :], mask=live_d, other=0.0)
        dv_bar = tl.load(dv_bar_in + row[:, None] * DV + dv[None, :], mask=live_dv, other=0.0)
        lse = tl.load(lse_in + row, mask=live, other=0.0)
        delta = tl.load(delta_in + row, mask=live, other=0.0)
        weights = tl.where(live, tl.exp(tl.sum(kk * q_bar, 1) - lse), 0.0)
        ds = weights * (tl.sum(vv * dv_bar, 1) - delta)
        dvv += weights[:, None] * dv_bar
        dk += ds[:, None] * q_bar
        dq_bar = tl.load(dq_bar_in + row[:, None] * D + d[None, :], mask=live_d, other=0.0)
        dk_bar = tl.load(dk_bar_in + row[:, None] * D + d[None, :], mask=live_d, other=0.0)
        if POOL == 1:
            dq += dq_bar
            dk += dk_bar
        else:  # max and anchor: to the position holding the pooled value
            q_at = tl.load(q_arg_in + row[:, None] * D + d[None, :], mask=live_d, other=-1)
            k_at = tl.load(k_arg_in + row[:, None] * D + d[None, :], mask=live_d, other=-1)
            dq += tl.where(q_at == t[:, None], dq_bar, 0.0)
            dk += tl.where(k_at == t[:, None], dk_bar, 0.0)
    out = bh.to(tl.int64) * L * D + t[:, None] * D + d[None, :]
    tl.store(dq_out + out, dq, mask=mask_d)
    tl.store(dk_out + out, dk, mask=mask_d)
    tl.store(dv_out + bh.to(tl.int64) * L * DV + t[:, None] * DV + dv[None, :], dvv, mask=mask_dv)
