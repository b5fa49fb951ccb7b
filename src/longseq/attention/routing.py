"""Routing Transformer (Roy et al. 2020): attend within learned k-means clusters, O(L (L/K + M) D).

The sparse counterpart of ``combiner_routing`` on the same partition (``attention=sparse
partition=routing``): the keys a query attends to here are exactly the ``direct`` keys of
Combiner-Learnable, without the cluster summaries. Clustering is ``clustering.OnlineKMeans``: per head K
unit-norm centroids (a buffer, seeded), routing vector = the position's key, normalized; in training the
centroids follow an EMA (decay ``ema_decay``) of their members. Queries and keys share the clusters.

- Bidirectional: one balanced assignment over the sequence, K clusters of S = L / K positions; a query
  attends to every key of its own cluster (self included). With K = 1 this is full attention.
- Causal: a balanced assignment over the whole sequence would let later tokens decide earlier clusters,
  so (as in ``combiner_routing``) keys are clustered by a balanced assignment per segment of M positions
  (``segment_len``), and a query is routed to its nearest centroid; the first S queries routed to a
  centroid get a slot in it. Query i in segment g attends to its own segment up to itself, plus (if
  routed) the members of its cluster in segments < g. Both pieces depend only on positions <= i.
  With K = 1 every query is routed and sees all j <= i: full causal attention.

Both forms are one softmax per query over the gathered keys; ``attention_matrix`` writes the same
weights densely (rows sum to 1, ``forward == P @ v``). The clustering is not differentiable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError, divisors
from longseq.attention.clustering import OnlineKMeans
from longseq.attention.geometry import cluster_order
from longseq.attention.registry import register_attention


@register_attention("routing")
class RoutingAttention(Attention):
    """Attention inside online k-means clusters (see the module docstring).

    Args:
        n_clusters: K; must divide L (bidirectional) or the causal segment length.
        block_size: causal segment granularity (segment = lcm(block_size, K)); None: the multiple of K
            dividing L closest to sqrt(L). Unused when bidirectional.
        ema_decay: centroid EMA decay (training only; Routing Transformer 0.999).
        seed: seeds the centroid initialization.
    """

    def __init__(
        self, *, causal: bool, n_clusters: int, block_size: int | None = None, ema_decay: float = 0.999,
        seed: int = 0, seq_len: int | None = None, n_heads: int | None = None, head_dim: int | None = None,
        **common,
    ) -> None:
        if not isinstance(n_clusters, int) or n_clusters < 1:
            raise AttentionConfigError(f"attention.n_clusters must be a positive integer, got {n_clusters!r}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise AttentionConfigError(f"attention.block_size must be a positive integer or null, got {block_size!r}")
        self.n_clusters, self.block_size, self.causal = n_clusters, block_size, bool(causal)
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, **common)
        if seq_len is not None:
            self.segment_len(seq_len)
        self.kmeans = OnlineKMeans(n_clusters, n_heads=n_heads, head_dim=head_dim, ema_decay=ema_decay, seed=seed)

    def requires_len_multiple_of(self) -> int:
        if self.causal and self.block_size is not None:
            return math.lcm(self.block_size, self.n_clusters)
        return self.n_clusters

    def geometry_key(self) -> str:
        return "attention.block_size / attention.n_clusters" if self.causal else "attention.n_clusters"

    def segment_len(self, length: int) -> int:
        """Causal segment length M (same rule as ``combiner_routing``)."""
        K = self.n_clusters
        if length % K:
            raise AttentionConfigError(f"attention.n_clusters={K} must divide the sequence length {length}; valid: {divisors(length)}")
        if self.block_size is not None:
            seg = math.lcm(self.block_size, K)
            if length % seg:
                raise AttentionConfigError(
                    f"attention.block_size={self.block_size} with attention.n_clusters={K} needs causal segments of "
                    f"lcm={seg}, which does not tile length {length}"
                )
            return seg
        candidates = [d for d in divisors(length) if d % K == 0]
        return min(candidates, key=lambda d: (abs(d - math.sqrt(length)), d))

    def assign(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(key_clusters, query_routes)`` ``(B, H, L)`` each (routes only when causal)."""
        if not self.causal:
            return self.kmeans.balanced(k), None
        return self.kmeans.balanced(k, group=self.segment_len(k.shape[-2])), self.kmeans.nearest(k)

    def allowed(self, key_clusters: torch.Tensor, query_routes: torch.Tensor | None) -> torch.Tensor:
        """Dense ``(B, H, L, L)`` mask of the attended keys (reference path, small L)."""
        L, K = key_clusters.shape[-1], self.n_clusters
        if not self.causal:
            return key_clusters.unsqueeze(-1) == key_clusters.unsqueeze(-2)
        segment = torch.arange(L, device=key_clusters.device) // self.segment_len(L)
        past = torch.ones(L, L, dtype=torch.bool, device=key_clusters.device).tril()
        same_segment = segment.unsqueeze(1) == segment.unsqueeze(0)
        earlier_segment = segment.unsqueeze(0) < segment.unsqueeze(1)
        routed = cluster_order(query_routes, K)[1] < L // K
        own_route = torch.where(routed, query_routes, K).unsqueeze(-1)
        return past & (same_segment | (earlier_segment & (key_clusters.unsqueeze(-2) == own_route)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D); moves the centroids in training."""
        self.check_length(q.shape[-2])
        key_clusters, query_routes = self.assign(k)
        out = self._causal(q, k, v, key_clusters, query_routes) if self.causal else self._bidirectional(q, k, v, key_clusters)
        self.kmeans.update(k, key_clusters)
        return out

    def _blocks(self, order: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Gather ``(B, H, L, D)`` tensors into cluster blocks ``(B, H, K, S, D)`` along ``order``."""
        B, H, L, D = xs[0].shape
        index = order.unsqueeze(-1).expand(B, H, L, D)
        return [x.gather(2, index).view(B, H, self.n_clusters, L // self.n_clusters, D) for x in xs]

    def _bidirectional(self, q, k, v, clusters):
        B, H, L, D = q.shape
        K = self.n_clusters
        order, _ = cluster_order(clusters, K)
        q_blk, k_blk, v_blk = self._blocks(order, q, k, v)
        fold = lambda x: x.reshape(B * H, K, L // K, D)  # noqa: E731  clusters in the SDPA "heads" slot
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(fold(q_blk), fold(k_blk), fold(v_blk), dropout_p=p)
        inverse = torch.empty_like(order).scatter_(2, order, torch.arange(L, device=q.device).expand_as(order))
        return out.view(B, H, L, D).gather(2, inverse.unsqueeze(-1).expand(B, H, L, D))

    def _causal(self, q, k, v, key_clusters, query_routes):
        B, H, L, D = q.shape
        K, S = self.n_clusters, L // self.n_clusters
        M = self.segment_len(L)
        n, per_segment = L // M, M // K
        device, neg_inf = q.device, float("-inf")
        qs = self.scale(q)

        # key cluster blocks in position order; member t of a cluster lies in segment t // (M / K)
        order, _ = cluster_order(key_clusters, K)
        k_blk, v_blk = self._blocks(order, k, v)  # (B, H, K, S, D)
        member_segment = torch.arange(S, device=device) // per_segment

        # query slots: the first S queries routed to centroid c take slots c*S + rank; the rest overflow
        _, rank = cluster_order(query_routes, K)
        routed = rank < S
        slot = torch.where(routed, query_routes * S + rank, K * S)  # (B, H, L); K*S = overflow bin
        positions = torch.arange(L, device=device).expand(B, H, L)
        slot_query = torch.zeros(B, H, K * S + 1, dtype=torch.long, device=device).scatter_(2, slot, positions)[..., :-1]
        slot_used = torch.zeros(B, H, K * S + 1, dtype=torch.bool, device=device).scatter_(2, slot, True)[..., :-1]
        slot_query, slot_used = slot_query.view(B, H, K, S), slot_used.view(B, H, K, S)

        # own cluster, earlier segments: slot queries x their cluster's block, back to query order
        q_slot = qs.gather(2, slot_query.view(B, H, K * S, 1).expand(B, H, K * S, D)).view(B, H, K, S, D)
        cluster_allowed = (member_segment < (slot_query // M).unsqueeze(-1)) & slot_used.unsqueeze(-1)
        cluster_logits = (q_slot @ k_blk.transpose(-1, -2)).masked_fill(~cluster_allowed, neg_inf)  # (B, H, K, S, S)
        cluster_logits = torch.cat([cluster_logits.view(B, H, K * S, S), cluster_logits.new_full((B, H, 1, S), neg_inf)], 2)
        cluster_logits = cluster_logits.gather(2, slot.unsqueeze(-1).expand(B, H, L, S))  # (B, H, L, S)

        # own segment up to self
        q_seg, k_seg, v_seg = (x.view(B, H, n, M, D) for x in (qs, k, v))
        causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
        segment_logits = (q_seg @ k_seg.transpose(-1, -2)).masked_fill(~causal, neg_inf)  # (B, H, n, M, M)

        # one softmax per query over [own cluster, earlier segments | own segment]
        logits = torch.cat([cluster_logits, segment_logits.view(B, H, L, M)], -1)
        weights = self.weight_dropout(logits.softmax(-1))
        w_cluster, w_segment = weights.split([S, M], -1)
        out = (w_segment.reshape(B, H, n, M, M) @ v_seg).view(B, H, L, D)
        w_slot = w_cluster.gather(2, slot_query.view(B, H, K * S, 1).expand(B, H, K * S, S)).view(B, H, K, S, S)
        out_slot = (w_slot.masked_fill(~slot_used.unsqueeze(-1), 0.0) @ v_blk).view(B, H, K * S, D)
        out_slot = torch.cat([out_slot, out_slot.new_zeros(B, H, 1, D)], 2)
        return out + out_slot.gather(2, slot.unsqueeze(-1).expand(B, H, L, D))

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_clusters, query_routes = self.assign(k)
        logits = self.scale(q) @ k.transpose(-1, -2)
        return logits.masked_fill(~self.allowed(key_clusters, query_routes), float("-inf")).softmax(-1)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, n_clusters={self.n_clusters}, block_size={self.block_size}"
