"""Key blocks chosen per query, at full resolution, as one FlexAttention call (``moba``, ``nsa``, ``combiner_select``).

A block mask describes tiles of 128 queries: a mask_mod that read each query's own choice would have to visit the
union of the choices of every query of a tile, close to every tile. So the call runs on gathered queries instead, the
flex form of the CPU engine's grouped tiles (``ops.block_select.grouped_attention``):

- the (query, chosen block) pairs are sorted by block into a query buffer of static length: "every pair" is the
  most the variant's rule can choose at that length (``pair_bound``), not ``L x k`` (``nsa``'s forced blocks leave
  it one free pick of its four, so a buffer sized for four held three empty rows per query);
- blocks of a tile or more: each block's pairs fill whole tiles of the buffer (``buffer_rows``: every pair plus at
  most a tile's padding per block), so every tile attends ONE key block, whose key tiles its row of ``kv_indices``
  names (``BlockMask.from_kv_blocks``). Packing them back to back instead would need 0.67 to 0.8 of the rows at
  16,384 and 65,536 but visit 1.10 to 1.23 times the tiles (counted from the tables on random data);
- blocks under a tile (several share a key tile anyway): the pairs back to back, a tile naming the key tiles of
  every block it holds. At 4,096 (m = 64) that halves ``moba``'s rows (``nsa``: a third) and visits 0.94 (0.86) of
  the tiles the one-block tiles did;
- the buffer holds the queries (a gather of q), the keys and values are the layer's own (no copy); the mask_mod keeps
  the block's keys (and, causal, those up to the pair's query; under padding the real ones);
- each pair's output and log-sum-exp are gathered back and merged over the query's choices (one softmax over the
  union of its blocks).

Everything is built on the device from the choices (sorts, cumulative sums, scatters): static shapes, no host read.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from longseq.attention.ops.flex import engine
from longseq.attention.ops.flex.block_masks import tile_tables
from longseq.attention.ops.flex.calls import whole_tiles


def buffer_rows(pairs: int, blocks: int, tile: int) -> int:
    """Rows of the query buffer: every pair, each block's group of pairs rounded up to whole tiles."""
    return whole_tiles(pairs + blocks * (tile - 1), tile)


