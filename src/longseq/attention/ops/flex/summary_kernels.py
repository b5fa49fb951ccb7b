"""Triton kernels of the fused region summaries (``ops.flex.regions.summary_kv``): one launch computes every
region's pooled key and local expectation and writes them, with the call's keys, into the KV of its flex call; two
launches compute the backward (a pass over the regions, then one over the positions).

A region is an arithmetic progression of positions, ``start + i * stride`` for ``i < count``, without the position
``skip`` (-1: none). For region r with members t (``q``, ``k``, ``v`` one head's rows ``(L, D)``):

    q_bar = scale * pool_t q_t,   k_bar = pool_t k_t   (pool: max or mean over D separately)
    p_t = softmax_t(k_t . q_bar),  v_bar = sum_t p_t v_t

The forward runs one program per region (three passes over its members: pools, online softmax) and one program per
``BLOCK_J`` KV slots that copies the call's keys and values (``slot_source``: a position, or a zero slot); a summary
program writes its result to every slot that holds a copy of it (``dst``). The backward's region pass recomputes the
pools (with the first member that holds each maximum), the log-sum-exp and ``delta = sum_t p_t (v_t . dv_bar)``,
and stores per region what the position pass needs; the position pass walks each position's regions (a CSR table,
``indptr`` / ``indices``) and sums its gradients without atomics:

    dv_t = dV[slot(t)] + sum_r p_rt dv_bar_r
    dk_t = dK[slot(t)] + sum_r ds_rt q_bar_r + [t holds k_bar_r's maximum] dk_bar_r     (mean: dk_bar_r / |r|)
    dq_t = sum_r [t holds the pooled maximum] dq_bar_r,  dq_bar_r = scale * sum_t ds_rt k_t  (mean: / |r|)
    ds_rt = p_rt (v_t . dv_bar_r - delta_r)

Everything accumulates in ``ACC`` (fp32, or fp64 for fp64 inputs). Tested under ``TRITON_INTERPRET=1`` against the
reference in ``ops.flex.regions`` and compiled for sm90 on the CPU (tests/attention/test_fused_summaries.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)  # a finite "minus infinity": an empty chunk's max stays finite (no exp(-inf + inf))


@triton.jit
def summary_kv_forward(
    q, k, v, k_out, v_out,
    start, stride, count, skip, slot_source, dst,
    H, L, R, KV, C, n_copy, scale,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, MEAN: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < D
    dv_ok = dv < DV
    qb = q + b * sqb + h * sqh
    kb = k + b * skb + h * skh
    vb = v + b * svb + h * svh
    kout = k_out + bh.to(tl.int64) * KV * D
    vout = v_out + bh.to(tl.int64) * KV * DV
    if pid < n_copy:  # the call's keys and values in its order, zeros in the empty slots
        j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
        j_ok = j < KV
        src = tl.load(slot_source + j, mask=j_ok, other=L + R)
        is_key = j_ok & (src < L)
        write = j_ok & ((src < L) | (src == L + R))
        pos = tl.where(is_key, src, 0)
        keys = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=is_key[:, None] & d_ok[None, :], other=0.0)
        values = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=is_key[:, None] & dv_ok[None, :], other=0.0)
        tl.store(kout + j[:, None] * D + d[None, :], keys, mask=write[:, None] & d_ok[None, :])
        tl.store(vout + j[:, None] * DV + dv[None, :], values, mask=write[:, None] & dv_ok[None, :])
    else:
        r = pid - n_copy
        first = tl.load(start + r)
        step = tl.load(stride + r)
        n = tl.load(count + r)
        left_out = tl.load(skip + r)
        if MEAN:
            q_pool = tl.zeros([BLOCK_D], dtype=ACC)
            k_pool = tl.zeros([BLOCK_D], dtype=ACC)
        else:
            q_pool = tl.full([BLOCK_D], NEG_BIG, dtype=ACC)
            k_pool = tl.full([BLOCK_D], NEG_BIG, dtype=ACC)
        size = tl.zeros([1], dtype=tl.int32)
        for i0 in range(0, n, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            pos = first + i * step
            ok = (i < n) & (pos != left_out)
            mask = ok[:, None] & d_ok[None, :]
            if MEAN:
                q_pool += tl.sum(tl.load(qb + pos[:, None] * sql + d[None, :] * sqd, mask=mask, other=0.0).to(ACC), 0)
                k_pool += tl.sum(tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=mask, other=0.0).to(ACC), 0)
            else:
                qq = tl.load(qb + pos[:, None] * sql + d[None, :] * sqd, mask=mask, other=NEG_BIG).to(ACC)
                kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=mask, other=NEG_BIG).to(ACC)
                q_pool = tl.maximum(q_pool, tl.max(qq, 0))
                k_pool = tl.maximum(k_pool, tl.max(kk, 0))
            size += tl.sum(ok.to(tl.int32), 0)
        if MEAN:
            q_pool = q_pool / tl.maximum(size, 1).to(ACC)
            k_pool = k_pool / tl.maximum(size, 1).to(ACC)
        else:  # an empty region pools to 0 (its summary is masked; 0 keeps products finite)
            q_pool = tl.where(size > 0, q_pool, 0.0)
            k_pool = tl.where(size > 0, k_pool, 0.0)
        q_bar = q_pool * scale
        run_max = tl.full([1], NEG_BIG, dtype=ACC)
        run_sum = tl.zeros([1], dtype=ACC)
        acc = tl.zeros([BLOCK_DV], dtype=ACC)
        for i0 in range(0, n, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            pos = first + i * step
            ok = (i < n) & (pos != left_out)
            kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=ok[:, None] & d_ok[None, :],
                         other=0.0).to(ACC)
            vv = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=ok[:, None] & dv_ok[None, :],
                         other=0.0).to(ACC)
            logits = tl.where(ok, tl.sum(kk * q_bar[None, :], 1), NEG_BIG)
            new_max = tl.maximum(run_max, tl.max(logits, 0))
            weights = tl.where(ok, tl.exp(logits - new_max), 0.0)
            rescale = tl.exp(run_max - new_max)
            run_sum = run_sum * rescale + tl.sum(weights, 0)
            acc = acc * rescale + tl.sum(weights[:, None] * vv, 0)
            run_max = new_max
        v_bar = acc / tl.maximum(run_sum, 1e-30)
        for c in range(0, C):
            slot = tl.load(dst + r * C + c)
            tl.store(kout + slot * D + d, k_pool, mask=d_ok & (slot >= 0))
            tl.store(vout + slot * DV + dv, v_bar, mask=dv_ok & (slot >= 0))


@triton.jit
def summary_kv_backward_regions(
    q, k, v, dk_kv, dv_kv,
    start, stride, count, skip, dst,
    q_bar_out, q_arg_out, k_arg_out, dq_bar_out, dk_bar_out, dv_bar_out, lse_out, delta_out,
    H, R, KV, C, scale,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MEAN: tl.constexpr, ACC: tl.constexpr,
):
    r = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < D
    dv_ok = dv < DV
    qb = q + b * sqb + h * sqh
    kb = k + b * skb + h * skh
    vb = v + b * svb + h * svh
    # the summary's gradients: the sum over the slots that hold a copy of it
    dk_bar = tl.zeros([BLOCK_D], dtype=ACC)
    dv_bar = tl.zeros([BLOCK_DV], dtype=ACC)
    for c in range(0, C):
        slot = tl.load(dst + r * C + c)
        dk_bar += tl.load(dk_kv + bh.to(tl.int64) * KV * D + slot * D + d, mask=d_ok & (slot >= 0), other=0.0).to(ACC)
        dv_bar += tl.load(dv_kv + bh.to(tl.int64) * KV * DV + slot * DV + dv, mask=dv_ok & (slot >= 0),
                          other=0.0).to(ACC)
    first = tl.load(start + r)
    step = tl.load(stride + r)
    n = tl.load(count + r)
    left_out = tl.load(skip + r)
    # pass 0: the pools, and the first member that holds each maximum
    if MEAN:
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
        if MEAN:
            q_pool += tl.sum(tl.load(qb + pos[:, None] * sql + d[None, :] * sqd, mask=mask, other=0.0).to(ACC), 0)
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
    if MEAN:
        q_pool = q_pool / tl.maximum(size, 1).to(ACC)
    else:
        q_pool = tl.where(size > 0, q_pool, 0.0)
    q_bar = q_pool * scale
    # pass 1: the log-sum-exp and delta = sum_t p_t (v_t . dv_bar), online
    run_max = tl.full([1], NEG_BIG, dtype=ACC)
    run_sum = tl.zeros([1], dtype=ACC)
    run_dot = tl.zeros([1], dtype=ACC)
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
        run_max = new_max
    lse = run_max + tl.log(tl.maximum(run_sum, 1e-30))
    delta = run_dot / tl.maximum(run_sum, 1e-30)
    # pass 2: dq_bar = scale * sum_t ds_t k_t
    dq_bar = tl.zeros([BLOCK_D], dtype=ACC)
    for i0 in range(0, n, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        pos = first + i * step
        ok = (i < n) & (pos != left_out)
        kk = tl.load(kb + pos[:, None] * skl + d[None, :] * skd, mask=ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
        vv = tl.load(vb + pos[:, None] * svl + dv[None, :] * svd, mask=ok[:, None] & dv_ok[None, :],
                     other=0.0).to(ACC)
        logits = tl.sum(kk * q_bar[None, :], 1)
        weights = tl.where(ok, tl.exp(logits - lse), 0.0)
        ds = weights * (tl.sum(vv * dv_bar[None, :], 1) - delta)
        dq_bar += tl.sum(ds[:, None] * kk, 0)
    dq_bar = dq_bar * scale
    if MEAN:
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
    H, L, R, KV,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr, MEAN: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < D
    dv_ok = dv < DV
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < L
    mask_d = t_ok[:, None] & d_ok[None, :]
    mask_dv = t_ok[:, None] & dv_ok[None, :]
    kk = tl.load(k + b * skb + h * skh + t[:, None] * skl + d[None, :] * skd, mask=mask_d, other=0.0).to(ACC)
    vv = tl.load(v + b * svb + h * svh + t[:, None] * svl + dv[None, :] * svd, mask=mask_dv, other=0.0).to(ACC)
    # the keys' own slots (a call with direct keys): their gradients as FlexAttention left them
    slot = tl.load(key_slot + t, mask=t_ok, other=-1)
    own = t_ok & (slot >= 0)
    dk = tl.load(dk_kv + bh.to(tl.int64) * KV * D + slot[:, None] * D + d[None, :],
                 mask=own[:, None] & d_ok[None, :], other=0.0).to(ACC)
    dvv = tl.load(dv_kv + bh.to(tl.int64) * KV * DV + slot[:, None] * DV + dv[None, :],
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
        if MEAN:
            dq += dq_bar
            dk += dk_bar
        else:
            q_at = tl.load(q_arg_in + row[:, None] * D + d[None, :], mask=live_d, other=-1)
            k_at = tl.load(k_arg_in + row[:, None] * D + d[None, :], mask=live_d, other=-1)
            dq += tl.where(q_at == t[:, None], dq_bar, 0.0)
            dk += tl.where(k_at == t[:, None], dk_bar, 0.0)
    out = bh.to(tl.int64) * L * D + t[:, None] * D + d[None, :]
    tl.store(dq_out + out, dq, mask=mask_d)
    tl.store(dk_out + out, dk, mask=mask_d)
    tl.store(dv_out + bh.to(tl.int64) * L * DV + t[:, None] * DV + dv[None, :], dvv, mask=mask_dv)
