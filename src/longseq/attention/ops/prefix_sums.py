"""Kernelized (linear) attention from positive feature maps, bidirectional or causal.

Shared by ``performer`` and ``linear``. With features ``phi_q``, ``phi_k`` ``(B, H, L, F)`` and values
``v`` ``(B, H, L, D)`` the output is ``out_i = sum_j w_ij v_j`` with ``w_ij = phi_q_i . phi_k_j`` normalized
over the allowed keys (all keys, or ``j <= i`` when causal).

The normalizer rides along as an extra all-ones value column, so numerator and denominator come out of
the same matmuls. Causal attention is chunked: inside a chunk of C positions the masked ``(C, C)`` kernel
block is applied directly (one batched GEMM over all chunks); across chunks ONE running state
``S = sum_j phi_k_j v_j^T`` ``(F, D+1)`` is carried from chunk to chunk (``_EarlierChunks``: a loop over the
L / C chunks, two ``(C, F) x (F, D+1)``-shaped GEMMs per chunk, hand-written backward that re-runs the
recurrence forwards and backwards). Memory is ``O(L (C + F + D) + F * D)``: neither the ``(B, H, L, F, D)``
tensor of a naive cumulative sum nor the ``(L / C, F, D)`` per-chunk prefix states exist (their cumulative
sum over chunks and its backward were the slowest part of the previous version on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.decoding import DecodingState
from longseq.attention.ops.masks import NEG_INF


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


@autocast_function
class _EarlierChunks(torch.autograd.Function):
    """Contribution of all earlier chunks: ``out[c] = fq[c] @ S_c`` with ``S_c = sum_{j < c} fk[j]^T vals[j]``.

    ``fq``, ``fk`` ``(N, n, C, F)``, ``vals`` ``(N, n, C, E)`` (N = batch x heads, n chunks of C) ->
    ``(N, n, C, E)``. One running state ``(N, F, E)``, updated in place (``baddbmm``); each chunk's product is
    written straight into a chunk-major buffer, so a chunk costs two GEMM calls forward and five backward.
    Half-precision inputs run in fp32 (a running sum over L positions). Backward:
    ``d fq[c] = dout[c] @ S_c^T`` (states re-run forwards) and, with ``dS_c = sum_{c' > c} fq[c']^T dout[c']``
    run backwards, ``d fk[c] = vals[c] @ dS_c^T``, ``d vals[c] = fk[c] @ dS_c``. Nothing of size
    ``n * F * E`` is ever stored.
    """

    @staticmethod
    def forward(ctx, fq, fk, vals):
        ctx.save_for_backward(fq, fk, vals)
        dtype = vals.dtype
        fq, fk, vals = (x.to(_accumulator(x.dtype)) for x in (fq, fk, vals))
        out = vals.new_empty(vals.shape[1], vals.shape[0], *vals.shape[2:])  # chunk-major (n, N, C, E)
        out[0] = 0
        for c, state in _running_states(fk, vals):
            torch.bmm(fq[:, c], state, out=out[c])
        return out.transpose(0, 1).to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        fq, fk, vals = (x.to(_accumulator(x.dtype)) for x in saved)
        grad_out = grad_out.to(vals.dtype)
        N, n, C, _ = fq.shape
        grad_fq = grad_fk = grad_vals = None
        if ctx.needs_input_grad[0]:
            grad_fq = fq.new_empty(n, N, C, fq.shape[-1])
            grad_fq[0] = 0
            for c, state in _running_states(fk, vals):
                torch.bmm(grad_out[:, c], state.transpose(-1, -2), out=grad_fq[c])
            grad_fq = grad_fq.transpose(0, 1).to(saved[0].dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_fk, grad_vals = fk.new_empty(n, N, C, fk.shape[-1]), vals.new_empty(n, N, C, vals.shape[-1])
            grad_fk[n - 1], grad_vals[n - 1] = 0, 0  # the last chunk feeds no later state
            grad_state = fq.new_zeros(N, fq.shape[-1], vals.shape[-1])  # sum over later chunks of fq^T dout
            for c in range(n - 2, -1, -1):
                grad_state.baddbmm_(fq[:, c + 1].transpose(-1, -2), grad_out[:, c + 1])
                torch.bmm(vals[:, c], grad_state.transpose(-1, -2), out=grad_fk[c])
                torch.bmm(fk[:, c], grad_state, out=grad_vals[c])
            grad_fk, grad_vals = grad_fk.transpose(0, 1).to(saved[1].dtype), grad_vals.transpose(0, 1).to(saved[2].dtype)
        return grad_fq, grad_fk, grad_vals


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (a running sum over L positions), else the input dtype."""
    return torch.promote_types(dtype, torch.float32)


def _running_states(fk: torch.Tensor, vals: torch.Tensor):
    """Yield ``(c, S_c)`` for chunks ``c = 1 .. n-1``, ``S_c = sum_{j < c} fk[j]^T vals[j]`` ``(N, F, E)``: ONE
    buffer updated in place, valid until the next step."""
    N, n, _, n_features = fk.shape
    state = fk.new_zeros(N, n_features, vals.shape[-1])
    for c in range(1, n):
        state.baddbmm_(fk[:, c - 1].transpose(-1, -2), vals[:, c - 1])
        yield c, state


def causal_kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64, query_shift: float = 0.0,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal normalized kernel attention, chunked (see the module docstring).

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
    fq, fk, vals = (x.reshape(B * H, n, C, x.shape[-1]) for x in (phi_q, phi_k, values))
    # own chunk: masked (C, C) kernel block, keys up to and including the query (the key scale rides on vals)
    # (in-place ops below act on fresh matmul outputs, which no backward needs)
    within = fq @ fk.transpose(-1, -2)  # (B*H, n, C, C)
    key_sums = fk.sum(-1, keepdim=True) if query_shift else None  # (B*H, n, C, 1): the shift's kernel term
    if query_shift:
        within += query_shift * key_sums.transpose(-1, -2)
    out = within.tril_() @ vals
    if n > 1:  # earlier chunks: one running (F, D+1) state
        out += _EarlierChunks.apply(fq, fk, vals)
        if query_shift:  # shift * sum_f S_c: exclusive prefix over chunks of the small (n, D+1) key-sum rows
            per_chunk = (key_sums * vals).sum(-2)  # (B*H, n, D+1)
            out += query_shift * (per_chunk.cumsum(1) - per_chunk).unsqueeze(-2)
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


@dataclass
class KernelSumsState(DecodingState):
    """Decoding state of causal kernel attention: the running ``S = sum_j phi_k_j [v_j, 1]^T`` ``(B, H, F, D+1)``
    (fp32 or wider), kept in units of ``exp(-log_offset)`` ``(B, H, 1, 1)`` when keys carry a log scale."""

    sums: torch.Tensor | None = None
    log_offset: torch.Tensor | None = None


def kernel_step(state: KernelSumsState, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                query_shift: float = 0.0, log_key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One causal position of normalized kernel attention: features ``(B, H, 1, F)``, ``v`` ``(B, H, 1, D)`` ->
    ``(B, H, 1, D)``; O(F D) per step, the same weights as ``causal_kernel_attention``.

    ``log_key_scale`` ``(B, H, 1, 1)``: the key's features are ``phi_k * exp(log_key_scale)`` (performer). The
    forward divides every key scale by one constant per (batch, head) that cancels in the normalization; here
    that constant is the running maximum, and the sums are rescaled when it grows (as an online softmax does).
    """
    t = state.reserve(phi_q, 1)
    values = _with_ones(v).to(_accumulator(v.dtype))
    if state.sums is None:
        B, H = phi_q.shape[:2]
        state.sums = values.new_zeros(B, H, phi_k.shape[-1], values.shape[-1])
        state.log_offset = values.new_full((B, H, 1, 1), NEG_INF)
    if log_key_scale is not None:
        offset = torch.maximum(state.log_offset, log_key_scale.to(values.dtype))
        state.sums.mul_(torch.exp(state.log_offset - offset))
        values = values * torch.exp(log_key_scale - offset)
        state.log_offset = offset
    state.sums.add_(phi_k.to(values.dtype).transpose(-1, -2) @ values)
    state.length = t + 1
    out = phi_q.to(values.dtype) @ state.sums
    if query_shift:
        out = out + query_shift * state.sums.sum(-2, keepdim=True)
    return (out[..., :-1] / out[..., -1:]).to(v.dtype)