def pair_bound(length: int, block_size: int, picks: Callable[[int], int]) -> int:
    """The most (query, block) pairs a selection can make at ``length`` when each query of block ``s`` (keys
    ``[s m, (s + 1) m)``, the last block possibly short) makes at most ``picks(s)``: plain integer arithmetic on the
    geometry, so a traced layer reads nothing from the device."""
    m = block_size
    return sum(min(m, length - s * m) * picks(s) for s in range(-(-length // m)))


def other_block_pairs(length: int, block_size: int, k: int, causal: bool) -> int:
    """``pair_bound`` of a rule that picks ``k`` of the query's other blocks (``moba``, ``combiner_select``): the
    earlier blocks when ``causal``, every other block otherwise (``ops.masks.other_blocks_mask``)."""
    n = length // block_size
    return pair_bound(length, block_size, lambda s: min(k, s if causal else n - 1))


def selected_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, ok: torch.Tensor,
                    block_size: int, tile: int, real: torch.Tensor | None = None, causal: bool = False,
                    most_pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over the keys of its chosen blocks, one softmax: unscaled ``q`` ``(B, H, L, D)``, k, v
    ``(B, H, L, .)``, ``chosen`` / ``ok`` ``(B, H, L, K)`` (block ``c`` = keys ``[c m, (c + 1) m)``; ``ok`` False: no
    block) -> output ``(B, H, L, Dv)`` and lse ``(B, H, L)`` (-inf where no key is left). ``real`` ``(B, L)``: the
    real keys; ``causal``: keys after the query are left out; ``most_pairs``: how many ``ok`` pairs the variant's
    rule can make at most (``pair_bound``; None: ``L K``), which sizes the query buffer. It must hold for every
    batch: a pair past it would read another pair's row (tested per variant, knobs included)."""
    B, H, L, K = chosen.shape
    m = block_size
    n = -(-L // m)  # blocks (the last may be short)
    P = L * K
    pairs = P if most_pairs is None else min(most_pairs, P)
    if not pairs:  # the rule leaves no free pick at this length (nsa with every pick forced; moba with one block)
        no_key = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), no_key
    packed = m < tile  # blocks under a tile share key tiles anyway: pairs back to back, a tile may span blocks
    R = whole_tiles(pairs, tile) if packed else buffer_rows(pairs, n, tile)
    device = chosen.device
    block = torch.where(ok, chosen, n).reshape(B, H, P)  # no choice: the sentinel block n, sorted last, dropped
    order = torch.sort(block, dim=-1, stable=True).indices
    sorted_block = block.gather(-1, order)
    if packed:
        row = torch.where(sorted_block < n, torch.arange(P, device=device), R)  # R: dropped
    else:  # each block's pairs from a tile's first row on
        counts = torch.zeros(B, H, n + 1, dtype=torch.long, device=device).scatter_add_(-1, block,
                                                                                       torch.ones_like(block))
        rows_of_block = (counts + tile - 1) // tile * tile
        rows_of_block[..., n] = 0
        group_start = rows_of_block.cumsum(-1) - rows_of_block  # each block's first row in the buffer
        first_pair = counts.cumsum(-1) - counts  # each block's first pair in sorted order
        rank = torch.arange(P, device=device) - first_pair.gather(-1, sorted_block)
        row = torch.where(sorted_block < n, group_start.gather(-1, sorted_block) + rank, R)
    row_of_pair = torch.empty_like(row).scatter_(-1, order, row)  # (B, H, P)
    pair_query = (torch.arange(P, device=device) // K).expand(B, H, P)
    row_query = torch.zeros(B, H, R + 1, dtype=torch.long, device=device).scatter_(-1, row_of_pair, pair_query)
    row_block = torch.full((B, H, R + 1), -1, dtype=torch.long, device=device).scatter_(-1, row_of_pair, block)
    row_query, row_block = row_query[..., :R], row_block[..., :R]

    def mask_mod(b, h, q, kv):
        ok_ = (kv // m == row_block[b, h, q]) & (kv < L)
        if causal:
            ok_ = ok_ & (kv <= row_query[b, h, q])
        if real is not None:
            ok_ = ok_ & real[b, kv.clamp(max=L - 1)]
        return ok_

    kv_len = whole_tiles(L, tile)
    tiles = _packed_tiles if packed else _one_block_per_tile
    mask = BlockMask.from_kv_blocks(*tiles(row_block, m, L, tile, kv_len // tile), BLOCK_SIZE=(tile, tile),
                                    mask_mod=mask_mod, seq_lengths=(R, kv_len))
    queries = q.gather(2, row_query.unsqueeze(-1).expand(B, H, R, q.shape[-1]))
    keys, values = (_tile_padded(x, kv_len) for x in (k, v))
    out, lse = engine.flex_call(queries, keys, values, mask, engine.query_scale(q))
    take = row_of_pair.clamp(max=R - 1)
    total = engine.logsumexp_of(torch.where(ok, lse.gather(2, take).view(B, H, L, K), float("-inf")))
    safe = torch.where(torch.isneginf(total), 0.0, total)  # no -inf - -inf: its NaN would reach the gradients
    # each row weighted by its query's softmax share (an unused row: lse -inf, weight 0) before it is read back per
    # pair, so the backward keeps the call's own output and per-row weights instead of an (L, K, Dv) copy;
    # index_select (not gather) keeps only its index
    weighted = out * (lse - safe.gather(2, row_query)).exp().unsqueeze(-1).to(out.dtype)
    rows = (torch.arange(B * H, device=device).view(B, H, 1) * R + take).flatten()
    per_pair = weighted.flatten(0, 2).index_select(0, rows).view(B, H, L, K, -1)
    return torch.where(ok.unsqueeze(-1), per_pair, 0.0).sum(-2), total


def _one_block_per_tile(row_block: torch.Tensor, m: int, L: int, tile: int,
                        n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_num, kv_indices)`` of a buffer whose every tile holds one block's pairs (its first row is always a
    pair; ``row_block`` ``(B, H, R)``, -1 past the pairs): the key tiles of that block."""
    tile_block = row_block[..., ::tile]  # (B, H, R / tile); -1: an unused tile
    first = (tile_block.clamp(min=0) * m) // tile
    last = ((tile_block.clamp(min=0) + 1) * m - 1).clamp(max=L - 1) // tile
    kv_num = torch.where(tile_block >= 0, last - first + 1, 0).to(torch.int32)
    # the row of key tiles is n_kv wide (torch 2.11 transposes the table over its last dimension): the block's tiles
    # first, the rest never read
    kv_indices = (first.unsqueeze(-1) + torch.arange(n_kv, device=row_block.device)).clamp(max=n_kv - 1)
    return kv_num, kv_indices.to(torch.int32)


def _packed_tiles(row_block: torch.Tensor, m: int, L: int, tile: int,
                  n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_num, kv_indices)`` of a buffer of pairs back to back (blocks of ``m`` < ``tile`` keys, each within two
    key tiles): every key tile of every block with a pair in the query tile."""
    B, H, R = row_block.shape
    used = row_block >= 0
    blocks = row_block.clamp(min=0)
    spans = torch.stack([blocks * m // tile, ((blocks + 1) * m - 1).clamp(max=L - 1) // tile], -1)
    spans = torch.where(used.unsqueeze(-1), spans, n_kv).view(B, H, R // tile, 2 * tile)
    table = torch.zeros(B, H, R // tile, n_kv + 1, dtype=torch.bool, device=row_block.device)
    return tile_tables(table.scatter_(-1, spans, True)[..., :n_kv])


def _tile_padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` ``(B, H, L, .)`` with zero rows up to ``length`` (masked key slots)."""
    missing = length - x.shape[-2]
    return x if not missing else torch.cat([x, x.new_zeros(*x.shape[:-2], missing, x.shape[-1])], -2)
