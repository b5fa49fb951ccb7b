"""Block masks of flex layouts: built from a ``mask_mod`` by index arithmetic, chunk by chunk of query tiles (never
an ``(L, KV)`` dense mask), and kept as static objects shared by every layer, model and step.

A variant's layout at one length is a ``StaticLayout``: its calls, their KV lengths padded to whole tiles, and one
``BlockMask`` per call, keyed by ``(variant's flex_key, L, tile, device)`` in one process-wide registry. Layers of
one model and of every other model with the same attention geometry share the object (a second model with another
layer count builds nothing). Padded batches (``key_padding_mask``) reuse the same tiles, every one marked partial
so the per-batch ``mask_mod`` (which reads the batch's padding) runs on all of them: no mask is rebuilt per batch
and nothing is read on the host.

The registry is filled outside any traced region: ``static_layout`` is traced by ``torch.compile`` as a dictionary
read; a miss calls the builder, which ``torch.compiler.disable`` keeps eager (a graph break on that first trace only;
the next call finds the entry and compiles without it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from longseq.attention.ops.flex import calls, summary_launch
from longseq.attention.ops.flex.calls import TILE, FlexCall, whole_tiles
from longseq.attention.ops.flex.regions import FusedKV

# The builder evaluates the mask_mod on a (B, H, rows, KV) index grid per chunk of query tiles: at most this many
# cells a chunk (int32 intermediates), so memory stays O(chunk) whatever L
MASK_CHUNK_CELLS = {"cuda": 1 << 26, "cpu": 1 << 22}
BUILDS = {"block_masks": 0}  # block masks built in this process (tests: a second model builds none)


def tile_classes(mask_mod: Callable, B: int, H: int, Q_LEN: int, KV_LEN: int, device, tile: int):
    """``(partial, full)`` ``(B, H, q tiles, kv tiles)`` bool: tiles with some / every cell allowed, from the
    ``mask_mod`` evaluated on broadcast index grids chunk by chunk of query tiles (the mask_mods here are elementwise
    index arithmetic, so broadcasting evaluates them directly, as ``create_mask``'s vmap would)."""
    device = torch.device(device)
    n_kv = -(-KV_LEN // tile)
    cells = MASK_CHUNK_CELLS.get(device.type, MASK_CHUNK_CELLS["cpu"])
    rows = tile * max(1, cells // (B * H * tile * KV_LEN))
    index = functools.partial(torch.arange, device=device, dtype=torch.int32)  # int32: half the grids' traffic
    b, h, kv = index(B).view(B, 1, 1, 1), index(H).view(1, H, 1, 1), index(KV_LEN).view(1, 1, 1, KV_LEN)
    partial, full = [], []
    for q0 in range(0, Q_LEN, rows):
        size = min(rows, Q_LEN - q0)
        chunk = mask_mod(b, h, index(q0, q0 + size).view(1, 1, size, 1), kv).expand(B, H, size, KV_LEN)
        chunk = torch.nn.functional.pad(chunk, (0, n_kv * tile - KV_LEN, 0, -(-size // tile) * tile - size))
        count = chunk.view(B, H, -1, tile, n_kv, tile).sum((3, 5), dtype=torch.int32)  # (B, H, q tiles, kv tiles)
        full.append(count == tile * tile)
        partial.append((count > 0) & (count < tile * tile))
    return torch.cat(partial, 2), torch.cat(full, 2)


def tile_tables(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile table ``(..., q tiles, kv tiles)`` bool -> ``(num, indices)`` as ``BlockMask.from_kv_blocks`` takes them."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def block_mask_from_tiles(partial: torch.Tensor, full: torch.Tensor | None, mask_mod: Callable, Q_LEN: int,
                          KV_LEN: int, tile: int) -> BlockMask:
    """A ``BlockMask`` from tile tables ``(B, H, q tiles, kv tiles)`` bool (``full=None``: every visited tile runs
    the mask_mod)."""
    full_blocks = (None, None) if full is None else tile_tables(full)
    return BlockMask.from_kv_blocks(*tile_tables(partial), *full_blocks, BLOCK_SIZE=(tile, tile), mask_mod=mask_mod,
                                    seq_lengths=(Q_LEN, KV_LEN))


def build_block_mask(mask_mod: Callable, B: int, H: int, Q_LEN: int, KV_LEN: int, device, tile: int) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` on ``(B, H, Q_LEN, KV_LEN)``: the tiles ``create_block_mask`` would find,
    classified chunk by chunk (``tile_classes``) on ``device``, so no dense mask ever exists. ``BUILDS`` counts the
    builds that run eagerly; traced (a data layout's mask inside a compiled step, built on the device each step) it
    does not: a traced counter is a guard on its value, and every step recompiled the graph."""
    if not torch.compiler.is_compiling():
        BUILDS["block_masks"] += 1
    partial, full = tile_classes(mask_mod, B, H, Q_LEN, KV_LEN, device, tile)
    return block_mask_from_tiles(partial, full, mask_mod, Q_LEN, KV_LEN, tile)


def with_mask_mod(mask: BlockMask, mask_mod: Callable) -> BlockMask:
    """The same tiles under another ``mask_mod`` (a batch's padding): no tile is rebuilt (every tile of ``mask``
    must be partial, or the new mask_mod would be skipped on the full ones)."""
    return BlockMask(mask.seq_lengths, mask.kv_num_blocks, mask.kv_indices, None, None, mask.q_num_blocks,
                     mask.q_indices, None, None, mask.BLOCK_SIZE, mask_mod)


def tiles_of(mask: BlockMask) -> float:
    """Tiles a block mask visits (partial + full), summed over batch and heads."""
    full = 0 if mask.full_kv_num_blocks is None else int(mask.full_kv_num_blocks.sum())
    return float(int(mask.kv_num_blocks.sum()) + full)


@functools.cache
def causal_full_tiles(L: int, tile: int = TILE) -> float:
    """Tiles causal full attention's block mask visits at length L (the denominator of ``flex_tiles_visited``)."""
    n = -(-L // tile)
    return n * (n + 1) / 2


# ------------------------------------------------------------------------------------------------
# Static layouts: one registry per process.
# ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class StaticLayout:
    """A variant's flex calls at one length with their block masks, shared by every module of the same geometry.

    ``masks[i]`` is call i's block mask over its KV padded to whole tiles (``kv_lens[i]``); the per-batch masks
    (``partial_masks``: the same tiles all partial, for a mask_mod that reads the batch: its padding or the variant's
    selection; ``direct_masks``: the fallback keys alone, for queries that padding leaves with nothing) are built
    when a call first needs them (``static_layout``'s ``per_batch`` and ``padded``)."""

    calls: tuple[FlexCall, ...]
    L: int
    tile: int
    device: torch.device
    kv_lens: tuple[int, ...]
    masks: tuple[BlockMask, ...]
    partial_masks: tuple[BlockMask, ...] | None = None
    direct_masks: tuple[BlockMask | None, ...] | None = None
    fused: tuple[FusedKV | None, ...] = ()  # per call with ``regions``: the tables of ``regions.summary_kv``


_REGISTRY: dict[tuple, StaticLayout] = {}


def static_layout(attn, L: int, device: torch.device, tile: int, padded: bool = False,
                  per_batch: bool = False) -> StaticLayout:
    """``attn``'s layout at length L on ``device`` from the registry, with its per-batch masks when a call needs them
    (``per_batch``: a mask_mod that reads the batch; ``padded``: key padding, which also needs the fallback masks).
    The module keeps a reference per (L, tile, device, needs) in its own ``flex_layouts`` dict, so a traced call
    reads (and guards on) one attribute of its own, not the registry that other variants keep growing."""
    key = (L, tile, device.type, device.index, padded, per_batch)
    layout = attn.flex_layouts.get(key)
    if layout is None:
        layout = attn.flex_layouts[key] = _register(attn, L, device, tile, padded, per_batch)
    return layout


@torch.compiler.disable
def _register(attn, L: int, device: torch.device, tile: int, padded: bool, per_batch: bool) -> StaticLayout:
    key = (attn.flex_key(), L, tile, device.type, device.index)
    layout = _REGISTRY.get(key)
    if layout is None:
        calls = tuple(attn.flex_calls(L, device))
        kv_lens = tuple(whole_tiles(call.kv_len(L), tile) for call in calls)
        masks = tuple(build_block_mask(call.mask_mod(L), 1, call.heads, L, kv, device, tile)
                      for call, kv in zip(calls, kv_lens))
        fused = tuple(None if call.regions is None else FusedKV.of(call, L, kv) for call, kv in zip(calls, kv_lens))
        if any(fused):
            summary_launch.register()  # here, not in a traced step: the step only reads torch.ops
        layout = _REGISTRY[key] = StaticLayout(calls, L, tile, device, kv_lens, masks, fused=fused)
    if (padded or per_batch) and layout.partial_masks is None:
        layout.partial_masks = tuple(_all_partial(mask) for mask in layout.masks)
    if padded and layout.direct_masks is None:
        layout.direct_masks = tuple(
            None if call.direct is None else
            build_block_mask(call.mask_mod(L, direct_only=True), 1, call.heads, L, whole_tiles(L, tile), device, tile)
            for call in layout.calls)
    return layout


def _all_partial(mask: BlockMask) -> BlockMask:
    """``mask``'s tiles (partial and full) all as partial ones, so a per-batch mask_mod runs on every tile."""
    BUILDS["block_masks"] += 1
    dense = mask.to_dense().bool()  # (B, H, q tiles, kv tiles): a tile table, not a cell mask
    return block_mask_from_tiles(dense, None, mask.mask_mod, *mask.seq_lengths, mask.BLOCK_SIZE[0])


def clear_registry() -> None:
    """Forget every static layout (tests; a process that changes devices)."""
    _REGISTRY.clear()


@contextlib.contextmanager
def summary_copies_every(rows: int | None):
    """Within: every call lays out its summaries once per ``rows`` queries, whatever their count
    (``FlexCall.summary_copies``), so a short sequence takes the path long ones do (``make gpu-check``'s correctness
    at L = 256); layouts built within are forgotten on leaving. ``rows`` None: the rule as it is."""
    if rows is None:
        yield
        return
    saved = calls.COPY_ROWS, calls.MIN_COPY_ROWS, calls.COPY_KEY_SHARE
    calls.COPY_ROWS, calls.MIN_COPY_ROWS, calls.COPY_KEY_SHARE = int(rows), int(rows), math.inf
    clear_registry()
    try:
        yield
    finally:
        calls.COPY_ROWS, calls.MIN_COPY_ROWS, calls.COPY_KEY_SHARE = saved
        clear_registry()
