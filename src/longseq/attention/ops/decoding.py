"""Incremental decoding (sampling, generation): per-layer states and the two generic decoders.

A causal attention with ``supports_decoding`` consumes a sequence position by position:
``state = attn.new_state(B, max_len, device=..., dtype=...)``, then ``attn.prefill(state, q, k, v)`` for a
prefix of T positions and ``attn.step(state, q, k, v)`` (T = 1) per new position, q, k, v unscaled
``(B, H, T, D)``; the outputs equal ``forward``'s at those positions (eval mode: no dropout). A state holds
tensors only; the module's own parameters are used at step time.

Two decoders cover every variant that is "a joint softmax over some keys and some region summaries":

- ``KVCache`` (``full``): the raw keys and values so far; a step attends to all of them, O(t D).
- ``PartitionDecoder`` (every Combiner partition and every sparse pattern that is a set of allowed keys,
  ``ops.partition.Partition``): index tables built once per ``max_len`` from the partition (direct keys of
  every position, usable regions of every position, the regions that complete at every position). A
  region's summary key and value are computed ONCE, when its last member arrives, by the variant's
  ``region_summaries`` hook; a step then costs one softmax over its direct keys and usable summaries,
  O((K_direct + K_regions) D) (e.g. O((m + n) D) for the sqrt(L) factorizations, O((1 + log L) D) for
  LogSparse), plus the summaries completing at that step.

The k-means partitions (``routing``, ``combiner_routing``) are data-dependent, so no static table describes
them: ``clustering.ClusteredAttention.step`` replays their causal forward with a ``clustering.ClusteredState``
(running query-route counts, each segment's keys clustered once when it completes, cached cluster summaries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from longseq.attention.errors import DecodingNotSupported
from longseq.attention.ops.masks import NEG_INF, causal_mask


@dataclass
class DecodingState:
    """What every decoding state has: the room (``max_len``) and the positions consumed (``length``)."""

    batch_size: int
    max_len: int
    device: torch.device
    dtype: torch.dtype
    length: int = 0

    def reserve(self, q: torch.Tensor, steps: int) -> int:
        """Check that ``steps`` more positions of batch ``q`` (B, H, T, D) fit; returns the first new position."""
        if q.shape[0] != self.batch_size:
            raise ValueError(f"decoding state was made for batch size {self.batch_size}, got {q.shape[0]}")
        if steps < 1:
            raise ValueError("prefill needs at least one position")
        if self.length + steps > self.max_len:
            raise ValueError(
                f"decoding past max_len={self.max_len}: {self.length} positions consumed, {steps} more given"
            )
        return self.length


@dataclass
class KVCache(DecodingState):
    """Raw keys and values of every position so far, ``(B, H, max_len, D)`` each (allocated on first use)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        """Write ``(B, H, T, D)`` keys and values after the consumed positions; returns ``(start, end)``."""
        start = self.reserve(k, k.shape[-2])
        end = start + k.shape[-2]
        if self.k is None:
            B, H = k.shape[:2]
            self.k = k.new_zeros(B, H, self.max_len, k.shape[-1], dtype=self.dtype, device=self.device)
            self.v = v.new_zeros(B, H, self.max_len, v.shape[-1], dtype=self.dtype, device=self.device)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return start, end


