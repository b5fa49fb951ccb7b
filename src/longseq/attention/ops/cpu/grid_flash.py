"""Joint softmax on the ``n x m`` grid as fused CPU flash-attention calls merged by their log-sum-exps (CPU engine).

- ``grid_flash_attention`` (``_GridFlash``): any number of ``FlashPart``s — each one fused CPU flash call over a
  window of the ``n x m`` grid, in row or column layout, causal and/or with an additive mask — merged by
  log-sum-exps; the pooled axial Combiners run their whole joint softmax on it.
- ``causal_row_column_flash``: its two-part case, own row causal + own column's earlier rows (``axial``, causal
  ``combiner_axial``). It had a Function of its own (``_CausalRowColumnFlash``, column operands copied into
  column layout); the general one takes transposed views instead and computes the same sums (equal to rounding:
  1 ulp in fp32, exact in bf16 on the tests' inputs); last wave's measurement found the general one faster on
  the row/column case (#22).

When they run is decided by ``ops.dispatch`` (the ``cpu_flash`` backend); the explicit paths they equal live in
``ops.joint_softmax`` and the variants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.cpu.kernels import flash_attention, flash_attention_backward

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
    softmax's gradient restricted to that part's keys; gradients are added
    into each operand's windows, no zero-filled full-size buffer per part. Every operand, output and gradient is
    handed to the kernels as a (transposed) view: no layout copies.

    Args: ``layouts`` (per tensor, "row"/"col"), ``parts`` (tuple of ``FlashPart``; the first covers the whole
    grid in row layout), ``scale``, then the tensors. Output: row layout ``(BH, n, m, Dv)``.
    """

    @staticmethod
    def forward(ctx, layouts, parts, scale, *tensors):
        outs, lses = [], []
        for part in parts:
            q, k, v = (_part_view(tensors[i], layouts[i], part.layout, window)
                       for i, window in zip(part.operands, (part.query_window, part.key_window, part.key_window)))
            mask = None if part.mask is None else part.mask.to(q.dtype)
            out, lse = flash_attention(q, k, v, 0.0, part.causal, attn_mask=mask, scale=scale)
            outs.append(out)
            lses.append(lse)
        lse = lses[0].clone(memory_format=torch.contiguous_format)  # (BH, n, m)
        for part, part_lse in zip(parts[1:], lses[1:]):
            joint = _window(lse, "row", part.query_window)
            # copy_ rather than out= a strided window: torch.compile traces it (out= breaks the graph); the temporary
            # is one log-sum-exp row per query (1 / D of the output)
            joint.copy_(torch.logaddexp(joint, _as_row(part_lse, part.layout)))
        out = outs[0].mul_((lses[0] - lse).exp_().unsqueeze(-1))
        for part, part_out, part_lse in zip(parts[1:], outs[1:], lses[1:]):
            weight = (_as_row(part_lse, part.layout) - _window(lse, "row", part.query_window)).exp_()
            _window(out, "row", part.query_window).addcmul_(_as_row(part_out, part.layout), weight.unsqueeze(-1))
        ctx.layouts, ctx.parts, ctx.scale = layouts, parts, scale
        ctx.save_for_backward(out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
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
            part_grads = flash_attention_backward(grad_o, q, k, v, o, part_lse, 0.0, part.causal, attn_mask=mask, scale=ctx.scale)
            for i, window, grad in zip(part.operands, (part.query_window, part.key_window, part.key_window), part_grads):
                accumulate(i, part.layout, window, grad)
        return (None, None, None, *grads)


def grid_flash_attention(parts: list[FlashPart], tensors: list[torch.Tensor], layouts: list[str],
                         scale: float) -> torch.Tensor:
    """One exact softmax per query over the keys of every ``FlashPart`` -> row layout ``(BH, n, m, Dv)``.

    ``tensors``: grid tensors, each ``(BH, n, m, D)`` (``layouts[i] == "row"``) or ``(BH, m, n, D)`` ("col");
    q is NOT scaled (``scale`` is passed to the kernels). The first part must cover the whole grid in row layout
    (the own-row direct part: every query has itself there). CPU only, one head size for q, k and v (``ops.dispatch``
    checks).
    """
    first = parts[0]
    n, m = tensors[first.operands[0]].shape[1:3]
    if first.layout != "row" or first.query_window != (0, n, 0, m):
        raise ValueError("grid_flash_attention: the first part must cover the whole grid in row layout")
    return _GridFlash.apply(tuple(layouts), tuple(parts), scale, *tensors)


def causal_row_column_flash(qr, kr, vr, column_k, column_v) -> torch.Tensor:
    """One causal softmax per query ``(r, c)`` over its own row (``c' <= c``) and, from its own column, the
    entries ``(r', c)`` of ``column_k, column_v`` for every earlier row ``r' < r``.

    Row layouts ``(B, H, n, m, D)`` in and out, q NOT scaled. Row-major Combiner passes the row summaries
    as the column entries, sparse ``axial`` the raw keys and values. Two ``FlashPart``s of ``grid_flash_attention``:
    the own row (row layout, causal) and the column entries of the earlier rows (column layout, rows shifted by
    one: row r may use r' <= r - 1, plain ``is_causal``), merged by their log-sum-exps. CPU, at least two rows,
    one head size for q, k and v (``ops.dispatch`` checks).
    """
    B, H, n, m, D = qr.shape
    tensors = [x.reshape(B * H, n, m, D) for x in (qr, kr, vr, column_k, column_v)]
    parts = [FlashPart("row", (0, n, 0, m), (0, n, 0, m), (0, 1, 2), causal=True),
             FlashPart("col", (1, n, 0, m), (0, n - 1, 0, m), (0, 3, 4), causal=True)]
    return grid_flash_attention(parts, tensors, ["row"] * 5, 1.0 / math.sqrt(D)).view(B, H, n, m, D)
