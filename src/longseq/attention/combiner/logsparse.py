"""Combiner-Logsparse (Ren et al. 2021, §4.2 and appendix B): the past as O(log L) aligned power-of-two blocks.

Causal (official JAX ``_SelfAttLogn`` semantics, without its L = 2^k + 1 bug): a query at p attends
itself directly, the previous token p - 1 raw when p is odd ("level 0"), and for every level
l = 1 .. Λ-1 with bit l of p set one summary of the aligned block [start, start + 2^l),
start = (p >> (l + 1)) << (l + 1) (the chunk of index (p >> l) - 1 at size 2^l). These blocks tile
[0, p) exactly (a Fenwick decomposition); Λ = bit length of (L - 1), so any L works.

Bidirectional (this project's clean partition): the past is tiled as above and the future (p, L)
by the mirror image of the same construction, i.e. the causal tiling of the reversed sequence: the
raw next token p + 1 when L - 1 - p is odd, and blocks aligned from the END of the sequence. Self is
attended once; every position is covered exactly once. (For L a power of two the mirrored blocks
are the ordinary aligned blocks.)

One softmax over the 1 + Λ (causal) or 1 + 2Λ (bidirectional) candidate logits per query. Summaries:
k_bar = pooled keys of the block, v_bar = sum_j softmax_j(q_bar . k_j) v_j with q_bar the pooled scaled
queries. Cost O(L D log L) time and O(L log L + L D) memory.

Without key padding everything is one autograd Function with a hand-written backward (``_CombinerLogsparse``):
hierarchical pooling (a level-l block's pool is the pool of its two halves, so all levels cost O(L D)), each
block's local expectation as a one-query softmax over strided views of k and v (``log_levels.summarized_blocks``:
no gather, no copy), and the level logits and outputs as the gather-free broadcasts of ``log_levels`` (shared
with ``logsparse``). The backward writes each of q, k, v's gradients into one buffer: autograd through per-level
views allocated, zero-filled and summed a full (L, D) gradient per level (measured:
docs/cpu_engine_measurements.md, *combiner/logsparse.py*).

Key padding (``key_padding_mask`` (B, L), True = pad; LRA): a padded key gets no direct weight (self, raw
previous/next token) and is left out of every block's pooled query, pooled key and inner softmax; a block
without a real key is masked. A query left with nothing (a padded query whose raw neighbours and blocks are
all padding) falls back to its unpadded direct keys. The padded path pools each block straight from its
members instead of hierarchically and runs on autograd (``LevelScores`` / ``LevelMix``); same O(L D log L) cost.
"""

from __future__ import annotations

import functools
import math

import torch

from longseq.attention.base import Attention
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.flex import calls
from longseq.attention.ops.flex.calls import TILE, FlexCall
from longseq.attention.ops.flex.regions import RegionTable
from longseq.attention.ops.geometry import fenwick_blocks, num_log_levels
from longseq.attention.ops.log_levels import (
    LevelMix,
    LevelScores,
    level_mix,
    level_mix_transposed,
    level_scores,
    level_views,
    mixed,
    row_dots,
    summarized_block_views,
    summarized_blocks,
    summary_count,
    summary_views,
)
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention


