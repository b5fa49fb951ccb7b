"""Triton kernels of ``combiner_axial``'s learned summary keys (``combiner.key_map``): one launch forward, two backward.

Rows are the column call's KV slots (``T = B * KV``), each a summary value ``x`` and its row-mate's key ``r``,
flattened over heads (width ``W = H * D``, the heads-last KV read without a copy):

    h = x W_in^T + r,   n = LayerNorm(h) = (h - mean) * rstd * gamma + beta,   k = n W_out^T

The forward runs one program per ``BLOCK_T`` rows: the first product in chunks of ``BLOCK_K`` input features (``x``
copied to the values it returns on the way), the norm over the whole row in registers, the second product in chunks
of ``BLOCK_K`` outputs. The backward's row pass recomputes ``h`` and the norm and writes, per row, the gradients of
``x`` (plus the values' own gradient) and ``r``, the normalized rows and ``dh`` for the weight pass, and per program
the partial sums of the norm's parameter gradients; the weight pass computes ``dW_out = dk^T n``, ``dW_in = dh^T x``
(one program per ``BLOCK_K x BLOCK_K`` tile, a loop over the rows) and sums the partials. No atomics: deterministic.

Products take operands in the input dtype (the weights cast as ``F.linear`` under autocast does) and accumulate in
``ACC`` (fp32, or fp64 for fp64 inputs); the norm runs in ``ACC``. fp32 operands multiply in full precision
(``input_precision="ieee"``), as torch's matrix products do by default, not in Triton's default TF32. Tested under ``TRITON_INTERPRET=1`` against
``combiner.key_map.reference_key_map`` and compiled for sm90 on the CPU (tests/attention/test_fused_summaries.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hidden(x, r, w_in, rows, r_ok, cols, c_ok, W, sxt, srt, swo, swi, values_out, svt,
            BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
            COPY: tl.constexpr):
    """``h = x W_in^T + r`` of rows ``rows`` ``(BLOCK_T, BLOCK_W)`` in ``ACC``; ``COPY``: ``x`` also stored to
    ``values_out``."""
    h = tl.zeros([BLOCK_T, BLOCK_W], dtype=ACC)
    for k0 in range(0, W, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < W
        xa = tl.load(x + rows[:, None] * sxt + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if COPY:
            tl.store(values_out + rows[:, None] * svt + kk[None, :], xa, mask=r_ok[:, None] & k_ok[None, :])
        wt = tl.load(w_in + cols[None, :] * swo + kk[:, None] * swi, mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        h = tl.dot(xa, wt.to(xa.dtype), h, out_dtype=ACC, input_precision="ieee")
    res = tl.load(r + rows[:, None] * srt + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    return h + res.to(ACC)


@triton.jit
def _normalized(h, c_ok, W, eps):
    """``((h - mean) * rstd, rstd)`` over each row's ``W`` features (zeros beyond them)."""
    mean = tl.sum(h, axis=1) / W
    centred = tl.where(c_ok[None, :], h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / W + eps)
    return centred * rstd[:, None], rstd


