"""Combiner with query-dependent selection (issue 24): a Combiner partition whose ``top_k`` best regions per query
come back at full resolution inside the same joint softmax.

Combiner mixes direct keys and region summaries in one softmax, but inside a region the weights do not depend on
the query (``p(j | R)``). Here each query ranks the regions it may use by its logit against their summary keys
(``q . k_bar_R``, the logit the joint softmax already has) and replaces the ``top_k`` best by their member keys:
one softmax over [direct keys ; members of the chosen regions ; summaries of the other usable regions]. It keeps
Combiner's full support and gains exact retrieval inside the chosen regions. ``top_k = 0`` is the plain Combiner
variant (its own ``forward``); ``top_k`` covering every region a query may use is full attention (the partition
covers every allowed key exactly once).

The partition is any pooled Combiner partition whose regions a static ``Partition`` describes and whose joint
softmax is one plan (``SELECT_PARTITIONS``): ``attention.partition=fixed`` (default) and the pooled axial
factorizations. ``combiner_axial`` (regions summarized by an anchor's own query), ``combiner_routing`` (k-means,
data-dependent) and ``combiner_logsparse`` (overlapping Fenwick regions: its member table is O(L^2)) are left out.

Fast path: index tables of the partition (direct keys, usable regions, region members); region summaries from
gathered members (``RegionSummary.region_summaries``, the function decoding uses); three parts of the one softmax
computed apart and merged by log-sum-exp (``ops.block_select``): the direct keys (fixed: the own segment as batched
``(m, m)`` products; other partitions: a per-query table), the chosen regions' members as (query, region) pairs in
tiles of queries sharing one region, and the other usable summaries (fixed: one ``(L, n)`` product; on the CPU
engine one flash call over every summary, the chosen and unusable ones masked). Cost
O(L (Kd + k Km + Kr) D) for Kd direct keys, Km members per region and Kr usable regions per query (fixed: m, m, n),
never an ``L x L`` tensor. FlexAttention (``attention.backend=flex``, auto on CUDA; partition=fixed): combiner_fixed's
call over [own segment ; summaries] with each query's chosen summaries masked by a per-batch mask_mod on its static
tiles, and the chosen segments on gathered queries (``ops.flex.selection``), merged into the one softmax.
"""

from __future__ import annotations

import torch

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.ops.block_select import (
    CPU_FLASH,
    TILED_PAIRS,
    block_attention,
    by_query_chunks,
    flash_inputs,
    gather_keys,
    grouped_attention,
    merge_parts,
    safe_softmax,
    score_dtype,
    scoring,
    top_blocks,
)
from longseq.attention.ops.cpu.flash_lse import flash_lse, pad_for_flash
from longseq.attention.ops.decoding import PartitionDecoder, PartitionState, index_table
from longseq.attention.ops.flex.selection import other_block_pairs, selected_blocks
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import (
    ATTENTION_REGISTRY,
    PARTITION_FAMILIES,
    accepted_kwargs,
    build_attention,
    register_attention,
)

SELECT_PARTITIONS = ("fixed", "axial_vertical", "axial_horizontal")


