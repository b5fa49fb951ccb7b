"""A flex call's region summaries and its KV assembly as ONE operation, ``summary_kv``: on CUDA one Triton launch
forward and two backward (``ops.flex.summary_kernels``) instead of the pools, products, softmaxes, concatenations and
padding that inductor compiled into 8 to 75 kernels forward and 9 to 150 backward per layer (L 4,096; counted on the
CPU for an sm90 target, ``longseq.bench.launches``).

A variant that pools its regions (``RegionSummary`` kinds ``max`` and ``mean``) describes them once per length as a
``RegionTable`` (``FlexCall.regions``): region r holds the positions ``start + i * stride``, ``i < count``, except
``skip``. ``FusedKV`` adds where each KV slot of the call takes its row from (``slot_source``, derived from the call's
own ``summary_kv`` layout, so copies, orders and tile padding are the call's) and the inverse tables the backward
walks. Both are static: built with the layout, shared by every layer and step.

``summary_kv`` is a ``torch.library.triton_op``: ``torch.compile`` traces into it and launches its kernels from the
compiled graph. On the CPU (no Triton device) it runs ``reference_summary_kv``, the same arithmetic in plain torch
(gathered members, dense over the largest region; tests and small lengths), with autograd's backward. The engine
uses it where ``fused_applies`` says so: CUDA (or ``fused_everywhere`` in tests and the launch count), no key
padding; every other case keeps the variant's own ``flex_summaries``, the reference the kernels are tested against.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

REDUCES = ("max", "mean", "anchor")
_FORCED = {"on": False}
_REGISTERED: dict[str, bool | None] = {"ok": None}  # longseq::summary_kv registered (``summary_launch.register``)


@dataclass(frozen=True, eq=False, repr=False)
class RegionTable:
    """Regions as arithmetic progressions of positions: region r = ``{start[r] + i * stride[r] : i < count[r]}``
    without ``skip[r]`` (-1: none), each ``(R,)`` int32 on the layout's device. ``reduce`` says how a region's summary
    query and key are made: ``max`` or ``mean`` pool its members, ``anchor`` takes the query and key of its position
    ``anchor[r]`` (a member; ``combiner_axial``'s row-mate). ``heads_last``: the fused KV is laid out ``(B, KV, H, D)``
    (a view ``(B, H, KV, D)`` of it), for a variant that maps the summaries across heads without a copy. Rows are in
    the order of the variant's ``flex_summaries`` (a call's ``summary_order`` applies to both)."""

    start: torch.Tensor
    stride: torch.Tensor
    count: torch.Tensor
    skip: torch.Tensor
    anchor: torch.Tensor
    reduce: str = "max"
    heads_last: bool = False
    max_count: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.reduce not in REDUCES:
            raise ValueError(f"RegionTable.reduce={self.reduce!r}; valid: {REDUCES}")
        object.__setattr__(self, "max_count", int(self.count.max()) if self.count.numel() else 0)

    @classmethod
    def of(cls, start, stride, count, skip=None, anchor=None, reduce: str = "max", heads_last: bool = False,
           device=None) -> RegionTable:
        """A table from integer tensors (or anything ``torch.as_tensor`` takes), broadcast to one length R."""
        parts = [torch.as_tensor(-1 if x is None else x, device=device) for x in (start, stride, count, skip, anchor)]
        parts = [x.to(torch.int32).contiguous() for x in torch.broadcast_tensors(*parts)]
        return cls(*parts, reduce=reduce, heads_last=heads_last)

    @property
    def n_regions(self) -> int:
        return self.start.numel()

    def member_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions (R, S) long, valid (R, S) bool)``, S the largest count: each region's members (gathers)."""
        i = torch.arange(max(self.max_count, 1), device=self.start.device)
        positions = self.start.long().unsqueeze(1) + i * self.stride.long().unsqueeze(1)
        valid = (i < self.count.unsqueeze(1)) & (positions != self.skip.long().unsqueeze(1))
        return positions.where(valid, 0), valid

    def members(self, L: int) -> torch.Tensor:
        """``(R, L)`` bool: the positions each region holds (tests)."""
        positions, valid = self.member_index()
        out = torch.zeros(self.n_regions, L, dtype=torch.bool, device=positions.device)
        region = torch.arange(self.n_regions, device=positions.device).unsqueeze(1).expand_as(positions)
        out[region[valid], positions[valid]] = True
        return out


