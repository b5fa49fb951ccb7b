"""Sliding-window patterns: ``local`` and ``longformer`` (one implementation; longformer adds dilation and global
tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import AttentionConfigError, check_int_knob
from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention


def neighbour_blocks(x: torch.Tensor, back: int, ahead: int) -> torch.Tensor:
    """Concatenate every block with its ``back`` previous and ``ahead`` next blocks (zeros off the ends).

    x (..., n, b, D) -> (..., n, (back + 1 + ahead) * b, D), keys ordered by position.
    """
    n = x.shape[-3]
    padded = F.pad(x, (0, 0, 0, 0, back, ahead))
    return torch.cat([padded[..., s : s + n, :, :] for s in range(back + 1 + ahead)], dim=-2)


@register_attention("local")
class LocalAttention(SparseAttention):
    """Sliding window of ``window`` keys; O(L w).

    Causal: query i attends to keys ``[i - window + 1, i]`` (``window`` keys including self).
    Bidirectional: keys with ``|i - j| <= window // 2``.
    ``longformer`` adds dilation and global tokens on top of this (same implementation).

    Any length works: queries are cut into blocks of ``b = max(reach, 1)`` positions, each attends to
    its own and neighbouring blocks through one 4-D SDPA call with a boolean band mask; the tail is
    padded and the padded keys masked.
    """

    def __init__(self, *, causal: bool, window: int = 8, **base) -> None:
        super().__init__(causal=causal, **base)
        self.window = check_int_knob(window, "attention.window")

    # band in units of the (dilated) step: offsets d = i - j with d in [-ahead, back]
    dilation = 1
    global_tokens = 0

    def band(self) -> tuple[int, int]:
        if self.causal:
            return self.window - 1, 0
        return self.window // 2, self.window // 2

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        back, ahead = self.band()
        step, g = self.dilation, self.global_tokens

        def direct(b, h, q, kv):
            d = q - kv
            ok = (d % step == 0) & (d <= back * step) & (d >= -ahead * step)
            if g:
                ok = ok | (q < g) | (kv < g)
            return ok

        return [FlexCall(direct)]

    def pattern(self, length: int) -> torch.Tensor:
        i = torch.arange(length).unsqueeze(1)
        j = torch.arange(length).unsqueeze(0)
        d = i - j
        back, ahead = self.band()
        step = self.dilation
        allowed = (d % step == 0) & (d <= back * step) & (d >= -ahead * step)
        if self.global_tokens:
            allowed |= (i < self.global_tokens) | (j < self.global_tokens)
        return allowed

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = q.shape
        self.check_length(L)
        step = self.dilation
        back, ahead = self.band()
        b = max(back, ahead, 1)
        # Dilation: i - j divisible by step means same residue mod step, so each residue class is an
        # undilated window over its own subsequence; fold the classes into the head axis.
        sub_len = -(-L // step)
        n = -(-sub_len // b)
        total = n * b * step
        pad = total - L

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B*H, step*n, b, D)
            x = F.pad(x, (0, 0, 0, pad)).reshape(B * H, n * b, step, D).transpose(1, 2)
            return x.reshape(B * H, step * n, b, D)

        qb, kb, vb = blocks(self.scale(q)), blocks(k), blocks(v)
        nb_back, nb_ahead = (1 if back else 0), (1 if ahead else 0)
        kw = neighbour_blocks(kb.view(B * H, step, n, b, D), nb_back, nb_ahead).flatten(1, 2)
        vw = neighbour_blocks(vb.view(B * H, step, n, b, D), nb_back, nb_ahead).flatten(1, 2)
        mask = self.cached("band", L, q.device, lambda: self.band_mask(L, b, n, q.device))
        if self.global_tokens:
            g = self.global_tokens
            kw = torch.cat([kw, k[:, :, :g].reshape(B * H, 1, g, D).expand(-1, step * n, -1, -1)], 2)
            vw = torch.cat([vw, v[:, :, :g].reshape(B * H, 1, g, D).expand(-1, step * n, -1, -1)], 2)
        out = self.sdpa(qb, kw, vw, mask)  # (B*H, step*n, b, D)
        # reshape, not view: CUDA's SDPA kernels return a (B, L, H, D)-strided output (measured on an H200)
        out = out.reshape(B * H, step, n * b, D).transpose(1, 2).reshape(B, H, total, D)[:, :, :L]
        if self.global_tokens:  # global queries attend to every key
            g = self.global_tokens
            out = out.index_copy(2, torch.arange(g, device=q.device), self.sdpa(self.scale(q[:, :, :g]), k, v))
        return out

    def band_mask(self, length: int, b: int, n: int, device) -> torch.Tensor:
        """(step*n, b, keys) bool mask for the blocked layout of ``forward``, from original positions."""
        step = self.dilation
        back, ahead = self.band()
        nb_back, nb_ahead = (1 if back else 0), (1 if ahead else 0)
        res = torch.arange(step, device=device).view(step, 1, 1, 1)
        blk = torch.arange(n, device=device).view(1, n, 1, 1)
        qs = blk * b + torch.arange(b, device=device).view(1, 1, b, 1)  # sub-position of query
        ks = (blk - nb_back) * b + torch.arange((nb_back + 1 + nb_ahead) * b, device=device).view(1, 1, 1, -1)
        d = qs - ks
        i, j = qs * step + res, ks * step + res  # original positions
        allowed = (d <= back) & (d >= -ahead) & (ks >= 0) & ((j < length) | (i == j))
        if self.global_tokens:
            # every query sees the global keys through their own columns; their band copies are
            # dropped so that each key counts once
            g = self.global_tokens
            allowed = torch.cat([allowed & (j >= g), torch.ones(step, n, b, g, dtype=torch.bool, device=device)], -1)
        return allowed.reshape(step * n, b, -1)


@register_attention("longformer")
class LongformerAttention(LocalAttention):
    """Longformer: sliding window (``local``) with optional dilation and global tokens; O(L (w + g)).

    Query i attends to keys j with ``i - j = dilation * t``, ``t in [0, window - 1]`` (causal) or
    ``|t| <= window // 2`` (bidirectional). The first ``global_tokens`` positions (e.g. a CLS token)
    attend to every key and are attended by every query — bidirectional only, since they see the
    future. Any length works (padded and masked internally).
    """

    def __init__(self, *, causal: bool, window: int = 8, dilation: int = 1, global_tokens: int = 0, **base) -> None:
        super().__init__(causal=causal, window=window, **base)
        self.dilation = check_int_knob(dilation, "attention.dilation")
        self.global_tokens = check_int_knob(global_tokens, "attention.global_tokens", minimum=0)
        if causal and self.global_tokens:
            raise AttentionConfigError(
                f"attention 'longformer': attention.global_tokens={global_tokens} needs bidirectional "
                "attention (global tokens attend to the future); set attention.global_tokens=0 for "
                "causal tasks (attention.causal=true)"
            )

    def forward(self, q, k, v):
        if self.global_tokens > q.shape[-2]:
            raise AttentionConfigError(
                f"attention.global_tokens={self.global_tokens} exceeds the sequence length {q.shape[-2]}"
            )
        return super().forward(q, k, v)
