"""NSA, Native Sparse Attention (DeepSeek 2025, arXiv 2502.11089): three branches per query, mixed by gates.

- **compression**: keys and values of blocks of ``compress_block`` l tokens taken every ``compress_stride`` d tokens
  are pooled into one token per block; the query attends the pooled tokens (causal: the blocks already complete);
- **selection**: the sequence is cut into selection blocks of ``block_size`` l' (the grid of ``BlockGrid``); block s
  is scored by the compression branch's probabilities of the compression blocks that overlap it, and the query
  attends, at full resolution, the ``select_blocks`` n best blocks (causal: up to itself). The first block and the
  ``local_blocks`` latest blocks (the query's own and the ones just before it) are always selected and count
  toward n, as in the open implementations (paper: l = 32, d = 16, l' = 64, n = 16 with 1 + 2 forced);
- **window**: a sliding window of ``window`` w keys (causal: the last w up to self; bidirectional: ``|i - j| <=
  w // 2``, the ``local`` pattern).

Each branch is its own softmax; the output is ``g_cmp o_cmp + g_sel o_sel + g_win o_win``. The paper computes the
gates from the layer input x; the attention contract carries only q, k, v, so here the gates are
``sigmoid(Linear(D, 3)(q))`` of each head's own (unscaled) query. ``gates=normalized`` (default) divides them by
their sum over the branches the query has (early causal queries have no complete compression block), so every
row of ``attention_matrix`` sums to one like every other registered variant; ``gates=sigmoid`` keeps the paper's
unnormalized gates (``normalized_rows`` False for that build).

Compression (``compress``): ``mean`` pools keys and values by the mean of the block (parameter-free); ``mlp``
compresses the keys with a small learned MLP of the block's keys plus an intra-block position embedding (the
paper's phi) and the values by a learned softmax over the block's positions. The values stay a linear pool of the
original tokens in both modes, and the learned key map only moves logits, so ``attention_matrix`` (the effective
weights over the original tokens: ``g_cmp p_cmp W_pool + g_sel P_sel + g_win P_win``) stays exact and
``matrix_is_exact`` holds for both; a learned map of the values would make it approximate.

Key padding (``ops.padding``): compression blocks pool their real tokens only (an MLP sees padded keys as zeros) and
a block without one is unusable; selection blocks without a real key are never chosen; padded keys get no weight;
a selection or window branch left without a real key falls back to its unpadded keys (own block, window), an empty
compression branch drops out of the gates. Decoding (causal): a KV cache plus every compression block's pooled key
and value, computed once when the block completes; a step recomputes the n best blocks from them, as ``forward``.

Cost O(L (L / d + n l' + w) D): the compression logits are dense over the L / d pooled tokens (as in the paper;
on the CPU engine, causal, in eight query chunks, each over the tokens pooled by its end).
Without key padding the forced selection blocks (own, local, first) are whole-sequence block products and only the
free picks are (query, block) pairs in tiles of queries sharing one block (``ops.block_select.grouped_attention``);
a causal window of one block reuses the own-block part (``unpadded_selection_and_window``). Under key padding every
pick, and the window's neighbouring blocks, go through the tiles. Small matrix products, no per-query key copy,
never an ``L x L`` tensor. Decoding steps read a gathered key table. No
FlexAttention path yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.ops.block_select import (
    CPU_FLASH,
    TILED_PAIRS,
    Pairs,
    Part,
    block_attention,
    block_table,
    by_query_chunks,
    flash_inputs,
    gathered_attention,
    grouped_attention,
    lse_factors,
    merge_parts,
    score_dtype,
    scoring,
    sink_attention,
    top_blocks,
    weighted_sum,
)
from longseq.attention.ops.cpu.flash_lse import flash_lse, pad_for_flash
from longseq.attention.ops.decoding import KVCache
from longseq.attention.ops.flex.calls import FlexCall, same_block
from longseq.attention.ops.flex.selection import pair_bound, selected_blocks
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import NEG_INF, full_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention

COMPRESS_KINDS = ("mean", "mlp")
GATE_KINDS = ("normalized", "sigmoid")
# causal compression as flash calls over this many query chunks, each against the pooled tokens complete by its end:
# fwd + bwd at L = 16384 (B1 H8 D64, 255 pooled tokens) 1, 2, 4, 8 chunks took 1, 0.82, 0.68, 0.62 of one call's time
# (16 and 32 as 8)
COMPRESS_CHUNKS = 8


@dataclass
class NsaState(KVCache):
    """Decoding state of ``nsa``: the KV cache and the pooled keys and values of the completed compression blocks."""

    k_c: torch.Tensor | None = None
    v_c: torch.Tensor | None = None
    n_compressed: int = 0


@register_attention("nsa")
class NativeSparseAttention(BlockGrid, Attention):
    """NSA, causal or bidirectional.

    Args:
        block_size: the selection block l'; must divide the sequence length.
        compress_block: compression block length l; compress_stride: its stride d (default l // 2, at least 1).
        select_blocks: n, selection blocks per query, the forced first and local blocks included.
        local_blocks: the query's own block and the ones before it always selected (at least 1: the own block).
        window: sliding window w.
        compress: ``mean`` or ``mlp`` (learned key compression; needs ``head_dim``).
        gates: ``normalized`` (default: rows sum to one) or ``sigmoid`` (the paper's).
        seq_len, n_heads, head_dim, dropout: see ``Attention`` (dropout on each branch's weights).
    """

    pattern_from_data = True  # top-k blocks by score
    supports_padding_mask = True
    supports_decoding = True
    has_parameters = True
    cpu_flash = CPU_FLASH
    host_reads, xla_path = TILED_PAIRS, True  # the xla backend: static tiles

    def __init__(self, *, causal: bool, block_size: int, compress_block: int = 32, compress_stride: int | None = None,
                 select_blocks: int = 16, local_blocks: int = 2, window: int = 512, compress: str = "mean",
                 gates: str = "normalized", **base) -> None:
        super().__init__(causal=causal, block_size=block_size, **base)
        self.compress_block = check_int_knob(compress_block, "attention.compress_block")
        stride = max(self.compress_block // 2, 1) if compress_stride is None else compress_stride
        self.compress_stride = check_int_knob(stride, "attention.compress_stride")
        if self.compress_stride > self.compress_block:
            raise AttentionConfigError(
                f"attention.compress_stride={stride} exceeds attention.compress_block={compress_block}: tokens "
                "between blocks would be in no compression block; choose a stride <= the block length")
        self.local_blocks = check_int_knob(local_blocks, "attention.local_blocks")
        self.select_blocks = check_int_knob(select_blocks, "attention.select_blocks")
        if self.select_blocks < 1 + self.local_blocks:
            raise AttentionConfigError(
                f"attention.select_blocks={select_blocks} cannot hold the first block and attention.local_blocks="
                f"{local_blocks} local blocks that are always selected; choose at least {1 + self.local_blocks}")
        self.window = check_int_knob(window, "attention.window")
        if compress not in COMPRESS_KINDS:
            raise AttentionConfigError(f"attention.compress={compress!r} is not valid; choose one of {COMPRESS_KINDS}")
        if gates not in GATE_KINDS:
            raise AttentionConfigError(f"attention.gates={gates!r} is not valid; choose one of {GATE_KINDS}")
        if self.head_dim is None:
            raise AttentionConfigError("attention 'nsa' needs head_dim (set by the model) for its query gates")
        self.compress, self.gates = compress, gates
        self.normalized_rows = gates == "normalized"
        D, l = self.head_dim, self.compress_block
        self.gate = nn.Linear(D, 3)
        if compress == "mlp":
            self.position = nn.Parameter(torch.zeros(l, D))  # intra-block position embedding of the keys
            self.key_mlp = nn.Sequential(nn.Linear(l * D, D), nn.GELU(), nn.Linear(D, D))
            self.value_logits = nn.Parameter(torch.zeros(l))  # the values' learned pool over positions

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, compress_block={self.compress_block}, "
                f"compress_stride={self.compress_stride}, select_blocks={self.select_blocks}, "
                f"local_blocks={self.local_blocks}, window={self.window}, compress={self.compress}, gates={self.gates}")

    # -- the pieces forward, the dense reference and decoding share ----------------------------------------------
    def n_compressed(self, length: int) -> int:
        """Compression blocks of a length-``length`` sequence (complete blocks only)."""
        l, d = self.compress_block, self.compress_stride
        return 0 if length < l else (length - l) // d + 1

    def pool_weights(self, real: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Value pooling weights ``(B|1, 1, C|1, l)`` over each compression block's positions, summing to one over
        its real members (``real`` ``(B, 1, C, l)`` bool or None); an empty block gets zeros (unusable)."""
        l = self.compress_block
        logits = self.value_logits.to(like.dtype) if self.compress == "mlp" else like.new_zeros(l)
        logits = logits.view(1, 1, 1, l)
        if real is not None:
            logits = logits.masked_fill(~real, NEG_INF)
            return logits.softmax(-1).nan_to_num(0.0)
        return logits.softmax(-1)

    def compressed(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None):
        """The compression branch's keys and values ``(B, H, C, .)`` pooled from k, v ``(B, H, L, .)`` over the real
        tokens (``real`` ``(B, L)`` or None), and ``compressed_ok`` ``(B|1, 1, L, C)``: the query at each position may
        use the block (causal: complete; padded: it holds a real token)."""
        L = k.shape[-2]
        C, l, d = self.n_compressed(L), self.compress_block, self.compress_stride
        real_c = None if real is None else real.unfold(1, l, d).unsqueeze(1)  # (B, 1, C, l)
        if C and self.compress == "mean" and real is None and l % d == 0 and L % d == 0:
            k_c, v_c = self.mean_pool(k, C), self.mean_pool(v, C)
        elif C:
            k_c, v_c = self.compress_blocks(*(x.unfold(2, l, d).transpose(-1, -2) for x in (k, v)), real_c)
        else:
            k_c, v_c = k[:, :, :0], v[:, :, :0]
        compressed_ok = self.compressed_allowed(torch.arange(L, device=k.device), C).view(1, 1, L, C)
        if real_c is not None:
            compressed_ok = compressed_ok & real_c.any(-1).unsqueeze(-2)
        return k_c, v_c, compressed_ok

    def compress_blocks(self, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                        real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled keys and values ``(B, H, C, D)`` of compression blocks ``(B, H, C, l, D)``."""
        weights = self.pool_weights(real, v_blocks)
        v_c = (weights.unsqueeze(-2).to(v_blocks.dtype) @ v_blocks).squeeze(-2)
        if self.compress == "mean":
            return (weights.unsqueeze(-2).to(k_blocks.dtype) @ k_blocks).squeeze(-2), v_c
        if real is not None:
            k_blocks = k_blocks * real.unsqueeze(-1).to(k_blocks.dtype)
        return self.map_keys(k_blocks), v_c

    def mean_pool(self, x: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """``compress=mean`` without key padding where the stride d divides l and L: the means of the ``n_blocks``
        compression blocks ``(B, H, C, D)`` of ``x`` ``(B, H, L, D)`` as the mean of l / d consecutive means of d tokens
        (fwd + bwd at L = 16384, B1 H8 D64: 0.03 s, where unfolded blocks took 0.18 s)."""
        B, H, L, D = x.shape
        r = self.compress_block // self.compress_stride
        chunks = x.view(B, H, L // self.compress_stride, self.compress_stride, D).mean(-2)
        total = chunks[:, :, :n_blocks]
        for j in range(1, r):
            total = total + chunks[:, :, j : j + n_blocks]
        return total / r

    def map_keys(self, k_blocks: torch.Tensor) -> torch.Tensor:
        """The learned key compression (``compress=mlp``): ``(..., l, D)`` block keys -> ``(..., D)``."""
        x = (k_blocks.to(self.position.dtype) + self.position).flatten(-2)
        return self.key_mlp(x).to(k_blocks.dtype)

    def gate_values(self, q: torch.Tensor, has_compressed: torch.Tensor) -> torch.Tensor:
        """Gates ``(B, H, T, 3)`` (compression, selection, window) from unscaled ``q`` ``(B, H, T, D)``;
        ``has_compressed`` ``(B|1, 1|H, T, 1)`` bool: the query has a usable compression block."""
        gates = torch.sigmoid(self.gate(q.to(self.gate.weight.dtype))).to(q.dtype)  # bf16 q, fp32 module
        gates = gates * torch.cat([has_compressed.to(gates.dtype).expand_as(gates[..., :1]), torch.ones_like(gates[..., 1:])], -1)
        return gates / gates.sum(-1, keepdim=True) if self.gates == "normalized" else gates

    def compressed_allowed(self, positions: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """``(T, C)`` bool: the query at each position may use compression block c (causal: block complete)."""
        if not self.causal:
            return torch.ones(positions.numel(), n_blocks, dtype=torch.bool, device=positions.device)
        ends = torch.arange(n_blocks, device=positions.device) * self.compress_stride + self.compress_block - 1
        return ends.view(1, -1) <= positions.view(-1, 1)

    def overlap(self, n_blocks: int, n_select: int, device) -> torch.Tensor:
        """``(C, S)`` float: compression block c overlaps selection block s."""
        start = torch.arange(n_blocks, device=device) * self.compress_stride
        s = torch.arange(n_select, device=device) * self.block_size
        return ((start.view(-1, 1) < s.view(1, -1) + self.block_size)
                & (s.view(1, -1) < start.view(-1, 1) + self.compress_block)).float()

    def choose(self, qs, k_c, compressed_ok, positions, n_select, occupied=None):
        """The selection rule: importance of each selection block = the compression probabilities of the blocks
        overlapping it (fp32 scores, autocast off); forced = block 0 and the ``local_blocks`` latest; top n.

        qs ``(B, H, T, D)``, k_c ``(B, H, C, D)``, compressed_ok ``(B|1, 1, T, C)``, positions ``(T,)``;
        ``occupied`` ``(B, 1, 1, S)`` (blocks with a real key) or None. Returns ``(blocks, ok)`` ``(B, H, T, n)``.
        Rows are independent: they are scored in chunks (``ops.block_select.by_query_chunks``)."""
        B, H, T, _ = qs.shape

        def rows(qs_, compressed_ok_, positions_):
            return self.choose_rows(qs_, k_c, compressed_ok_, positions_, n_select, occupied)

        return by_query_chunks(rows, T, B * H * (k_c.shape[-2] + 8) * 4, qs.device, qs, compressed_ok, positions)

    def choose_rows(self, qs, k_c, compressed_ok, positions, n_select, occupied=None):
        """``choose`` on one chunk of query rows (the same arguments)."""
        with scoring(qs), torch.no_grad():  # in place: no copies of the (T, C) scores
            dtype = score_dtype(qs)
            extra = -k_c.shape[-2] % 8  # masked zero keys up to a multiple of 8: the product took 0.7x the time
            k_c = torch.nn.functional.pad(k_c.to(dtype), (0, 0, 0, extra))
            allowed = torch.nn.functional.pad(compressed_ok, (0, extra), value=False)
            logits = (qs.to(dtype) @ k_c.transpose(-1, -2)).masked_fill_(~allowed, NEG_INF)
            importance = self.importance(logits.softmax(-1).nan_to_num_(0.0), n_select)  # no block: all zero
        choosable, forced = self.selectable(positions, n_select)
        if occupied is not None:
            choosable = choosable & occupied
        score = importance.masked_fill_(~choosable, NEG_INF).masked_fill_(forced & choosable, float("inf"))
        return top_blocks(score, self.select_blocks)

    def selectable(self, positions: torch.Tensor, n_select: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, S)`` bool each: the selection blocks the query at each position may choose (causal: up to its own) and
        the ones always chosen (block 0 and the ``local_blocks`` latest)."""
        own = positions // self.block_size
        s = torch.arange(n_select, device=positions.device)
        choosable = (s.view(1, -1) <= own.view(-1, 1)) if self.causal else torch.ones(
            own.numel(), n_select, dtype=torch.bool, device=positions.device)
        forced = (s.view(1, -1) == 0) | ((s.view(1, -1) <= own.view(-1, 1))
                                          & (s.view(1, -1) > own.view(-1, 1) - self.local_blocks))
        return choosable, forced

    def selection_regions(self, length: int, device: torch.device | None = None) -> Partition:
        """What a query can use, as a ``Partition`` (not a joint softmax: NSA mixes three branches): direct = its
        window and its forced selection blocks (block 0 and the ``local_blocks`` latest; causal: up to self), read at
        full resolution whatever the scores; regions = the other selection blocks it may choose (family 0: picked by
        the compression scores, then read at full resolution) and the compression blocks it may use (family 1: a
        pooled token each, a query-independent summary). For the recall study's structural column
        (``longseq.report.recall_structure``)."""
        S, m = self.grid(length).n_rows, self.block_size
        pos = torch.arange(length, device=device)
        causal = full_mask(length, self.causal, device)
        choosable, forced = self.selectable(pos, S)
        block = pos // m
        back, ahead = self.reach(length)
        offset = pos.view(-1, 1) - pos.view(1, -1)
        direct = (((offset <= back) & (-offset <= ahead)) | forced[:, block]) & causal
        select_members = torch.arange(S, device=device).view(S, 1) == block.view(1, -1)
        C = self.n_compressed(length)
        starts = torch.arange(C, device=device).view(C, 1) * self.compress_stride
        compress_members = (pos.view(1, -1) >= starts) & (pos.view(1, -1) < starts + self.compress_block)
        members = torch.cat([select_members, compress_members])
        usable = torch.cat([choosable & ~forced, self.compressed_allowed(pos, C)], -1)
        family = torch.cat([torch.zeros(S, dtype=torch.long, device=device),
                            torch.ones(C, dtype=torch.long, device=device)])
        return Partition.from_candidates(direct, members, usable, family)

    def importance(self, probs: torch.Tensor, n_select: int) -> torch.Tensor:
        """Each selection block's importance ``(B, H, T, S)``: the sum of the compression probabilities ``probs``
        ``(B, H, T, C)`` of the compression blocks overlapping it. Where the stride d divides l and l', block s
        overlaps the w = (l + l') / d - 1 blocks from s l' / d - l / d + 1 on: w strided adds (0.55x the time of the
        product with the dense ``overlap`` matrix at L = 16384), in a fixed order, the same for every caller."""
        l, d, m = self.compress_block, self.compress_stride, self.block_size
        C = probs.shape[-1]
        if l % d or m % d:
            return probs @ self.overlap(C, n_select, probs.device).to(probs.dtype)
        r, w, first = m // d, (l + m) // d - 1, l // d - 1  # block s: compression blocks s r - first + j, j < w
        total = probs.new_zeros(*probs.shape[:-1], n_select)
        for j in range(w):
            s0, s1 = max(0, -(-(first - j) // r)), min(n_select - 1, (C - 1 + first - j) // r)
            if s0 <= s1:
                c0 = s0 * r - first + j
                total[..., s0 : s1 + 1] += probs[..., c0 : c0 + (s1 - s0) * r + 1 : r]
        return total

    def reach(self, length: int) -> tuple[int, int]:
        """The window as ``(back, ahead)``: keys j with ``i - back <= j <= i + ahead``."""
        if self.causal:
            return min(self.window, length) - 1, 0
        half = min(self.window // 2, length - 1)
        return half, half

    def unpadded_selection_and_window(self, qs, k, v, chosen, ok, m: int, dropout: float, flash):
        """The selection and window branches without key padding ``(selection, window)``: each a list of parts of the
        branch's one softmax (``mix`` joins them) or a ``(B, H, L, Dv)`` output. Every query's forced blocks are
        always among its chosen ones here, so they run as whole-sequence products, parts of the selection's one
        softmax: its own block (``block_attention``, causal: up to self), the ``local_blocks - 1`` blocks before it
        (shifted block products) and block 0 for the queries past the local blocks (``sink_attention``); only the
        free picks go through the tiled (query, block) pairs. A causal window of one block (w = l', the default) is
        that own-block part plus a band of the block before, so it reuses the part (not under dropout: the branches
        would share its mask); other windows: ``window_attention``."""
        B, H, L, _ = qs.shape
        n = L // m
        everything = torch.ones(1, 1, 1, m, m, dtype=torch.bool, device=qs.device)
        own = block_attention(qs, k, v, m, full_mask(m, self.causal, qs.device).view(1, 1, 1, m, m), dropout, flash)
        parts = [own] + [block_attention(qs, k, v, m, everything, dropout, flash, shift=j)
                         for j in range(1, min(self.local_blocks, n))]
        if n > self.local_blocks:
            parts.append(sink_attention(qs, k, v, m, self.local_blocks * m, dropout, flash))
        own_block = (torch.arange(L, device=qs.device) // m).view(1, 1, L, 1)
        forced = (chosen == 0) | ((chosen <= own_block) & (chosen > own_block - self.local_blocks))
        members = torch.arange(L, device=qs.device).view(n, m)
        member_ok = torch.ones(1, n, m, dtype=torch.bool, device=qs.device)
        parts.append(grouped_attention(qs, k, v, members, member_ok, chosen, ok & ~forced, dropout=dropout,
                                       flash=flash))
        if self.causal and self.window == m and not dropout:
            band = torch.ones(m, m, dtype=torch.bool, device=qs.device).triu(1).view(1, 1, 1, m, m)  # j > i - m
            return parts, [own, block_attention(qs, k, v, m, band, 0.0, flash, shift=1)]
        return parts, self.window_attention(qs, k, v, None, *self.reach(L), dropout, flash)

    def padded_selection_and_window(self, qs, k, v, real, chosen, ok, m: int, dropout: float, flash):
        """The selection and window branches under key padding, each ``(B, H, L, Dv)``: every chosen block as tiled
        (query, block) pairs (causal: band-limited to the past), a query left without a real key falls back to its
        unpadded own block; the window's neighbouring blocks the same way (``window_attention``)."""
        B, _, L, _ = qs.shape
        members = torch.arange(L, device=qs.device).view(-1, m)
        causal = (L, 0) if self.causal else None
        out_s, lse, _ = merge_parts([grouped_attention(qs, k, v, members, real.view(B, -1, m), chosen, ok, causal,
                                                       dropout=dropout, flash=flash)])
        own = block_attention(qs, k, v, m, full_mask(m, self.causal, qs.device).view(1, 1, 1, m, m), dropout, flash)
        out_s = torch.where((lse > NEG_INF).unsqueeze(-1), out_s, own.out)  # rule 3: the unpadded own block
        return out_s, self.window_attention(qs, k, v, real, *self.reach(L), dropout, flash)

    def mix(self, gates: torch.Tensor, branches: list) -> torch.Tensor:
        """``g_cmp o_cmp + g_sel o_sel + g_win o_win`` from the gates ``(B, H, L, 3)`` and the three branches, each an
        output ``(B, H, L, Dv)`` or a list of the parts of its one softmax, as one ``weighted_sum``: a part weighs its
        branch's gate times its share of the branch's softmax (``lse_factors``); a part of two branches (the own
        block) is one term."""
        B, H, L, _ = gates.shape
        weights: dict[int, torch.Tensor] = {}  # id(part) -> its weight, summed over the branches it is in
        parts: dict[int, Part | Pairs] = {}
        for gate, branch in zip(gates.unbind(-1), branches):
            if isinstance(branch, torch.Tensor):
                branch, factors = [Part(branch, None)], [1.0]
            else:
                factors = lse_factors(branch)[0]
            for factor, part in zip(factors, branch):
                weight = factor * (gate.reshape(-1)[part.query] if isinstance(part, Pairs) else gate[:, :, part.start:])
                weights[id(part)] = weights[id(part)] + weight if id(part) in weights else weight
                parts[id(part)] = part
        return weighted_sum([(weights[key], part) for key, part in parts.items()], (B, H, L))

    def compressed_flash(self, q_p: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor,
                         compressed_ok: torch.Tensor) -> torch.Tensor:
        """The compression branch as fused CPU flash calls: padded queries ``q_p`` ``(B, H, L, D + 1)``, pooled keys
        and values ``(B, H, C, D)``, ``compressed_ok`` ``(B|1, 1, L, C)`` -> ``(B, H, L, D)``. Causal: the queries in
        ``COMPRESS_CHUNKS`` chunks, each against the pooled tokens complete by its end only (the others are masked for
        all of its queries): eight chunks take about 9/16 of the dense ``(L, C)`` products."""
        k_p, v_p = pad_for_flash(k_c, 0.0), pad_for_flash(v_c, 1.0)
        if not self.causal:
            return flash_lse(q_p, k_p, v_p, compressed_ok)[0]
        B, H, L, _ = q_p.shape
        bounds = [L * i // COMPRESS_CHUNKS for i in range(COMPRESS_CHUNKS + 1)]
        outs = []
        # split by sizes: one backward node (tensor_split and slices each zero-fill a gradient of all of q_p)
        chunks = q_p.split([b - a for a, b in zip(bounds, bounds[1:])], 2)
        for a, b, q_chunk in zip(bounds, bounds[1:], chunks):
            c = self.n_compressed(b)  # the pooled tokens complete by the chunk's last query
            outs.append(flash_lse(q_chunk, k_p[:, :, :c], v_p[:, :, :c], compressed_ok[..., a:b, :c])[0] if c
                        else v_c.new_zeros(B, H, b - a, v_c.shape[-1]))
        return torch.cat(outs, 2)

    def window_attention(self, qs, k, v, real, back: int, ahead: int, dropout: float, flash) -> torch.Tensor:
        """The window branch of ``forward``: positions in blocks of ``b = max(back, ahead, 1)`` (the last one padded),
        each query paired with its own block and the neighbours its reach touches (``grouped_attention``);
        ``real`` ``(B, L)`` or None; a query whose window holds no real key falls back to its unpadded window."""
        B, H, L, _ = qs.shape
        if real is None and flash is not None:
            return self.window_flash(flash, back, ahead)
        b = max(back, ahead, 1)
        n = -(-L // b)
        members = torch.arange(n * b, device=qs.device).view(n, b)
        inside = (members < L).unsqueeze(0)
        members = members.clamp(max=L - 1)
        own = torch.arange(L, device=qs.device) // b
        steps = torch.arange(-1 if back else 0, 2 if ahead else 1, device=qs.device)
        chosen = (own.view(L, 1) + steps).clamp(0, n - 1).view(1, 1, L, -1).expand(B, qs.shape[1], L, -1)
        ok = ((own.view(L, 1) + steps >= 0) & (own.view(L, 1) + steps < n)).view(1, 1, L, -1).expand_as(chosen)
        pairs = lambda allowed: grouped_attention(qs, k, v, members, allowed, chosen, ok, (back, ahead),  # noqa: E731
                                                  dropout=dropout, flash=flash)
        if real is None:
            return merge_parts([pairs(inside)]).out
        out, lse, _ = merge_parts([pairs(inside & real[:, members])])
        return torch.where((lse > NEG_INF).unsqueeze(-1), out, merge_parts([pairs(inside)]).out)

    def window_flash(self, flash, back: int, ahead: int) -> torch.Tensor:
        """The window branch without key padding as one fused flash call: queries in the grid's blocks of c, each
        block against the span of ``back + c + ahead`` keys around it (from the keys padded by back and ahead
        positions), under one band mask per block (keys outside the sequence masked)."""
        B, H, L, D = flash.q.shape
        D -= 1  # the padded inputs' extra column
        c = self.grid(L).n_cols
        n, span = L // c, back + c + ahead
        device = flash.q.device
        t = torch.arange(span, device=device)
        rows = (torch.arange(n, device=device).view(n, 1) * c + t).flatten()  # (n span) rows of the padded keys
        r = torch.arange(c, device=device).view(c, 1)
        key_pos = (torch.arange(n, device=device) * c - back).view(n, 1, 1) + t  # (n, 1, span)
        allowed = (t >= r) & (t <= r + back + ahead) & (key_pos >= 0) & (key_pos < L)  # (n, c, span)

        def keys(x):
            x = x.view(B * H, L, D + 1)
            x = torch.cat([x.new_zeros(B * H, back, D + 1), x, x.new_zeros(B * H, ahead, D + 1)], 1)
            return x.index_select(1, rows).view(B * H, n, span, D + 1)

        q_b = flash.q.view(B * H, n, c, D + 1)
        out = flash_lse(q_b, keys(flash.k), keys(flash.v), allowed.unsqueeze(0))[0]
        return out.reshape(B, H, L, D)

    def window_table(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, W)`` key positions of each query's window and which exist (``0 <= j < length``)."""
        if self.causal:
            width = min(self.window, length)
            idx = positions.view(-1, 1) - width + 1 + torch.arange(width, device=positions.device)
        else:
            half = min(self.window // 2, length - 1)
            idx = positions.view(-1, 1) + torch.arange(-half, half + 1, device=positions.device)
        valid = (idx >= 0) & (idx < length)
        return idx.clamp(0, length - 1), valid

    # -- the contract ------------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, Dv); ``key_padding_mask`` (B, L) bool, True = padded key."""
        B, H, L, _ = q.shape
        grid = self.grid(L)
        S, m = grid.n_rows, grid.n_cols
        qs = self.scale(q)
        pos = torch.arange(L, device=q.device)
        drop = self.dropout if self.training else 0.0
        real = None if key_padding_mask is None else ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        flash = flash_inputs(self, q, k, v, qs, key_padding_mask)

        # compression: blocks of l every d tokens, pooled; one dense softmax over the L / d pooled tokens
        k_c, v_c, compressed_ok = self.compressed(k, v, real)
        C = k_c.shape[-2]
        has_compressed = compressed_ok.any(-1, keepdim=True)
        if C and flash is not None:  # fused CPU flash calls; a query without a usable block gets 0
            out_c = self.compressed_flash(flash.q, k_c, v_c, compressed_ok)
        else:
            logits = (qs @ k_c.transpose(-1, -2)).masked_fill(~compressed_ok, NEG_INF)
            out_c = self.weight_dropout(logits.softmax(-1).nan_to_num(0.0)) @ v_c

        # selection: the n best selection blocks at full resolution (causal: up to self); window: the last w keys
        occupied = None if real is None else real.view(B, 1, 1, S, m).any(-1)
        chosen, ok = self.choose(qs, k_c, compressed_ok, pos, S, occupied)
        if real is None:
            selection, window = self.unpadded_selection_and_window(qs, k, v, chosen, ok, m, drop, flash)
        else:
            selection, window = self.padded_selection_and_window(qs, k, v, real, chosen, ok, m, drop, flash)
        return self.mix(self.gate_values(q, has_compressed), [out_c, selection, window])

    # -- the flex layout (``ops.flex``): one group a branch (its own softmax), mixed by the gates -----------------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        """Compression: the queries against the pooled tokens alone (causal: the complete blocks); selection: the
        forced blocks (block 0, the own block and the ``local_blocks - 1`` before it; causal: up to self) as a static
        call, the free picks on gathered queries (``flex_extra_parts``); window: the band. Block 0, which every query
        attends, is that call's regions (one key each) rather than its direct keys, so its key tiles are copied
        per query rows as summaries are (``FlexCall.summary_copies``)."""
        L, m, causal = length, self.block_size, self.causal
        l, d, local = self.compress_block, self.compress_stride, self.local_blocks
        C = self.n_compressed(L)
        back, ahead = self.reach(L)

        def complete(b, h, q, c):
            return (c * d + l - 1 <= q) if causal else c >= 0

        def compressed_members():
            start = torch.arange(C, device=device).view(C, 1) * d
            pos = torch.arange(L, device=device).view(1, L)
            return (pos >= start) & (pos < start + l)

        def forced(b, h, q, kv):  # block 0: the regions below
            own, block = q // m, kv // m
            ok = (block > 0) & (block <= own) & (block > own - local)
            return ok & (kv <= q) if causal else ok

        def first_block_usable(b, h, q, r):
            return r <= q if causal else r >= 0

        def first_block_members():
            return torch.eye(m, L, dtype=torch.bool, device=device)

        def first_block(qs, k, v, real):
            return k[..., :m, :], v[..., :m, :], None if real is None else real[:, :m]

        def window(b, h, q, kv):
            return (q - kv <= back) & (kv - q <= ahead)

        return [FlexCall(None, None, C, complete, compressed_members, group=0),
                FlexCall(forced, n_regions=m, usable=first_block_usable, members=first_block_members,
                         summaries=first_block, group=1, fallback=same_block(m, causal), key_regions=True),
                FlexCall(window, group=2)]

    def flex_batch_state(self, qs, k, v, real, tile):
        """The pooled tokens, which queries have one, and each query's selection (``choose``, as ``forward``)."""
        B, _, L, _ = qs.shape
        S, m = L // self.block_size, self.block_size
        k_c, v_c, compressed_ok = self.compressed(k, v, real)
        occupied = None if real is None else real.view(B, 1, 1, S, m).any(-1)
        chosen, ok = self.choose(qs, k_c, compressed_ok, torch.arange(L, device=qs.device), S, occupied)
        own = (torch.arange(L, device=qs.device) // m).view(1, 1, L, 1)
        forced = (chosen == 0) | ((chosen <= own) & (chosen > own - self.local_blocks))
        occupied_c = None if real is None else compressed_ok.any(-2).squeeze(1)  # (B, C): a real token pooled
        return k_c, v_c, occupied_c, compressed_ok.any(-1), chosen, ok & ~forced

    def flex_summaries(self, index, qs, k, v, real, state=None):
        return state[:3]

    def flex_extra_parts(self, state, q, k, v, real, tile):
        chosen, free = state[4:]
        most = self.free_pairs(q.shape[-2], padded=real is not None)
        return [(1, *selected_blocks(q, k, v, chosen, free, self.block_size, tile, real, causal=self.causal,
                                     most_pairs=most))]

    def free_pairs(self, length: int, padded: bool) -> int:
        """The most free (not forced) picks at ``length`` (``ops.flex.selection.pair_bound``). A query of selection
        block s may choose c = s + 1 blocks (causal; S otherwise) and ``choose`` always takes its f forced ones
        (s + 1 for s < ``local_blocks``, else block 0 and the ``local_blocks`` latest), so it has min(n, c) - min(n,
        f) free picks (n = ``select_blocks``): one of the default four. Under key padding an empty forced block
        leaves its pick free, so the bound is min(n, c) there."""
        S, n, local = length // self.block_size, self.select_blocks, self.local_blocks

        def picks(s: int) -> int:
            choosable = s + 1 if self.causal else S
            forced = 0 if padded else (s + 1 if s < local else local + 1)
            return min(n, choosable) - min(n, forced)

        return pair_bound(length, self.block_size, picks)

    def flex_group_weights(self, state, q):
        has_compressed = state[3].unsqueeze(-1)  # (B|1, 1, L, 1)
        return self.gate_values(q, has_compressed)

    def branch_matrices(self, q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None = None):
        """Dense reference (small L): the gates ``(B, H, L, 3)`` and each branch's effective weights over the original
        tokens ``(B, H, L, L)``: compression ``p_cmp @ W_pool``, selection and window as masked softmaxes."""
        B, H, L, _ = q.shape
        grid = self.grid(L)
        S, m = grid.n_rows, grid.n_cols
        qs = self.scale(q)
        pos = torch.arange(L, device=q.device)
        real = torch.ones(B, L, dtype=torch.bool, device=q.device) if key_padding_mask is None else \
            ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        logits = qs @ k.transpose(-1, -2)

        C, l, d = self.n_compressed(L), self.compress_block, self.compress_stride
        starts = torch.arange(C, device=q.device) * d
        members = starts.view(C, 1) + torch.arange(l, device=q.device)  # (C, l) positions
        real_c = real[:, members].unsqueeze(1)  # (B, 1, C, l)
        pool = torch.zeros(B, 1, C, L, dtype=q.dtype, device=q.device)
        pool.scatter_(-1, members.view(1, 1, C, l).expand(B, 1, C, l), self.pool_weights(real_c, q).expand(B, 1, C, l))
        if self.compress == "mean":
            k_c = pool @ k
        else:
            k_blocks = k[:, :, members] * real_c.unsqueeze(-1).to(k.dtype)  # (B, H, C, l, D)
            k_c = self.map_keys(k_blocks)
        compressed_ok = self.compressed_allowed(pos, C).view(1, 1, L, C) & real_c.any(-1).unsqueeze(-2)
        probs = (qs @ k_c.transpose(-1, -2)).masked_fill(~compressed_ok, NEG_INF).softmax(-1).nan_to_num(0.0)
        p_cmp = probs @ pool

        block = pos // m
        causal = (pos.view(L, 1) >= pos.view(1, L)) | (not self.causal)
        chosen, ok = self.choose(qs, k_c, compressed_ok, pos, S, real.view(B, 1, 1, S, m).any(-1))
        picked = torch.zeros(B, H, L, S, dtype=torch.bool, device=q.device).scatter_(-1, chosen, ok)
        own = (block.view(L, 1) == block.view(1, L)) & causal
        allowed = picked[..., block] & causal & real.view(B, 1, 1, L)
        allowed = torch.where(allowed.any(-1, keepdim=True), allowed, own)
        p_sel = logits.masked_fill(~allowed, NEG_INF).softmax(-1)

        offset = pos.view(L, 1) - pos.view(1, L)
        band = ((offset >= 0) & (offset < self.window)) if self.causal else (offset.abs() <= self.window // 2)
        allowed = band & real.view(B, 1, 1, L)
        allowed = torch.where(allowed.any(-1, keepdim=True), allowed, band)
        p_win = logits.masked_fill(~allowed, NEG_INF).softmax(-1)
        return self.gate_values(q, compressed_ok.any(-1, keepdim=True)), p_cmp, p_sel, p_win

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) ``g_cmp p_cmp W_pool + g_sel P_sel + g_win P_win`` from ``branch_matrices`` (dense, small L)."""
        gates, p_cmp, p_sel, p_win = self.branch_matrices(q, k, key_padding_mask)
        return gates[..., :1] * p_cmp + gates[..., 1:2] * p_sel + gates[..., 2:] * p_win

    # -- incremental decoding ---------------------------------------------------------------------------------
    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> NsaState:
        return NsaState(batch_size, max_len, device, dtype)

    def step(self, state: NsaState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``; a compression block is pooled once,
        when its last token arrives."""
        t, _ = state.append(k, v)
        B, H = q.shape[:2]
        l, d, m = self.compress_block, self.compress_stride, self.block_size
        if state.k_c is None:
            C = max(self.n_compressed(state.max_len), 1)
            state.k_c = state.k.new_zeros(B, H, C, state.k.shape[-1])
            state.v_c = state.v.new_zeros(B, H, C, state.v.shape[-1])
        if t >= l - 1 and (t - l + 1) % d == 0:  # compression block c = (t - l + 1) / d just completed
            c, start = state.n_compressed, t - l + 1
            k_c, v_c = self.compress_blocks(state.k[:, :, None, start : t + 1], state.v[:, :, None, start : t + 1], None)
            state.k_c[:, :, c : c + 1], state.v_c[:, :, c : c + 1] = k_c, v_c
            state.n_compressed = c + 1
        C = state.n_compressed
        qs = self.scale(q)
        pos = torch.full((1,), t, dtype=torch.long, device=q.device)
        k_c, v_c = state.k_c[:, :, :C], state.v_c[:, :, :C]
        out_c = (qs @ k_c.transpose(-1, -2)).softmax(-1) @ v_c if C else torch.zeros_like(qs[..., :1]) * v[..., :1, :]
        g = t // m
        chosen, ok = self.choose(qs, k_c, torch.ones(1, 1, 1, C, dtype=torch.bool, device=q.device), pos, g + 1)
        idx, valid = block_table(chosen, ok, m)
        out_s = gathered_attention(qs, state.k, state.v, idx, valid & (idx <= t))
        w_idx, w_valid = self.window_table(pos, state.max_len)
        out_w = gathered_attention(qs, state.k, state.v, w_idx.view(1, 1, 1, -1), (w_valid & (w_idx <= t)).view(1, 1, 1, -1))
        gates = self.gate_values(q, torch.full((1, 1, 1, 1), C > 0, device=q.device))
        return gates[..., :1] * out_c + gates[..., 1:2] * out_s + gates[..., 2:] * out_w