def cached_causal_attention(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """Causal softmax attention of T new positions over every cached one: q, k, v ``(B, H, T, D)`` -> ``(B, H, T, D)``."""
    start, end = cache.append(k, v)
    keys, values = cache.k[:, :, :end], cache.v[:, :, :end]
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    if end - start == 1:  # one query sees every cached key
        return F.scaled_dot_product_attention(q, keys, values)
    allowed = causal_mask(end - start, q.device, offset=start)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


def index_table(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a bool ``(N, M)`` mask as an index table: ``(idx (N, K) long, valid (N, K) bool)``, K = the
    largest row count (at least 1); each row lists its True columns in increasing order, then padding (0).
    Memory O(N K + nnz): no (N, M) integer temporary."""
    counts = mask.sum(-1)
    width = max(int(counts.max()) if mask.numel() else 0, 1)
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: columns increase within a row
    starts = counts.cumsum(0) - counts
    rank = torch.arange(rows.numel(), device=mask.device) - starts[rows]
    idx = torch.zeros(mask.shape[0], width, dtype=torch.long, device=mask.device)
    idx[rows, rank] = cols
    valid = torch.arange(width, device=mask.device) < counts.unsqueeze(-1)
    return idx, valid


@dataclass
class DecodingTables:
    """A causal ``Partition`` of ``max_len`` positions as index tables (built once, shared by every state).

    Attributes:
        direct, direct_valid: ``(L, Kd)`` the direct keys of every query.
        usable, usable_valid: ``(P, L, Kr)`` the regions every query uses, per plan (P = 1 but for the
            mixture's ``plans=average``).
        members, members_valid: ``(R, Km)`` each region's members.
        anchor: ``(R,)`` the position whose query summarizes the region, or -1 (pooled queries).
        completing: per position, the regions whose last member it is (``(n,)`` long each).
    """

    direct: torch.Tensor
    direct_valid: torch.Tensor
    usable: torch.Tensor
    usable_valid: torch.Tensor
    members: torch.Tensor
    members_valid: torch.Tensor
    anchor: torch.Tensor
    completing: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, partition, plans: list[torch.Tensor] | None = None) -> DecodingTables:
        """Tables of ``partition`` (``ops.partition.Partition``); ``plans``: one ``(R,)`` bool region filter per
        plan (the regions a plan's softmax may use), None = one plan with every region."""
        L, device = partition.direct.shape[-1], partition.direct.device
        direct, direct_valid = index_table(partition.direct)
        filters = plans if plans is not None else [torch.ones(partition.members.shape[0], dtype=torch.bool, device=device)]
        tables = [index_table(partition.usable & keep) for keep in filters]
        width = max(t[0].shape[-1] for t in tables)
        usable = torch.stack([F.pad(idx, (0, width - idx.shape[-1])) for idx, _ in tables])
        usable_valid = torch.stack([F.pad(ok, (0, width - ok.shape[-1])) for _, ok in tables])
        members, members_valid = index_table(partition.members)
        last = members.gather(1, (members_valid.sum(-1, keepdim=True) - 1).clamp(min=0)).squeeze(-1)  # (R,)
        # causal: a query reads only earlier keys and regions that completed at or before it
        position = torch.arange(L, device=device)
        future_direct = (direct > position[:, None]) & direct_valid
        future_region = (last[usable] > position[:, None]) & usable_valid if last.numel() else usable_valid
        if future_direct.any() or future_region.any():
            raise DecodingNotSupported("a decoding partition must be causal (no query may reach a later key)")
        order = torch.argsort(last, stable=True)
        completing = list(order.split(torch.bincount(last, minlength=L).tolist()))
        return cls(direct, direct_valid, usable, usable_valid, members, members_valid, partition.anchor, completing)


@dataclass
class PartitionState(DecodingState):
    """Decoding state of a ``PartitionDecoder``: scaled queries, keys and values so far ``(B, H, max_len, D)``,
    and the summary keys and values of every completed region ``(B, H, R, D)``."""

    tables: DecodingTables | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_bar: torch.Tensor | None = None
    v_bar: torch.Tensor | None = None

    def allocate(self, q: torch.Tensor, v: torch.Tensor) -> None:
        B, H, _, D = q.shape
        zeros = lambda n, d: torch.zeros(B, H, n, d, device=self.device, dtype=self.dtype)  # noqa: E731
        n_regions = self.tables.members.shape[0]
        self.q, self.k, self.v = zeros(self.max_len, D), zeros(self.max_len, D), zeros(self.max_len, v.shape[-1])
        self.k_bar, self.v_bar = zeros(n_regions, D), zeros(n_regions, v.shape[-1])


class PartitionDecoder:
    """Mixin for a causal variant whose weights are one joint softmax (or the mean of several, ``plans``) over
    its direct keys and the summaries of usable regions, described by ``decoding_partition(L)``.

    The variant provides ``decoding_partition(length) -> Partition``, ``region_summaries(...)`` (when it has
    regions) and optionally ``decoding_plans(partition)``. Tables are cached per (length, device).
    """

    supports_decoding = True

    def decoding_partition(self, length: int, device=None):
        raise NotImplementedError

    def decoding_plans(self, partition) -> list[torch.Tensor] | None:
        """One ``(R,)`` bool region filter per softmax plan whose outputs are averaged (None: one plan)."""
        return None

    def region_summaries(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                         anchor_q: torch.Tensor | None, anchor_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Summary keys and values ``(B, H, n, D)`` of n completed regions from their members' scaled queries,
        keys and values ``(B, H, n, Km, D)`` (``valid`` ``(n, Km)`` marks real members) and, for anchored
        regions, the anchor's scaled query and key ``(B, H, n, D)``."""
        raise NotImplementedError

    def decoding_tables(self, length: int, device) -> DecodingTables:
        cache = self.__dict__.setdefault("_decoding_tables", {})
        key = (length, str(device))
        if key not in cache:
            partition = self.decoding_partition(length, device)
            cache[key] = DecodingTables.of(partition, self.decoding_plans(partition))
        return cache[key]

    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> PartitionState:
        return PartitionState(batch_size, max_len, device, dtype, tables=self.decoding_tables(max_len, device))

    def step(self, state: PartitionState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``."""
        t = state.reserve(q, 1)
        if state.q is None:
            state.allocate(q, v)
        tables = state.tables
        state.q[:, :, t] = self.scale(q[:, :, 0])
        state.k[:, :, t], state.v[:, :, t] = k[:, :, 0], v[:, :, 0]
        state.length = t + 1
        done = tables.completing[t]
        if done.numel():
            self._summarize(state, done)
        qs = state.q[:, :, t : t + 1]  # (B, H, 1, D)
        direct_k = state.k.index_select(2, tables.direct[t])  # (B, H, Kd, D)
        direct_v = state.v.index_select(2, tables.direct[t])
        direct_logits = (qs @ direct_k.transpose(-1, -2)).masked_fill(~tables.direct_valid[t], NEG_INF)
        out = None
        for plan in range(tables.usable.shape[0]):
            regions, usable = tables.usable[plan, t], tables.usable_valid[plan, t]
            if usable.any():
                summary_k, summary_v = state.k_bar.index_select(2, regions), state.v_bar.index_select(2, regions)
                region_logits = (qs @ summary_k.transpose(-1, -2)).masked_fill(~usable, NEG_INF)
                weights = torch.cat([direct_logits, region_logits], -1).softmax(-1)
                part = weights @ torch.cat([direct_v, summary_v], -2)
            else:
                part = direct_logits.softmax(-1) @ direct_v
            out = part if out is None else out + part
        return out / tables.usable.shape[0]

    def _summarize(self, state: PartitionState, regions: torch.Tensor) -> None:
        """Compute and store the summaries of ``regions`` (their last member just arrived)."""
        tables = state.tables
        idx, valid = tables.members[regions], tables.members_valid[regions]  # (n, Km)
        B, H = state.q.shape[:2]
        gather = lambda x: x.index_select(2, idx.flatten()).view(B, H, *idx.shape, x.shape[-1])  # noqa: E731
        anchor = tables.anchor[regions]
        anchor_q = anchor_k = None
        if (anchor >= 0).all():
            anchor_q, anchor_k = state.q.index_select(2, anchor), state.k.index_select(2, anchor)
        k_bar, v_bar = self.region_summaries(gather(state.q), gather(state.k), gather(state.v), valid, anchor_q, anchor_k)
        state.k_bar[:, :, regions], state.v_bar[:, :, regions] = k_bar, v_bar
