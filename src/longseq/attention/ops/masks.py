"""The one mask convention of the attention package: boolean masks mean **True = may attend**.

``NEG_INF`` is the logit of a key a query may not attend (``logits.masked_fill(~allowed, NEG_INF)``). The masks
that several variants and references start from live here: ``causal_mask`` (the lower triangle), ``full_mask``
(full attention, causal or not: also the keys a query sees inside its own block), ``other_blocks_mask`` (the
blocks a query's block may see as a whole) and ``mask_from_index_table`` (the dense form of a key table).
``cacheable`` makes a mask or table that a layer caches across steps into device data.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def cacheable(tables):
    """``tables`` (a tensor, or a tuple / list of them) as a layer may cache them across steps. On an XLA device a
    freshly built tensor is a node of the traced step, so the first step's graph would build it and every later step
    read it: two graphs (measured: combiner_fixed and axial compiled again at their second step). Computed once
    here (a host round trip on the first step only), they are device data in every step's graph. Elsewhere as is."""
    if isinstance(tables, (tuple, list)):
        return type(tables)(cacheable(t) for t in tables)
    if isinstance(tables, torch.Tensor) and tables.device.type == "xla":
        return tables.cpu().to(tables.device)
    return tables


def causal_mask(length: int, device: torch.device | str | None = None, offset: int = 0) -> torch.Tensor:
    """(L, L + offset) bool, True where key j <= query i + offset (queries are the last L of L + offset positions
    when ``offset`` > 0, as in a decoding step after ``offset`` cached positions)."""
    return torch.ones(length, length + offset, dtype=torch.bool, device=device).tril(offset)


def future_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, L) bool, True where key j > query i: the complement of ``causal_mask`` (what a causal query may NOT see)."""
    return ~causal_mask(length, device)


def full_mask(length: int, causal: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, L) bool: ``causal_mask`` when ``causal``, else every key; full attention over L positions (a whole
    sequence, or a block's own positions)."""
    if causal:
        return causal_mask(length, device)
    return torch.ones(length, length, dtype=torch.bool, device=device)


def other_blocks_mask(n_blocks: int, causal: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """(n, n) bool over (query block g, key block g'): True where g may see g' as a whole other block, the earlier
    blocks g' < g when ``causal``, every g' != g otherwise (its own block it sees through ``full_mask``)."""
    ids = torch.arange(n_blocks, device=device)
    return ids.view(-1, 1) > ids.view(1, -1) if causal else ids.view(-1, 1) != ids.view(1, -1)


def mask_from_index_table(idx: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
    """(L, L) bool from a key table: ``idx`` (L, K) long key positions of each query, ``valid`` (L, K) bool
    (small L only: the dense form of a sparse pattern, for references and tests)."""
    allowed = torch.zeros(length, length, dtype=torch.bool, device=idx.device)
    rows = torch.arange(length, device=idx.device).unsqueeze(1).expand_as(idx)
    allowed[rows[valid], idx[valid]] = True
    return allowed
