"""Kernelized (linear) attention from positive feature maps, bidirectional or causal.

Shared by ``performer`` and ``linear``. With features ``phi_q``, ``phi_k`` ``(B, H, L, F)`` and values
``v`` ``(B, H, L, D)`` the output is ``out_i = sum_j w_ij v_j`` with ``w_ij = phi_q_i . phi_k_j`` normalized
over the allowed keys (all keys, or ``j <= i`` when causal). The normalizer rides along as an extra all-ones
value column, so numerator and denominator come out of the same matmuls.

Causal attention (``causal_kernel_attention``) is chunked and tiled. Inside a chunk of C positions the
masked ``(C, C)`` kernel block ``tril(fq fk^T)`` is applied directly; all earlier chunks enter through the
state ``P = sum fk^T [v, 1]`` ``(F, D+1)`` of the keys before the chunk: per-chunk states from ONE batched
GEMM, an in-place prefix sum over chunks, then ONE batched GEMM ``fq_c P_{c-1}``. A tile is S positions (a
multiple of C) of all batch x heads at once; tiles run one after another and carry ``P`` from tile to tile,
backward runs them in reverse and carries ``sum fq^T d out``. The feature maps (``KernelFeatures``) run
inside the tiles, so the ``(L, F)`` features never exist whole: backward recomputes them per tile. Saved for
backward: q, k, v, the output, the normalizer, the kernel blocks ``(L, C)`` (recomputing them is a GEMM over
``(L, F)``) and one state per tile. Key features with a log scale (performer) are kept in units of the
running maximum log scale, as an online softmax does: the constant cancels in the normalization.

Why tiles: an untiled version spent its time in about a thousand tiny ``bmm`` calls and in page faults on fresh
``(B, H, L, F)`` temporaries; tile-sized ones (``TILE_ROWS``) come back from the allocator's free lists and stay in
cache (measured: docs/cpu_engine_measurements.md, *prefix_sums*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (sums over up to L positions), else the input dtype."""
    return torch.promote_types(dtype, torch.float32)


