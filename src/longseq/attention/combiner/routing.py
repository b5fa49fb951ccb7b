"""Combiner-Learnable (Ren et al. 2021, §4.4 and appendix D): a k-means partition, Combiner style.

Positions are routed by online k-means (``clustering.OnlineKMeans``, Routing Transformer style: one set
of K unit-norm centroids per head, routing vector = the position's key, normalized; centroids follow an
EMA of their members in training). A query attends directly to its own cluster and sees every other
cluster through one summary (pooled key, pooled query, local expectation of the values), all in ONE
softmax over [direct logits ; summary logits] with a single 1/sqrt(D).

Bidirectional (clean partition). Clusters are balanced: K clusters of S = L / K positions.
- direct = every member of the query's own cluster (self included);
- regions = every other cluster, whole. None is empty.

Causal. A balanced assignment over the whole sequence would let later tokens decide the cluster of
earlier ones (information from the future), so the causal partition is built from two causal-safe
pieces on segments of length M (``segment_len``: the smallest multiple of ``block_size`` that
``n_clusters`` divides, so ``M = block_size`` when K divides it):
- key clusters: each segment is split by the balanced assignment into K clusters of M / K members, so
  a key's cluster depends only on its own segment and every cluster has exactly g * M / K members in
  the first g segments;
- query route rho(i): the nearest centroid of position i's own routing vector. The first S positions
  (in position order) routed to a centroid get a slot in it ("routed"); later ones overflow. Both
  depend only on positions <= i.
For query i in segment g:
- direct = own segment up to and including i  ∪  (if routed) key cluster rho(i) ∩ segments < g;
- regions = for every key cluster c (except rho(i) when routed): R(c, g) = c ∩ segments < g.
Every j <= i is covered exactly once (own segment directly; an earlier j directly when it is in the
query's cluster, else through the summary of its cluster), nothing later is covered, and all regions
are non-empty for g >= 1 (segment 0 has no regions: they are masked). R(c, g) is the first g * M / K
members of cluster c (members sorted by position), so its summary comes from pooling each
(cluster, segment) chunk, a running pool over segments (max of maxes / mean of equal-size means) and
one masked inner softmax per (cluster, segment) over the cluster's block.

Cost per query: M + S direct logits + K summary logits; memory O(L (M + L/K + K)) plus O(L D) for the
gathered cluster blocks, never L x L (``attention_matrix`` excepted). The clustering is not
differentiable (ids only); gradients flow through q, k, v of every used logit, pool and value.

Fast path (the ``cpu_flash`` backend: causal, unpadded, dropout-free, CPU: ``_causal_flash``). The joint softmax is
three fused CPU flash-attention calls merged exactly by their log-sum-exps (``ops.cpu.cluster_flash``: own segment,
own cluster in slot order, the K summaries of the query's segment), and each summary's inner softmax over
R(c, g) is one more (SDPA over the cluster blocks, a broadcast (n - 1, S) mask); the running max pools of
queries and keys are one stacked ``ops.running_max`` scan. Why: the explicit path's (B, H, L, S + M + K) logits,
their gathers, concatenations, softmax and copies cost several times the flash calls (measured:
docs/cpu_engine_measurements.md, *cluster_flash*). With padding or weight dropout the explicit path below runs
(the reference for the fast one).

Key padding (``key_padding_mask`` (B, L), True = pad; LRA). Padded keys still take cluster slots (the
balanced assignment places them after every real key, into the room left, so real keys cluster as
without the padding's contents), but get no direct weight, are left out of every cluster summary (pooled
query, pooled key, inner softmax), and a cluster (or causal region R(c, g)) without a real key is masked.
Causal padded queries are routed nowhere (route K: they take no query slot), and only real keys move the
centroids in training. A query left with nothing (only a padded one can be) falls back to its unpadded
direct keys. ``attention_matrix`` applies the shared rule ``Partition.without_padding`` per document.

Incremental decoding (causal; ``ClusteredAttention.step``, state ``clustering.ClusteredState``): exact, since
nothing depends on the future. A step at position t in segment g routes its key to the nearest centroid
(its slot from a running per-centroid count) and runs one softmax over the own cluster's members in segments
< g (at most S = L / K), the own segment up to t (at most M) and the K cached summaries of R(c, g):
O((L / K + M + K) D). When segment g completes, its M keys are clustered once (balanced assignment, as in
``forward``) into the cluster blocks, and the summaries of R(c, g + 1) are computed once
(``_segment_completed``: running max / mean pools advanced by one chunk, one inner softmax per cluster over
its members so far, O(t D)), i.e. amortized O(t D / M) per step. The centroids do not move (eval mode).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longseq.attention.combiner.summary import RegionSummary
from longseq.attention.ops.clustering import CausalClusterSlots, ClusteredAttention, OnlineKMeans
from longseq.attention.ops.cpu.cluster_flash import cluster_slots_flash
from longseq.attention.ops.dispatch import CpuFlash
from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.ops.geometry import cluster_order
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition
from longseq.attention.ops.running_max import running_maxes
from longseq.attention.registry import register_attention


@register_attention("combiner_routing")
class CombinerRoutingAttention(ClusteredAttention):
    """Combiner-Learnable: own k-means cluster direct, one summary per other cluster (see module doc).

    Args:
        causal: causal partition (segments + causal-safe routing) or the bidirectional clean partition.
        n_clusters: K; must divide L (bidirectional) or the causal segment length.
        block_size: causal segment granularity (the segment length is the smallest multiple of it
            that K divides). ``None``: the length-dependent default, the multiple of K dividing L
            closest to sqrt(L). Unused when bidirectional.
        summary: region pooling: ``max`` (default), ``mean``, ``deepsets_max``, ``deepsets_mean``.
        ema_decay: k-means centroid EMA decay (training only).
        seed: seeds the centroid initialization.
        seq_len, n_heads, head_dim, dropout: see ``Attention``; dropout acts on the joint weights.
    """

    def __init__(
        self,
        *,
        causal: bool,
        n_clusters: int,
        block_size: int | None = None,
        summary: str = "max",
        ema_decay: float = 0.999,
        seed: int = 0,
        seq_len: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        self.check_cluster_knobs(n_clusters, block_size)
        self.n_clusters = n_clusters
        self.block_size = block_size
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, dropout=dropout,
                         backend=backend)
        if seq_len is not None:
            self.check_length(seq_len)
            self.segment_len(seq_len)  # fail at construction, naming the keys
        self.summary = RegionSummary(summary, head_dim)
        self.has_parameters = self.summary.has_parameters
        self.kmeans = OnlineKMeans(n_clusters, n_heads=n_heads, head_dim=head_dim, ema_decay=ema_decay, seed=seed)

    # -- clustering (geometry, ``assign``: ``ClusteredAttention``) ----------------------------------
    def partition(
        self, key_clusters: torch.Tensor, query_routes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense partition for explicit cluster ids (reference path, small L).

        Args:
            key_clusters: ``(..., L)`` ids of every position as a key (balanced; per segment when causal).
            query_routes: ``(..., L)`` nearest-centroid ids of every query (causal only).

        Returns ``(direct, regions)``: ``direct`` ``(..., L, L)`` bool (query i attends key j directly) and
        ``regions`` ``(..., L, K, L)`` bool (members of the region that query i sees as cluster c's summary;
        all False where that summary is not used).
        """
        K, device = self.n_clusters, key_clusters.device
        clusters = torch.arange(K, device=device)
        in_cluster = key_clusters.unsqueeze(-2) == clusters.unsqueeze(-1)  # (..., K, L): j in cluster c
        if not self.causal:
            own = key_clusters.unsqueeze(-1)  # (..., L, 1)
            direct = own == key_clusters.unsqueeze(-2)
            regions = in_cluster.unsqueeze(-3) & (clusters != own).unsqueeze(-1)  # (..., L, K, L)
            return direct, regions
        if query_routes is None:
            raise ValueError("causal partition needs query_routes")
        direct, earlier_segment, own_route = self.causal_direct_mask(key_clusters, query_routes)
        regions = (
            earlier_segment.unsqueeze(-2)  # (L, 1, L)
            & in_cluster.unsqueeze(-3)  # (..., 1, K, L)
            & (clusters != own_route).unsqueeze(-1)  # (..., L, K, 1)
        )
        return direct, regions

    # -- forward (``ClusteredAttention.forward`` dispatches here) --------------------------------
    supports_padding_mask = True
    # ``_causal_flash``: no key padding, no weight dropout; eager only (dynamo cannot trace its Function's context
    # under no_grad: "setattr() on tuple", once the k-means assignment stopped breaking the graph before it)
    cpu_flash = CpuFlash(causal_only=True, compiles=False)

    def _bidirectional(self, q, k, v, clusters, real=None):
        B, H, L, D = q.shape
        K, S = self.n_clusters, L // self.n_clusters
        order, _ = cluster_order(clusters, K)
        q_blk, k_blk, v_blk = self._blocks(order, self.scale(q), k, v)  # (B, H, K, S, D)
        p = self.dropout if self.training else 0.0
        if real is not None:
            keys, values, mask = self._bidirectional_padded(q_blk, k_blk, v_blk, self._members(order, real))
        elif K == 1:
            keys, values, mask = k_blk, v_blk, None
        else:
            q_bar = self.summary.pool_queries(q_blk, 3).unsqueeze(3)  # (B, H, K, 1, D)
            k_bar = self.summary.pool_keys(k_blk, 3)  # (B, H, K, D)
            inner = (q_bar @ k_blk.transpose(-1, -2)).softmax(-1)  # (B, H, K, 1, S): whole clusters, unmasked
            v_bar = (inner @ v_blk).squeeze(3)  # (B, H, K, D)
            # every cluster block sees [its own S keys ; the K summaries], its own summary masked
            keys = torch.cat([k_blk, k_bar.unsqueeze(2).expand(B, H, K, K, D)], 3)
            values = torch.cat([v_blk, v_bar.unsqueeze(2).expand(B, H, K, K, D)], 3)
            other = ~torch.eye(K, dtype=torch.bool, device=q.device).unsqueeze(1).expand(K, S, K)
            mask = torch.cat([torch.ones(K, S, S, dtype=torch.bool, device=q.device), other], -1).unsqueeze(0)
        fold = lambda x: x.reshape(B * H, K, x.shape[3], x.shape[4])  # noqa: E731  blocks in the SDPA "heads" slot
        if mask is not None and mask.dim() == 5:  # per-document padded mask (B, H, K, S, S + K)
            mask = fold(mask)
        out = F.scaled_dot_product_attention(fold(q_blk), fold(keys), fold(values), attn_mask=mask, dropout_p=p, scale=1.0)
        return self._unblock(order, out)

    def flex_data_calls(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None) -> list:
        """One call over [keys ; cluster summaries] whose mask reads this batch's clusters ``(B, H, L)``.
        Bidirectional: own cluster directly, every other cluster through its summary (K slots). Causal: own segment
        up to self and (if routed) the route's cluster in earlier segments directly, every other cluster c through
        R(c, g) = its members in segments < g (slots ``g * K + c``: a segment's K summaries side by side).
        Summaries: the pooling over the clusters' real members (``region_summaries``; causal the running pools
        ``_segment_prefix_padded``) and inner softmaxes."""
        self.kmeans._ensure(k)
        clusters, routes = self.assign(k, real)
        self.kmeans.update(k, clusters, None if real is None else real.unsqueeze(1))  # a no-op in eval
        B, H, L, _ = k.shape
        K = self.n_clusters
        order, _ = cluster_order(clusters, K)

        def members_of(real_keys):
            if real_keys is None:
                return torch.ones(B, H, K, L // K, dtype=torch.bool, device=k.device)
            return self._members(order, real_keys)  # (B, H, K, S)

        if not self.causal:
            def direct(b, h, q, kv):
                return clusters[b, h, q] == clusters[b, h, kv]

            def usable(b, h, q, r):
                return r != clusters[b, h, q]

            def summaries(qs, k, v, real):
                blocks = self._blocks(order, qs, k, v)  # (B, H, K, S, .): each cluster's members in position order
                member = None if real is None else members_of(real)
                k_bar, v_bar = self.summary.region_summaries(*blocks, member)
                return k_bar, v_bar, None if member is None else member.any(-1)

            return [FlexCall(direct, None, K, usable, heads=H, summaries=summaries)]

        M = self.segment_len(L)
        n = L // M
        own = self.flex_routes(routes, L)

        def usable(b, h, q, r):
            g, c = r // K, r % K
            return (g == q // M) & (g >= 1) & (c != own[b, h, q])

        def summaries(qs, k, v, real):
            q_blk, k_blk, v_blk = self._blocks(order, qs, k, v)  # (B, H, K, S, .); member t lies in segment t // (M/K)
            member = members_of(real)
            q_bar, occupied = self._segment_prefix_padded(self.summary.query_features(q_blk), member, n)  # (B,H,K,n,.)
            k_bar, _ = self._segment_prefix_padded(self.summary.key_features(k_blk), member, n)
            S = q_blk.shape[3]
            earlier = torch.arange(S, device=k.device) // (M // K) < torch.arange(n, device=k.device).unsqueeze(1)
            allowed = earlier & member.unsqueeze(3)  # (B, H, K, n, S): R(c, g)'s real members
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # an empty region keeps a finite row (it is masked)
            inner = (q_bar @ k_blk.transpose(-1, -2)).masked_fill(~allowed, NEG_INF).softmax(-1)
            v_bar = inner @ v_blk
            slots = [x.transpose(2, 3).flatten(2, 3) for x in (k_bar, v_bar)]  # (B, H, n * K, .): slot g * K + c
            return slots[0], slots[1], occupied.transpose(2, 3).flatten(2, 3)

        return [FlexCall(self.flex_causal_direct(clusters, own, L), None, n * K, usable, heads=H, summaries=summaries)]

    def _members(self, order: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Which members of every cluster block are real keys: ``real`` (B, L) -> (B, H, K, S) bool."""
        B, H, L = order.shape
        return real.unsqueeze(1).expand(B, H, L).gather(2, order).view(B, H, self.n_clusters, L // self.n_clusters)

    def _bidirectional_padded(self, q_blk, k_blk, v_blk, member):
        """Keys, values and mask (B, H, K, S, S + K) for every cluster block under key padding; ``member``
        (B, H, K, S) bool marks real keys. Summaries pool real members only; a cluster without one is masked."""
        B, H, K, S, D = k_blk.shape
        occupied = member.any(-1)  # (B, H, K)
        q_bar = self.summary.masked_reduce(self.summary.query_features(q_blk), member).unsqueeze(3)  # (B, H, K, 1, D)
        k_bar = self.summary.masked_reduce(self.summary.key_features(k_blk), member)  # (B, H, K, D)
        # an empty cluster gets any finite inner row (all members); its summary is masked below
        inner_mask = (member | ~occupied.unsqueeze(-1)).unsqueeze(3)  # (B, H, K, 1, S)
        inner = (q_bar @ k_blk.transpose(-1, -2)).masked_fill(~inner_mask, NEG_INF).softmax(-1)
        v_bar = (inner @ v_blk).squeeze(3)  # (B, H, K, Dv)
        keys = torch.cat([k_blk, k_bar.unsqueeze(2).expand(B, H, K, K, D)], 3)
        values = torch.cat([v_blk, v_bar.unsqueeze(2).expand(B, H, K, K, v_bar.shape[-1])], 3)
        other = ~torch.eye(K, dtype=torch.bool, device=k_blk.device)  # (own cluster, summarized cluster)
        mask = torch.cat([member.unsqueeze(3).expand(B, H, K, S, S),
                          (other & occupied.unsqueeze(2)).unsqueeze(3).expand(B, H, K, S, K)], -1)
        own_cluster_only = torch.cat([mask.new_ones(S), mask.new_zeros(K)])  # the unpadded direct keys
        return keys, values, torch.where(mask.any(-1, keepdim=True), mask, own_cluster_only)

    def _causal(self, q, k, v, key_clusters, query_routes, real=None):
        if self.backend_for(q, k, v, real) == "cpu_flash":  # ``real`` is not None exactly under key padding
            return self._causal_flash(q, k, v, key_clusters, query_routes)
        B, H, L, D = q.shape
        K, S = self.n_clusters, L // self.n_clusters
        M = self.segment_len(L)
        n, per_segment = L // M, M // K
        device, neg_inf = q.device, NEG_INF
        qs = self.scale(q)

        # cluster blocks: members of each key cluster in position order; member t lies in segment t // (M/K)
        order, _ = cluster_order(key_clusters, K)
        q_blk, k_blk, v_blk = self._blocks(order, qs, k, v)  # (B, H, K, S, D)
        member_segment = torch.arange(S, device=device) // per_segment  # (S,)

        # direct: own cluster in earlier segments (via query slots) | own segment up to self
        slots = CausalClusterSlots(query_routes, K, M)
        cluster_logits, segment_logits = slots.logits(qs, k, k_blk)  # (B, H, L, S), (B, H, n, M, M)

        # summaries of R(c, g) = first g*M/K members of cluster c = its chunks of segments < g:
        # pool each (cluster, segment) chunk, run the pool over segments, shift by one segment
        inner_allowed = member_segment < torch.arange(n, device=device).unsqueeze(1)  # (n, S)
        if real is None:
            pools = self._running_pools(self.summary.query_features(q_blk), self.summary.key_features(k_blk), n)
            # (B, H, K, n, D): R(c, g) = segments < g; g = 0 gets a placeholder (segment 0's pool)
            q_bar, k_bar = (torch.cat([pool[:, :, :, :1], pool[:, :, :, :-1]], 3) for pool in pools)
            inner_allowed[0] = True  # R(c, 0) is empty: its logit is masked below; keep this softmax finite
        else:
            member = self._members(order, real)  # (B, H, K, S): real keys
            q_bar, occupied = self._segment_prefix_padded(self.summary.query_features(q_blk), member, n)
            k_bar, _ = self._segment_prefix_padded(self.summary.key_features(k_blk), member, n)
            inner_allowed = inner_allowed & member.unsqueeze(3)  # (B, H, K, n, S)
            # an empty region gets any finite inner row; its logit is masked below
            inner_allowed = inner_allowed | ~inner_allowed.any(-1, keepdim=True)
            unpadded_direct = torch.cat([cluster_logits, segment_logits.view(B, H, L, M)], -1)
            own_members = member.gather(2, query_routes.clamp(max=K - 1).unsqueeze(-1).expand(B, H, L, S))
            cluster_logits = cluster_logits.masked_fill(~own_members, neg_inf)
            segment_logits = segment_logits.masked_fill(~real.view(B, 1, n, 1, M), neg_inf)
        inner = (q_bar @ k_blk.transpose(-1, -2)).masked_fill_(~inner_allowed, neg_inf).softmax(-1)
        v_bar = (inner @ v_blk).transpose(2, 3)  # (B, H, n, K, D)
        summary_logits = qs.view(B, H, n, M, D) @ k_bar.permute(0, 1, 3, 4, 2)  # (B, H, n, M, K)
        own_route = torch.where(slots.routed, query_routes, K).view(B, H, n, M, 1)
        summary_allowed = (torch.arange(K, device=device) != own_route) & (
            torch.arange(n, device=device) > 0
        ).view(n, 1, 1)
        if real is not None:
            summary_allowed = summary_allowed & occupied.permute(0, 1, 3, 2).unsqueeze(3)  # (B, H, n, M, K)
        summary_logits = summary_logits.masked_fill_(~summary_allowed, neg_inf)

        # one joint softmax per query over [own cluster | own segment | summaries]
        logits = torch.cat([cluster_logits, segment_logits.view(B, H, L, M), summary_logits.view(B, H, L, K)], -1)
        if real is not None:  # a query left with nothing falls back to its unpadded direct keys
            empty = (logits == neg_inf).all(-1, keepdim=True)
            logits = torch.where(empty, F.pad(unpadded_direct, (0, K), value=neg_inf), logits)
        weights = self.weight_dropout(logits.softmax(-1))
        w_cluster, w_segment, w_summary = weights.split([S, M, K], -1)

        out = (w_segment.view(B, H, n, M, M) @ v.view(B, H, n, M, D)).view(B, H, L, D)
        out = out + (w_summary.view(B, H, n, M, K) @ v_bar).view(B, H, L, D)
        return out + slots.cluster_output(w_cluster, v_blk)

    def _causal_flash(self, q, k, v, key_clusters, query_routes):
        """The unpadded, dropout-free causal forward as fused CPU flash calls (``ops.cpu.cluster_flash``):
        own segment | own cluster in earlier segments | the K summaries of R(c, g), one joint softmax."""
        B, H, L, D = q.shape
        K, M = self.n_clusters, self.segment_len(L)
        S, n = L // K, L // M
        order, _ = cluster_order(key_clusters, K)
        q_blk, k_blk, v_blk = self._blocks(order, q, k, v)  # (B, H, K, S, D), q unscaled
        slots = CausalClusterSlots(query_routes, K, M)
        if K == 1 or n == 1:  # no other cluster, or no earlier segment: no summary is used
            return cluster_slots_flash(slots, q, k, v, k_blk, v_blk)
        # summaries of R(c, g), g = 1..n-1: the pools through segment g - 1. Pools are positively homogeneous, so
        # pooling unscaled queries and scaling the pool is exact up to rounding.
        q_pool, k_pool = self._running_pools(self.summary.query_features(q_blk), self.summary.key_features(k_blk), n)
        q_bar, k_bar = q_pool[:, :, :, :-1] * (1.0 / math.sqrt(D)), k_pool[:, :, :, :-1]  # (B, H, K, n - 1, D)
        earlier = torch.arange(S, device=q.device) // (M // K) < torch.arange(1, n, device=q.device).unsqueeze(1)
        inner_mask = torch.zeros(earlier.shape, dtype=q_bar.dtype, device=q.device).masked_fill_(~earlier, NEG_INF)
        fold = lambda x: x.reshape(B * H, K, x.shape[3], x.shape[4])  # noqa: E731  clusters in the SDPA heads slot
        v_bar = F.scaled_dot_product_attention(fold(q_bar), fold(k_blk), fold(v_blk), attn_mask=inner_mask, scale=1.0)
        v_bar = v_bar.view(B, H, K, n - 1, D)
        return cluster_slots_flash(slots, q, k, v, k_blk, v_blk, k_bar.transpose(2, 3), v_bar.transpose(2, 3))

    def _running_pools(self, q_features: torch.Tensor, k_features: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Running pools of each cluster's members over its n segment chunks: featurized cluster blocks
        ``(B, H, K, S, D)`` (S = n chunks of S/n members, one per segment) -> ``(B, H, K, n, D)``, entry g pooling
        the members in segments <= g. Max: one stacked ``running_maxes`` scan for queries and keys."""
        B, H, K, S, D = q_features.shape
        per_segment = S // n
        chunks = [x if per_segment == 1 else self.summary.reduce_over(x.view(B, H, K, n, per_segment, D), 4)
                  for x in (q_features, k_features)]
        if self.summary.reduce == "max":
            return list(running_maxes(chunks, 3))
        # equal-size chunks: the mean of chunk means is the mean of their union
        count = torch.arange(1, n + 1, device=q_features.device, dtype=chunks[0].dtype).view(n, 1)
        return [x.cumsum(3) / count for x in chunks]

    def _segment_prefix_padded(self, features: torch.Tensor, member: torch.Tensor, n: int):
        """The pools of R(c, g) = segments < g (g = 0: a placeholder) over real members only: features
        (B, H, K, S, D), ``member`` (B, H, K, S) bool -> (pools (B, H, K, n, D), occupied (B, H, K, n): R(c, g) has
        a real member); empty regions pool to 0."""
        B, H, K, S, D = features.shape
        chunks = features.view(B, H, K, n, S // n, D)
        real = member.view(B, H, K, n, S // n, 1)
        count = real.sum(4).cumsum(3)  # (B, H, K, n, 1): real members in segments <= g
        if self.summary.reduce == "max":
            running = torch.cummax(chunks.masked_fill(~real, NEG_INF).max(4).values, 3).values
        else:
            running = (chunks * real.to(chunks.dtype)).sum(4).cumsum(3) / count.clamp(min=1).to(chunks.dtype)
        running = running.masked_fill(count == 0, 0.0)  # no -inf left for later products
        shifted = torch.cat([running[:, :, :, :1], running[:, :, :, :-1]], 3)
        occupied = torch.cat([torch.zeros_like(count[:, :, :, :1]), count[:, :, :, :-1]], 3) > 0
        return shifted, occupied.squeeze(-1)

    # -- incremental decoding (``ClusteredAttention.step`` drives it) -------------------------------
    def _segment_completed(self, state, g, q_chunk, k_chunk):
        """Segment g completed: the summaries of R(c, g + 1) = cluster c's members in segments <= g, for every c.

        The running pools (max of chunk maxes / sum of chunk means over g + 1 equal chunks, as ``_running_pools``)
        advance by one chunk; the inner softmax of each pooled query runs over the cluster's (g + 1) M / K members
        so far. Cost O(t D) once per segment (t = (g + 1) M), cached in ``state.summary``."""
        chunk_q = self.summary.reduce_over(self.summary.query_features(q_chunk), 3)  # (B, H, K, D)
        chunk_k = self.summary.reduce_over(self.summary.key_features(k_chunk), 3)
        cache = state.summary
        if g == 0:
            cache["q_pool"], cache["k_pool"] = chunk_q, chunk_k
        elif self.summary.reduce == "max":
            cache["q_pool"], cache["k_pool"] = torch.maximum(cache["q_pool"], chunk_q), torch.maximum(cache["k_pool"], chunk_k)
        else:  # running sums of equal-size chunk means, divided below
            cache["q_pool"], cache["k_pool"] = cache["q_pool"] + chunk_q, cache["k_pool"] + chunk_k
        count = 1 if self.summary.reduce == "max" else g + 1
        q_bar, k_bar = cache["q_pool"] / count, cache["k_pool"] / count
        members = (g + 1) * (state.segment // self.n_clusters)
        k_members, v_members = state.k_blk[:, :, :, :members], state.v_blk[:, :, :, :members]  # (B, H, K, m, D)
        inner = (q_bar.unsqueeze(3) @ k_members.transpose(-1, -2)).softmax(-1)  # (B, H, K, 1, m)
        cache["k_bar"], cache["v_bar"] = k_bar, (inner @ v_members).squeeze(3)  # (B, H, K, D)

    def _decoding_summaries(self, state, qs, own_route, g):
        """Summary logits ``(B, H, 1, K)`` and values ``(B, H, K, D)`` of R(c, g) for a query of segment g >= 1
        (its own routed cluster masked); None in segment 0 (no regions)."""
        if g == 0:
            return None
        k_bar, v_bar = state.summary["k_bar"], state.summary["v_bar"]
        other = torch.arange(self.n_clusters, device=qs.device) != own_route.unsqueeze(-1)  # (B, H, K)
        logits = (qs @ k_bar.transpose(-1, -2)).masked_fill(~other.unsqueeze(-2), NEG_INF)
        return logits, v_bar

    # -- reference --------------------------------------------------------------------------------
    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) effective weights, written densely from ``partition`` (small L only); with
        ``key_padding_mask`` each document's partition follows ``Partition.without_padding``."""
        if key_padding_mask is not None:
            return self.padded_attention_matrix(q, k, key_padding_mask.to(device=q.device, dtype=torch.bool))
        B, H, L, D = q.shape
        K = self.n_clusters
        key_clusters, query_routes = self.assign(k)
        direct, regions = self.partition(key_clusters, query_routes)  # (B, H, L, L), (B, H, L, K, L)
        qs = self.scale(q)
        direct_logits = (qs @ k.transpose(-1, -2)).masked_fill(~direct, NEG_INF)
        members = regions.reshape(B, H, L * K, L)
        q_bar = self.summary.pool_region_queries(qs, members)  # (B, H, L*K, D): per (query, cluster)
        k_bar = self.summary.pool_region_keys(k, members).view(B, H, L, K, D)
        inner = (q_bar @ k.transpose(-1, -2)).masked_fill(~members, NEG_INF)
        inner = inner.softmax(-1).nan_to_num(0.0).view(B, H, L, K, L)  # unused empty regions -> 0
        summary_logits = (qs.unsqueeze(3) * k_bar).sum(-1).masked_fill(~regions.any(-1), NEG_INF)
        joint = torch.cat([direct_logits, summary_logits], -1).softmax(-1)
        w_direct, w_summary = joint.split([L, K], -1)
        return w_direct + torch.einsum("bhik,bhikj->bhij", w_summary, inner)

    def padded_attention_matrix(self, q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        """(B, H, L, L) weights under key padding (B, L): the clustering of ``assign(k, real)``, then per document
        and head the shared rule ``Partition.without_padding`` on the partition written as L * K regions (query i's
        view of cluster c is region i * K + c). A loop over (B, H) on this small-L reference path only."""
        B, H, L, _ = q.shape
        K = self.n_clusters
        key_clusters, query_routes = self.assign(k, ~key_padding_mask)
        direct, regions = self.partition(key_clusters, query_routes)  # (B, H, L, L), (B, H, L, K, L)
        own_regions = torch.eye(L, dtype=torch.bool, device=q.device).repeat_interleave(K, 1)  # (L, L * K)
        rows = []
        for b in range(B):
            for h in range(H):
                flat = regions[b, h].reshape(L * K, L)
                part = Partition.from_candidates(direct[b, h], flat, own_regions).without_padding(key_padding_mask[b])
                rows.append(self.summary.matrix(part, self.scale(q[b, h])[None, None], k[b, h][None, None]))
        return torch.cat(rows).view(B, H, L, L)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, n_clusters={self.n_clusters}, block_size={self.block_size}"
