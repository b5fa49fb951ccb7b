"""Computation shared by several sparse patterns (one softmax per query over its keys, never an ``L x L`` tensor).

- index tables ``(L, K)`` of each query's keys, repeats removed so each key counts once (``logsparse``,
  ``random``);
- the two layouts of one grid: row-wise logits from a batched matmul on ``(B, H, n, m, D)`` and column-wise ones
  from the transposed layout (``column_part``), joined in one softmax (``softmax_over_parts``) (``axial``, ``strided``);
- ``matmul`` / ``contiguous_grad``: batched-matmul and SDPA outputs go through an identity whose backward makes
  the gradient contiguous, because CPU ``bmm`` backward on strided or zero-stride gradients is tens of times
  slower.
"""

from __future__ import annotations

import torch

from longseq.attention.base import Attention
from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.masks import NEG_INF


def dedupe_index_table(idx: torch.Tensor, valid: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row of an index table and invalidate repeated keys, so each key counts once.

    ``idx`` (L, K) long key positions, ``valid`` (L, K) bool -> the same shapes, rows sorted, invalid
    entries pointing at key 0 (any in-range index; they are masked).
    """
    keyed = torch.where(valid, idx, torch.full_like(idx, length))  # invalid sorts last
    keyed, _ = keyed.sort(dim=1)
    repeat = torch.zeros_like(valid)
    repeat[:, 1:] = keyed[:, 1:] == keyed[:, :-1]
    valid = (keyed < length) & ~repeat
    return torch.where(valid, keyed, torch.zeros_like(keyed)), valid


def softmax_over_parts(attn: Attention, logit_parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """One softmax over the concatenation of logit parts (last axis; masked entries are -inf), with ``attn``'s
    weight dropout, split back into the parts (the concatenating path; ``ops.joint_softmax`` keeps the parts
    apart where dropout is off)."""
    widths = [p.shape[-1] for p in logit_parts]
    weights = attn.weight_dropout(torch.cat(logit_parts, -1).softmax(-1))
    return [w.contiguous() for w in weights.split(widths, -1)]


@autocast_function
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    Applied to batched-matmul outputs: CPU ``bmm`` backward on a transposed or zero-stride gradient
    (e.g. from ``out.sum().backward()``) leaves BLAS and runs tens of times slower.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, its gradient made contiguous on the way back (see ``_ContiguousGrad``)."""
    return _ContiguousGrad.apply(x)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose gradient reaches ``bmm`` in a contiguous layout."""
    return contiguous_grad(a @ b)


def column_part(q_grid, k_grid, v_grid, mask: torch.Tensor):
    """Column-layout logits and the matching value map for an ``n x m`` grid.

    q_grid, k_grid, v_grid (B, H, n, m, D) (q already scaled); ``mask`` (n, n) bool over (query row, key
    row). Returns ``logits`` (B, H, n, m, n) — query (r, c) against key (r', c) — and ``apply(w)`` mapping
    weights of that shape to a (B, H, n, m, D) output. Transposed copies are made contiguous because
    CPU ``bmm`` on such strided views is orders of magnitude slower.
    """
    qc, kc, vc = (x.transpose(2, 3).contiguous() for x in (q_grid, k_grid, v_grid))  # (B, H, m, n, D)
    logits = matmul(qc, kc.transpose(-1, -2)).masked_fill(~mask, NEG_INF).transpose(2, 3).contiguous()

    def apply(weights: torch.Tensor) -> torch.Tensor:
        return matmul(weights.transpose(2, 3).contiguous(), vc).transpose(2, 3)

    return logits, apply
