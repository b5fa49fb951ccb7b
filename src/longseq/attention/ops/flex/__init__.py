"""The FlexAttention backend: every sparse pattern and Combiner partition as ``flex_attention`` calls over
``[keys ; region summaries]`` with static ``BlockMask``s built from the geometry's index arithmetic.

What a variant computes is written once (``partition(L)`` / ``pattern(L)``, ``attention_matrix``); its flex layout
is one way of computing it and lives beside its other paths, as three methods of the variant (``Attention``):
``flex_calls(L, device)`` (the calls: masks and orders, ``calls.FlexCall``), ``flex_summaries(index, qs, k, v,
real)`` (the summaries a call appends after its keys) and, for masks that depend on the batch, ``flex_data_calls``.
This package knows no variant:

- ``calls``: ``FlexCall`` and the index rules layouts share (own block, own column, column order);
- ``block_masks``: block masks built chunk by chunk on the device, never from a dense mask, and the registry of
  static layouts shared by every layer, model and step;
- ``engine``: one layer's summaries, calls and log-sum-exp merge, one compiled graph on CUDA;
- ``inspection``: tiles visited, the backward's longest loop and the bytes kept for it (the benchmark), and
  the calls' masks as a ``Partition`` (tests).
"""

from longseq.attention.ops.flex.block_masks import BUILDS, build_block_mask, static_layout, tiles_of
from longseq.attention.ops.flex.calls import TILE, FlexCall, tile_size
from longseq.attention.ops.flex.engine import flex_forward, merge_by_lse
from longseq.attention.ops.flex.inspection import (
    flex_kept_for_backward,
    flex_longest_loop,
    flex_partition,
    flex_tiles_visited,
)

__all__ = ["BUILDS", "TILE", "FlexCall", "build_block_mask", "flex_forward", "flex_kept_for_backward",
           "flex_longest_loop", "flex_partition", "flex_tiles_visited", "merge_by_lse", "static_layout", "tile_size",
           "tiles_of"]
