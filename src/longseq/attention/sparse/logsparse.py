"""LogSparse pattern (Combiner §4.2): self plus one key per aligned power-of-two block of the past."""

from __future__ import annotations

import torch

from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.ops.geometry import logsparse_keys, num_log_levels
from longseq.attention.ops.log_levels import LevelMix, LevelScores
from longseq.attention.ops.masks import mask_from_index_table
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention
from longseq.attention.sparse.kernels import dedupe_index_table


@register_attention("logsparse")
class LogSparseAttention(SparseAttention):
    """LogSparse pattern of the Combiner paper §4.2; O(L log L).

    Causal: position p attends to itself and, for every set bit l of p, to ``((p >> l) << l) - 1``
    (the last cell of each aligned power-of-two block that tiles [0, p), i.e. the blocks
    ``combiner_logsparse`` summarizes; ``geometry.logsparse_keys``). E.g. p = 13 attends to 13, 12, 11,
    7. Bidirectional: the causal set plus its mirror image (the causal pattern of the reversed
    sequence: j with ``L-1-j`` in the causal set of ``L-1-i``). Any length works. Forward never gathers:
    at level l the queries with bit l set are the odd blocks of 2^l-block pairs and share one key, so the
    logits ``(BH, 1 + levels, L)`` and the output are per-level broadcasts (``log_levels``; hand-written
    backward), one softmax over each query's ``1 + levels`` (bidirectional ``1 + 2 levels``) slots.
    """

    def index_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, K) sorted key table without repeats, and its validity."""
        idx, valid = logsparse_keys(length)
        if not self.causal:  # mirror: row i of the reversed table, keys reflected
            mirrored = (length - 1 - idx).flip(0)[:, 1:]
            idx = torch.cat([idx, mirrored], 1)
            valid = torch.cat([valid, valid.flip(0)[:, 1:]], 1)
        return dedupe_index_table(idx, valid, length)

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        L, causal = length, self.causal

        def direct(b, h, q, kv):
            ok = causal_logsparse(q, kv)
            return ok if causal else ok | causal_logsparse(L - 1 - q, L - 1 - kv)

        return [FlexCall(direct)]

    def pattern(self, length: int) -> torch.Tensor:
        return mask_from_index_table(*self.index_table(length), length)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        qs, kf, vf = self.scale(q).reshape(B * H, L, D), k.reshape(B * H, L, D), v.reshape(B * H, L, -1)
        logits = LevelScores.apply(qs, kf, True)  # (BH, 1 + levels, L): self, then one slot per level
        if self.causal:
            weights = self.weight_dropout(logits.softmax(1))
            return LevelMix.apply(weights, vf, True).view(B, H, L, -1)
        # the mirror image is the causal pattern of the reversed sequence (without self, counted once)
        mirrored = LevelScores.apply(qs.flip(1), kf.flip(1), False).flip(-1)
        weights = self.weight_dropout(torch.cat([logits, mirrored], 1).softmax(1))
        own = 1 + num_log_levels(L)
        out = LevelMix.apply(weights[:, :own], vf, True)
        out = out + LevelMix.apply(weights[:, own:].flip(-1), vf.flip(1), False).flip(1)
        return out.view(B, H, L, -1)


def causal_logsparse(i, j):
    """j in the causal LogSparse set of i (``geometry.logsparse_keys``) by index arithmetic (flex masks): j = i, or
    j + 1 = i with its bits below some set bit l cleared, i.e. i's bits at and above the lowest set bit of j + 1
    equal j + 1's."""
    t = j + 1
    low = t & (-t)
    return (j == i) | ((j < i) & ((i & ~(low - 1)) == t))