@register_attention("combiner_logsparse")
class CombinerLogsparseAttention(PooledCombiner, Attention):
    """Combiner-Logsparse, causal or bidirectional, any sequence length.

    Args:
        causal: past only (official semantics) or the mirrored past+future partition.
        summary: region pooling, ``max`` (default, official), ``mean``, ``deepsets_max``,
            ``deepsets_mean`` (the DeepSets kinds learn two D x D maps and need ``head_dim``).
        seq_len, n_heads, head_dim, dropout: see ``Attention``. Dropout acts on the inner summary
            weights p(j|R) only, as in the official JAX layer.
    """

    def __init__(
        self,
        *,
        causal: bool,
        summary: str = "max",
        seq_len: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, dropout=dropout,
                         backend=backend)
        self.summary = RegionSummary(summary, head_dim)
        self.has_parameters = self.summary.has_parameters

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, summary={self.summary.kind}"

    # -- geometry -------------------------------------------------------------------------------
    def partition(self, length: int, device: torch.device | None = None) -> Partition:
        """The partition (for tests, ``attention_matrix`` and decoding): direct = self plus the raw previous /
        next token; regions = the distinct blocks some query summarizes."""
        direct, blocks, allowed = _past_partition(length, device)
        if not self.causal:
            # the future of p is the past of L - 1 - p in the reversed sequence
            future_direct, future_blocks, future_allowed = _past_partition(length, device)
            direct = direct | future_direct.flip(0, 1)
            blocks = torch.cat([blocks, future_blocks.flip(1)])
            allowed = torch.cat([allowed, future_allowed.flip(0)], 1)
        # a block may be both a past and a mirrored future block (e.g. L a power of two): one region
        regions, which = torch.unique(blocks, dim=0, return_inverse=True)
        region_allowed = torch.zeros(length, regions.shape[0], dtype=torch.float64, device=device)
        region_allowed = region_allowed.index_add_(1, which, allowed.to(torch.float64)) > 0
        return Partition.from_candidates(direct, regions, region_allowed)

    # -- the contract -----------------------------------------------------------------------------
    supports_padding_mask = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D) (v may have its own last width);
        ``key_padding_mask`` (B, L) bool, True = padded key."""
        B, H, L, D = q.shape
        scale = 1.0 / math.sqrt(D)
        flat = [x.reshape(B * H, L, x.shape[-1]) for x in (q, k, v)]
        if key_padding_mask is None:
            features = [self.summary.query_features(flat[0]), self.summary.key_features(flat[1])]
            features = [None if f is x else f for f, x in zip(features, flat)]  # identity: pool q, k themselves
            drop = self.dropout if self.training else 0.0
            out = _CombinerLogsparse.apply(*flat, *features, self.summary.reduce, scale, drop, self.causal)
            return out.view(B, H, L, -1)

        real = ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        # the future of p is the past of L - 1 - p in the reversed sequence (self counted once, in the past)
        directions = [flat] if self.causal else [flat, [x.flip(1) for x in flat]]
        logits, summaries, usable = [], [], []
        for past, (qf, kf, vf) in zip((True, False), directions):
            k_bars, v_bars, direction_usable = self.padded_summaries(qf, kf, vf, real if past else real.flip(-1), B, scale)
            usable.append(direction_usable if past else direction_usable.flip(-1))
            scores = LevelScores.apply(qf, kf, past, *k_bars)  # (BH, [self +] levels, L)
            logits.append(scores if past else scores.flip(-1))
            summaries.append(v_bars)
        logits = torch.cat(logits, 1) * scale
        logits = self.padded_logits(logits.view(B, H, -1, L), real, torch.cat(usable, -2)).view(B * H, -1, L)
        weights = logits.softmax(1)
        own = 1 + num_log_levels(L)  # self + the past levels
        vf = flat[2]
        out = LevelMix.apply(weights[:, :own], vf, True, *summaries[0])
        if not self.causal:
            future = weights[:, own:].flip(-1)
            out = out + LevelMix.apply(future, vf.flip(1), False, *summaries[1]).flip(1)
        return out.view(B, H, L, -1)

    # -- the flex layout (``ops.flex``): one call over [self and the raw neighbours ; every summarized block] ------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        L, causal = length, self.causal
        level, chunk, future, copy_from = flex_regions(L, causal, device)

        def direct(b, h, q, kv):
            ok = (kv == q) | ((kv == q - 1) & (q % 2 == 1))
            if not causal:
                ok = ok | ((kv == q + 1) & ((L - 1 - q) % 2 == 1))
            return ok

        def usable(b, h, q, r):
            lvl, c, fut = level[r], chunk[r], future[r]
            p = torch.where(fut, L - 1 - q, q)  # the future of q is the past of L - 1 - q
            return (((p >> lvl) & 1) == 1) & ((p >> lvl) - 1 == c)

        def members():
            pos = torch.arange(L, device=device)
            start = chunk << level
            inside = (pos.unsqueeze(0) >= start.unsqueeze(1)) & (pos.unsqueeze(0) < (start + (1 << level)).unsqueeze(1))
            return torch.where(future.unsqueeze(1), inside.flip(-1), inside)

        return [FlexCall(direct, None, level.numel(), usable, members,
                         summary_order=flex_region_rows(level, chunk, future, L), copy_from=copy_from,
                         regions=self.flex_region_table(L, device) if self.summary.poolable else None)]

    def flex_region_table(self, L: int, device) -> RegionTable:
        """``flex_summaries``'s blocks as position ranges, in its row order: per direction and level l >= 1 the even
        chunks c of 2^l positions, ``[c 2^l, (c + 1) 2^l)``; a future block (the reversed sequence's) is the range
        ``[L - (c + 1) 2^l, L - c 2^l)``."""
        starts, sizes = [], []
        for future in ([False] if self.causal else [False, True]):
            for lvl in range(1, num_log_levels(L)):
                size = 1 << lvl
                chunk = torch.arange(0, L >> lvl, 2)
                starts.append(L - (chunk + 1) * size if future else chunk * size)
                sizes.append(torch.full_like(chunk, size))
        return RegionTable.of(torch.cat(starts), 1, torch.cat(sizes), reduce=self.summary.reduce, device=device)

    def flex_summaries(self, index: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       real: torch.Tensor | None, state=None):
        """Every summarized block's pooled key and local expectation: per level the even full chunks of the (for the
        future: reversed) sequence, pooled over real members, level-major (the call's ``summary_order`` puts them in
        KV order)."""
        L = qs.shape[-2]
        levels = range(1, num_log_levels(L))
        directions = [(qs, k, v, real)]
        if not self.causal:
            directions.append((*(x.flip(-2) for x in (qs, k, v)), None if real is None else real.flip(-1)))
        k_rows, v_rows, occupied = [], [], []
        for dq, dk, dv, dreal in directions:
            for lvl in levels:
                size, count = 1 << lvl, L >> lvl
                blocks = [x[..., : count * size, :].unflatten(-2, (count, size))[:, :, ::2] for x in (dq, dk, dv)]
                member = None if dreal is None else dreal[:, : count * size].view(-1, 1, count, size)[:, :, ::2]
                # by value (amax) when unpadded: most regions hold two or four members, and max kept int64 argmax
                # indices for every pooled row of q and k; amax keeps the scaled queries once
                # (ops.flex.flex_kept_for_backward at L = 16,384: 8.7 -> 6.2 outputs' worth). Padded, amax would
                # keep each level's masked copy instead (19.7 against 9.7), so max stays
                k_bar, v_bar = self.summary.region_summaries(*blocks, member, by_value=member is None)
                k_rows.append(k_bar)
                v_rows.append(v_bar)
                if member is not None:
                    occupied.append(member.any(-1)[:, 0])
        return torch.cat(k_rows, -2), torch.cat(v_rows, -2), None if real is None else torch.cat(occupied, -1)

    def padded_summaries(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, batch: int,
                         scale: float) -> tuple[list, list, torch.Tensor]:
        """``summaries`` over the real members of each block (``real`` (B, L) bool, True = real key) plus ``usable``
        (B, 1, levels, L): the slot's key is real (level 0, the raw previous token) / its block has a real member.

        Autograd through masked per-level views (the padded path is for LRA lengths, not the fast path); each
        block is pooled straight from its members instead of hierarchically.
        """
        N, L, D = q.shape
        levels = num_log_levels(L)
        q_features, k_features = self.summary.query_features(q), self.summary.key_features(k)
        real_rows = real.repeat_interleave(N // batch, 0)  # (N, L)
        usable = torch.zeros(batch, 1, levels, L, dtype=torch.bool, device=real.device)
        if levels:
            usable[:, 0, 0, 1:] = real[:, :-1]  # the raw previous token
        k_bars, v_bars = [None] * min(levels, 1), [None] * min(levels, 1)
        for level in range(1, levels):
            member = summarized_blocks(real_rows.unsqueeze(-1), level).squeeze(-1)  # (N, P, 2^l)
            occupied = member.any(-1)  # (N, P)
            q_bar = self.summary.masked_reduce(summarized_blocks(q_features, level), member) * scale
            inner_logits = (summarized_blocks(k, level) @ q_bar.unsqueeze(-1)).squeeze(-1)  # (N, P, 2^l)
            # an empty block gets any finite inner row (all members); its summary slot is masked
            inner = inner_logits.masked_fill(~(member | ~occupied.unsqueeze(-1)), NEG_INF).softmax(-1)
            inner = self.weight_dropout(inner)
            k_bars.append(self.summary.masked_reduce(summarized_blocks(k_features, level), member))
            v_bars.append((inner.unsqueeze(-2) @ summarized_blocks(v, level)).squeeze(-2))
            # the odd block of each pair (and the incomplete pair's tail) reads its even block's summary
            column = usable[:, 0, level].unsqueeze(-1)  # (B, L, 1) view
            for (readers, _), block in zip(level_views(column, level), summary_views(occupied[:: N // batch], level, L)):
                readers.copy_(block[:, :, None, None].expand_as(readers))
        return k_bars, v_bars, usable

    def padded_logits(self, logits: torch.Tensor, real: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
        """Key padding on the logits (B, H, slots, L) [self, past levels, (future levels)]: a slot stays when its
        geometry allows it (finite logit) and its key is real / its block has a real member (``usable``
        (B, 1, slots - 1, L) after self); a row left empty keeps its unpadded direct slots (self, raw previous /
        next token)."""
        L = logits.shape[-1]
        levels = num_log_levels(L)
        allowed = torch.cat([real[:, None, None, :], usable], 2) & (logits > NEG_INF)
        direct = torch.zeros(logits.shape[2], 1, dtype=torch.bool, device=logits.device)
        direct[: min(2, 1 + levels)] = True  # self, previous token
        if not self.causal and levels:
            direct[1 + levels] = True  # next token
        allowed = torch.where(allowed.any(2, keepdim=True), allowed, (logits > NEG_INF) & direct)
        return logits.masked_fill(~allowed, NEG_INF)


@functools.cache
def _flex_regions(L: int, causal: bool, big: int) -> tuple[torch.Tensor, int]:
    rows = []
    for future in ([False] if causal else [False, True]):
        for level in range(1, num_log_levels(L)):
            for chunk in range(0, L >> level, 2):
                first_user = (chunk + 1) << level
                if future:  # users of the mirrored block, in sequence order: L - 1 - p for p in the users
                    first_user = L - min(L, (chunk + 2) << level)
                rows.append((((1 << level) >= big, first_user, level, future), (level, chunk, future)))
    rows.sort(key=lambda row: row[0])
    small = sum(not row[0][0] for row in rows)
    return torch.tensor([row[1] for row in rows], dtype=torch.long).view(-1, 3), small


def flex_regions(L: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The summarized blocks of the flex layout as tables ``(level, chunk, future)`` ``(R,)`` each, in KV order, and
    the number of small ones (``FlexCall.copy_from``: the big ones are laid out in copies).

    Past block ``(l, c)`` (l >= 1, c even, full) is used by the queries p with ``p >> l == c + 1``; a future block is
    the mirror image (the past block of ``L - 1 - p`` in the reversed sequence). Order (tile count, not
    semantics): blocks shorter than a tile sorted by the first query that uses them, so a query tile's small
    blocks sit in one or two key tiles; blocks of a tile or more (each used by whole query tiles) last. A key tile
    of big blocks is used by every query tile of their users, and the coarse levels' users span the sequence, so the
    big blocks are the call's hot summaries (``calls.copy_rows`` also bounds "big", so a test's short layout, whose
    blocks are all under a tile, copies some).
    """
    table, small = _flex_regions(L, causal, min(TILE, calls.copy_rows(L)))
    table = table.to(device)
    return table[:, 0], table[:, 1], table[:, 2].bool(), small