@register_attention("combiner_select")
class CombinerSelectAttention(PartitionDecoder, Attention):
    """A Combiner partition with the ``top_k`` best regions per query at full resolution.

    Args:
        causal: the partition's causal or bidirectional build.
        partition: the Combiner partition, a name of ``SELECT_PARTITIONS`` or a mapping ``{name: ..., <knobs>}``
            (the ``partition=`` config group's form); ``attention.partition=fixed`` by default.
        top_k: regions per query replaced by their members (0 = the plain Combiner variant).
        block_size, summary: the partition's knobs (block_size where the partition has one).
        seq_len, n_heads, head_dim, dropout: see ``Attention``; dropout acts on the joint weights.
    """

    pattern_from_data = True  # top-k blocks by score
    supports_padding_mask = True
    cpu_flash = CPU_FLASH
    host_reads, xla_path = TILED_PAIRS, True  # the xla backend: static tiles

    def __init__(self, *, causal: bool, partition="fixed", top_k: int = 2, block_size: int | None = None,
                 summary: str = "max", **common) -> None:
        super().__init__(causal=causal, **common)
        spec = {"name": partition} if isinstance(partition, str) else dict(partition)
        geometry = spec.pop("name", None)
        if geometry not in SELECT_PARTITIONS:
            raise AttentionConfigError(
                f"attention.partition={geometry!r} has no combiner_select variant; valid: {list(SELECT_PARTITIONS)}")
        target = PARTITION_FAMILIES["combiner"][geometry]
        knobs = {"summary": summary, **spec}
        if block_size is not None and "block_size" in accepted_kwargs(ATTENTION_REGISTRY[target].cls):
            knobs.setdefault("block_size", block_size)
        self.inner = build_attention(target, causal=causal, **common, **knobs)
        self.top_k = check_int_knob(top_k, "attention.top_k", minimum=0)
        self.has_parameters = self.inner.has_parameters
        self._tables: dict = {}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, partition={self.inner.name}, top_k={self.top_k}"

    # -- geometry: the inner Combiner's --------------------------------------------------------------------
    def requires_len_multiple_of(self) -> int:
        return self.inner.requires_len_multiple_of()

    def check_length(self, length: int) -> None:
        self.inner.check_length(length)

    def partition(self, length: int, device=None) -> Partition:
        """The plain Combiner partition (before selection)."""
        return self.inner.partition(length, device)

    def tables(self, length: int, device) -> tuple[torch.Tensor, ...]:
        """Index tables of ``partition(length)``: direct ``(L, Kd)``, usable regions ``(L, Kr)``, members
        ``(R, Km)``, each with its valid mask; the usable regions as None and the ``(L, R)`` mask instead where
        ``dense_regions`` holds (cached per length and device)."""
        key = (length, str(device))
        if key not in self._tables:  # built on the host (index tables count rows), then moved: no device read
            part = self.partition(length, "cpu")
            regions, region_ok = index_table(part.usable)
            if self.dense_regions(part.usable.shape[-1], regions):
                regions, region_ok = None, part.usable
            tables = (*index_table(part.direct), regions, region_ok, *index_table(part.members))
            self._tables[key] = tuple(None if t is None else t.to(device) for t in tables)
        return self._tables[key]

    # -- shared steps -------------------------------------------------------------------------------------
    def summaries(self, qs, k, v, members, member_ok):
        """Summary keys and values ``(B, H, R, D)`` of every region from its members (``member_ok`` ``(B|1, 1, R,
        Km)``; an empty region gets its unmasked members so its row stays finite: the caller masks it)."""
        usable = member_ok | ~member_ok.any(-1, keepdim=True)
        gather = lambda x: gather_keys(x, members.view(1, 1, *members.shape))  # noqa: E731  (B, H, R, Km, D)
        return self.inner.summary.region_summaries(gather(qs), gather(k), gather(v), usable)

    def dense_regions(self, n_regions: int, regions: torch.Tensor) -> bool:
        """Whether a query's regions are better taken as a ``(T, R)`` mask over every region (few regions, e.g.
        fixed: one ``(T, R)`` product, no gather or scatter) than gathered per query from its table (many regions,
        e.g. one per axial column prefix)."""
        return n_regions <= 2 * regions.shape[-1]

    def region_logits(self, qs: torch.Tensor, k_bar: torch.Tensor, regions: torch.Tensor | None) -> torch.Tensor:
        """Logits of each query against the summary keys: every region ``(B, H, T, R)`` (``regions`` None, the dense
        form) or its usable regions ``regions`` ``(B|1, H|1, T, Kr)`` -> ``(B, H, T, Kr)``."""
        if regions is None:
            return qs @ k_bar.transpose(-1, -2)
        return (gather_keys(k_bar, regions) @ qs.unsqueeze(-1)).squeeze(-1)

    def choose(self, qs, k_bar, regions, region_ok, logits=None):
        """The ``top_k`` usable regions per query by ``q . k_bar``: ``regions`` ``(B|1, H|1, T, Kr)`` ids, ``region_ok``
        their usability -> chosen slots ``(B, H, T, k)`` into ``regions`` and whether each is used. ``logits``: the
        joint softmax's own region logits, reused when already in the scoring dtype (fp32 / fp64, no autocast)."""
        with scoring(qs), torch.no_grad():
            dtype = score_dtype(qs)
            if logits is None or logits.dtype != dtype:
                logits = self.region_logits(qs.to(dtype), k_bar.to(dtype), regions)
            scores = logits.masked_fill(~region_ok, NEG_INF)
        return top_blocks(scores, self.top_k)

    def joint(self, qs, k, v, k_bar, v_bar, direct, regions, region_ok, members, member_ok, flash=None):
        """One softmax per query over its direct keys (``direct``: that part's ``(out, lse)``), the members of its
        ``top_k`` regions (tiled by region, ``grouped_attention``) and the summaries of its other usable regions,
        merged by log-sum-exp. Regions: per query ``regions`` ``(B|1, H|1, T, Kr)`` ids and ``region_ok`` their
        usability, or ``regions`` None and ``region_ok`` ``(B|1, 1, T, R)`` a mask over every region (the dense form,
        ``dense_regions``); ``members``/``member_ok`` ``(R, Km)`` / ``(B|1, 1, R, Km)``; ``flash``: the padded
        inputs of the CPU engine's flash calls (``cpu_flash``), or None: the tiles, and in the dense form the
        summaries too (one masked flash call over every region's summary, where the explicit path builds the
        ``(T, R)`` logits, their masked softmax and two products). Returns the merged ``Part`` ``(out (B, H, T, Dv),
        lse (B, H, T))``."""
        B, H, T, _ = qs.shape
        drop = self.dropout if self.training else 0.0
        flash_summaries = flash is not None and regions is None
        logits = None if flash_summaries else self.region_logits(qs, k_bar, regions)
        slots, ok = self.choose(qs, k_bar, regions, region_ok, logits)
        chosen = slots if regions is None else regions.expand(B, H, T, -1).gather(-1, slots)  # (B, H, T, k) ids
        picked = grouped_attention(qs, k, v, members, member_ok[:, 0], chosen, ok, dropout=drop, flash=flash)
        width = k_bar.shape[-2] if regions is None else regions.shape[-1]
        replaced = torch.zeros(B, H, T, width, dtype=torch.bool, device=qs.device).scatter(-1, slots, ok)
        if flash_summaries:
            summaries = flash_lse(flash.q, pad_for_flash(k_bar, 0.0), pad_for_flash(v_bar, 1.0), region_ok & ~replaced)
            return merge_parts([direct, picked, summaries])
        weights, lse = safe_softmax(logits, region_ok & ~replaced)
        if drop:
            weights = torch.nn.functional.dropout(weights, drop)
        if regions is None:
            summary = weights.to(v_bar.dtype) @ v_bar
        else:
            summary = (weights.unsqueeze(-2).to(v_bar.dtype) @ gather_keys(v_bar, regions)).squeeze(-2)
        return merge_parts([direct, picked, (summary, lse)])

    def direct_part(self, qs, k, v, direct, direct_ok, whole: bool = False, flash=None):
        """Each query over its direct keys ``(out, lse)``, from its direct table ``(B|1, H|1, T, Kd)``: for the whole
        sequence (``whole``) of the fixed partition, the own segment as batched ``(m, m)`` products (the table lists
        the segment's keys in order); otherwise gathered per query."""
        drop = self.dropout if self.training else 0.0
        if whole and self.inner.name == "combiner_fixed":
            m = self.inner.block_size
            B, H, L, _ = qs.shape
            allowed = direct_ok.reshape(direct_ok.shape[0], 1, L // m, m, -1)  # own segment in order: (.., m, m)
            return block_attention(qs, k, v, m, allowed, drop, flash)
        weights, lse = safe_softmax((gather_keys(k, direct) @ qs.unsqueeze(-1)).squeeze(-1), direct_ok)
        if drop:
            weights = torch.nn.functional.dropout(weights, drop)
        return (weights.unsqueeze(-2).to(v.dtype) @ gather_keys(v, direct)).squeeze(-2), lse

    # -- the flex layout (``ops.flex``), partition=fixed: combiner_fixed's call without the chosen segments'
    # summaries, the chosen segments on gathered queries (``ops.flex.selection``), one softmax ----------------------
    flex_selects = True

    def flex_config_reason(self) -> str | None:
        if self.inner.name != "combiner_fixed":
            return (f"its flex layout is written for attention.partition=fixed (its regions are key blocks); "
                    f"{self.inner.name}'s are not")
        return None

    def flex_calls(self, length: int, device: torch.device) -> list:
        return self.inner.flex_calls(length, device)

    def flex_batch_state(self, qs, k, v, real, tile):
        """The segments' summaries (the inner Combiner's) and each query's ``top_k`` usable segments by
        ``q . k_bar`` (``choose``, the rule of ``forward``), scored in chunks of query rows as ``moba`` and ``nsa``
        score theirs (``by_query_chunks``): in one piece the fp32 scores and their integer keys were 2 x 537 MB at
        L = 65,536 (H 8, 256 segments), more than the layer saves for its backward (about 640 MB)."""
        k_bar, v_bar, occupied = self.inner.flex_summaries(0, qs, k, v, real)
        L = qs.shape[-2]
        m = self.inner.block_size
        segment = torch.arange(L, device=qs.device) // m
        other = torch.arange(L // m, device=qs.device)
        usable = (other < segment.view(-1, 1)) if self.causal else (other != segment.view(-1, 1))  # (L, n)
        usable = usable.view(1, 1, L, -1) if occupied is None else usable & occupied.view(-1, 1, 1, L // m)
        if self.top_k == 0:
            return k_bar, v_bar, occupied, None, None
        B, H, n = qs.shape[0], qs.shape[1], L // m

        def rows(qs_, usable_):
            return self.choose(qs_, k_bar, None, usable_)

        return k_bar, v_bar, occupied, *by_query_chunks(rows, L, B * H * n * 4, qs.device, qs, usable)

    def flex_summaries(self, index, qs, k, v, real, state=None):
        return state[:3]

    def flex_call_mask(self, index, state):
        chosen, ok = state[3:]
        if chosen is None:
            return None
        L, K = chosen.shape[-2], chosen.shape[-1]

        def not_chosen(b, h, q, kv):  # a summary slot kv = L + r is left out when the query chose segment r
            region = kv - L
            keep = ~((region == chosen[b, h, q, 0]) & ok[b, h, q, 0])
            for j in range(1, K):  # top_k, a handful: unrolled
                keep = keep & ~((region == chosen[b, h, q, j]) & ok[b, h, q, j])
            return keep

        return not_chosen

    def flex_extra_parts(self, state, q, k, v, real, tile):
        chosen, ok = state[3:]
        if chosen is None:
            return []
        L, m = q.shape[-2], self.inner.block_size
        most = other_block_pairs(L, m, self.top_k, self.causal)
        return [(0, *selected_blocks(q, k, v, chosen, ok, m, tile, real, most_pairs=most))]

    # -- the contract ---------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, Dv); ``key_padding_mask`` (B, L) bool, True = padded key."""
        L = q.shape[-2]
        self.check_length(L)
        if self.top_k == 0:
            return self.inner(q, k, v, key_padding_mask=key_padding_mask)
        return self.selected_forward(q, k, v, key_padding_mask)

    def selected_forward(self, q, k, v, key_padding_mask=None):
        """The selection path (``forward`` for ``top_k`` > 0; callable at ``top_k = 0`` for tests)."""
        B, H, L, _ = q.shape
        direct, direct_ok, regions, region_ok, members, member_ok = self.tables(L, q.device)
        qs = self.scale(q)
        direct, direct_ok = direct.view(1, 1, L, -1), direct_ok.view(1, 1, L, -1)
        region_ok = region_ok.view(1, 1, L, -1)
        regions = None if regions is None else regions.view(1, 1, L, -1)
        member_ok = member_ok.view(1, 1, *member_ok.shape)
        if key_padding_mask is not None:  # ``ops.padding``: padded keys leave direct sets and regions
            real = ~key_padding_mask.to(device=q.device, dtype=torch.bool)  # (B, L)
            member_ok = member_ok & real[:, members].unsqueeze(1)  # (B, 1, R, Km)
            occupied = member_ok.any(-1)  # (B, 1, R)
            if regions is None:
                region_ok = region_ok & occupied.unsqueeze(-2)
            else:
                region_ok = region_ok & occupied[torch.arange(B, device=q.device).view(B, 1, 1, 1), 0, regions]
            unpadded = direct_ok
            direct_ok = direct_ok & real[:, direct[0, 0]].unsqueeze(1)
        flash = flash_inputs(self, q, k, v, qs, key_padding_mask)
        k_bar, v_bar = self.summaries(qs, k, v, members, member_ok)
        out, lse, _ = self.joint(qs, k, v, k_bar, v_bar, self.direct_part(qs, k, v, direct, direct_ok, True, flash),
                                 regions, region_ok, members, member_ok, flash)
        if key_padding_mask is not None:  # rule 3: a query without any real key: its unpadded direct keys
            unpadded_out = self.direct_part(qs, k, v, direct, unpadded, True, flash)[0]
            out = torch.where((lse > NEG_INF).unsqueeze(-1), out, unpadded_out)
        return out

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) dense reference (small L), independent of the tables of ``forward``: per document and head,
        the partition (``without_padding`` under key padding), pooled summary keys, the ``top_k`` usable regions
        by ``q . k_bar`` moved into the direct set, then ``RegionSummary.matrix`` of that partition."""
        B, H, L, _ = q.shape
        base, qs = self.partition(L, q.device), self.scale(q)
        pads = torch.zeros(B, L, dtype=torch.bool, device=q.device) if key_padding_mask is None else \
            key_padding_mask.to(device=q.device, dtype=torch.bool)
        rows = []
        for b in range(B):
            part = base.without_padding(pads[b])
            heads = []
            for h in range(H):
                qh, kh = qs[b : b + 1, h : h + 1], k[b : b + 1, h : h + 1]
                chosen = torch.zeros_like(part.usable)
                if part.members.shape[0]:
                    k_bar = self.inner.summary.pool_region_keys(kh, part.members)  # (1, 1, R, D)
                    with scoring(qh):
                        dtype = score_dtype(qh)
                        scores = (qh.to(dtype) @ k_bar.to(dtype).transpose(-1, -2))[0, 0]
                    slots, ok = top_blocks(scores.masked_fill(~part.usable, NEG_INF), self.top_k)
                    chosen.scatter_(-1, slots, ok)
                direct = part.direct | ((chosen.double() @ part.members.double()) > 0)
                selected = Partition(direct, part.members, part.usable & ~chosen, part.family, part.anchor)
                heads.append(self.inner.summary.matrix(selected, qh, kh))
            rows.append(torch.cat(heads, 1))
        return torch.cat(rows)

    # -- incremental decoding (``PartitionDecoder`` tables and cached summaries; selection per step) -----------
    def decoding_partition(self, length: int, device=None) -> Partition:
        return self.partition(length, device)

    def region_summaries(self, q, k, v, member, anchor_q=None, anchor_k=None):
        return self.inner.summary.region_summaries(q, k, v, member)

    def step(self, state: PartitionState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``; the completed regions' summaries are
        cached (``PartitionDecoder``), the ``top_k`` usable ones replaced by their members from the cache."""
        if self.top_k == 0:
            return super().step(state, q, k, v)
        t = state.reserve(q, 1)
        if state.q is None:
            state.allocate(q, v)
        tables = state.tables
        qs = self.scale(q)
        state.q[:, :, t], state.k[:, :, t], state.v[:, :, t] = qs[:, :, 0], k[:, :, 0], v[:, :, 0]
        state.length = t + 1
        done = tables.completing[t]
        if done.numel():
            self._summarize(state, done)
        view = lambda x: x[t].view(1, 1, 1, -1)  # noqa: E731
        member_ok = tables.members_valid.view(1, 1, *tables.members_valid.shape)
        direct = self.direct_part(qs, state.k, state.v, view(tables.direct), view(tables.direct_valid))
        return self.joint(qs, state.k, state.v, state.k_bar, state.v_bar, direct, view(tables.usable[0]),
                          view(tables.usable_valid[0]), tables.members, member_ok)[0]
