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
weights densely (rows sum to 1, ``forward == P @ v``). The clustering is not differentiable. Causal, on the
``cpu_flash`` backend (CPU, no weight dropout), the softmax is two fused flash calls merged by their log-sum-exps
(``ops.cpu.cluster_flash``, shared with ``combiner_routing``; measured ~3x faster at L = 16384).

Incremental decoding (causal; ``ClusteredAttention.step``, shared with ``combiner_routing``): exact. A step at
position t routes its key to the nearest centroid (slot from a running per-centroid count) and runs one
softmax over the own cluster's members in earlier segments (at most L / K) and its own segment up to t (at
most M): O((L / K + M) D); each segment's M keys are clustered once, when the segment completes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.ops.clustering import CausalClusterSlots, ClusteredAttention, OnlineKMeans
from longseq.attention.ops.cpu.cluster_flash import cluster_slots_flash
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.ops.geometry import cluster_order
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.registry import register_attention


@register_attention("routing")
class RoutingAttention(ClusteredAttention):
    """Attention inside online k-means clusters (see the module docstring).

    Args:
        n_clusters: K; must divide L (bidirectional) or the causal segment length.
        block_size: causal segment granularity (segment = lcm(block_size, K)); None: the multiple of K
            dividing L closest to sqrt(L). Unused when bidirectional.
        ema_decay: centroid EMA decay (training only; Routing Transformer 0.999).
        seed: seeds the centroid initialization.
    """

    cpu_flash = CpuFlash(causal_only=True)  # the causal joint softmax (``ops.cpu.cluster_flash``)

    def __init__(
        self, *, causal: bool, n_clusters: int, block_size: int | None = None, ema_decay: float = 0.999,
        seed: int = 0, seq_len: int | None = None, n_heads: int | None = None, head_dim: int | None = None,
        **common,
    ) -> None:
        self.check_cluster_knobs(n_clusters, block_size)
        self.n_clusters, self.block_size = n_clusters, block_size
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, **common)
        if seq_len is not None:
            self.check_length(seq_len)
            self.segment_len(seq_len)
        self.kmeans = OnlineKMeans(n_clusters, n_heads=n_heads, head_dim=head_dim, ema_decay=ema_decay, seed=seed)

    def allowed(self, key_clusters: torch.Tensor, query_routes: torch.Tensor | None) -> torch.Tensor:
        """Dense ``(B, H, L, L)`` mask of the attended keys (reference path, small L)."""
        if not self.causal:
            return key_clusters.unsqueeze(-1) == key_clusters.unsqueeze(-2)
        return self.causal_direct_mask(key_clusters, query_routes)[0]

    def _bidirectional(self, q, k, v, clusters):
        B, H, L, D = q.shape
        K = self.n_clusters
        order, _ = cluster_order(clusters, K)
        q_blk, k_blk, v_blk = self._blocks(order, q, k, v)
        fold = lambda x: x.reshape(B * H, K, L // K, D)  # noqa: E731  clusters in the SDPA "heads" slot
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(fold(q_blk), fold(k_blk), fold(v_blk), dropout_p=p)
        return self._unblock(order, out)

    def _causal(self, q, k, v, key_clusters, query_routes):
        B, H, L, D = q.shape
        S, M = L // self.n_clusters, self.segment_len(L)
        n = L // M
        order, _ = cluster_order(key_clusters, self.n_clusters)
        k_blk, v_blk = self._blocks(order, k, v)  # (B, H, K, S, D)
        slots = CausalClusterSlots(query_routes, self.n_clusters, M)
        if self.backend_for(q, k, v) == "cpu_flash":
            return cluster_slots_flash(slots, q, k, v, k_blk, v_blk)
        cluster_logits, segment_logits = slots.logits(self.scale(q), k, k_blk)

        # one softmax per query over [own cluster, earlier segments | own segment]
        logits = torch.cat([cluster_logits, segment_logits.view(B, H, L, M)], -1)
        weights = self.weight_dropout(logits.softmax(-1))
        w_cluster, w_segment = weights.split([S, M], -1)
        out = (w_segment.reshape(B, H, n, M, M) @ v.view(B, H, n, M, D)).view(B, H, L, D)
        return out + slots.cluster_output(w_cluster, v_blk)

    def flex_data_calls(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None) -> list:
        """One call in sequence order whose mask reads this batch's k-means clusters ``(B, H, L)`` (``assign``; the
        centroids move in training as in ``forward``). Bidirectional: same key cluster. Causal: own segment up to
        self, plus (if the query took a slot of its route) its route's key cluster in earlier segments."""
        self.kmeans._ensure(k)
        clusters, routes = self.assign(k)
        self.kmeans.update(k, clusters)  # a no-op in eval
        L, H = k.shape[-2], k.shape[1]
        if self.causal:
            return [FlexCall(self.flex_causal_direct(clusters, self.flex_routes(routes, L), L), heads=H)]

        def direct(b, h, q, kv):
            return clusters[b, h, q] == clusters[b, h, kv]

        return [FlexCall(direct, heads=H)]

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_clusters, query_routes = self.assign(k)
        logits = self.scale(q) @ k.transpose(-1, -2)
        return logits.masked_fill(~self.allowed(key_clusters, query_routes), NEG_INF).softmax(-1)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, n_clusters={self.n_clusters}, block_size={self.block_size}"