def flex_region_rows(level: torch.Tensor, chunk: torch.Tensor, future: torch.Tensor, L: int) -> torch.Tensor:
    """Row of each (level, chunk, future) in the level-major concatenation ``flex_summaries`` builds (past levels
    1.., then future levels 1..; even chunks only)."""
    levels = num_log_levels(L)
    per_level = torch.tensor([0, 0] + [((L >> lvl) + 1) // 2 for lvl in range(1, levels)], device=level.device)
    offsets = per_level.cumsum(0)[:-1]  # offsets[l] = rows of levels < l (levels from 1)
    return future.long() * per_level.sum() + offsets[level] + chunk // 2


def _past_partition(length: int, device: torch.device | None):
    """Causal logsparse sets: direct (L, L), blocks (R, L) of every level >= 1 chunk, allowed (L, R)."""
    pos = torch.arange(length, device=device)
    direct = torch.eye(length, dtype=torch.bool, device=device)
    direct[1:, :-1] |= torch.eye(length - 1, dtype=torch.bool, device=device) & (pos[1:] % 2 == 1).unsqueeze(1)
    start, valid = fenwick_blocks(length, device)  # (L, levels)
    blocks, allowed = [], []
    for level in range(1, start.shape[1]):
        size = 1 << level
        chunk_start = torch.arange(length >> level, device=device) * size  # full chunks only
        member = (pos.unsqueeze(0) >= chunk_start.unsqueeze(1)) & (pos.unsqueeze(0) < chunk_start.unsqueeze(1) + size)
        blocks.append(member)
        allowed.append(valid[:, level : level + 1] & (start[:, level : level + 1] == chunk_start.unsqueeze(0)))
    if not blocks:
        return direct, torch.zeros(0, length, dtype=torch.bool, device=device), torch.zeros(length, 0, dtype=torch.bool, device=device)
    blocks, allowed = torch.cat(blocks), torch.cat(allowed, 1)
    used = allowed.any(0)
    return direct, blocks[used], allowed[:, used]


@autocast_function
class _CombinerLogsparse(torch.autograd.Function):
    """Combiner-Logsparse without key padding, causal or bidirectional, as one Function with a hand-written backward.

    ``apply(q, k, v, q_features, k_features, reduce, scale, dropout, causal)``: ``q, k, v`` ``(N, L, .)`` (q
    unscaled); ``q_features`` / ``k_features`` the DeepSets features to pool (shaped like q / k) or None to pool q / k
    themselves; ``reduce`` ``"max"`` / ``"mean"``; ``scale`` = 1/sqrt(D); ``dropout`` on the inner weights p(j|R).
    Output ``(N, L, Dv)``.

    Per direction (the future is the past of the reversed sequence) ``_LevelSummaries`` builds every level's
    summaries; the joint softmax over [self, raw previous token, level summaries, (the mirrored slots)] runs on
    ``(N, slots, L)`` logits from ``log_levels.level_scores`` (scaled there, on the small tensor, not as a scaled
    copy of q), and the output is ``log_levels.level_mix``. The backward writes each of q, k, v's gradients into ONE
    buffer: the products' adjoints, the summaries' inner softmax and the pooling add into it in place.

    Why one Function (measured, L = 16384, fp32, CPU): separate Functions for the summaries and the products gave
    every input one fresh (N, L, D) gradient per Function plus a full-size sum in the autograd engine; at this size
    each such buffer is a fresh 32 MB mapping that page-faults on every call.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_features, k_features, reduce, scale, dropout, causal):
        own = 1 + num_log_levels(q.shape[1])  # self + the past levels
        directions = [(q, k, v, q_features, k_features)]
        if not causal:
            directions.append(tuple(None if x is None else x.flip(1) for x in directions[0]))
        summaries, logits = [], []
        for past, (dq, dk, dv, dq_features, dk_features) in zip((True, False), directions):
            summary = _LevelSummaries(dq, dk, dv, dq_features, dk_features, reduce, scale, dropout)
            scores = level_scores(dq, dk, past, NEG_INF, summary.key_rows)  # (N, [self +] levels, L)
            logits.append(scores if past else scores.flip(-1))
            summaries.append(summary)
        weights = (torch.cat(logits, 1) if len(logits) > 1 else logits[0]).mul_(scale).softmax(1)
        out = level_mix(weights[:, :own], v, True, summaries[0].value_rows)
        if not causal:
            out += level_mix(weights[:, own:].flip(-1), directions[1][2], False, summaries[1].value_rows).flip(1)
        ctx.save_for_backward(q, k, v, q_features, k_features, weights)
        ctx.directions, ctx.summaries, ctx.scale = directions[1:], summaries, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_features, k_features, weights = ctx.saved_tensors
        own = 1 + num_log_levels(q.shape[1])
        grad_out = grad_out.contiguous()  # a broadcast (zero-stride) grad would make every slot view alias
        directions = [(q, k, v, q_features, k_features), *ctx.directions]
        grad_outs = [grad_out] + [grad_out.flip(1) for _ in ctx.directions]
        slot_weights = [weights[:, :own]] + [weights[:, own:].flip(-1) for _ in ctx.directions]
        grad_weights, grad_values = [], []
        for past, (_, _, dv, _, _), summary, g, w in zip((True, False), directions, ctx.summaries, grad_outs, slot_weights):
            scores = level_scores(g, dv, past, 0.0, summary.value_rows)
            grad_weights.append(scores if past else scores.flip(-1))
            grad_values.append(level_mix_transposed(w, g, past, summary.value_rows))
        grad_weights = torch.cat(grad_weights, 1) if len(grad_weights) > 1 else grad_weights[0]
        grad_logits = grad_weights.sub_((grad_weights * weights).sum(1, keepdim=True)).mul_(weights).mul_(ctx.scale)
        grads = []
        for past, (dq, dk, _, dq_features, dk_features), summary, (grad_v, grad_v_rows) in zip(
                (True, False), directions, ctx.summaries, grad_values):
            slots = grad_logits[:, :own] if past else grad_logits[:, own:].flip(-1)
            grad_q = level_mix(slots, dk, past, summary.key_rows)
            grad_k, grad_k_rows = level_mix_transposed(slots, dq, past, summary.key_rows)
            grad_q_features = None if dq_features is None else torch.zeros_like(dq_features)
            grad_k_features = None if dk_features is None else torch.zeros_like(dk_features)
            summary.backward(grad_k_rows, grad_v_rows, grad_q if grad_q_features is None else grad_q_features, grad_k,
                             grad_v, grad_k if grad_k_features is None else grad_k_features)
            grads.append([grad_q, grad_k, grad_v, grad_q_features, grad_k_features])
        if len(grads) > 1:  # the mirrored direction's gradients, back in sequence order
            for grad, mirrored in zip(grads[0], grads[1]):
                if grad is not None:
                    grad += mirrored.flip(1)
        return (*grads[0], None, None, None, None)


class _LevelSummaries:
    """Every level's summaries of one direction (``_CombinerLogsparse``), and their backward.

    ``q, k, v`` ``(N, L, .)`` (q unscaled), ``q_features`` / ``k_features`` the DeepSets features or None (pool q / k).
    ``key_rows`` / ``value_rows``: ``[None, level 1, ...]`` (level 0 is the raw previous token), the pooled keys
    ``(N, P_l, D)`` and local expectations ``(N, P_l, Dv)`` of the ``P_l = summary_count`` blocks some query reads
    (``log_levels.summarized_blocks``), in the layout ``log_levels`` takes.

    - pooling is hierarchical (a level-l block is two level-(l-1) blocks; exact for max and mean), so all levels
      cost O(L D) together; the backward routes each pooled gradient down the same tree (max: to the half the
      maximum took, ties to the first);
    - the local expectation of a block is a one-query softmax over its 2^l members, on strided views of k and v
      (no gather, no copy); its backward adds into the caller's gradient buffers through the same views.
    """

    def __init__(self, q, k, v, q_features, k_features, reduce: str, scale: float, dropout: float) -> None:
        L = q.shape[1]
        levels = num_log_levels(L)
        self.k, self.v, self.reduce, self.scale = k, v, reduce, scale
        self.key_rows: list[torch.Tensor | None] = [None] * min(levels, 1)
        self.value_rows: list[torch.Tensor | None] = [None] * min(levels, 1)
        self.q_pools = _pool_levels(q if q_features is None else q_features, reduce, levels)
        self.k_pools = _pool_levels(k if k_features is None else k_features, reduce, levels)
        self.q_bars, self.weights, self.kept = [], [], []
        for level in range(1, levels):
            summarized = slice(0, 2 * summary_count(L, level), 2)  # the even blocks, in pair order
            q_bar = self.q_pools[level][:, summarized] * scale  # every summary kind is positively homogeneous
            w = row_dots(summarized_blocks(k, level), q_bar).softmax(-1)  # (N, P, 2^l): p(j|R)
            kept = None
            if dropout > 0:
                kept = torch.empty_like(w).bernoulli_(1 - dropout).div_(1 - dropout)
            self.key_rows.append(self.k_pools[level][:, summarized].contiguous())
            self.value_rows.append(mixed(w if kept is None else w * kept, summarized_blocks(v, level)))
            self.q_bars.append(q_bar)
            self.weights.append(w)
            self.kept.append(kept)

    def backward(self, grad_key_rows: list, grad_value_rows: list, grad_q_pooled: torch.Tensor, grad_k: torch.Tensor,
                 grad_v: torch.Tensor, grad_k_pooled: torch.Tensor) -> None:
        """Add the summaries' gradients in place: ``grad_k`` / ``grad_v`` get the inner softmax's, ``grad_q_pooled`` /
        ``grad_k_pooled`` (q / k, or their DeepSets features) the pooling's; ``grad_key_rows`` / ``grad_value_rows``
        are the gradients of ``key_rows`` / ``value_rows`` (None at level 0)."""
        grad_q_bars = [None]
        for level in range(1, len(self.q_pools)):
            w, kept, grad_v_bar = self.weights[level - 1], self.kept[level - 1], grad_value_rows[level]
            applied = w if kept is None else w * kept
            for view, rows in summarized_block_views(grad_v, level):  # in place on every device (XLA included)
                view.addcmul_(applied[:, rows].unsqueeze(-1), grad_v_bar[:, rows].unsqueeze(-2))
            grad_w = row_dots(summarized_blocks(self.v, level), grad_v_bar)
            if kept is not None:
                grad_w.mul_(kept)
            grad_logits = grad_w.sub_((grad_w * w).sum(-1, keepdim=True)).mul_(w)  # softmax backward
            grad_q_bars.append(mixed(grad_logits, summarized_blocks(self.k, level)).mul_(self.scale))
            for view, rows in summarized_block_views(grad_k, level):
                view.addcmul_(grad_logits[:, rows].unsqueeze(-1), self.q_bars[level - 1][:, rows].unsqueeze(-2))
        _unpool_levels(self.q_pools, grad_q_bars, self.reduce, grad_q_pooled)
        _unpool_levels(self.k_pools, grad_key_rows, self.reduce, grad_k_pooled)


def _pool_levels(x: torch.Tensor, reduce: str, levels: int) -> list[torch.Tensor]:
    """Hierarchical pools ``[x, level 1, ...]`` of ``x`` ``(N, L, D)``: level l ``(N, L >> l, D)``, one row per full
    aligned block of 2^l positions, each from the two halves one level down."""
    pools = [x]
    for level in range(1, levels):
        halves = pools[-1][:, : 2 * (x.shape[1] >> level)].unflatten(1, (-1, 2))
        first, second = halves[:, :, 0], halves[:, :, 1]
        pools.append(torch.maximum(first, second) if reduce == "max" else (first + second).mul_(0.5))
    return pools


def _unpool_levels(pools: list[torch.Tensor], summary_grads: list, reduce: str, grad_x: torch.Tensor) -> None:
    """Backward of ``_pool_levels``: ``pools`` ``[x, level 1, ...]``, ``summary_grads[l]`` the gradient of level l's
    summarized rows (its even rows ``0, 2, ..``; ``[0]`` unused); adds the gradient of ``x`` into ``grad_x`` in place.

    Top level first, each level's gradient (own summaries plus what its parent routed down) goes to the half the
    forward's maximum took (ties: the first half) or half to each (mean). The levels' gradients and the routing
    masks live in scratch buffers of level 1's size, reused level after level: a fresh tensor per level (and the
    float copy a bool mask product makes) cost about half of this backward at L = 16384.
    """
    top = len(pools) - 1
    if top < 1:
        return
    grad = torch.zeros_like(pools[-1])
    spares = [torch.empty_like(pools[1]) for _ in range(2 if top > 1 else 0)]  # ping-pong level gradients
    if reduce == "max":
        route = torch.empty_like(pools[1])
    for level in range(top, 0, -1):
        own = summary_grads[level]
        grad[:, 0 : 2 * own.shape[1] : 2] += own
        n = grad.shape[1]
        if level == 1:
            below = grad_x
        else:
            below = spares[level % 2][:, : pools[level - 1].shape[1]]
            below[:, 2 * n :] = 0  # rows past the last full block of this level
        pair = below[:, : 2 * n].unflatten(1, (n, 2))
        if reduce == "max":
            halves = pools[level - 1][:, : 2 * n].unflatten(1, (n, 2))
            # In-place ops on the views rather than ``out=`` a strided view: the same memory traffic, and torch.compile
            # traces it (``out=`` into a non-contiguous tensor breaks the graph).
            taken = route[:, :n].copy_(halves[:, :, 0]).ge_(halves[:, :, 1])  # 1.0 / 0.0; ties: first
            if level == 1:
                pair[:, :, 0].addcmul_(grad, taken)
                pair[:, :, 1].addcmul_(grad, taken.sub_(1).neg_())  # 1 - taken: exactly 0 or 1
            else:
                pair[:, :, 0].copy_(grad).mul_(taken)
                pair[:, :, 1].copy_(grad).mul_(taken.sub_(1).neg_())
        elif level == 1:
            pair += grad.unsqueeze(2) * 0.5
        else:
            pair.copy_(grad.unsqueeze(2).expand_as(pair)).mul_(0.5)
        grad = below