class KernelFeatures:
    """The feature maps of causal kernel attention, applied tile by tile inside ``causal_kernel_attention``.

    Every method takes and returns plain tensors (no autograd) of rows ``(..., T, .)`` in one dtype (tiles
    ``(B*H, T, .)`` in the accumulator dtype) and never writes to its arguments: ``query(q) -> phi (.., T, F)``,
    ``key(k) -> (phi (.., T, F), log scale (.., T, 1) or None)`` (a key's features are ``phi * exp(log
    scale)``), and their vector-Jacobian products. This base class is the identity: its inputs already are
    the features. ``query_features`` / ``key_features`` apply a map with autograd (bidirectional attention,
    ``attention_matrix``, decoding), so each map is written once.
    """

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def query_grad(self, q: torch.Tensor, phi: torch.Tensor, grad_phi: torch.Tensor) -> torch.Tensor:
        return grad_phi

    def key(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return k, None

    def key_grad(self, k: torch.Tensor, phi: torch.Tensor, grad_phi: torch.Tensor,
                 grad_log_scale: torch.Tensor | None) -> torch.Tensor:
        return grad_phi


GIVEN_FEATURES = KernelFeatures()


@autocast_function
class _MappedQueries(torch.autograd.Function):
    """``features.query`` with autograd, on queries ``(..., T, D)`` (bidirectional, ``attention_matrix``)."""

    @staticmethod
    def forward(ctx, features, q):
        phi = features.query(q)
        ctx.features = features
        ctx.save_for_backward(q, phi)
        return phi

    @staticmethod
    def backward(ctx, grad_phi):
        q, phi = ctx.saved_tensors
        return None, ctx.features.query_grad(q, phi, grad_phi.contiguous())


@autocast_function
class _MappedKeys(torch.autograd.Function):
    """``features.key`` with autograd, on keys ``(..., T, D)``: ``(phi, log scale or None)``."""

    @staticmethod
    def forward(ctx, features, k):
        phi, log_scale = features.key(k)
        ctx.features = features
        ctx.save_for_backward(k, phi)
        return phi, log_scale

    @staticmethod
    def backward(ctx, grad_phi, grad_log_scale):
        k, phi = ctx.saved_tensors
        if grad_log_scale is not None:
            grad_log_scale = grad_log_scale.contiguous()
        return None, ctx.features.key_grad(k, phi, grad_phi.contiguous(), grad_log_scale)


def query_features(features: KernelFeatures, q: torch.Tensor) -> torch.Tensor:
    """Differentiable ``features.query(q)`` ``(..., T, D) -> (..., T, F)``."""
    return _MappedQueries.apply(features, q)


def key_features(features: KernelFeatures, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable ``features.key(k)``: ``(..., T, D) -> ((..., T, F), (..., T, 1) or None)``."""
    return _MappedKeys.apply(features, k)


# Rows (positions x heads) per tile on CPU: tiles this small keep every chunk-level temporary (features,
# (C, C) blocks, per-chunk states) in cache and take it back from the allocator's free lists, while a fresh
# 32 MB tensor costs about as much in page faults (first touch of mmap'ed memory) as a 64^3-shaped batched
# GEMM over all of it. 2048 measured fastest for linear and performer (L=16384, B x H = 8: 1024-8192 within
# 15%). Other devices (caching allocators, launch-bound) take large tiles.
TILE_ROWS = 2048
TILE_ROWS_ACCELERATOR = 2**20


def _tile_length(N: int, L: int, C: int, device: torch.device) -> int:
    """Positions per tile: a multiple of C, all N = B x H heads batched, about ``TILE_ROWS`` rows."""
    rows = TILE_ROWS if device.type == "cpu" else TILE_ROWS_ACCELERATOR
    return min(max(1, rows // (N * C)) * C, -(-L // C) * C)


def _rows(x: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Positions ``start:stop`` of ``(B, H, L, W)`` as ``(B*H, T, W)`` in ``dtype`` (a view when it can be)."""
    return x[:, :, start:stop].flatten(0, 1).to(dtype)


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous ``(N, length, W)``: ``x`` ``(N, T, W)`` followed by zero rows."""
    if x.shape[1] == length:
        return x.contiguous()
    out = x.new_zeros(x.shape[0], length, x.shape[2])
    out[:, : x.shape[1]] = x
    return out


def _scan_chunks_(x: torch.Tensor, reverse: bool = False) -> None:
    """In place: inclusive prefix sums of ``(N, n, ...)`` over the chunk dimension 1 (suffix sums if ``reverse``).

    Whole-chunk adds rather than ``torch.cumsum``, which walks a non-last dimension one element's column at
    a time: 158 ms against 8 ms for an (8, 256, 256 x 65) fp32 tensor (one thread)."""
    n = x.shape[1]
    for c in range(n - 2, -1, -1) if reverse else range(1, n):
        x[:, c] += x[:, c + 1 if reverse else c - 1]


def _states_before(fk_c: torch.Tensor, vals_c: torch.Tensor, carry: torch.Tensor | None, N: int):
    """For the ``(N n)`` flattened chunks of one tile: ``states`` ``(N n, F, E)`` with ``states[i - 1]`` the state
    ``sum fk^T vals`` of everything before chunk ``i`` (``i >= 1``; chunk 0 sees ``carry[0]``), and the state
    after the tile's last chunk per head ``(N, F, E)`` (the next tile's carry).

    Inclusive prefix sums over each head's chunks, then each head's last slot, needed by no later chunk
    of that head, holds the carry of the next head: so ONE batched GEMM ``fq[1:] @ states[:-1]`` serves
    every chunk, head boundaries included.
    """
    states = torch.bmm(fk_c.transpose(1, 2), vals_c)
    per_head = states.view(N, -1, *states.shape[1:])
    if carry is not None:
        per_head[:, 0] += carry
    _scan_chunks_(per_head)
    after = per_head[:, -1].clone()
    per_head[:-1, -1] = 0 if carry is None else carry[1:]
    return states, after


def _states_after(fq_c: torch.Tensor, grads_c: torch.Tensor, later: torch.Tensor | None, N: int):
    """The mirror image of ``_states_before`` for backward: ``suffix[i + 1]`` is ``sum fq^T grads`` over
    everything after chunk ``i`` (the last chunk sees ``later[-1]``), and the sum over the whole tile and
    ``later`` per head ``(N, F, E)`` (for the tile before)."""
    suffix = torch.bmm(fq_c.transpose(1, 2), grads_c)
    per_head = suffix.view(N, -1, *suffix.shape[1:])
    if later is not None:
        per_head[:, -1] += later
    _scan_chunks_(per_head, reverse=True)
    before = per_head[:, 0].clone()
    per_head[1:, 0] = 0 if later is None else later[:-1]
    return suffix, before


def _tile_forward(fq, fk, vals, carry, C: int, blocks: torch.Tensor | None):
    """Unnormalized ``out = [num, den]`` ``(N, T, E)`` of one tile (T a multiple of C) and the carry after it;
    the tile's masked kernel blocks ``tril(fq fk^T)`` go to ``blocks`` ``(N T / C, C, C)`` when given."""
    N, T, _ = fq.shape
    fq_c, fk_c, vals_c = (x.view(-1, C, x.shape[-1]) for x in (fq, fk, vals))
    out = torch.bmm(torch.bmm(fq_c, fk_c.transpose(1, 2), out=blocks).tril_(), vals_c)
    states, after = _states_before(fk_c, vals_c, carry, N)
    out[1:].baddbmm_(fq_c[1:], states[:-1])
    if carry is not None:
        out[0].addmm_(fq_c[0], carry[0])
    return out.view(N, T, -1), after


def _tile_backward(fq, fk, vals, grads, blocks, carry, later, C: int):
    """Gradients ``(d fq, d fk, d vals)`` of one tile from ``grads`` = d loss / d out ``(N, T, E)``, the forward's
    ``blocks``, ``carry`` (the state entering the tile) and ``later`` (``sum fq^T grads`` over all later tiles,
    None: none); also returns ``later`` extended by this tile, for the tile before."""
    N, T, _ = fq.shape
    fq_c, fk_c, vals_c, g_c = (x.view(-1, C, x.shape[-1]) for x in (fq, fk, vals, grads))
    g_blocks = torch.bmm(g_c, vals_c.transpose(1, 2)).tril_()
    g_vals = torch.bmm(blocks.transpose(1, 2), g_c)
    g_fq = torch.bmm(g_blocks, fk_c)
    g_fk = torch.bmm(g_blocks.transpose(1, 2), fq_c)
    del g_blocks
    states, _ = _states_before(fk_c, vals_c, carry, N)
    g_fq[1:].baddbmm_(g_c[1:], states[:-1].transpose(1, 2))
    if carry is not None:
        g_fq[0].addmm_(g_c[0], carry[0].transpose(0, 1))
    del states
    suffix, before = _states_after(fq_c, g_c, later, N)
    g_fk[:-1].baddbmm_(vals_c[:-1], suffix[1:].transpose(1, 2))
    g_vals[:-1].baddbmm_(fk_c[:-1], suffix[1:])
    if later is not None:
        g_fk[-1].addmm_(vals_c[-1], later[-1].transpose(0, 1))
        g_vals[-1].addmm_(fk_c[-1], later[-1])
    return g_fq.view(N, T, -1), g_fk.view(N, T, -1), g_vals.view(N, T, -1), before


class _Tiles:
    """The tiles of one call: positions ``start:stop`` per tile, chunk-padded, and their inputs.

    A tile holds S positions (a multiple of C) of all B x H heads at once; its features, values and
    per-chunk states are tile-sized temporaries.
    """

    def __init__(self, features: KernelFeatures, q, k, v, log_key_scale, C: int, S: int, query_shift: float,
                 acc: torch.dtype):
        self.features, self.q, self.k, self.v, self.log_key_scale = features, q, k, v, log_key_scale
        self.C, self.S, self.query_shift, self.acc, self.L = C, S, query_shift, acc, v.shape[-2]

    def starts(self) -> range:
        return range(0, self.L, self.S)

    def inputs(self, start: int):
        """``(q rows, k rows, query features, chunk-padded fq + s, fk, values [v, 1], key log scale or None)``:
        rows ``(N, T, .)``, padded ``(N, T', .)`` (T' = T rounded up to whole chunks; padded keys and values are
        zero), log scale ``(N, T, 1)``."""
        stop = min(start + self.S, self.L)
        T = stop - start
        padded = -(-T // self.C) * self.C
        q_rows, k_rows = _rows(self.q, start, stop, self.acc), _rows(self.k, start, stop, self.acc)
        phi_q = self.features.query(q_rows)
        phi_k, log_scale = self.features.key(k_rows)
        if self.log_key_scale is not None:
            extra = _rows(self.log_key_scale, start, stop, self.acc)
            log_scale = extra if log_scale is None else log_scale + extra
        fq = _padded(phi_q + self.query_shift if self.query_shift else phi_q, padded)
        vals = fq.new_zeros(fq.shape[0], padded, self.v.shape[-1] + 1)
        vals[:, :T, :-1] = _rows(self.v, start, stop, self.acc)
        vals[:, :T, -1] = 1
        return q_rows, k_rows, phi_q, fq, _padded(phi_k, padded), vals, log_scale

    def blocks(self, buffer: torch.Tensor, start: int) -> torch.Tensor:
        """The tile's ``(N T' / C, C, C)`` slice of a flat kernel-block buffer (each tile's blocks contiguous)."""
        N, C = self.v.shape[0] * self.v.shape[1], self.C
        padded = -(-(min(start + self.S, self.L) - start) // C) * C
        return buffer[N * start * C : N * (start + padded) * C].view(-1, C, C)


@autocast_function
class _CausalKernelAttention(torch.autograd.Function):
    """Causal normalized kernel attention, tile by tile (see the module docstring).

    ``features`` (a ``KernelFeatures``) maps q, k ``(B, H, L, D)``; v ``(B, H, L, D)``; ``log_key_scale``
    ``(B, H, L, 1)`` or None adds to the key features' log scale -> ``(B, H, L, D)``. Saves q, k, v, the
    output, the normalizer ``(B H, L)``, the kernel blocks ``(B H L, C)`` and one ``(B H, F, D+1)`` state per
    tile; backward recomputes each tile's features and states from those.
    """

    @staticmethod
    def forward(ctx, features, q, k, v, log_key_scale, chunk_size, query_shift, tile_size, for_backward):
        B, H, L, D = v.shape
        N = B * H
        C = max(1, min(chunk_size, L))
        acc = _accumulator(torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
        S = tile_size * C if tile_size else _tile_length(N, L, C, v.device)
        tiles = _Tiles(features, q, k, v, log_key_scale, C, S, query_shift, acc)
        out_rows = v.new_empty(B, H, L, D)
        den = torch.empty(N, L, dtype=acc, device=v.device)
        # every tile's (C, C) kernel blocks: recomputing them in backward costs a GEMM over (L, F), keeping
        # them one (L, C) buffer
        blocks = den.new_empty(N * -(-L // C) * C * C) if for_backward else None
        carries, offsets = [], []
        carry = offset = None  # running state (N, F, D+1); running max log key scale (N, 1, 1)
        for start in tiles.starts():
            _, _, _, fq, fk, vals, log_scale = tiles.inputs(start)
            T = min(S, L - start)
            if log_scale is not None:  # keys in units of exp(running max), as an online softmax does
                tile_max = log_scale.amax(1, keepdim=True)
                new_offset = tile_max if offset is None else torch.maximum(offset, tile_max)
                if carry is not None:
                    carry.mul_(torch.exp(offset - new_offset))
                offset = new_offset
                vals[:, :T].mul_(torch.exp(log_scale - offset))
            carries.append(carry)
            offsets.append(offset)
            out, carry = _tile_forward(fq, fk, vals, carry, C, None if blocks is None else tiles.blocks(blocks, start))
            out = out[:, :T]
            den[:, start : start + T] = out[..., D]
            # in place on the view, not out= a strided view: torch.compile traces it (out= breaks the graph)
            out_rows.view(N, L, D)[:, start : start + T].copy_(out[..., :D]).div_(out[..., D:])
        if offset is not None:  # saved states and normalizers in the units of the final (largest) offset
            for i, start in enumerate(tiles.starts()):
                factor = torch.exp(offsets[i] - offset)
                den[:, start : start + S] *= factor.view(N, 1)
                if carries[i] is not None:
                    carries[i] *= factor
        ctx.config = (features, C, S, query_shift)
        ctx.save_for_backward(q, k, v, log_key_scale, out_rows, den, blocks, offset, *carries)
        return out_rows

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, log_key_scale, out_rows, den, blocks, offset, *carries = ctx.saved_tensors
        features, C, S, query_shift = ctx.config
        L, D, acc = v.shape[-2], v.shape[-1], den.dtype
        tiles = _Tiles(features, q, k, v, log_key_scale, C, S, query_shift, acc)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grad_log = torch.empty_like(log_key_scale) if log_key_scale is not None else None
        later = None
        for i, start in reversed(list(enumerate(tiles.starts()))):
            stop = min(start + S, L)
            T = stop - start
            q_rows, k_rows, phi_q, fq, fk, vals, log_scale = tiles.inputs(start)
            scale = None
            if log_scale is not None:
                scale = torch.exp(log_scale - offset)
                vals[:, :T].mul_(scale)
            grads = torch.empty_like(vals)  # d loss / d [num, den]
            grads[:, T:] = 0
            grads[:, :T, :D].copy_(_rows(grad_out, start, stop, acc)).div_(den[:, start:stop].unsqueeze(-1))
            grads[:, :T, D] = -(grads[:, :T, :D] * _rows(out_rows, start, stop, acc)).sum(-1)
            g_fq, g_fk, g_vals, later = _tile_backward(fq, fk, vals, grads, tiles.blocks(blocks, start), carries[i],
                                                       later, C)
            g_fq, g_fk, g_vals = g_fq[:, :T], g_fk[:, :T], g_vals[:, :T]
            g_log_scale = None
            if scale is not None:
                g_log_scale = (g_vals * vals[:, :T]).sum(-1, keepdim=True)
                g_vals = g_vals[..., :D] * scale
            else:
                g_vals = g_vals[..., :D]
            _write(grad_q, start, stop, features.query_grad(q_rows, phi_q, g_fq))
            _write(grad_k, start, stop, features.key_grad(k_rows, fk[:, :T], g_fk, g_log_scale))
            _write(grad_v, start, stop, g_vals)
            if grad_log is not None:
                _write(grad_log, start, stop, g_log_scale)
        return None, grad_q, grad_k, grad_v, grad_log, None, None, None, None


def _write(grad: torch.Tensor, start: int, stop: int, rows: torch.Tensor) -> None:
    """``grad[:, :, start:stop] = rows`` for ``(B, H, L, W)`` and ``(B*H, T, W)``."""
    grad[:, :, start:stop] = rows.view(grad.shape[0], grad.shape[1], stop - start, -1)


def causal_kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64, query_shift: float = 0.0,
    key_scale: torch.Tensor | None = None, *, features: KernelFeatures = GIVEN_FEATURES,
    log_key_scale: torch.Tensor | None = None, tile_size: int | None = None,
) -> torch.Tensor:
    """Causal normalized kernel attention, chunked and tiled (see the module docstring).

    phi_q, phi_k: ``(B, H, L, F)`` positive features, or the queries and keys that ``features`` maps to them;
    v: ``(B, H, L, D)`` -> ``(B, H, L, D)``. ``query_shift``, ``key_scale``: as in ``kernel_attention``;
    ``log_key_scale`` ``(B, H, L, 1)``: the same as ``key_scale = exp(log_key_scale)`` without overflow.
    ``tile_size``: chunks per tile (default: about ``TILE_ROWS`` rows).
    Any L: the tail is zero-padded to a whole chunk (zero key features add nothing to any sum).
    """
    if key_scale is not None:
        log_key_scale = key_scale.log() if log_key_scale is None else log_key_scale + key_scale.log()
    for_backward = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (phi_q, phi_k, v, log_key_scale))
    return _CausalKernelAttention.apply(features, phi_q, phi_k, v, log_key_scale, chunk_size, float(query_shift),
                                        tile_size, for_backward)


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
