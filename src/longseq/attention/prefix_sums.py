"""Kernelized (linear) attention from positive feature maps, bidirectional or causal.

Shared by ``performer`` and ``linear``. With features ``phi_q``, ``phi_k`` ``(B, H, L, F)`` and values
``v`` ``(B, H, L, D)`` the output is ``out_i = sum_j w_ij v_j`` with ``w_ij = phi_q_i . phi_k_j`` normalized
over the allowed keys (all keys, or ``j <= i`` when causal).

The normalizer rides along as an extra all-ones value column, so numerator and denominator come out of
the same matmuls. Causal attention uses a chunked prefix sum: inside a chunk of C positions the masked
``(C, C)`` kernel block is applied directly; across chunks only one running state ``sum_j phi_k_j v_j^T``
``(F, D+1)`` per chunk is kept (exclusive cumulative sum over chunks). Memory is
``O(L (C + F + D) + L/C * F * D)``; the ``(B, H, L, F, D)`` tensor of a naive cumulative sum never exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """Append the all-ones column that accumulates the normalizer: ``(B, H, L, D) -> (B, H, L, D+1)``."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)


def kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, query_shift: float = 0.0,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional normalized kernel attention, ``O(L F D)``: ``(B, H, L, F)`` x2, ``(B, H, L, D)`` -> ``(B, H, L, D)``.

    ``query_shift`` is added to every query feature, applied on the small state instead of on the
    ``(L, F)`` features (``(phi_q + s) S = phi_q S + s * sum_f S_f``). ``key_scale`` ``(B, H, L, 1)``
    multiplies every key's features, applied to the ``(L, D+1)`` values instead. Both save passes over
    the largest tensors.
    """
    values = _with_ones(v)
    if key_scale is not None:
        values = values * key_scale
    state = phi_k.transpose(-1, -2) @ values  # (B, H, F, D+1)
    out = phi_q @ state
    if query_shift:
        out = out + query_shift * state.sum(-2, keepdim=True)
    return out[..., :-1] / out[..., -1:]


def causal_kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64, query_shift: float = 0.0,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal normalized kernel attention through chunked prefix sums (see the module docstring).

    phi_q, phi_k: ``(B, H, L, F)`` positive features; v: ``(B, H, L, D)`` -> ``(B, H, L, D)``.
    ``query_shift``, ``key_scale``: as in ``kernel_attention``.
    Any L: the tail is zero-padded to a whole chunk (zero key features add nothing to any sum).
    """
    B, H, L, n_features = phi_q.shape
    C = max(1, min(chunk_size, L))
    pad = (-L) % C
    values = _with_ones(v)
    if key_scale is not None:
        values = values * key_scale
    if pad:
        phi_q, phi_k, values = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, values))
    n = (L + pad) // C
    fq, fk, vals = (x.view(B, H, n, C, x.shape[-1]) for x in (phi_q, phi_k, values))
    # earlier chunks: exclusive prefix sum of the per-chunk states (B, H, n, F, D+1)
    chunk_states = fk.transpose(-1, -2) @ vals
    before = chunk_states.cumsum(2) - chunk_states
    out = fq @ before
    # own chunk: masked (C, C) kernel block, keys up to and including the query
    within = fq @ fk.transpose(-1, -2)
    if query_shift:
        out = out + query_shift * before.sum(-2, keepdim=True)
        within = within + query_shift * fk.sum(-1).unsqueeze(-2)
    within = within.tril()  # the key scale rides on vals
    out = out + within @ vals
    out = out.view(B, H, n * C, -1)[:, :, :L]
    return out[..., :-1] / out[..., -1:]


def kernel_weights(
    phi_q: torch.Tensor, phi_k: torch.Tensor, causal: bool, query_shift: float = 0.0,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The normalized weights ``(B, H, L, L)`` that the two functions above apply (small L only)."""
    if key_scale is not None:
        phi_k = phi_k * key_scale
    weights = (phi_q + query_shift) @ phi_k.transpose(-1, -2)
    if causal:
        weights = weights.tril()
    return weights / weights.sum(-1, keepdim=True)