@dataclass(frozen=True, eq=False, repr=False)
class FusedKV:
    """What ``summary_kv`` needs of one call at one length, all static: the regions, ``slot_source`` ``(KV,)`` (a
    slot's row: a key position in ``[0, L)``, summary ``s - L`` in ``[L, L + R)``, zeros at ``L + R``), ``dst``
    ``(R, C)`` (the slots that hold summary r, -1 padded), ``key_slot`` ``(L,)`` (the slot of each position's own
    key, -1 for a call without direct keys) and the CSR ``indptr`` ``(L + 1,)`` / ``indices`` of the regions that
    hold each position."""

    regions: RegionTable
    L: int
    slot_source: torch.Tensor
    dst: torch.Tensor
    key_slot: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor

    @classmethod
    def of(cls, call, L: int, kv_len: int) -> FusedKV:
        """The tables of ``call`` (a ``FlexCall`` with ``regions``) at length L over its ``kv_len`` slots (whole
        tiles): the summaries' slots come from the call's own ``summary_order`` and ``summary_kv``."""
        regions = call.regions
        device, R = regions.start.device, regions.n_regions
        rows = torch.arange(1, R + 1, device=device)  # 0 marks a padding slot of summary_kv
        if call.summary_order is not None:
            rows = rows.index_select(0, call.summary_order)
        laid = call.summary_kv(rows.view(1, 1, -1, 1).float(), L).view(-1).long()
        summaries = torch.where(laid > 0, L + laid - 1, L + R)
        keys = []
        if call.direct is not None:
            keys = [torch.arange(L, device=device) if call.order is None else call.order.long()]
        source = torch.cat([*keys, summaries])
        source = torch.cat([source, source.new_full((kv_len - source.numel(),), L + R)])
        # the slots of each summary, in slot order: sorted (region, slot) pairs, not an (R, KV) table (at 16,384
        # combiner_mixture's took 20 GB to build)
        region = source - L
        held = (region >= 0) & (region < R)
        region, slot = region[held], torch.arange(kv_len, device=device)[held]
        order = torch.argsort(region * kv_len + slot)
        region, slot = region[order], slot[order]
        per_region = torch.bincount(region, minlength=R)
        copies = max(int(per_region.max()) if R else 0, 1)
        rank = torch.arange(region.numel(), device=device) - (per_region.cumsum(0) - per_region)[region]
        dst = torch.full((R, copies), -1, dtype=torch.long, device=device)
        dst[region, rank] = slot
        if call.direct is None:
            key_slot = torch.full((L,), -1, device=device)
        else:
            key_slot = torch.arange(L, device=device) if call.order is None else call.sequence_order
        positions, valid = regions.member_index()
        region_of = torch.arange(R, device=device).unsqueeze(1).expand_as(positions)
        member_pos, member_region = positions[valid], region_of[valid]
        order = torch.argsort(member_pos * max(R, 1) + member_region)
        indices = member_region[order]
        indptr = torch.zeros(L + 1, dtype=torch.long, device=device)
        indptr[1:] = torch.bincount(member_pos, minlength=L).cumsum(0)
        as_int = functools.partial(torch.Tensor.to, dtype=torch.int32)
        return cls(regions, L, as_int(source).contiguous(), as_int(dst).contiguous(), as_int(key_slot).contiguous(),
                   as_int(indptr).contiguous(), as_int(indices).contiguous())

    @property
    def kv_len(self) -> int:
        return self.slot_source.numel()


