"""Exact joint softmax over several blocks of candidate keys, each kept in the layout its batched matmul
produces (shared by the axial family and ``strided``; the explicit path, any device).

- ``LogitGroup`` / ``joint_groups_attention`` (``_JointGroupsAttention``, explicit backward): any number of
  groups in row layout ``(B, H, n, m, w)`` or column layout ``(B, H, m, n, w)``, one shared max and sum, no
  ``(..., sum w)`` concatenation (the row/column case of ``combiner_axial`` is two groups).

The same joint softmaxes as fused CPU flash calls merged by log-sum-exps (``causal_row_column_flash``,
``grid_flash_attention``) are the CPU engine's: ``ops.cpu.grid_flash``.

Masks are allowed masks (True = may attend), like every mask of the package.
"""

from __future__ import annotations

import torch

from longseq.attention.ops.amp import autocast_function
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
