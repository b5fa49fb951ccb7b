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
queries. Cost O(L D log L) time and O(L log L + L D) memory; the level logits and outputs are the
gather-free broadcasts of ``log_levels`` (shared with ``logsparse``), with a hand-written backward.

Key padding (``key_padding_mask`` (B, L), True = pad; LRA): a padded key gets no direct weight (self, raw
previous/next token) and is left out of every block's pooled query, pooled key and inner softmax; a block
without a real key is masked. A query left with nothing (a padded query whose raw neighbours and blocks are
all padding) falls back to its unpadded direct keys. The padded path pools each block straight from its
members instead of hierarchically; same O(L D log L) cost.
"""

from __future__ import annotations

import torch

from longseq.attention.base import Attention
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.ops.geometry import fenwick_blocks, num_log_levels
from longseq.attention.ops.log_levels import LevelMix, LevelScores
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
    ) -> None:
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, dropout=dropout)
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
        L = q.shape[-2]
        qs = self.scale(q)
        real = None if key_padding_mask is None else ~key_padding_mask.to(device=q.device, dtype=torch.bool).unsqueeze(1)
        self_logit = (qs * k).sum(-1, keepdim=True)  # (B, H, L, 1)
        past = _PastLevels(self, qs, k, v, real)
        logits = [self_logit, past.logits()]
        allowed = [torch.ones(L, 1, dtype=torch.bool, device=q.device), past.allowed]
        if not self.causal:
            future = _PastLevels(self, qs.flip(-2), k.flip(-2), v.flip(-2), None if real is None else real.flip(-1))
            logits.append(future.logits().flip(-2))
            allowed.append(future.allowed.flip(0))
        allowed = torch.cat(allowed, -1)  # (L, slots): [self, previous token, levels >= 1, (next token, levels)]
        n_levels = past.allowed.shape[-1]
        if real is not None:
            usable = [real.unsqueeze(-1), past.usable]
            if not self.causal:
                usable.append(future.usable.flip(-2))
            allowed = self.padded_allowed(allowed, torch.cat(usable, -1), n_levels)
        weights = torch.cat(logits, -1).masked_fill(~allowed, NEG_INF).softmax(-1)
        out = weights[..., :1] * v + past.output(weights[..., 1 : 1 + n_levels])
        if not self.causal:
            out = out + future.output(weights[..., 1 + n_levels :].flip(-2)).flip(-2)
        return out

    def padded_allowed(self, allowed: torch.Tensor, usable: torch.Tensor, n_levels: int) -> torch.Tensor:
        """The slots (B, 1, L, slots) a query may use under padding: geometry ``allowed`` (L, slots) and a real
        key / occupied block (``usable``); a row left empty keeps its unpadded direct slots (self, raw
        previous / next token)."""
        direct = torch.zeros(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
        direct[:2] = True  # self, previous token
        if not self.causal:
            direct[1 + n_levels] = True  # next token
        mask = allowed & usable
        return torch.where(mask.any(-1, keepdim=True), mask, allowed & direct)


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


class _PastLevels:
    """The causal candidates of one direction: raw previous token + one block summary per level >= 1.

    Works on strided chunk views, no gathers. At level l the sequence is cut into n_full = L >> l
    aligned chunks of size 2^l. A query in chunk j has bit l set iff j is odd, and then reads the
    summary of chunk j - 1. So only EVEN chunks are summarized and only ODD chunks query them: view
    the sequence as pairs (even chunk, odd chunk) of length 2^(l+1). When n_full is odd, the last
    full chunk is even and the positions after it (a partial chunk, possibly empty) read it.
    All per-level work is O(L D / 2), hence O(L D log L) in total.
    """

    def __init__(self, attn: CombinerLogsparseAttention, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 real: torch.Tensor | None = None) -> None:
        self.qs, self.k, self.v = qs, k, v
        L = qs.shape[-2]
        self.length = L
        self.n_levels = num_log_levels(L)
        _, valid = fenwick_blocks(L, qs.device)  # (L, levels); level 0 = p odd
        if self.n_levels == 0:  # L = 1: keep one always-masked "previous token" slot
            valid = torch.zeros(L, 1, dtype=torch.bool, device=qs.device)
        self.allowed = valid  # (L, max(levels, 1))
        self.k_bar, self.v_bar = [], []  # per level >= 1, even chunks only: (B, H, ceil(n_full / 2), D or Dv)
        if real is None:
            self._summarize(attn, qs, k, v)
        else:
            self._summarize_padded(attn, qs, k, v, real)

    def _summarize(self, attn: CombinerLogsparseAttention, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        summary = attn.summary
        q_pool, k_pool = summary.query_features(qs), summary.key_features(k)
        for level in range(1, self.n_levels):
            n_full = self.length >> level
            # a level-l chunk is two level-(l-1) chunks: pool hierarchically (exact for max and mean)
            q_pool = summary.reduce_over(q_pool[..., : 2 * n_full, :].unflatten(-2, (n_full, 2)), -2)
            k_pool = summary.reduce_over(k_pool[..., : 2 * n_full, :].unflatten(-2, (n_full, 2)), -2)
            q_bar = q_pool[..., 0::2, :]
            inner = (self._even_chunks(k, level) * q_bar.unsqueeze(-2)).sum(-1).softmax(-1)  # (B, H, n_even, 2^l)
            inner = attn.weight_dropout(inner)
            self.k_bar.append(k_pool[..., 0::2, :])
            self.v_bar.append((inner.unsqueeze(-1) * self._even_chunks(v, level)).sum(-2))

    def _summarize_padded(self, attn: CombinerLogsparseAttention, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          real: torch.Tensor) -> None:
        """Summaries over the real members of each block; ``real`` (B, 1, L) bool. Sets ``usable``
        (B, 1, L, levels): the slot's key is real / its block has a real member."""
        summary = attn.summary
        q_features, k_features = summary.query_features(qs), summary.key_features(k)
        usable = torch.zeros(*real.shape, self.allowed.shape[-1], dtype=torch.bool, device=real.device)
        usable[..., 1:, 0] = real[..., :-1]  # the raw previous token
        occupied_levels = []
        for level in range(1, self.n_levels):
            member = self._even_chunks(real.unsqueeze(-1), level).squeeze(-1)  # (B, 1, n_even, 2^l)
            occupied = member.any(-1)  # (B, 1, n_even)
            q_bar = summary.masked_reduce(self._even_chunks(q_features, level), member)
            logits = (self._even_chunks(k, level) * q_bar.unsqueeze(-2)).sum(-1)  # (B, H, n_even, 2^l)
            # an empty block gets any finite inner row (all members); its summary slot is masked
            inner = logits.masked_fill(~(member | ~occupied.unsqueeze(-1)), NEG_INF).softmax(-1)
            inner = attn.weight_dropout(inner)
            self.k_bar.append(summary.masked_reduce(self._even_chunks(k_features, level), member))
            self.v_bar.append((inner.unsqueeze(-1) * self._even_chunks(v, level)).sum(-2))
            occupied_levels.append(occupied)
        self._spread(usable, occupied_levels)
        self.usable = usable

    def _spread(self, columns: torch.Tensor, per_block: list[torch.Tensor]) -> None:
        """Write per-block values of every level >= 1 ((..., n_even) each) into ``columns`` (..., L, levels) at the
        positions that read that block (the odd chunks and the tail)."""
        for level, values in enumerate(per_block, start=1):
            column = columns[..., level]  # (..., L) view
            n_pairs = (self.length >> level) // 2
            self._odd_chunks(column, level)[...] = values[..., :n_pairs, None]
            tail = self._tail(level)
            if tail is not None:
                column[..., tail] = values[..., -1:]

    def _even_chunks(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """Strided view of the even full chunks of size 2^level: (B, H, ceil(n_full / 2), 2^level, ...)."""
        n_full = self.length >> level
        return x[..., : n_full << level, :].unflatten(-2, (n_full, 1 << level))[..., 0::2, :, :]

    def _odd_chunks(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """Strided view of the odd full chunks: (B, H, n_full // 2, 2^level, ...) (dims after L kept)."""
        size, n_pairs = 1 << level, (self.length >> level) // 2
        return x[:, :, : n_pairs * 2 * size].unflatten(2, (n_pairs, 2 * size))[:, :, :, size:]

    def _tail(self, level: int) -> slice | None:
        """Positions after the last full chunk that read its summary (n_full odd), or None."""
        n_full = self.length >> level
        start = n_full << level
        return slice(start, self.length) if n_full % 2 == 1 and start < self.length else None

    def logits(self) -> torch.Tensor:
        """(B, H, L, levels) logits [previous token, level 1, ...]; unused slots hold -inf
        (L = 1: one slot holding 0, always masked by the caller).

        Level 0 is the raw previous token (a position), levels >= 1 the even blocks' summary keys: one
        gather-free ``LevelScores`` call (``log_levels``) with a hand-written backward.
        """
        qs, k = self.qs, self.k
        B, H, L, D = qs.shape
        if self.n_levels == 0:  # L = 1: the one always-masked slot
            return qs.new_zeros(B, H, L, 1)
        summaries = [None, *(k_bar.reshape(B * H, -1, k_bar.shape[-1]) for k_bar in self.k_bar)]
        scores = LevelScores.apply(qs.reshape(B * H, L, D), k.reshape(B * H, L, D), False, *summaries)
        return scores.view(B, H, self.n_levels, L).transpose(-1, -2)

    def output(self, weights: torch.Tensor) -> torch.Tensor:
        """Weights (B, H, L, levels) of [previous token, level 1, ...] -> their output part (B, H, L, Dv)."""
        v = self.v
        B, H, L, Dv = v.shape
        if self.n_levels == 0:
            return torch.zeros_like(v)
        summaries = [None, *(v_bar.reshape(B * H, -1, Dv) for v_bar in self.v_bar)]
        w = weights.transpose(-1, -2).reshape(B * H, self.n_levels, L)
        return LevelMix.apply(w, v.reshape(B * H, L, Dv), False, *summaries).view(B, H, L, Dv)
