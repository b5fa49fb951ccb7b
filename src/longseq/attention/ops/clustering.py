"""Online k-means for learned partitions (Routing Transformer, Roy et al. 2020; Combiner-Learnable).

Per head, ``K`` unit-norm centroids live in a buffer (so they are saved with checkpoints but get no
gradient). A position is routed by the cosine similarity of its (unit-normalized) routing vector with
the centroids. Two assignments are offered:

- ``nearest``: each position takes its most similar centroid. A position's cluster depends only on its
  own vector, so it is safe for causal use, but cluster sizes vary.
- ``balanced``: every group of ``N`` consecutive positions is split into ``K`` clusters of exactly
  ``N / K`` members (a partition). Rule (``balanced_assignment``), a capacity-constrained greedy run
  in rounds: every unassigned position proposes to its most similar centroid that still has room;
  each centroid accepts its most similar proposers up to its remaining room (ties: earlier position
  first); rejected positions propose again next round. Each round fills at least one centroid (or
  ends the assignment), so there are at most ``K`` rounds; with centroids that already spread the
  data there are only a few. A position's cluster depends on the whole group (not causal inside it).
  Key padding: padded positions (``deferred``) still get a cluster, but only after every real position is
  placed, filling the room left in position order; so the real positions' clusters never depend on the
  padding's contents.

In training, ``update`` moves every centroid toward the mean of the routing vectors assigned to it:
``c <- normalize(decay * c + (1 - decay) * mean)`` (exponential moving average, decay 0.999 as in
Routing Transformer); centroids without members stay put. Eval mode never changes them. Under key padding
only real positions move the centroids.

Shared by ``routing`` and ``combiner_routing``: ``ClusteredAttention`` (their common base: knobs, causal
segment length, assignment, cluster blocks, forward dispatch, dense causal direct mask) and
``CausalClusterSlots`` (the vectorized causal direct keys: own cluster in earlier segments + own segment).

Speed: on the ``cpu_flash`` backend (``ops.dispatch``) the causal forward without padding or weight dropout runs
as fused CPU flash-attention calls merged by their log-sum-exps (``ops.cpu.cluster_flash``; measured:
docs/cpu_engine_measurements.md, *cluster_flash*). On CPU, heads run in
groups whose temporaries stay under ``TEMPORARY_BYTES`` (``ops.cpu.memory``: glibc maps 32 MiB and larger blocks
afresh, ~20 ms of page faults each per call); one score matrix serves both assignments; the centroid update sums by ``index_add_`` instead of a
(B, H, L, K) one-hot; cluster blocks are row permutations (``_PermuteRows``) whose backward is the inverse one.

Incremental decoding (``ClusteredState``, ``ClusteredAttention.step``) replays the causal forward exactly:
a position's query route and slot come from a running per-centroid count (its rank among same-route
queries), and a segment's key clusters are computed ONCE, by the same balanced assignment, when its last key
arrives (queries inside a segment attend to their own segment directly, so they never need its clusters).
Eval mode: the centroids do not move (``OnlineKMeans.update`` is a no-op), and a step never moves them.
The geometry (S = L / K query slots per centroid, segment length M) is that of ``max_len``: a state reproduces
``forward`` over ``max_len`` positions (this forward is not prefix-consistent: a shorter sequence has fewer
slots per centroid), so decode with ``max_len`` = the length the model runs at (the backbone's default).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError, divisors
from longseq.attention.ops.amp import autocast_function, has_autocast
from longseq.attention.ops.cpu.memory import FRESH_MAP_BYTES, heads_per_group
from longseq.attention.ops.decoding import DecodingState
from longseq.attention.ops.geometry import check_block_size, cluster_order
from longseq.attention.ops.masks import NEG_INF, causal_mask


def host_loop_applies(scores: torch.Tensor) -> bool:
    """The kernel choice of ``balanced_assignment``: the loop that shrinks the pending positions (and stops when none
    are left, usually after a few of its K rounds) reads sizes on the host, so it runs on CPU tensors outside
    ``torch.compile`` only; elsewhere all K rounds run with static shapes (``_balanced_static``)."""
    return scores.device.type == "cpu" and not torch.compiler.is_compiling()


def balanced_assignment(scores: torch.Tensor, deferred: torch.Tensor | None = None,
                        nearest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Partition ``N`` positions into ``K`` equal clusters from similarity ``scores`` ``(..., N, K)``.

    Returns ``(..., N)`` long cluster ids; each id occurs exactly ``N / K`` times per leading index.
    See the module docstring for the rule. Not differentiable (ids only). ``deferred`` (bool, broadcastable
    to ``(..., N)``, e.g. padded keys): those positions are left out of the rounds and then fill the
    remaining room in position order, whatever their scores. ``nearest``: ``scores.max(-1)`` when the caller
    has it already (the first round's proposals).
    """
    *lead, n_pos, n_clusters = scores.shape
    if n_pos % n_clusters:
        raise AttentionConfigError(
            f"attention.n_clusters={n_clusters} must divide the {n_pos} positions being clustered"
        )
    flat_scores = scores.detach().reshape(-1, n_clusters)  # (G*N, K), one row per position
    if not host_loop_applies(flat_scores):
        return _balanced_static(flat_scores, n_pos, n_clusters, deferred, lead)
    device = flat_scores.device
    groups = flat_scores.shape[0] // n_pos
    assignment = torch.full((groups * n_pos,), -1, dtype=torch.long, device=device)
    room = torch.full((groups * n_clusters,), n_pos // n_clusters, dtype=torch.long, device=device)
    pending = torch.arange(groups * n_pos, device=device)  # increasing = earlier positions first
    late = None
    if deferred is not None:
        deferred = deferred.expand(*lead, n_pos).reshape(-1)
        pending, late = pending[~deferred], pending[deferred]
    first_round = True
    for _ in range(n_clusters):  # at most K rounds; usually a handful, each on the still-pending rows
        if pending.numel() == 0:
            break
        group = pending // n_pos
        if first_round:  # every centroid has room: everyone proposes to its nearest centroid
            best, choice = flat_scores.max(-1) if nearest is None else (x.reshape(-1) for x in nearest)
            if late is not None:
                best, choice = best[pending], choice[pending]
            first_round = False
        else:
            full = (room.view(groups, n_clusters) == 0)[group]  # (P, K)
            best, choice = flat_scores[pending].masked_fill(full, NEG_INF).max(-1)
        slot = group * n_clusters + choice  # (group, centroid) proposed to
        # proposers of each slot, most similar first; stable sorts keep earlier positions first on ties
        by_score = torch.sort(-best, stable=True).indices
        order = by_score[torch.sort(slot[by_score], stable=True).indices]
        sorted_slot = slot[order]
        proposals = torch.bincount(slot, minlength=room.numel())
        first = proposals.cumsum(0) - proposals
        rank = torch.arange(order.numel(), device=device) - first[sorted_slot]
        accepted = rank < room[sorted_slot]
        assignment[pending[order[accepted]]] = choice[order[accepted]]
        room = room - torch.bincount(sorted_slot[accepted], minlength=room.numel())
        pending = torch.sort(pending[order[~accepted]]).values
    if late is not None and late.numel():
        # each group's leftover room equals its deferred count, so the r-th deferred position overall takes
        # the r-th free slot in (group, centroid) order
        free_slot = torch.searchsorted(room.cumsum(0), torch.arange(late.numel(), device=device), right=True)
        assignment[late] = free_slot % n_clusters
    return assignment.view(*lead, n_pos)


def _balanced_static(flat_scores: torch.Tensor, n_pos: int, n_clusters: int, deferred: torch.Tensor | None,
                     lead: list[int]) -> torch.Tensor:
    """``balanced_assignment``'s rule with static shapes and no host reads (GPUs, ``torch.compile``): every position
    takes part in all K rounds (an assigned or deferred one proposes to no slot), boolean indexing becomes
    ``torch.where`` and ``bincount`` becomes ``scatter_add``; the assignments equal the CPU loop's, which skips
    the rounds (and positions) with nothing left to place."""
    device = flat_scores.device
    total = flat_scores.shape[0]
    groups = total // n_pos
    slots = groups * n_clusters
    position = torch.arange(total, device=device)
    group = position // n_pos
    assignment = torch.full((total,), -1, dtype=torch.long, device=device)
    room = torch.full((slots + 1,), n_pos // n_clusters, dtype=torch.long, device=device)  # + a sentinel slot
    late = None
    if deferred is not None:
        late = deferred.expand(*lead, n_pos).reshape(-1)
    for _ in range(n_clusters):  # each round fills at least one centroid: K rounds place everyone
        full = (room[:slots].view(groups, n_clusters) == 0)[group]  # (N, K)
        best, choice = flat_scores.masked_fill(full, NEG_INF).max(-1)
        proposing = assignment < 0
        if late is not None:
            proposing = proposing & ~late
        slot = torch.where(proposing, group * n_clusters + choice, slots)  # non-proposers: the sentinel slot
        by_score = torch.sort(-best, stable=True).indices
        order = by_score[torch.sort(slot[by_score], stable=True).indices]
        sorted_slot = slot[order]
        proposals = torch.zeros(slots + 1, dtype=torch.long, device=device).scatter_add_(0, slot, torch.ones_like(slot))
        rank = torch.arange(total, device=device) - (proposals.cumsum(0) - proposals)[sorted_slot]
        accepted_sorted = (rank < room[sorted_slot]) & (sorted_slot < slots)
        accepted = torch.zeros_like(accepted_sorted).scatter_(0, order, accepted_sorted)
        assignment = torch.where(accepted, choice, assignment)
        room = room - torch.zeros_like(room).scatter_add_(0, slot, accepted.long())
    if late is not None:  # the r-th deferred position overall takes the r-th free slot in (group, centroid) order
        rank_late = late.long().cumsum(0) - 1
        free_slot = torch.searchsorted(room[:slots].cumsum(0), rank_late.clamp(min=0), right=True)
        assignment = torch.where(late, free_slot % n_clusters, assignment)
    return assignment.view(*lead, n_pos)


class OnlineKMeans(nn.Module):
    """Per-head unit-norm centroids ``(H, K, D)`` with nearest / balanced routing and EMA updates.

    Args:
        n_clusters: K.
        n_heads, head_dim: H and D; when unknown at construction the centroids are created on first use
            (from the same seed, so still reproducible) and ``load_state_dict`` adopts the stored shape.
        ema_decay: weight of the old centroid in the training-time update.
        seed: seeds the Gaussian initialization (normalized to unit length).
    """

    def __init__(
        self,
        n_clusters: int,
        n_heads: int | None = None,
        head_dim: int | None = None,
        ema_decay: float = 0.999,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(n_clusters, int) or n_clusters < 1:
            raise AttentionConfigError(f"attention.n_clusters must be a positive integer, got {n_clusters!r}")
        if not 0.0 <= ema_decay <= 1.0:
            raise AttentionConfigError(f"attention.ema_decay must be in [0, 1], got {ema_decay}")
        self.n_clusters = n_clusters
        self.ema_decay = float(ema_decay)
        self.seed = int(seed)
        if n_heads is not None and head_dim is not None:
            self.register_buffer("centroids", self._initial_centroids(n_heads, head_dim))
        else:
            self.register_buffer("centroids", torch.empty(0))

    def _initial_centroids(self, n_heads: int, head_dim: int, like: torch.Tensor | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        c = F.normalize(torch.randn(n_heads, self.n_clusters, head_dim, generator=g, dtype=torch.float64), dim=-1)
        if like is None:
            return c.to(torch.get_default_dtype())
        return c.to(device=like.device, dtype=like.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        stored = state_dict.get(prefix + "centroids")
        if stored is not None and stored.shape != self.centroids.shape:
            self.centroids = torch.empty_like(stored, device=self.centroids.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _ensure(self, x: torch.Tensor, heads: slice = slice(None)) -> None:
        """Create the centroids on first use (from all of ``x``'s heads); check that ``x`` matches ``heads`` of them."""
        H, D = x.shape[1], x.shape[-1]
        if self.centroids.numel() == 0 and heads == slice(None):
            self.centroids = self._initial_centroids(H, D, like=x)
        elif self.centroids[heads].shape != (H, self.n_clusters, D):
            raise AttentionConfigError(
                f"k-means centroids have shape {tuple(self.centroids.shape)} but the input has H={H}, D={D}"
            )

    def scores(self, x: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """Cosine similarity of routing vectors ``x`` ``(B, H, L, D)`` with the centroids -> ``(B, H, L, K)``;
        ``heads``: the centroids' heads that ``x`` holds (a head group of the input). In fp32 at least, autocast off:
        bf16 scores rounded differently by a compiled and an eager run chose other clusters on an H200 (the
        compiled flex path and its own bf16 ``attention_matrix`` then disagreed by 9 %)."""
        self._ensure(x, heads)
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False) if has_autocast(x.device.type) else contextlib.nullcontext():
            x = F.normalize(x.detach().to(dtype), dim=-1)
            return torch.einsum("bhld,hkd->bhlk", x, self.centroids[heads].to(dtype))

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, L)`` id of the most similar centroid; depends only on each position's own vector."""
        return self.scores(x).argmax(-1)

    def balanced(self, x: torch.Tensor, group: int | None = None, deferred: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, H, L)`` balanced ids: each run of ``group`` consecutive positions (default: all L) is
        split into K clusters of ``group / K`` members. ``deferred`` ``(B, 1 or H, L)`` bool: positions placed
        last, into the room the others leave (padded keys)."""
        return self.balance(self.scores(x), group, deferred)

    def balance(self, scores: torch.Tensor, group: int | None = None, deferred: torch.Tensor | None = None,
                nearest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``balanced`` from precomputed ``scores(x)`` ``(B, H, L, K)`` (and ``scores.max(-1)``, if known) ->
        ``(B, H, L)`` ids."""
        B, H, L, _ = scores.shape
        group = L if group is None else group
        if L % group:
            raise AttentionConfigError(f"k-means group {group} does not divide the length {L}")
        scores = scores.view(B, H, L // group, group, self.n_clusters)
        if deferred is not None:
            deferred = deferred.reshape(B, -1, L // group, group)
        return balanced_assignment(scores, deferred, nearest).view(B, H, L)

    @torch.no_grad()
    def update(self, x: torch.Tensor, clusters: torch.Tensor, real: torch.Tensor | None = None,
               heads: slice = slice(None)) -> None:
        """EMA step toward the mean routing vector of each cluster (training only; no-op in eval).

        x: ``(B, H, L, D)`` routing vectors (normalized here); clusters: ``(B, H, L)`` ids; ``real``
        ``(B, 1 or H, L)`` bool: only these positions count (padded keys do not move the centroids); ``heads``:
        the centroids' heads that ``x`` holds (only those move).
        """
        if not self.training or self.ema_decay >= 1.0:
            return
        self._ensure(x, heads)
        centroids = self.centroids[heads]
        x = F.normalize(x.detach(), dim=-1).to(centroids.dtype)
        H, K, D = centroids.shape
        B, L = x.shape[0], x.shape[2]
        # per-(head, cluster) sums by one index_add over bins h * K + c: a (B, H, L, K) one-hot costs ~5x more
        bins = (clusters + torch.arange(H, device=x.device).view(1, H, 1) * K).reshape(-1)
        rows = x.reshape(-1, D)
        weights = None
        if real is not None:
            weights = real.expand(B, H, L).reshape(-1).to(x.dtype)
            rows = rows * weights.unsqueeze(-1)
        sums = x.new_zeros(H * K, D).index_add_(0, bins, rows).view(H, K, D)
        ones = torch.ones_like(bins, dtype=x.dtype) if weights is None else weights
        counts = x.new_zeros(H * K).index_add_(0, bins, ones).view(H, K, 1)  # no bincount: static shapes
        means = sums / counts.clamp(min=1.0)
        moved = F.normalize(self.ema_decay * centroids + (1.0 - self.ema_decay) * means, dim=-1)
        centroids.copy_(torch.where(counts > 0, moved, centroids))

    def extra_repr(self) -> str:
        return f"n_clusters={self.n_clusters}, ema_decay={self.ema_decay}, seed={self.seed}"


@dataclass
class ClusteredState(DecodingState):
    """Decoding state of a causal k-means partition (``routing``, ``combiner_routing``) for ``max_len`` = L.

    Attributes:
        segment: causal segment length M (``segment_len(max_len)``).
        q, k, v: scaled queries, keys, values of every position so far ``(B, H, L, D)`` (the own-segment
            direct keys, and the members of a segment when it completes).
        k_blk, v_blk: key cluster blocks ``(B, H, K, S, D)``, S = L / K, filled one chunk of M / K members per
            completed segment (member t of a cluster lies in segment t // (M / K), as in ``forward``).
        route_count: ``(B, H, K)`` queries routed to each centroid so far (a query is "routed", i.e. gets a
            slot, while its centroid's count is below S).
        summary: the variant's cached summaries of completed regions (``combiner_routing``), else empty.
    """

    segment: int = 0
    n_clusters: int = 1
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_blk: torch.Tensor | None = None
    v_blk: torch.Tensor | None = None
    route_count: torch.Tensor | None = None
    summary: dict | None = None

    def allocate(self, q: torch.Tensor, v: torch.Tensor) -> None:
        B, H, _, D = q.shape
        K, S, Dv = self.n_clusters, self.max_len // self.n_clusters, v.shape[-1]
        zeros = lambda *shape: torch.zeros(*shape, device=self.device, dtype=self.dtype)  # noqa: E731
        self.q, self.k, self.v = zeros(B, H, self.max_len, D), zeros(B, H, self.max_len, D), zeros(B, H, self.max_len, Dv)
        self.k_blk, self.v_blk = zeros(B, H, K, S, D), zeros(B, H, K, S, Dv)
        self.route_count = torch.zeros(B, H, K, dtype=torch.long, device=self.device)
        self.summary = {}


# Head groups keep every temporary below glibc's fresh-mmap size (``ops.cpu.memory``; ~20 ms of page faults per
# 32 MiB block measured here).
TEMPORARY_BYTES = FRESH_MAP_BYTES // 2


class ClusteredAttention(Attention):
    """Geometry shared by the k-means partitions (``routing`` and ``combiner_routing``).

    Subclasses set ``n_clusters`` (K) and ``block_size``, check a known ``seq_len`` (``check_length``,
    ``segment_len``) and own an ``OnlineKMeans`` as ``kmeans``. Causal
    keys are clustered per segment of ``segment_len`` positions; queries are routed to their nearest
    centroid. No ``__init__`` here, so the subclasses' constructor keywords stay the accepted config keys.
    """

    pattern_from_data = True  # k-means clusters of the keys and queries

    n_clusters: int
    block_size: int | None
    kmeans: OnlineKMeans

    @staticmethod
    def check_cluster_knobs(n_clusters: int, block_size: int | None) -> None:
        """Reject a non-positive ``attention.n_clusters`` / ``attention.block_size`` (None allowed)."""
        if not isinstance(n_clusters, int) or n_clusters < 1:
            raise AttentionConfigError(f"attention.n_clusters must be a positive integer, got {n_clusters!r}")
        if block_size is not None:  # divisibility is checked on lcm(block_size, n_clusters) by the base class
            check_block_size(block_size)

    def requires_len_multiple_of(self) -> int:
        if self.causal and self.block_size is not None:
            return math.lcm(self.block_size, self.n_clusters)
        return self.n_clusters

    def geometry_key(self) -> str:
        return "attention.block_size / attention.n_clusters" if self.causal else "attention.n_clusters"

    # the flex layouts' masks read this batch's clusters: built per call (``ops.flex``), never cached
    flex_from_data = True

    def flex_routes(self, routes: torch.Tensor, L: int) -> torch.Tensor:
        """``(B, H, L)`` the key cluster a causal query attends in earlier segments (flex masks): its route when it
        took one of the route's L / K query slots, else K (none; ``causal_direct_mask``)."""
        K = self.n_clusters
        routed = (cluster_order(routes, K + 1)[1] < L // K) & (routes < K)
        return torch.where(routed, routes, K)

    def flex_causal_direct(self, clusters: torch.Tensor, own: torch.Tensor, L: int):
        """The causal direct mask by index: own segment up to self, and (if routed) the route's key cluster in
        earlier segments (``clusters`` ``(B, H, L)`` of the keys, ``own`` from ``flex_routes``)."""
        M = self.segment_len(L)

        def direct(b, h, q, kv):
            same_segment = q // M == kv // M
            return (kv <= q) & (same_segment | ((kv // M < q // M) & (clusters[b, h, kv] == own[b, h, q])))

        return direct

    def segment_len(self, length: int) -> int:
        """Causal segment length M for sequence length L: the smallest multiple of ``block_size`` that K
        divides; with ``block_size=None`` the multiple of K dividing L closest to sqrt(L)."""
        K = self.n_clusters
        if length % K:
            raise AttentionConfigError(
                f"attention.n_clusters={K} must divide the sequence length {length}; valid: {divisors(length)}"
            )
        if self.block_size is not None:
            seg = math.lcm(self.block_size, K)
            if length % seg:
                raise AttentionConfigError(
                    f"attention.block_size={self.block_size} with attention.n_clusters={K} needs causal segments "
                    f"of lcm={seg}, which does not tile length {length}; pick block_size and n_clusters "
                    f"whose lcm divides {length}"
                )
            return seg
        candidates = [d for d in divisors(length) if d % K == 0]
        return min(candidates, key=lambda d: (abs(d - math.sqrt(length)), d))

    def assign(self, k: torch.Tensor, real: torch.Tensor | None = None,
               heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cluster ids from the keys ``(B, H, L, D)``: ``(key_clusters, query_routes)``, each ``(B, H, L)``.

        Bidirectional: one balanced partition, ``query_routes`` is None (a query's cluster is its own).
        Causal: key clusters balanced per segment, query routes = nearest centroid.
        ``real`` ``(B, L)`` bool (key padding, False = pad): padded keys are placed after the real ones
        (``balanced_assignment``'s ``deferred``) and, causal, padded queries get route K (no centroid), so
        they take no query slot from a real query. ``heads``: the centroids' heads that ``k`` holds.
        """
        pad = None if real is None else ~real.unsqueeze(1)  # (B, 1, L)
        scores = self.kmeans.scores(k, heads)  # once for both assignments
        if not self.causal:
            return self.kmeans.balance(scores, deferred=pad), None
        nearest = scores.max(-1)  # the routes, and the balanced assignment's first proposals
        routes = nearest.indices if real is None else nearest.indices.masked_fill(pad, self.n_clusters)
        return self.kmeans.balance(scores, group=self.segment_len(k.shape[-2]), deferred=pad, nearest=nearest), routes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D) via the subclass's ``_causal`` / ``_bidirectional``;
        moves the centroids in training. ``key_padding_mask`` (B, L) bool, True = pad: only for subclasses
        with ``supports_padding_mask`` (their ``_causal`` / ``_bidirectional`` take ``real``).

        Heads are independent (own centroids, own clusters), so they run in groups of ``head_group(q)``: with
        every temporary of a group under ``TEMPORARY_BYTES``, the allocator reuses freed memory instead of
        mapping (and page-faulting) fresh pages on every call.
        """
        self.check_length(q.shape[-2])
        real = None
        if key_padding_mask is not None:
            self.check_padding_support()
            real = ~key_padding_mask.to(device=k.device, dtype=torch.bool)
        self.kmeans._ensure(k)
        H, size = q.shape[1], self.head_group(q)
        if size >= H:
            return self._forward_heads(q, k, v, real, slice(None))
        groups = zip(range(0, H, size), *(x.split(size, dim=1) for x in (q, k, v)))
        return torch.cat([self._forward_heads(qg, kg, vg, real, slice(h, h + size)) for h, qg, kg, vg in groups], 1)

    def head_group(self, q: torch.Tensor) -> int:
        """Heads per group: on CPU the most whose widest temporary, ``(B, heads, L, w)`` for w the largest of the
        block sizes (L / K, K, M) and D, stays under ``TEMPORARY_BYTES`` (at least one); elsewhere all heads (a
        caching allocator reuses memory anyway)."""
        B, H, L, D = q.shape
        if q.device.type != "cpu":
            return H
        K = self.n_clusters
        widest = max(L // K, K, D, self.segment_len(L) if self.causal else 1)
        return heads_per_group(H, B * L * widest * q.element_size(), TEMPORARY_BYTES)

    def _forward_heads(self, q, k, v, real, heads: slice) -> torch.Tensor:
        """``forward`` on one head group: q, k, v ``(B, h, L, D)`` hold the centroids' ``heads``."""
        key_clusters, query_routes = self.assign(k, real, heads)
        padding = {} if real is None else {"real": real}
        if self.causal:
            out = self._causal(q, k, v, key_clusters, query_routes, **padding)
        else:
            out = self._bidirectional(q, k, v, key_clusters, **padding)
        self.kmeans.update(k, key_clusters, None if real is None else real.unsqueeze(1), heads)
        return out

    def causal_direct_mask(
        self, key_clusters: torch.Tensor, query_routes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense causal direct keys (reference path, small L): ``(direct, earlier_segment, own_route)``.

        ``direct`` ``(..., L, L)``: own segment up to self, plus (if routed) the key cluster of the query's
        route in earlier segments; ``earlier_segment`` ``(L, L)``: seg(j) < seg(i); ``own_route``
        ``(..., L, 1)``: the query's route, K where the query overflowed its centroid or has none (route K:
        a padded query).
        """
        L, K = key_clusters.shape[-1], self.n_clusters
        device = key_clusters.device
        segment = torch.arange(L, device=device) // self.segment_len(L)
        past = causal_mask(L, device)
        same_segment = segment.unsqueeze(1) == segment.unsqueeze(0)
        earlier_segment = segment.unsqueeze(0) < segment.unsqueeze(1)
        routed = (cluster_order(query_routes, K + 1)[1] < L // K) & (query_routes < K)  # (..., L)
        own_route = torch.where(routed, query_routes, K).unsqueeze(-1)  # K = "no cluster"
        direct = past & (same_segment | (earlier_segment & (key_clusters.unsqueeze(-2) == own_route)))
        return direct, earlier_segment, own_route

    # -- incremental decoding (causal) ------------------------------------------------------------
    # Per step at position t (segment g = t // M): O((S + M + K) D) for one softmax over the own cluster's
    # members in earlier segments (S = L / K), the own segment so far and (Combiner) the K cluster summaries;
    # plus, once per segment, the balanced assignment of its M keys and the variant's ``_segment_completed``.
    supports_decoding = True

    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> ClusteredState:
        return ClusteredState(batch_size, max_len, device, dtype, segment=self.segment_len(max_len),
                              n_clusters=self.n_clusters)

    def step(self, state: ClusteredState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``, equal to the causal ``forward``'s
        output there for a sequence of ``state.max_len`` positions (eval mode; the centroids are not moved)."""
        t = state.reserve(q, 1)
        if state.q is None:
            state.allocate(q, v)
        B, H, _, D = q.shape
        K, M, S = self.n_clusters, state.segment, state.max_len // self.n_clusters
        g, start = t // M, (t // M) * M
        qs = self.scale(q)
        state.q[:, :, t], state.k[:, :, t], state.v[:, :, t] = qs[:, :, 0], k[:, :, 0], v[:, :, 0]
        state.length = t + 1

        # query route: nearest centroid of the position's key; a slot while fewer than S came before it
        route = self.kmeans.nearest(k)[..., 0]  # (B, H)
        routed = state.route_count.gather(-1, route.unsqueeze(-1)).squeeze(-1) < S
        state.route_count.scatter_add_(-1, route.unsqueeze(-1), torch.ones_like(route.unsqueeze(-1)))

        # direct: own cluster's members in segments < g (if routed) | own segment up to t
        pick = route.view(B, H, 1, 1, 1)
        own_k = state.k_blk.gather(2, pick.expand(B, H, 1, S, D)).squeeze(2)  # (B, H, S, D)
        own_v = state.v_blk.gather(2, pick.expand(B, H, 1, S, state.v_blk.shape[-1])).squeeze(2)
        earlier = torch.arange(S, device=q.device) < g * (M // K)
        cluster_logits = (qs @ own_k.transpose(-1, -2)).masked_fill(~(earlier & routed.unsqueeze(-1)).unsqueeze(-2), NEG_INF)
        segment_k, segment_v = state.k[:, :, start : t + 1], state.v[:, :, start : t + 1]
        logits = [cluster_logits, qs @ segment_k.transpose(-1, -2)]
        values = [own_v, segment_v]
        summaries = self._decoding_summaries(state, qs, torch.where(routed, route, K), g)
        if summaries is not None:
            logits.append(summaries[0])
            values.append(summaries[1])
        out = torch.cat(logits, -1).softmax(-1) @ torch.cat(values, -2)

        if t == start + M - 1:  # the segment completed: cluster its keys once
            self._complete_segment(state, g)
        return out

    def _complete_segment(self, state: ClusteredState, g: int) -> None:
        """Cluster segment ``g``'s keys (balanced, as ``assign``) into chunk g of the cluster blocks."""
        K, M = self.n_clusters, state.segment
        per_segment = M // K
        span = slice(g * M, (g + 1) * M)
        order, _ = cluster_order(self.kmeans.balanced(state.k[:, :, span]), K)  # (B, H, M)
        B, H = order.shape[:2]

        def blocks(x: torch.Tensor) -> torch.Tensor:
            return x[:, :, span].gather(2, order.unsqueeze(-1).expand(B, H, M, x.shape[-1])).view(B, H, K, per_segment, -1)

        chunk = slice(g * per_segment, (g + 1) * per_segment)
        state.k_blk[:, :, :, chunk], state.v_blk[:, :, :, chunk] = blocks(state.k), blocks(state.v)
        self._segment_completed(state, g, blocks(state.q), blocks(state.k))

    def _decoding_summaries(self, state: ClusteredState, qs: torch.Tensor, own_route: torch.Tensor,
                            g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Extra (logits ``(B, H, 1, R)``, values ``(B, H, R, D)``) of a step in segment ``g`` joining the
        softmax; ``own_route`` ``(B, H)``: the routed cluster, K when overflowed. None: direct keys only."""
        return None

    def _segment_completed(self, state: ClusteredState, g: int, q_chunk: torch.Tensor, k_chunk: torch.Tensor) -> None:
        """Hook: segment ``g``'s scaled queries and keys as cluster chunks ``(B, H, K, M / K, D)`` just arrived."""

    def _blocks(self, order: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Gather ``(B, H, L, D)`` tensors into cluster blocks ``(B, H, K, S, D)`` along ``order``."""
        B, H, L = order.shape
        rows, inverse = _permutation_rows(order)
        return [_PermuteRows.apply(x.reshape(B * H * L, x.shape[-1]), rows, inverse).view(
            B, H, self.n_clusters, L // self.n_clusters, x.shape[-1]) for x in xs]

    @staticmethod
    def _unblock(order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Cluster-block outputs (any shape holding ``(B, H, L, D)`` in ``order``) back to position order."""
        B, H, L = order.shape
        D = out.shape[-1]
        rows, inverse = _permutation_rows(order)
        return _PermuteRows.apply(out.reshape(B * H * L, D), inverse, rows).view(B, H, L, D)


def _permutation_rows(order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-(b, h) permutation ``order`` ``(B, H, L)`` as flat row indices into ``(B * H * L, D)`` and its inverse."""
    B, H, L = order.shape
    rows = (order + torch.arange(B * H, device=order.device).view(B, H, 1) * L).view(-1)
    inverse = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=order.device))
    return rows, inverse


@autocast_function
class _PermuteRows(torch.autograd.Function):
    """``x[rows]`` for a permutation ``rows`` of the rows of ``x`` ``(N, D)``; the gradient is ``grad[inverse]``.

    Measured reason: ``gather`` with an expanded ``(B, H, L, D)`` index reads 8 bytes of index per element and
    its backward scatter-adds into a fresh zero tensor; a permutation's backward is one more row selection.
    """

    @staticmethod
    def forward(ctx, x, rows, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class CausalClusterSlots:
    """The direct part of the causal k-means partition, vectorized (``routing`` and ``combiner_routing``).

    Query i in segment g attends directly to its own segment up to itself, plus (if routed) the members of
    its key cluster in segments < g. Query slots: the first S = L / K queries routed to centroid c take
    slots c*S + rank in it; the rest overflow into bin K*S (no own-cluster keys), as do queries with
    route K (no centroid: padded queries). ``logits`` / ``cluster_output``: the explicit logits (any device,
    padding, weight dropout); the CPU engine's ``ops.cpu.cluster_flash`` runs the whole joint softmax as fused
    CPU flash calls from the same slots.

    Args:
        query_routes: ``(B, H, L)`` nearest-centroid ids in ``[0, K]``.
        n_clusters: K.
        segment_len: causal segment length M.
    """

    def __init__(self, query_routes: torch.Tensor, n_clusters: int, segment_len: int) -> None:
        B, H, L = query_routes.shape
        K, S = n_clusters, L // n_clusters
        device = query_routes.device
        self.n_clusters, self.segment_len = K, segment_len
        _, rank = cluster_order(query_routes, K + 1)
        self.routed = (rank < S) & (query_routes < K)  # (B, H, L)
        self.slot = torch.where(self.routed, query_routes * S + rank, K * S)  # (B, H, L); K*S = overflow bin
        positions = torch.arange(L, device=device).expand(B, H, L)
        slot_query = torch.zeros(B, H, K * S + 1, dtype=torch.long, device=device).scatter_(2, self.slot, positions)
        slot_used = torch.zeros(B, H, K * S + 1, dtype=torch.bool, device=device).scatter_(2, self.slot, True)
        self.slot_query = slot_query[..., :-1].view(B, H, K, S)  # position of the query in each slot
        self.slot_used = slot_used[..., :-1].view(B, H, K, S)

    def logits(self, qs: torch.Tensor, k: torch.Tensor, k_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Direct logits ``(cluster_logits (B, H, L, S), segment_logits (B, H, n, M, M))``.

        qs: ``(B, H, L, D)`` scaled queries; k: ``(B, H, L, D)`` keys; k_blk: ``(B, H, K, S, D)`` key cluster
        blocks in position order (member t of a cluster lies in segment t // (M / K)). Masked entries are -inf.
        """
        B, H, L, D = qs.shape
        K, M = self.n_clusters, self.segment_len
        S, n = L // K, L // M
        device, neg_inf = qs.device, NEG_INF
        member_segment = torch.arange(S, device=device) // (M // K)  # (S,)

        # own cluster, earlier segments: slot queries x their cluster's block
        q_slot = qs.gather(2, self.slot_query.view(B, H, K * S, 1).expand(B, H, K * S, D)).view(B, H, K, S, D)
        cluster_allowed = (member_segment < (self.slot_query // M).unsqueeze(-1)) & self.slot_used.unsqueeze(-1)
        cluster_logits = (q_slot @ k_blk.transpose(-1, -2)).masked_fill_(~cluster_allowed, neg_inf)  # (B, H, K, S, S)
        # back to query order; overflow queries read an all -inf row
        cluster_logits = torch.cat([cluster_logits.view(B, H, K * S, S), cluster_logits.new_full((B, H, 1, S), neg_inf)], 2)
        cluster_logits = cluster_logits.gather(2, self.slot.unsqueeze(-1).expand(B, H, L, S))

        # own segment up to self
        q_seg, k_seg = qs.view(B, H, n, M, D), k.view(B, H, n, M, D)
        causal = causal_mask(M, device)
        segment_logits = (q_seg @ k_seg.transpose(-1, -2)).masked_fill_(~causal, neg_inf)
        return cluster_logits, segment_logits

    def cluster_output(self, w_cluster: torch.Tensor, v_blk: torch.Tensor) -> torch.Tensor:
        """Own-cluster part of the output: weights ``(B, H, L, S)`` x value blocks ``(B, H, K, S, D)`` ->
        ``(B, H, L, D)`` in query order (zero for overflow queries)."""
        B, H, K, S, D = v_blk.shape
        L = w_cluster.shape[2]
        w_slot = w_cluster.gather(2, self.slot_query.view(B, H, K * S, 1).expand(B, H, K * S, S)).view(B, H, K, S, S)
        out_slot = (w_slot.masked_fill(~self.slot_used.unsqueeze(-1), 0.0) @ v_blk).view(B, H, K * S, D)
        out_slot = torch.cat([out_slot, out_slot.new_zeros(B, H, 1, D)], 2)
        return out_slot.gather(2, self.slot.unsqueeze(-1).expand(B, H, L, D))
