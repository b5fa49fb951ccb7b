"""What a flex layout visits and means, without running an attention: tiles against causal full attention's and its
backward's longest serial loop (the benchmark's hardware-independent columns), and the calls' masks back as one
dense ``Partition`` (tests)."""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import create_mask

from longseq.attention.ops.flex.block_masks import causal_full_tiles, static_layout, tiles_of
from longseq.attention.ops.flex.calls import TILE, tile_size
from longseq.attention.ops.partition import Partition


def flex_tiles_visited(attn, L: int, device="cpu", tile: int = TILE) -> float:
    """Tiles (``tile`` x ``tile``) the flex calls visit at length L, counted from their ``BlockMask``s (partial +
    full blocks, averaged over the heads the mask distinguishes), divided by causal full attention's at the same
    L and tile. Hardware independent; no attention runs. NaN for layouts whose tiles depend on the data (``routing``'s
    clusters; the blocks ``moba``, ``nsa`` and ``combiner_select`` choose per query)."""
    if attn.flex_from_data or attn.pattern_from_data:
        return math.nan
    layout = static_layout(attn, L, torch.device(device), tile)
    total = sum(tiles_of(mask) / call.heads for call, mask in zip(layout.calls, layout.masks))
    return total / causal_full_tiles(L, tile)


def flex_longest_loop(attn, L: int, device="cpu", tile: int = TILE) -> float:
    """The most query tiles that visit one key tile in any static call, divided by the query tiles of the sequence
    (causal full attention's longest, at key tile 0). FlexAttention's backward computes each key tile's dK and dV in
    one program that loops over those query tiles, so this is the backward's serial chain, hardware independent:
    1.0 where every query uses the same key tile (summaries laid out once, ``calls.FlexCall.summary_copies``). The
    blocks that ``moba``, ``nsa`` and ``combiner_select`` choose per batch are not counted; NaN for the k-means
    layouts (every call from the data)."""
    if attn.flex_from_data:
        return math.nan
    layout = static_layout(attn, L, torch.device(device), tile)
    longest = max(int((mask.q_num_blocks + (0 if mask.full_q_num_blocks is None else mask.full_q_num_blocks)).max())
                  for mask in layout.masks)
    return longest / -(-L // tile)


def flex_partition(attn, L: int, head: int = 0) -> Partition:
    """The union of the flex calls' ``create_mask``s at length L as one dense ``Partition`` (sequence order; small
    L, tests): direct sets from the key columns, one region per summary column (``FlexCall.members``)."""
    direct = torch.zeros(L, L, dtype=torch.bool)
    members, usable, anchors, families = [], [], [], []
    for call in static_layout(attn, L, torch.device("cpu"), tile_size(L)).calls:
        mask = create_mask(call.mask_mod(L), 1, call.heads, L, call.kv_len(L), "cpu")[0]  # (heads, L, KV)
        mask = mask[min(head, call.heads - 1)]
        order = torch.arange(L) if call.order is None else call.order.cpu()
        keys = L if call.direct is not None else 0
        if keys:
            block = torch.zeros(L, L, dtype=torch.bool)
            block[order.unsqueeze(1), order.unsqueeze(0)] = mask[:, :L]
            direct |= block
        if call.n_regions:
            use = torch.zeros(L, call.n_regions, dtype=torch.bool)
            use[order] = call.summary_columns(mask[:, keys:], L)
            if call.key_regions:  # single keys laid out as regions: direct keys
                direct |= (use.double() @ call.members().cpu().double()) > 0
                continue
            usable.append(use)
            members.append(call.members().cpu())
            anchors.append(torch.full((call.n_regions,), -1, dtype=torch.long) if call.anchors is None
                           else call.anchors().cpu())
            families.append(torch.full((call.n_regions,), call.family, dtype=torch.long))
    if not members:
        return Partition.direct_only(direct)
    return Partition.from_candidates(direct, torch.cat(members), torch.cat(usable, 1), torch.cat(families),
                                     torch.cat(anchors))
