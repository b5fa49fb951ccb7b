"""The CPU engine's fused path of query-dependent block selection (``ops.block_select``: ``moba``, ``nsa``,
``combiner_select``): the (tile, keys) products as CPU flash calls whose log-sum-exp stays differentiable, so
parts computed apart still merge exactly by their log-sum-exps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.cpu.kernels import flash_attention, flash_attention_backward
from longseq.attention.ops.masks import NEG_INF


@autocast_function
class FlashLse(torch.autograd.Function):
    """``(out, lse)`` of one softmax per query row over its keys, by the fused CPU flash kernel, both differentiable
    (the kernel's own autograd drops the lse gradient, which merging parts by their log-sum-exps needs).

    Inputs are padded by ``pad_for_flash`` (one extra last column: 0 for q and k, 1 for v): q ``(N, h, T, D + 1)``,
    k, v ``(N, h, S, D + 1)`` with unit last stride (queries already scaled); ``mask`` additive float ``(N|1, h|1, T,
    S)`` (0 = may attend, -inf = not) or None; ``empty`` bool broadcastable to ``(N, h, T)``: rows without an allowed
    key (out 0, lse -inf), or None. Returns ``out`` ``(N, h, T, D)`` and ``lse`` ``(N, h, T)``.

    Why the padding: ``d lse_i / d s_ij = p_ij``, so the lse gradient g enters the one flash backward call as
    ``dO``'s value on the column of ones (``dP_ij += g_i``), whose output column is given as 0 (``D_i = dO_i . O_i``
    unchanged); the kernel wants one head size, hence the zero column of q and k (the logits do not change). Padding
    the sources before they are gathered avoids copying the large gathered tiles.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, empty, causal):
        out, lse = flash_attention(q, k, v, 0.0, causal, attn_mask=mask, scale=1.0)
        if empty is not None:
            lse = lse.masked_fill(empty, 0.0)  # finite for the backward kernel; those rows' p are all 0 anyway
        out[..., -1] = 0.0  # the row sums of p (the ones column): 0 for the backward (see above)
        result = out[..., :-1]  # a view: its values are not the column the line above sets
        ctx.save_for_backward(q, k, v, out, lse, mask, empty)
        ctx.causal = causal
        return result, lse if empty is None else lse.masked_fill(empty, NEG_INF)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, mask, empty = ctx.saved_tensors
        if empty is not None:
            grad_lse = grad_lse.masked_fill(empty, 0.0)
        grad = torch.cat([grad_out, grad_lse.unsqueeze(-1).to(grad_out.dtype)], -1)
        dq, dk, dv = flash_attention_backward(grad, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask, scale=1.0)
        return dq, dk, dv, None, None, None


@dataclass(frozen=True, eq=False)
class FlashInputs:
    """Scaled q, k and v padded once per forward for ``FlashLse`` (``pad_for_flash``), ``(B, H, L, D + 1)`` each: every
    flash call of that forward reads views or gathers of them (padding per call copied the inputs once per call)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    views: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> FlashInputs:
        return cls(pad_for_flash(qs, 0.0), pad_for_flash(k, 0.0), pad_for_flash(v, 1.0))

    def __iter__(self):
        return iter((self.q, self.k, self.v))

    def blocks(self, name: str, block_size: int, first: int, count: int) -> torch.Tensor:
        """Blocks ``first .. first + count`` of ``block_size`` rows of input ``name`` (q, k or v) for one flash call:
        every block as the batch, ``(B H n, 1, block_size, D + 1)``, the kernel's own layout for its outputs and
        gradients (as heads they were copied back); a range of blocks as heads, ``(B H, count, block_size, D + 1)``
        (a range is no batch axis of a view, and a shifted copy as batch measured no faster). One view per
        request: calls that share it (``nsa``'s selection and window on the block before) share its gradient
        scatter."""
        key = (name, block_size, first, count)
        if key not in self.views:
            x = getattr(self, name)
            B, H, L, D = x.shape
            n = L // block_size
            if (first, count) == (0, n):
                self.views[key] = x.view(B * H * n, 1, block_size, D)
            else:
                self.views[key] = x.view(B * H, n, block_size, D)[:, first : first + count]
        return self.views[key]


def pad_for_flash(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` ``(..., D)`` with one more last column of ``value`` (``FlashLse``: 0 for q and k, 1 for v)."""
    return torch.cat([x, x.new_full((*x.shape[:-1], 1), value)], -1)


def flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
              causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``FlashLse`` of padded q, k, v (``pad_for_flash``) ``(N, h, T|S, D + 1)`` from a bool ``allowed`` ``(N|1, h|1,
    T, S)`` (True = may attend) or None (every key): ``(out (N, h, T, D), lse (N, h, T))``. Several heads run as the
    batch (``(N h, 1, ...)`` views): the kernel lays its outputs and gradients out as (batch, rows, heads), so heads
    came back strided and their gradients were copied."""
    N, h = q.shape[:2]
    if h > 1 and all(_foldable(x) for x in (q, k, v)):  # (a range of blocks as heads is not: it stays heads)
        fold = lambda x: x.reshape(N * h, 1, *x.shape[2:])  # noqa: E731
        if allowed is not None and allowed.shape[:2] != (1, 1):
            allowed = fold(allowed.expand(N, h, *allowed.shape[2:]))
        out, lse = flash_lse(fold(q), fold(k), fold(v), allowed, causal)
        return out.view(N, h, *out.shape[2:]), lse.view(N, h, lse.shape[-1])
    if allowed is None:
        return FlashLse.apply(q, k, v, None, None, causal)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, NEG_INF)
    empty = ~allowed.any(-1)
    return FlashLse.apply(q, k, v, mask, empty if bool(empty.any()) else None, causal)


def _foldable(x: torch.Tensor) -> bool:
    """Whether ``x``'s first two axes merge into one without a copy."""
    return x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1)
