"""Region summaries for Combiner: how a region's queries and keys are pooled into one vector.

``kind`` is ``max`` (the official JAX choice), ``mean``, ``deepsets_max`` or ``deepsets_mean``
(a learned bias-free ``Linear(D, D)`` + ReLU applied per position before pooling, separate weights
for queries and keys, paper Table 3). All kinds are positively homogeneous in the bias-free case, so
pooling scaled or unscaled queries differs only by the scale factor; callers pool *scaled* queries.
"""

from __future__ import annotations

import torch
from torch import nn

from longseq.attention.errors import AttentionConfigError
from longseq.attention.ops.decoding import PartitionDecoder
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition
from longseq.attention.ops.running_max import running_maxes

SUMMARY_KINDS = ("max", "mean", "deepsets_max", "deepsets_mean")


class RegionSummary(nn.Module):
    """Pools queries and keys of a region along one axis.

    Args:
        kind: one of ``SUMMARY_KINDS``.
        head_dim: per-head width D; required for the DeepSets kinds.
    """

    def __init__(self, kind: str = "max", head_dim: int | None = None) -> None:
        super().__init__()
        if kind not in SUMMARY_KINDS:
            raise AttentionConfigError(f"attention.summary={kind!r} is not valid; choose one of {SUMMARY_KINDS}")
        self.kind = kind
        self.reduce = kind.rsplit("_", 1)[-1]  # "max" or "mean"
        if kind.startswith("deepsets"):
            if head_dim is None:
                raise AttentionConfigError(f"attention.summary={kind} needs head_dim (set by the model)")
            self.phi_query = nn.Linear(head_dim, head_dim, bias=False)
            self.phi_key = nn.Linear(head_dim, head_dim, bias=False)
        else:
            self.phi_query = self.phi_key = None

    @property
    def has_parameters(self) -> bool:
        return self.phi_query is not None

    def flex_key(self) -> tuple:
        """Its part of the owning attention's ``flex_key``: the pooling, which the fused summaries' tables hold."""
        return (type(self).__qualname__, self.kind)

    @property
    def poolable(self) -> bool:
        """The pool acts on the queries and keys themselves (``max``, ``mean``): ``ops.flex.regions.summary_kv``
        computes it fused; the DeepSets kinds' learned maps keep the variant's own summaries."""
        return self.phi_query is None

    def _pool(self, x: torch.Tensor, dim: int, phi: nn.Module | None) -> torch.Tensor:
        return self.reduce_over(self._features(x, phi), dim)

    @staticmethod
    def _features(x: torch.Tensor, phi: nn.Module | None) -> torch.Tensor:
        return x if phi is None else torch.relu(phi(x))

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        """Per-position query features before pooling (DeepSets map, or ``q`` itself). ``(..., D)``."""
        return self._features(q, self.phi_query)

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        """Per-position key features before pooling (DeepSets map, or ``k`` itself). ``(..., D)``."""
        return self._features(k, self.phi_key)

    def masked_reduce(self, features: torch.Tensor, member: torch.Tensor | None, by_value: bool = False) -> torch.Tensor:
        """Pool featurized vectors ``(..., s, D)`` over their real members ``member`` ``(..., s)`` bool -> ``(..., D)``;
        ``member=None``: every position is real (decided by the caller from its configuration, never by reading the
        mask: that would be a device-to-host sync per call on a GPU). ``by_value``: a max pool's backward keeps its
        input and result (``amax``) instead of ``max``'s int64 argmax indices (8 bytes per pooled element): fewer
        bytes where regions hold a few members each and the input is kept anyway.

        Key padding: padded positions stay out of the pool; a region without a real member pools to 0
        (its summary is masked by the caller).
        """
        def pool_max(x: torch.Tensor) -> torch.Tensor:
            return x.amax(-2) if by_value else x.max(-2).values

        if member is None:  # no masked copy (max, not amax, by default: amax's backward took 2x the time on CPU)
            return pool_max(features) if self.reduce == "max" else features.mean(-2)
        if self.reduce == "max":
            pooled = pool_max(features.masked_fill(~member.unsqueeze(-1), NEG_INF))
            return pooled.masked_fill(~member.any(-1, keepdim=True), 0.0)
        weights = member.unsqueeze(-1).to(features.dtype)
        return (features * weights).sum(-2) / weights.sum(-2).clamp(min=1.0)

    def reduce_over(self, features: torch.Tensor, dim: int) -> torch.Tensor:
        """Pool already-featurized vectors over axis ``dim`` (removed).

        Max of maxes and mean of equal-size means are again the pool of the union, so callers may
        pool hierarchically (e.g. aligned power-of-two blocks built from their two halves).
        """
        # max(dim) keeps argmax indices, so its backward is one scatter instead of amax's tie bookkeeping
        return features.max(dim).values if self.reduce == "max" else features.mean(dim)

    def _pool_regions(self, x: torch.Tensor, membership: torch.Tensor, phi: nn.Module | None) -> torch.Tensor:
        features = self._features(x, phi)  # (..., L, D)
        member = membership.to(torch.bool)  # (R, L)
        if self.reduce == "max":
            spread = features.unsqueeze(-3).masked_fill(~member.unsqueeze(-1), NEG_INF)  # (..., R, L, D)
            pooled = spread.amax(-2)
            # an empty region has no summary; 0 keeps later products finite (its logit is masked anyway)
            return pooled.masked_fill(~member.any(-1, keepdim=True), 0.0)
        weights = member.to(features.dtype)
        return (weights @ features) / weights.sum(-1, keepdim=True).clamp(min=1.0)

    def pool_region_queries(self, q: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
        """Pool (scaled) queries ``(..., L, D)`` over each region of ``membership`` ``(R, L)`` bool -> ``(..., R, D)``.

        Dense and O(R L D): meant for reference matrices at small L, not for fast paths.
        Empty regions pool to 0.
        """
        return self._pool_regions(q, membership, self.phi_query)

    def pool_region_keys(self, k: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
        """Pool keys ``(..., L, D)`` over each region of ``membership`` ``(R, L)`` -> ``(..., R, D)`` (dense, small L)."""
        return self._pool_regions(k, membership, self.phi_key)

    def matrix(self, part: Partition, qs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Dense Combiner weights ``(B, H, L, L)`` of a partition whose regions are pooled (reference path, small L).

        ``qs`` scaled queries, ``k`` keys ``(B, H, L, D)``; each region's summary query and key pool its
        members (``pool_region_queries`` / ``pool_region_keys``), then ``Partition.effective_matrix``.
        """
        return part.effective_matrix(qs, k, self.pool_region_queries(qs, part.members),
                                     self.pool_region_keys(k, part.members))

    def region_summaries(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, member: torch.Tensor | None,
                         by_value: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Summary keys and values ``(B, H, n, D)`` of n regions (incremental decoding: once, when a region
        completes; the flex layouts: every region at once) from their members' scaled queries, keys and values
        ``(B, H, n, s, D)``; ``member`` (broadcastable to ``(B, H, n, s)``) bool marks real members, None: all are:
        ``k_bar`` the pooled keys, ``v_bar = softmax(q_bar . k) v``. ``by_value``: max pools keep their values
        for the backward (``masked_reduce``), for callers with many small regions."""
        q_bar = self.masked_reduce(self.query_features(q), member, by_value)
        k_bar = self.masked_reduce(self.key_features(k), member, by_value)
        logits = (k @ q_bar.unsqueeze(-1)).squeeze(-1)
        if member is not None:  # an empty region keeps a finite row (callers mask its summary): a row of -inf would
            # make NaN weights, and NaN reaches v's gradient through the masked summary (0 * NaN)
            logits = logits.masked_fill(~(member | ~member.any(-1, keepdim=True)), NEG_INF)
        return k_bar, (logits.softmax(-1).unsqueeze(-2) @ v).squeeze(-2)

    def _prefix(self, x: torch.Tensor, dim: int, phi: nn.Module | None) -> torch.Tensor:
        x = self._features(x, phi)
        if self.reduce == "max":
            return running_max(x, dim)
        count = torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=x.dtype)
        shape = [1] * x.dim()
        shape[dim] = -1
        return x.cumsum(dim) / count.view(shape)

    def pool_queries(self, q: torch.Tensor, dim: int) -> torch.Tensor:
        """Pool (scaled) queries over axis ``dim`` (removed). Last axis must be D."""
        return self._pool(q, dim, self.phi_query)

    def pool_keys(self, k: torch.Tensor, dim: int) -> torch.Tensor:
        """Pool keys over axis ``dim`` (removed). Last axis must be D."""
        return self._pool(k, dim, self.phi_key)

    def prefix_queries(self, q: torch.Tensor, dim: int) -> torch.Tensor:
        """Inclusive running pool of queries along ``dim`` (same shape), for prefix regions."""
        return self._prefix(q, dim, self.phi_query)

    def prefix_keys(self, k: torch.Tensor, dim: int) -> torch.Tensor:
        """Inclusive running pool of keys along ``dim`` (same shape), for prefix regions."""
        return self._prefix(k, dim, self.phi_key)


def running_max(x: torch.Tensor, dim: int, reverse: bool = False) -> torch.Tensor:
    """Inclusive running max of ``x`` along ``dim`` (same shape): ``torch.cummax(x, dim).values`` (suffix max if
    ``reverse``), with cummax's gradient routing; a blocked scan (``ops.running_max``), with or without autograd."""
    return running_maxes((x,), dim, reverse)[0]


class PooledCombiner(PartitionDecoder):
    """Shared by the Combiner variants whose regions pool their members (``summary``): the dense reference
    ``attention_matrix`` and incremental decoding, both from the variant's ``partition(L)`` alone.

    Decoding (``ops.decoding.PartitionDecoder``): a region's pooled key and local expectation are computed once,
    when its last member arrives; a step is one softmax over its direct keys and usable summaries.
    """

    family = "combiner"  # also for subclasses defined outside the package

    def decoding_partition(self, length: int, device=None) -> Partition:
        return self.partition(length, device)

    def region_summaries(self, q, k, v, member, anchor_q=None, anchor_k=None):
        return self.summary.region_summaries(q, k, v, member)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) effective weights, built densely from ``partition`` (independent of ``forward``).

        With ``key_padding_mask`` each document gets ``partition(L).without_padding(pad)`` (``ops.padding``'s
        rule): a loop over the batch on this small-L reference path only.
        """
        part, qs = self.partition(q.shape[-2], q.device), self.scale(q)
        if key_padding_mask is None:
            return self.summary.matrix(part, qs, k)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([self.summary.matrix(part.without_padding(pad), qs[b : b + 1], k[b : b + 1])
                          for b, pad in enumerate(pads)])
