"""MoBA, Mixture of Block Attention (Moonshot 2025, arXiv 2502.13189): each query attends its own block and the
``top_k`` other blocks whose mean key scores highest against it, in one softmax.

The keys are cut into n = L / m blocks of ``block_size`` m (the grid of ``BlockGrid``). Block g' is scored for the
query at position i by ``q_i . mean(k over block g')`` (parameter-free gating). Causal: the query's own block
(keys up to and including itself) plus the ``top_k`` best EARLIER blocks; bidirectional: the whole own block plus
the ``top_k`` best OTHER blocks. ``top_k`` covering every block is full attention; ``top_k = 0`` is block-local
attention. Cost O(L (top_k + 1) m D + L n D): the n block scores per query; the own block as batched (m, m)
products; the chosen blocks as (query, block) pairs sorted by block into tiles of queries that share one block
(``ops.block_select.grouped_attention``, the varlen trick of the public MoBA code), so every product is a small
matrix product and no per-query copy of the keys is made; the parts merged by log-sum-exp. Never an ``L x L``
tensor.

Key padding (``ops.padding``): a block's mean key averages its real keys only, a block without a real key is never
chosen, padded keys get no weight, and a query left without a real key falls back to its unpadded own block.
Decoding (causal): a KV cache plus each block's mean key, computed once when the block completes; a step scores the
completed blocks, keeps the ``top_k`` best and attends them and its own block, as ``forward`` does. Public MoBA
code falls back to dense attention to decode; this one does not. FlexAttention (``attention.backend=flex``, auto on
CUDA): the own block as a static call and the chosen blocks on gathered queries (``ops.flex.selection``: a block mask
describes tiles of queries, so a per-query choice is made one by moving the queries), merged into the one softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longseq.attention.base import Attention, check_int_knob
from longseq.attention.ops.block_select import (
    CPU_FLASH,
    TILED_PAIRS,
    block_attention,
    block_table,
    by_query_chunks,
    flash_inputs,
    gathered_attention,
    grouped_attention,
    merge_parts,
    score_dtype,
    scoring,
    top_blocks,
)
from longseq.attention.ops.decoding import KVCache
from longseq.attention.ops.flex.calls import FlexCall, same_block
from longseq.attention.ops.flex.selection import other_block_pairs, selected_blocks
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.masks import NEG_INF, full_mask, other_blocks_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention


@dataclass
class MobaState(KVCache):
    """Decoding state of ``moba``: the KV cache and the mean key of every completed block ``(B, H, n, D)``."""

    k_bar: torch.Tensor | None = None


@register_attention("moba")
class MobaAttention(BlockGrid, Attention):
    """MoBA, causal or bidirectional.

    Args:
        causal: own block up to self + the ``top_k`` best earlier blocks, or own block + the best other blocks.
        block_size: block length m; must divide the sequence length.
        top_k: blocks chosen per query besides its own (0 = block-local attention; >= n - 1 = full attention).
        seq_len, n_heads, head_dim, dropout: see ``Attention`` (dropout on the attention weights).
    """

    pattern_from_data = True  # top-k blocks by score
    supports_padding_mask = True
    supports_decoding = True
    cpu_flash = CPU_FLASH
    host_reads, xla_path = TILED_PAIRS, True  # the xla backend: static tiles

    def __init__(self, *, causal: bool, block_size: int, top_k: int = 2, **base) -> None:
        super().__init__(causal=causal, block_size=block_size, **base)
        self.top_k = check_int_knob(top_k, "attention.top_k", minimum=0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, top_k={self.top_k}"

    # -- selection (one rule for forward, the dense reference and decoding) ------------------------------------
    def choose(self, qs: torch.Tensor, k_bar: torch.Tensor, choosable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``top_k`` blocks of each query: scaled ``qs`` ``(B, H, T, D)``, block mean keys ``k_bar``
        ``(B, H, n, D)``, ``choosable`` ``(B|1, 1, T|1, n)`` bool -> ``(blocks, ok)`` ``(B, H, T, k)``; the scores in
        chunks of query rows (``by_query_chunks``)."""
        def rows(qs_, choosable_):
            with scoring(qs_), torch.no_grad():
                dtype = score_dtype(qs_)
                scores = (qs_.to(dtype) @ k_bar.to(dtype).transpose(-1, -2)).masked_fill(~choosable_, NEG_INF)
            return top_blocks(scores, self.top_k)

        B, H, T, _ = qs.shape
        return by_query_chunks(rows, T, B * H * k_bar.shape[-2] * 4, qs.device, qs, choosable)

    def block_means(self, k: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean key of every block ``(B, H, n, D)`` over its real keys, and which blocks have one ``(B, 1, 1, n)``
        (None without padding); ``real`` ``(B, L)`` bool, True = real key."""
        B, H, L, D = k.shape
        n, m = L // self.block_size, self.block_size
        blocks = k.reshape(B, H, n, m, D)
        if real is None:
            return blocks.mean(-2), None
        weight = real.view(B, 1, n, m, 1).to(k.dtype)
        k_bar = (blocks * weight).sum(-2) / weight.sum(-2).clamp(min=1.0)
        return k_bar, real.view(B, 1, 1, n, m).any(-1)

    def selection_regions(self, length: int, device: torch.device | None = None) -> Partition:
        """What a query can use, as a ``Partition`` (not a joint softmax: what ``choose`` picks from): direct = its own
        block (causal: up to self); regions = the blocks, usable where ``choose`` may pick them (causal: earlier
        blocks), each scored by its mean key (a query-independent summary) and attended at full resolution once
        picked. For the recall study's structural column (``longseq.report.recall_structure``)."""
        m = self.grid(length).n_cols
        n = length // m
        pos = torch.arange(length, device=device)
        block = pos // m
        own = (block.view(-1, 1) == block.view(1, -1)) & full_mask(length, self.causal, device)
        members = torch.arange(n, device=device).view(n, 1) == block.view(1, -1)
        return Partition.from_candidates(own, members, other_blocks_mask(n, self.causal, device)[block])

    # -- the contract ----------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, Dv); ``key_padding_mask`` (B, L) bool, True = padded key."""
        B, H, L, _ = q.shape
        m = self.grid(L).n_cols
        n = L // m
        qs = self.scale(q)
        drop = self.dropout if self.training else 0.0
        real = None if key_padding_mask is None else ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        flash = flash_inputs(self, q, k, v, qs, key_padding_mask)
        k_bar, occupied = self.block_means(k, real)
        pos = torch.arange(L, device=q.device)
        choosable = other_blocks_mask(n, self.causal, q.device)[pos // m].view(1, 1, L, -1)
        if occupied is not None:
            choosable = choosable & occupied
        chosen, ok = self.choose(qs, k_bar, choosable)
        # own block: batched (m, m) products; chosen blocks: (query, block) pairs tiled by block; one softmax
        within = full_mask(m, self.causal, q.device).view(1, 1, 1, m, m)
        members = pos.view(n, m)
        if real is None:
            member_ok = torch.ones(1, n, m, dtype=torch.bool, device=q.device)
            own = block_attention(qs, k, v, m, within, drop, flash)
        else:
            member_ok = real.view(B, n, m)
            own = block_attention(qs, k, v, m, within & member_ok.view(B, 1, n, 1, m), drop, flash)
        picked = grouped_attention(qs, k, v, members, member_ok, chosen, ok, dropout=drop, flash=flash)
        out, lse, _ = merge_parts([own, picked])
        if real is not None:  # rule 3: a query without a real key falls back to its unpadded own block
            unpadded = block_attention(qs, k, v, m, within, drop, flash).out
            out = torch.where((lse > NEG_INF).unsqueeze(-1), out, unpadded)
        return out

    # -- the flex layout (``ops.flex``): the own block as a static call, the chosen blocks gathered, one softmax ------
    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        return [FlexCall(same_block(self.block_size, self.causal))]

    def flex_batch_state(self, qs, k, v, real, tile):
        """This batch's choice ``(blocks, ok)`` ``(B, H, L, top_k)``, as ``forward`` makes it."""
        L = qs.shape[-2]
        n = L // self.block_size
        k_bar, occupied = self.block_means(k, real)
        pos = torch.arange(L, device=qs.device)
        choosable = other_blocks_mask(n, self.causal, qs.device)[pos // self.block_size].view(1, 1, L, n)
        return self.choose(qs, k_bar, choosable if occupied is None else choosable & occupied)

    def flex_extra_parts(self, state, q, k, v, real, tile):
        if self.top_k == 0:
            return []
        chosen, ok = state
        L, m = q.shape[-2], self.block_size
        most = other_block_pairs(L, m, self.top_k, self.causal)
        return [(0, *selected_blocks(q, k, v, chosen, ok, m, tile, real, most_pairs=most))]

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) dense reference (small L): every logit, block means from a membership matrix, the chosen
        blocks as a dense mask, one masked softmax; independent of ``forward``'s gathered tables."""
        B, H, L, _ = q.shape
        m = self.grid(L).n_cols
        n = L // m
        qs = self.scale(q)
        pos = torch.arange(L, device=q.device)
        block = pos // m
        members = (torch.arange(n, device=q.device).view(n, 1) == block.view(1, L)).to(q.dtype)  # (n, L)
        real = torch.ones(B, L, dtype=torch.bool, device=q.device) if key_padding_mask is None else \
            ~key_padding_mask.to(device=q.device, dtype=torch.bool)
        weight = members * real.view(B, 1, 1, L).to(q.dtype)  # (B, 1, n, L)
        k_bar = (weight @ k) / weight.sum(-1, keepdim=True).clamp(min=1.0)
        occupied = (weight.sum(-1) > 0).unsqueeze(-2)  # (B, 1, 1, n)
        choosable = other_blocks_mask(n, self.causal, q.device)[block].view(1, 1, L, n) & occupied
        chosen, ok = self.choose(qs, k_bar, choosable)
        picked = torch.zeros(B, H, L, n, dtype=torch.bool, device=q.device)
        picked.scatter_(-1, chosen, ok)
        own = (block.view(L, 1) == block.view(1, L)) & ((pos.view(L, 1) >= pos.view(1, L)) | (not self.causal))
        allowed = (own | picked[..., block]) & real.view(B, 1, 1, L)
        allowed = torch.where(allowed.any(-1, keepdim=True), allowed, own)
        return (qs @ k.transpose(-1, -2)).masked_fill(~allowed, NEG_INF).softmax(-1)

    # -- incremental decoding -------------------------------------------------------------------------------
    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> MobaState:
        return MobaState(batch_size, max_len, device, dtype)

    def step(self, state: MobaState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``; the block's mean key is cached
        when the block completes."""
        t, _ = state.append(k, v)
        m = self.block_size
        g = t // m
        B, H = q.shape[:2]
        if state.k_bar is None:
            state.k_bar = state.k.new_zeros(B, H, state.max_len // m, state.k.shape[-1])
        if (t + 1) % m == 0:  # the same reduction as ``block_means``
            state.k_bar[:, :, g] = state.k[:, :, g * m : (g + 1) * m].mean(-2)
        qs = self.scale(q)
        blocks = torch.full((B, H, 1, 1), g, dtype=torch.long, device=q.device)
        if g and self.top_k:
            chosen, ok = self.choose(qs, state.k_bar[:, :, :g], torch.ones(1, 1, 1, g, dtype=torch.bool, device=q.device))
            blocks = torch.cat([blocks, chosen], -1)
            ok = torch.cat([torch.ones(B, H, 1, 1, dtype=torch.bool, device=q.device), ok], -1)
        else:
            ok = torch.ones_like(blocks, dtype=torch.bool)
        idx, valid = block_table(blocks, ok, m)
        return gathered_attention(qs, state.k, state.v, idx, valid & (idx <= t))
