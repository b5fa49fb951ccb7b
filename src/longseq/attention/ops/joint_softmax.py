"""Exact joint softmax over several blocks of candidate keys, each kept in the layout its batched matmul
produces, and the flash merge of two causal blocks (shared by the axial family, ``strided`` and ``axial``).

- ``LogitGroup`` / ``joint_groups_attention`` (``_JointGroupsAttention``, explicit backward): any number of
  groups in row layout ``(B, H, n, m, w)`` or column layout ``(B, H, m, n, w)``, one shared max and sum, no
  ``(..., sum w)`` concatenation (the row/column case of ``combiner_axial`` is two groups).
- ``causal_row_column_flash`` (``_CausalRowColumnFlash``): own row causal + own column's earlier rows as two
  fused CPU flash-attention calls merged exactly by their log-sum-exps.
- ``grid_flash_attention`` (``_GridFlash``): the general form of that merge, any number of ``FlashPart``s — each
  one fused CPU flash call over a window of the ``n x m`` grid, in row or column layout, causal and/or with an
  additive mask — merged by log-sum-exps; the pooled axial Combiners run their whole joint softmax on it.

Masks are allowed masks (True = may attend), like every mask of the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longseq.attention.ops.amp import autocast_dtype, autocast_function
from longseq.attention.ops.masks import NEG_INF


class LogitGroup:
    """One block of candidate keys for every query, with the values its weights apply to.

    ``layout="row"``: keys/values ``(B, H, n, w, D)`` shared by the queries of a row, mask
    broadcastable to ``(n, m, w)``. ``layout="col"``: keys/values ``(B, H, m, w, D)`` shared by the
    queries of a column, mask broadcastable to ``(m, n, w)``. ``logits`` come out in the row layout
    ``(B, H, n, m, w)`` so all groups concatenate on the last axis.

    Under key padding masks carry a leading batch axis (``(B, 1, ...)``), and a direct group keeps its
    unpadded mask as ``fallback``: the keys a query with nothing else to attend to falls back to.
    """

    def __init__(self, layout: str, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                 fallback: torch.Tensor | None = None):
        # Contiguous operands: CPU bmm over strided batches copies matrix by matrix.
        self.layout, self.keys, self.values, self.mask = layout, keys.contiguous(), values.contiguous(), mask
        self.fallback = fallback
        self.width = keys.shape[-2]

    def has_key(self) -> torch.Tensor:
        """Row-layout ``(..., n, m)`` bool: the query has at least one allowed key in this group."""
        any_key = self.mask.any(-1)
        return any_key if self.layout == "row" else any_key.transpose(-1, -2)

    def logits(self, q_row: torch.Tensor, q_col: torch.Tensor) -> torch.Tensor:
        q = q_row if self.layout == "row" else q_col
        logits = q @ self.keys.transpose(-1, -2)
        if self.mask is not None:
            logits = logits.masked_fill(~self.mask, NEG_INF)
        return logits if self.layout == "row" else logits.transpose(2, 3)

    def apply(self, weights: torch.Tensor) -> torch.Tensor:
        """Row-layout weights ``(B, H, n, m, w)`` -> output ``(B, H, n, m, D)``."""
        if self.layout == "row":
            return weights.contiguous() @ self.values
        return (weights.transpose(2, 3).contiguous() @ self.values).transpose(2, 3)


@autocast_function
class _JointGroupsAttention(torch.autograd.Function):
    """Exact joint softmax over several ``LogitGroup``s, each kept in its own layout.

    The groups share one max and one normaliser (``w = exp(s - M) / Z`` with ``M``, ``Z`` over all
    groups), so no ``(..., 3n + 2m)`` concatenation, split or transposed logit copy is made; logits
    are exponentiated in place and every bmm operand is contiguous or a last-two-axes transpose.

    Args: ``layouts`` (tuple of "row"/"col"), ``masks`` (allowed masks or None, per group),
    ``keep_weights`` (False for inference: nothing will call backward), ``q_row`` ``(B, H, n, m, D)``,
    ``q_col`` ``(B, H, m, n, D)`` (scaled), then ``k_0, v_0, k_1, ...``. Output ``(B, H, n, m, Dv)`` (row layout).

    Inference (``keep_weights=False``) applies the unnormalized ``exp(s - M)`` and divides the
    ``(n, m, Dv)`` output by ``Z`` once, instead of normalizing every ``(n, m, w)`` weight block that only
    backward needs; nothing is saved.
    """

    @staticmethod
    def forward(ctx, layouts, masks, keep_weights, q_row, q_col, *keys_values):
        weights, top = [], None
        for layout, mask, keys in zip(layouts, masks, keys_values[0::2]):
            logits = (q_row if layout == "row" else q_col) @ keys.transpose(-1, -2)
            if mask is not None:
                logits.masked_fill_(~mask, NEG_INF)
            group_top = logits.amax(-1) if layout == "row" else logits.amax(-1).transpose(-1, -2)  # (B,H,n,m)
            top = group_top if top is None else torch.maximum(top, group_top)
            weights.append(logits)
        total = None
        for layout, w in zip(layouts, weights):  # the direct part holds self, so ``top`` is finite
            w.sub_((top if layout == "row" else top.transpose(-1, -2)).unsqueeze(-1)).exp_()
            group_sum = w.sum(-1) if layout == "row" else w.sum(-1).transpose(-1, -2)
            total = group_sum if total is None else total + group_sum
        inv_total = total.reciprocal_()
        out = None
        for layout, w, values in zip(layouts, weights, keys_values[1::2]):
            if keep_weights:
                w.mul_((inv_total if layout == "row" else inv_total.transpose(-1, -2)).unsqueeze(-1))
            part = w @ values if layout == "row" else (w @ values).transpose(2, 3)
            out = part.clone(memory_format=torch.contiguous_format) if out is None else out.add_(part)
        if not keep_weights:
            return out.mul_(inv_total.unsqueeze(-1))
        ctx.layouts = layouts
        ctx.save_for_backward(q_row, q_col, out, *keys_values, *weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layouts = ctx.layouts
        q_row, q_col, out, *rest = ctx.saved_tensors
        keys_values, weights = rest[: 2 * len(layouts)], rest[2 * len(layouts) :]
        grad_row = grad_out.contiguous()  # zero-stride or transposed grads would push bmm off BLAS
        grad_col = grad_row.transpose(2, 3).contiguous() if "col" in layouts else None
        row_dot = (grad_row * out).sum(-1)  # (B,H,n,m): <dO, out> of the softmax backward
        grad_q = {"row": None, "col": None}
        grad_kv = []
        for layout, w, keys, values in zip(layouts, weights, keys_values[0::2], keys_values[1::2]):
            grad_o = grad_row if layout == "row" else grad_col
            dot = row_dot if layout == "row" else row_dot.transpose(-1, -2)
            grad_values = w.transpose(-1, -2) @ grad_o
            grad_logits = (grad_o @ values.transpose(-1, -2)).sub_(dot.unsqueeze(-1)).mul_(w)
            part = grad_logits @ keys
            grad_q[layout] = part if grad_q[layout] is None else grad_q[layout].add_(part)
            grad_kv += [grad_logits.transpose(-1, -2) @ (q_row if layout == "row" else q_col), grad_values]
        return None, None, None, grad_q["row"], grad_q["col"], *grad_kv


def with_padding_fallback(groups: list[LogitGroup]) -> list[LogitGroup]:
    """The groups of one joint softmax, with queries left without any allowed key (only padded queries
    can be: a real query always has itself) falling back to their unpadded direct keys, so no row is NaN."""
    has_key = None
    for group in groups:
        has_key = group.has_key() if has_key is None else has_key | group.has_key()
    empty = ~has_key  # (B, 1, n, m)
    out = []
    for g in groups:
        if g.fallback is None:
            out.append(g)
            continue
        empty_here = (empty if g.layout == "row" else empty.transpose(-1, -2)).unsqueeze(-1)
        out.append(LogitGroup(g.layout, g.keys, g.values, g.mask | (empty_here & g.fallback)))
    return out


def joint_groups_attention(groups: list[LogitGroup], q_row: torch.Tensor, q_col: torch.Tensor) -> torch.Tensor:
    """Dropout-free joint softmax over ``groups`` -> ``(B, H, n, m, Dv)``; q_row/q_col scaled, see ``LogitGroup``.

    Without autograd (``torch.no_grad``/``inference_mode``, or no input that requires grad) it takes the
    inference path of ``_JointGroupsAttention`` (the same result, without the backward's bookkeeping).
    """
    layouts, masks = tuple(g.layout for g in groups), tuple(g.mask for g in groups)
    tensors = [q_row, q_col, *[x for g in groups for x in (g.keys, g.values)]]
    keep_weights = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return _JointGroupsAttention.apply(layouts, masks, keep_weights, *tensors)


@autocast_function
class _CausalRowColumnFlash(torch.autograd.Function):
    """Causal joint softmax from two fused CPU flash-attention calls merged by their log-sum-exps.

    Own-row keys (causal inside the row) and the summaries of strictly earlier rows seen from the
    query's column are two causal attentions: rows folded into heads ``(BH, n, m, D)``, and columns
    folded into heads ``(BH, m, n - 1, D)`` with queries of rows ``1..n-1`` against summaries of rows
    ``0..n-2`` (row r may use r' < r, i.e. ``r' <= r - 1``: plain ``is_causal``). The two parts are
    merged exactly by their log-sum-exps; the backward calls the flash backward of each part with the
    JOINT output and log-sum-exp, which is exactly the joint softmax's gradient restricted to that
    part. CPU only (the ``_for_cpu`` kernels return the log-sum-exp that public SDPA hides).

    Inputs: ``q_row, k_row, v_row`` ``(BH, n, m, D)`` (q unscaled, ``scale`` = 1/sqrt(D));
    ``q_col`` ``(BH, m, n - 1, D)`` (queries of rows >= 1); ``sk_col, sv_col`` ``(BH, m, n - 1, D)``
    (summaries of rows <= n - 2). Output ``(BH, n, m, D)``.
    """

    @staticmethod
    def forward(ctx, q_row, k_row, v_row, q_col, sk_col, sv_col, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_direct, lse_direct = flash(q_row, k_row, v_row, 0.0, True, scale=scale)  # lse (BH, n, m)
        out_summary, lse_summary = flash(q_col, sk_col, sv_col, 0.0, True, scale=scale)  # lse (BH, m, n-1)
        lse_summary = lse_summary.transpose(1, 2)  # (BH, n-1[r>=1], m)
        lse = lse_direct.clone()
        lse[:, 1:] = torch.logaddexp(lse_direct[:, 1:], lse_summary)
        out = out_direct.mul_((lse_direct - lse).exp_().unsqueeze(-1))
        out[:, 1:] += out_summary.transpose(1, 2) * (lse_summary - lse[:, 1:]).exp_().unsqueeze(-1)
        ctx.save_for_backward(q_row, k_row, v_row, q_col, sk_col, sv_col, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_row, k_row, v_row, q_col, sk_col, sv_col, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        grads_row = flash_backward(grad_out, q_row, k_row, v_row, out, lse, 0.0, True, scale=ctx.scale)
        in_columns = [x[:, 1:].transpose(1, 2).contiguous() for x in (grad_out, out, lse.unsqueeze(-1))]
        grads_col = flash_backward(
            in_columns[0], q_col, sk_col, sv_col, in_columns[1], in_columns[2].squeeze(-1), 0.0, True, scale=ctx.scale
        )
        return (*grads_row, *grads_col, None)


def flash_row_column_applies(qr: torch.Tensor, vr: torch.Tensor) -> bool:
    """Whether ``causal_row_column_flash`` can run: CPU kernels, at least two rows, and one head size for
    q, k and v (tests probe with v = identity)."""
    return qr.device.type == "cpu" and qr.shape[2] > 1 and vr.shape[-1] == qr.shape[-1]


def causal_row_column_flash(qr, kr, vr, column_k, column_v) -> torch.Tensor:
    """One causal softmax per query ``(r, c)`` over its own row (``c' <= c``) and, from its own column, the
    entries ``(r', c)`` of ``column_k, column_v`` for every earlier row ``r' < r``.

    Row layouts ``(B, H, n, m, D)`` in and out, q NOT scaled. Row-major Combiner passes the row summaries
    as the column entries, sparse ``axial`` the raw keys and values. Two fused flash calls
    (``_CausalRowColumnFlash``); see ``flash_row_column_applies`` for when it runs.
    """
    B, H, n, m, D = qr.shape
    rows4 = [x.reshape(B * H, n, m, D) for x in (qr, kr, vr)]
    q_col, k_col, v_col = (  # (B*H, m, n-1, D): queries of rows >= 1, column entries of rows <= n-2
        x[:, :, rows].transpose(2, 3).reshape(B * H, m, n - 1, D)  # one copy into column layout
        for x, rows in ((qr, slice(1, None)), (column_k, slice(None, -1)), (column_v, slice(None, -1)))
    )
    out = _CausalRowColumnFlash.apply(*rows4, q_col, k_col, v_col, 1.0 / math.sqrt(D))
    return out.view(B, H, n, m, D)


# ------------------------------------------------------------------------------------------------
# Joint softmax as fused flash calls on windows of the grid.
# ------------------------------------------------------------------------------------------------
Window = tuple[int, int, int, int]  # (first row, end row, first column, end column) of the n x m grid


@dataclass(frozen=True)
class FlashPart:
    """One block of candidate keys of a joint softmax on the ``n x m`` grid, run as ONE fused CPU flash call.

    ``layout="row"``: every sequence is a grid row — the queries of ``query_window``'s k-th row attend the keys
    of ``key_window``'s k-th row (equal row counts), positions along the columns. ``layout="col"``: every
    sequence is a grid column, paired column for column, positions along the rows. ``operands``: indices of
    q, k, v among the tensors given to ``grid_flash_attention``. ``causal`` (the flash kernel's: the i-th
    query of a sequence may use its keys 0..i) and ``mask`` (additive float, broadcastable to (queries, keys)
    of one sequence, shared by all sequences) select the keys; every query must keep at least one.
    """

    layout: str
    query_window: Window
    key_window: Window
    operands: tuple[int, int, int]
    causal: bool = False
    mask: torch.Tensor | None = None


def _window(x: torch.Tensor, layout: str, window: Window) -> torch.Tensor:
    """The view of ``window`` in grid tensor ``x`` stored in ``layout``: row ``(BH, n, m, ·)`` or column ``(BH, m, n, ·)``."""
    r0, r1, c0, c1 = window
    return x[:, r0:r1, c0:c1] if layout == "row" else x[:, c0:c1, r0:r1]


def _part_view(x: torch.Tensor, stored: str, layout: str, window: Window) -> torch.Tensor:
    """``window`` of ``x`` (stored in layout ``stored``) seen in a part's ``layout``: a view, never a copy. The CPU
    flash kernels take any strides with a unit last one; transposed inputs measured as fast as contiguous."""
    view = _window(x, stored, window)
    return view if stored == layout else view.transpose(1, 2)


def _as_row(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A part's result ``(BH, sequences, positions, ...)`` as a row-layout window (a view)."""
    return x if layout == "row" else x.transpose(1, 2)


def _zero_outside(x: torch.Tensor, layout: str, window: Window) -> None:
    """Zero every entry of grid tensor ``x`` (stored in ``layout``) outside ``window``."""
    a0, a1, s0, s1 = window if layout == "row" else (window[2], window[3], window[0], window[1])
    x[:, :a0].zero_()
    x[:, a1:].zero_()
    x[:, a0:a1, :s0].zero_()
    x[:, a0:a1, s1:].zero_()


@autocast_function
class _GridFlash(torch.autograd.Function):
    """Exact joint softmax of several ``FlashPart``s merged by their log-sum-exps (see ``grid_flash_attention``).

    Forward: one flash call per part (its output and log-sum-exp per query), then the joint log-sum-exp
    ``lse = log sum_p exp(lse_p)`` and ``out = sum_p exp(lse_p - lse) out_p`` on each part's query window.
    Backward: each part's flash backward with the JOINT output and log-sum-exp, which is exactly the joint
    softmax's gradient restricted to that part's keys (as in ``_CausalRowColumnFlash``); gradients are added
    into each operand's windows, no zero-filled full-size buffer per part. Every operand, output and gradient is
    handed to the kernels as a (transposed) view: no layout copies.

    Args: ``layouts`` (per tensor, "row"/"col"), ``parts`` (tuple of ``FlashPart``; the first covers the whole
    grid in row layout), ``scale``, then the tensors. Output: row layout ``(BH, n, m, Dv)``.
    """

    @staticmethod
    def forward(ctx, layouts, parts, scale, *tensors):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        outs, lses = [], []
        for part in parts:
            q, k, v = (_part_view(tensors[i], layouts[i], part.layout, window)
                       for i, window in zip(part.operands, (part.query_window, part.key_window, part.key_window)))
            mask = None if part.mask is None else part.mask.to(q.dtype)
            out, lse = flash(q, k, v, 0.0, part.causal, attn_mask=mask, scale=scale)
            outs.append(out)
            lses.append(lse)
        lse = lses[0].clone(memory_format=torch.contiguous_format)  # (BH, n, m)
        for part, part_lse in zip(parts[1:], lses[1:]):
            joint = _window(lse, "row", part.query_window)
            torch.logaddexp(joint, _as_row(part_lse, part.layout), out=joint)
        out = outs[0].mul_((lses[0] - lse).exp_().unsqueeze(-1))
        for part, part_out, part_lse in zip(parts[1:], outs[1:], lses[1:]):
            weight = (_as_row(part_lse, part.layout) - _window(lse, "row", part.query_window)).exp_()
            _window(out, "row", part.query_window).addcmul_(_as_row(part_out, part.layout), weight.unsqueeze(-1))
        ctx.layouts, ctx.parts, ctx.scale = layouts, parts, scale
        ctx.save_for_backward(out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        out, lse, *tensors = ctx.saved_tensors
        layouts = ctx.layouts
        grads = [None] * len(tensors)

        def accumulate(index: int, layout: str, window: Window, grad: torch.Tensor) -> None:
            grad = grad if layout == layouts[index] else grad.transpose(1, 2)  # now in the operand's layout
            if grads[index] is None and grad.shape == tensors[index].shape:
                grads[index] = grad
            elif grads[index] is None:
                grads[index] = torch.empty_like(tensors[index], memory_format=torch.contiguous_format)
                _zero_outside(grads[index], layouts[index], window)
                _window(grads[index], layouts[index], window).copy_(grad)
            else:
                _window(grads[index], layouts[index], window).add_(grad)

        for part in ctx.parts:
            q, k, v = (_part_view(tensors[i], layouts[i], part.layout, window)
                       for i, window in zip(part.operands, (part.query_window, part.key_window, part.key_window)))
            grad_o, o, part_lse = (_part_view(x, "row", part.layout, part.query_window) for x in (grad_out, out, lse))
            mask = None if part.mask is None else part.mask.to(q.dtype)
            part_grads = flash_backward(grad_o, q, k, v, o, part_lse, 0.0, part.causal, attn_mask=mask, scale=ctx.scale)
            for i, window, grad in zip(part.operands, (part.query_window, part.key_window, part.key_window), part_grads):
                accumulate(i, part.layout, window, grad)
        return (None, None, None, *grads)


def grid_flash_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``grid_flash_attention`` should run: CPU flash kernels, one head size for q, k and v (tests probe the
    weights with v = identity), and no half-precision training — the CPU flash backward in bf16 measured about
    twice its fp32 time (74 vs 38 ms per 128 x 128 part, B*H = 2, n = 128, D = 64), slower than the explicit
    joint softmax whose batched matmuls bf16 speeds up; in bf16 inference the flash path stays the faster one."""
    if q.device.type != "cpu" or v.shape[-1] != q.shape[-1]:
        return False
    dtype = autocast_dtype(q) or q.dtype
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return not (training and dtype in (torch.bfloat16, torch.float16))


def grid_flash_attention(parts: list[FlashPart], tensors: list[torch.Tensor], layouts: list[str],
                         scale: float) -> torch.Tensor:
    """One exact softmax per query over the keys of every ``FlashPart`` -> row layout ``(BH, n, m, Dv)``.

    ``tensors``: grid tensors, each ``(BH, n, m, D)`` (``layouts[i] == "row"``) or ``(BH, m, n, D)`` ("col");
    q is NOT scaled (``scale`` is passed to the kernels). The first part must cover the whole grid in row layout
    (the own-row direct part: every query has itself there). CPU only (``grid_flash_applies``).
    """
    first = parts[0]
    n, m = tensors[first.operands[0]].shape[1:3]
    if first.layout != "row" or first.query_window != (0, n, 0, m):
        raise ValueError("grid_flash_attention: the first part must cover the whole grid in row layout")
    return _GridFlash.apply(tuple(layouts), tuple(parts), scale, *tensors)