@triton.jit
def key_map_forward(
    x, r, w_in, gamma, beta, w_out, keys_out, values_out,
    T, W, eps,
    sxt, srt, swo, swi, svt, skt,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    cols = tl.arange(0, BLOCK_W)
    c_ok = cols < W
    rows = rows.to(tl.int64)
    h = _hidden(x, r, w_in, rows, r_ok, cols, c_ok, W, sxt, srt, swo, swi, values_out, svt,
                BLOCK_T, BLOCK_W, BLOCK_K, ACC, True)
    x_hat, _ = _normalized(h, c_ok, W, eps)
    g = tl.load(gamma + cols, mask=c_ok, other=0.0).to(ACC)
    b = tl.load(beta + cols, mask=c_ok, other=0.0).to(ACC)
    n = (x_hat * g[None, :] + b[None, :]).to(keys_out.dtype.element_ty)
    for j0 in range(0, W, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        j_ok = jj < W
        wt = tl.load(w_out + jj[None, :] * swo + cols[:, None] * swi, mask=j_ok[None, :] & c_ok[:, None], other=0.0)
        k = tl.dot(n, wt.to(n.dtype), out_dtype=ACC, input_precision="ieee")
        tl.store(keys_out + rows[:, None] * skt + jj[None, :], k, mask=r_ok[:, None] & j_ok[None, :])


@triton.jit
def key_map_backward_rows(
    x, r, w_in, gamma, beta, w_out, dk, dv, dx_out, dr_out, n_out, dh_out, dgamma_part, dbeta_part,
    T, W, eps,
    sxt, srt, swo, swi, sdkt, sdvt, sdxt, sdrt,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    cols = tl.arange(0, BLOCK_W)
    c_ok = cols < W
    rows = rows.to(tl.int64)
    h = _hidden(x, r, w_in, rows, r_ok, cols, c_ok, W, sxt, srt, swo, swi, x, 0,
                BLOCK_T, BLOCK_W, BLOCK_K, ACC, False)
    x_hat, rstd = _normalized(h, c_ok, W, eps)
    g = tl.load(gamma + cols, mask=c_ok, other=0.0).to(ACC)
    b = tl.load(beta + cols, mask=c_ok, other=0.0).to(ACC)
    dn = tl.zeros([BLOCK_T, BLOCK_W], dtype=ACC)  # dk W_out
    for j0 in range(0, W, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        j_ok = jj < W
        dka = tl.load(dk + rows[:, None] * sdkt + jj[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0.0)
        wt = tl.load(w_out + jj[:, None] * swo + cols[None, :] * swi, mask=j_ok[:, None] & c_ok[None, :], other=0.0)
        dn = tl.dot(dka, wt.to(dka.dtype), dn, out_dtype=ACC, input_precision="ieee")
    tl.store(dgamma_part + pid * W + cols, tl.sum(dn * x_hat, axis=0), mask=c_ok)
    tl.store(dbeta_part + pid * W + cols, tl.sum(dn, axis=0), mask=c_ok)
    keep = r_ok[:, None] & c_ok[None, :]
    tl.store(n_out + rows[:, None] * W + cols[None, :], x_hat * g[None, :] + b[None, :], mask=keep)
    dxh = dn * g[None, :]
    dh = rstd[:, None] * (dxh - (tl.sum(dxh, axis=1) / W)[:, None]
                          - x_hat * (tl.sum(dxh * x_hat, axis=1) / W)[:, None])
    dh = tl.where(c_ok[None, :], dh, 0.0)
    tl.store(dr_out + rows[:, None] * sdrt + cols[None, :], dh, mask=keep)
    tl.store(dh_out + rows[:, None] * W + cols[None, :], dh, mask=keep)
    dh_in = dh.to(dx_out.dtype.element_ty)
    for i0 in range(0, W, BLOCK_K):
        ii = i0 + tl.arange(0, BLOCK_K)
        i_ok = ii < W
        wt = tl.load(w_in + cols[:, None] * swo + ii[None, :] * swi, mask=c_ok[:, None] & i_ok[None, :], other=0.0)
        dx = tl.dot(dh_in, wt.to(dh_in.dtype), out_dtype=ACC, input_precision="ieee")
        dx += tl.load(dv + rows[:, None] * sdvt + ii[None, :], mask=r_ok[:, None] & i_ok[None, :], other=0.0).to(ACC)
        tl.store(dx_out + rows[:, None] * sdxt + ii[None, :], dx, mask=r_ok[:, None] & i_ok[None, :])


@triton.jit
def key_map_backward_weights(
    x, dk, n, dh, dgamma_part, dbeta_part, dw_in, dw_out, dgamma, dbeta,
    T, W, n_parts,
    sxt, sdkt, swo, swi,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    """Program ``(tile, which)``: ``which`` 0 a tile of ``dW_out = dk^T n``, 1 of ``dW_in = dh^T x``, 2 a chunk of the
    norm's parameter gradients (the row pass's partial sums added up)."""
    tile = tl.program_id(0)
    which = tl.program_id(1)
    tiles = tl.cdiv(W, BLOCK_K)
    if which == 2:
        cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        c_ok = cols < W
        if tile < tiles:
            sg = tl.zeros([BLOCK_K], dtype=ACC)
            sb = tl.zeros([BLOCK_K], dtype=ACC)
            for p in range(0, n_parts):
                sg += tl.load(dgamma_part + p * W + cols, mask=c_ok, other=0.0)
                sb += tl.load(dbeta_part + p * W + cols, mask=c_ok, other=0.0)
            tl.store(dgamma + cols, sg, mask=c_ok)
            tl.store(dbeta + cols, sb, mask=c_ok)
    else:
        jj = (tile // tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        ii = (tile % tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        j_ok = jj < W
        i_ok = ii < W
        acc = tl.zeros([BLOCK_K, BLOCK_K], dtype=ACC)
        for t0 in range(0, T, BLOCK_T):
            t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            t_ok = t < T
            if which == 0:
                left = tl.load(dk + t[:, None] * sdkt + jj[None, :], mask=t_ok[:, None] & j_ok[None, :], other=0.0)
                right = tl.load(n + t[:, None] * W + ii[None, :], mask=t_ok[:, None] & i_ok[None, :], other=0.0)
            else:
                left = tl.load(dh + t[:, None] * W + jj[None, :], mask=t_ok[:, None] & j_ok[None, :], other=0.0)
                right = tl.load(x + t[:, None] * sxt + ii[None, :], mask=t_ok[:, None] & i_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(left), right.to(left.dtype), acc, out_dtype=ACC, input_precision="ieee")
        where = jj[:, None] * swo + ii[None, :] * swi
        if which == 0:
            tl.store(dw_out + where, acc, mask=j_ok[:, None] & i_ok[None, :])
        else:
            tl.store(dw_in + where, acc, mask=j_ok[:, None] & i_ok[None, :])