# -- when the fused operation runs ------------------------------------------------------------------------
def fused_applies(q: torch.Tensor, key_padding: bool) -> bool:
    """Whether the engine computes a call's summaries and KV with ``summary_kv``: on CUDA (where its kernels run), or
    everywhere inside ``fused_everywhere``, once the operation is registered (``summary_launch.register``, when a
    layout was built; it needs Triton); never under key padding (its masked pools stay the variant's own)."""
    return not key_padding and (q.is_cuda or _FORCED["on"]) and bool(_REGISTERED["ok"])


@contextlib.contextmanager
def fused_everywhere():
    """Within: the engine takes ``summary_kv`` on every device (tests; the launch count on the CPU)."""
    saved = _FORCED["on"]
    _FORCED["on"] = True
    try:
        yield
    finally:
        _FORCED["on"] = saved


# -- the reference: plain torch, autograd's backward -----------------------------------------------------------
def reference_summaries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, regions: RegionTable,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_bar (B, H, R, D), v_bar (B, H, R, Dv))`` of unscaled ``q``, ``k``, ``v`` ``(B, H, L, .)``: pooled keys and
    the local expectations under the pooled queries times ``scale``; an empty region gives zeros. Dense over
    ``(R, largest count)``: for tests and short sequences."""
    positions, valid = regions.member_index()
    qm, km, vm = (x[..., positions, :] for x in (q, k, v))  # (B, H, R, S, .)
    keep = valid.unsqueeze(-1)
    occupied = valid.any(-1, keepdim=True)  # (R, 1)
    if regions.reduce == "anchor":
        q_bar, k_bar = (x[..., regions.anchor.long(), :] for x in (q, k))
    elif regions.reduce == "max":
        q_bar = qm.masked_fill(~keep, float("-inf")).amax(-2).where(occupied, 0.0)
        k_bar = km.masked_fill(~keep, float("-inf")).amax(-2).where(occupied, 0.0)
    else:
        size = valid.sum(-1, keepdim=True).clamp(min=1).to(q.dtype)
        q_bar, k_bar = (qm * keep).sum(-2) / size, (km * keep).sum(-2) / size
    logits = (km * (q_bar * scale).unsqueeze(-2)).sum(-1).masked_fill(~valid, float("-inf"))
    weights = logits.masked_fill(~occupied, 0.0).softmax(-1).masked_fill(~valid, 0.0)
    return k_bar, (weights.unsqueeze(-1) * vm).sum(-2)


def reference_summary_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: FusedKV,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``summary_kv`` in plain torch: the call's KV ``(B, H, KV, .)`` = keys in the call's order, summaries in their
    slots, zeros elsewhere (``FusedKV.slot_source``)."""
    k_bar, v_bar = reference_summaries(q, k, v, fused.regions, scale)
    source = fused.slot_source.long()
    rows_k = torch.cat([k, k_bar.to(k.dtype), k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], -2)
    rows_v = torch.cat([v, v_bar.to(v.dtype), v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], -2)
    return rows_k.index_select(-2, source), rows_v.index_select(-2, source)


# -- the operation ------------------------------------------------------------------------------------------------
def summary_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: FusedKV,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's KV ``(B, H, KV, D)`` and ``(B, H, KV, Dv)`` from unscaled ``q``, ``k``, ``v`` ``(B, H, L, .)``: its keys
    (in its order), every region's pooled key and local expectation (logits ``scale * pool(q) . k``) in their slots,
    zeros in the rest. Differentiable; one kernel forward and two backward on CUDA."""
    r = fused.regions
    return torch.ops.longseq.summary_kv(q, k, v, r.start, r.stride, r.count, r.skip, r.anchor, fused.slot_source,
                                        fused.dst, fused.key_slot, fused.indptr, fused.indices, float(scale),
                                        REDUCES.index(r.reduce), r.max_count, r.heads_last)
