"""Geometry shared by the sparse patterns and their Combiner counterparts.

Positions ``p`` in ``[0, L)`` are laid out row-major on an ``n x m`` grid: ``p = r * m + c`` with
``n = L / m`` rows (segments) and ``m = block_size`` columns (segment length). Log-sparse geometry
uses aligned power-of-two blocks (a Fenwick decomposition of ``[0, p)``). Every function here is
pure index arithmetic so that fast implementations, dense reference masks and tests agree.

``check_block_size`` is the one validation of a block size and ``BlockGrid`` the one mixin that owns the
``attention.block_size`` knob of a grid variant (validation, length rule, ``grid(L)``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from longseq.attention.errors import AttentionConfigError, divisors


@dataclass(frozen=True)
class Grid:
    """Row-major ``n_rows x n_cols`` view of a length-``n_rows * n_cols`` sequence."""

    n_rows: int
    n_cols: int

    @property
    def length(self) -> int:
        return self.n_rows * self.n_cols

    @classmethod
    def of(cls, length: int, block_size: int, key: str = "attention.block_size") -> Grid:
        """Grid with ``block_size`` columns; raises naming ``key`` when it does not tile ``length``."""
        block_size = check_block_size(block_size, length, key)
        return cls(length // block_size, block_size)

    def rows(self, device: torch.device | None = None) -> torch.Tensor:
        """(L,) row index of every position."""
        return torch.arange(self.length, device=device) // self.n_cols

    def cols(self, device: torch.device | None = None) -> torch.Tensor:
        """(L,) column index of every position."""
        return torch.arange(self.length, device=device) % self.n_cols


def check_block_size(block_size, length: int | None = None, key: str = "attention.block_size") -> int:
    """The one validation of a block size (a grid's row length m, a segment or block length), shared by every
    variant that has one: a positive integer (``bool`` and non-integers such as 4.7 or 4.0 rejected, never
    floored) that divides ``length`` when the sequence length is known. Returns it as ``int``; raises
    ``AttentionConfigError`` naming ``key`` and the valid values.
    """
    def valid() -> str:  # only when raising: listing the divisors of a long length is an O(L) loop
        return "valid values: " + (str(divisors(length)) if length else "positive integers dividing the sequence length")

    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise AttentionConfigError(f"{key}={block_size!r} is not a positive integer; {valid()}")
    if length is not None and length % block_size:
        raise AttentionConfigError(f"{key}={block_size} does not tile sequence length {length}; {valid()}")
    return int(block_size)


class BlockGrid:
    """Mixin of every variant laid out on a ``Grid`` of ``block_size`` columns (segments, blocks, grid rows):
    the one owner of the ``attention.block_size`` knob.

    It validates the knob once at construction (``check_block_size``, against ``seq_len`` when known), stores it,
    makes the sequence length a multiple of it, checks a length seen later with the same rule and message, and
    gives the grid of a length. List it before the ``Attention`` base (``class V(BlockGrid, Attention)``); a
    variant keeps ``block_size`` in its own signature only to give it a default, and passes it on.
    """

    block_size: int

    def __init__(self, *, block_size: int, **base) -> None:
        super().__init__(**base)
        self.block_size = check_block_size(block_size, base.get("seq_len"))

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def check_length(self, length: int) -> None:
        check_block_size(self.block_size, length)

    def grid(self, length: int) -> Grid:
        """The ``n x block_size`` grid of a length-``length`` sequence; raises naming ``attention.block_size``
        when the block size does not tile it."""
        return Grid.of(length, self.block_size)


def num_log_levels(length: int) -> int:
    """Levels needed so that aligned power-of-two blocks tile ``[0, p)`` for every ``p < length``.

    This is the bit length of ``length - 1`` (``floor(log2(L-1)) + 1``), which avoids the official
    code's missing top level at ``L = 2^k + 1``.
    """
    return max(int(length - 1).bit_length(), 0)


def fenwick_blocks(length: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned power-of-two blocks that tile ``[0, p)`` exactly, per position and level.

    Returns ``(start, valid)`` of shape ``(L, levels)``: at level ``l`` position ``p`` owns the block
    ``[start, start + 2**l)`` when bit ``l`` of ``p`` is set (``valid``), namely the chunk of index
    ``(p >> l) - 1`` in the level-``l`` chunking, i.e. ``start = ((p >> (l + 1)) << (l + 1))``.
    """
    levels = num_log_levels(length)
    p = torch.arange(length, device=device).unsqueeze(1)  # (L, 1)
    lvl = torch.arange(levels, device=device).unsqueeze(0)  # (1, levels)
    valid = ((p >> lvl) & 1).bool()
    start = (p >> (lvl + 1)) << (lvl + 1)
    return start, valid


def logsparse_keys(length: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal LogSparse key set of every position (Combiner paper §4.2), as an index table.

    Position ``p`` attends to itself and, for every set bit ``l`` of ``p``, to the position
    ``((p >> l) << l) - 1``: the last cell of the Fenwick block that ``fenwick_blocks`` assigns to ``p``
    at level ``l`` (in the paper's 1-based words: the suffix sums of the binary expansion of ``i - 1``).
    E.g. ``p = 13 = 0b1101`` attends to 13, 12, 11 and 7. The key at the lowest set bit is always
    ``p - 1``; the spacing to ``p`` grows geometrically, so every row has ``popcount(p) + 1`` keys.

    Returns ``(idx, valid)`` of shape ``(L, 1 + levels)``: column 0 is ``p`` itself, column ``1 + l`` the
    level-``l`` key (``valid`` False and ``idx`` 0 where bit ``l`` of ``p`` is clear).
    """
    p = torch.arange(length, device=device).unsqueeze(1)  # (L, 1)
    lvl = torch.arange(num_log_levels(length), device=device).unsqueeze(0)  # (1, levels)
    valid = ((p >> lvl) & 1).bool()
    idx = torch.where(valid, ((p >> lvl) << lvl) - 1, torch.zeros_like(p))
    return torch.cat([p, idx], 1), torch.cat([torch.ones_like(p, dtype=torch.bool), valid], 1)


def cluster_order(clusters: torch.Tensor, n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group positions by cluster id, keeping position order inside each cluster.

    Args:
        clusters: ``(..., L)`` long ids in ``[0, n_clusters)``.

    Returns ``(order, rank)``, both ``(..., L)`` long: ``order`` lists the positions of cluster 0 in
    increasing position, then cluster 1, ... (so with balanced clusters ``order.view(..., K, L // K)``
    are the cluster blocks); ``rank[p]`` is the index of ``p`` among the members of its own cluster,
    i.e. how many earlier positions share its cluster (depends only on ids at positions <= p).
    """
    order = torch.sort(clusters, dim=-1, stable=True).indices
    sizes = torch.zeros(*clusters.shape[:-1], n_clusters, dtype=torch.long, device=clusters.device)
    sizes.scatter_add_(-1, clusters, torch.ones_like(clusters))
    first = sizes.cumsum(-1) - sizes  # (..., K) index in ``order`` where each cluster starts
    index_in_order = torch.empty_like(order).scatter_(
        -1, order, torch.arange(clusters.shape[-1], device=clusters.device).expand_as(order)
    )
    rank = index_in_order - first.gather(-1, clusters)
    return order, rank
