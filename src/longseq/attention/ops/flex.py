"""The FlexAttention backend: every sparse pattern and Combiner partition as ``flex_attention`` calls over
``[keys ; region summaries]`` with a ``BlockMask`` compiled from the partition's index arithmetic.

What a variant computes is written once (``partition(L)`` / ``pattern(L)``, ``attention_matrix``); this module
is one way of computing it. A variant's flex *layout* is a list of ``FlexPlan`` calls; each call attends its
queries to ``[the L keys ; R region summaries]`` (KV longer than Q) under a ``mask_mod`` read from the geometry by
index arithmetic (segment index, row / column, log level, block table), never from an ``(L, L + R)`` dense mask:

- one call for ``combiner_fixed``, ``combiner_logsparse``, ``local``, ``longformer``, ``logsparse``, ``bigbird``,
  ``random``;
- two calls merged exactly by their log-sum-exps for the grid variants whose keys include a column (strided in
  sequence order, it would touch every tile): own row (+ the vertical regions of the query's row) in sequence
  order, own column (+ the row-major or horizontal summaries) in column order — ``axial``, ``combiner_axial``,
  ``combiner_axial_vertical`` / ``_horizontal``, ``combiner_mixture`` (``plans=average``: one pair per plan,
  averaged); ``strided`` and ``fixed`` likewise (band / own block, then the strided column / the summary cells in
  column order);
- ``routing`` and ``combiner_routing``: one call whose mask reads this batch's k-means clusters
  (``DATA_LAYOUTS``: built per call, never cached).

Summaries are the variant's own pooling and local expectation of v (``RegionSummary.region_summaries`` on
reshaped segments and log-level chunks; the pooled axial variants' ``padded_prefix_summaries`` /
``padded_excluding_own_summaries``; ``combiner_axial``'s anchored row attention and ``summary_keys``), O(L D) per
region family. The order of the summaries in KV only decides how many tiles are visited, never the result.

Key padding (``ops.padding``'s one rule, per-batch masks in the ``mask_mod``): padded keys leave the direct
sets and the summaries (``region_summaries`` pools real members only); a region without a real key is masked; a
query left with nothing (its log-sum-exp is -inf: only a padded query can be) takes the output of the same calls
with its unpadded direct keys only.

Devices: on CUDA ``flex_attention`` is compiled once (``torch.compile``, module level; a fused Triton kernel
that skips empty tiles, forward and backward). On CPU it runs eagerly (the unfused reference, exact, forward
only: torch raises on CPU inputs that require grad), so the CPU use is inference and tests under ``no_grad``.
Weight dropout is not applied (inference semantics); the dispatch (``attention.backend``) does not pick flex for
training with ``attention.dropout > 0``.

Exports for the dispatch and the benchmark: ``flex_unsupported_reason``, ``flex_attention_forward``,
``flex_tiles_visited``; for tests ``flex_partition`` (the calls' masks back as one dense ``Partition``).
"""

from __future__ import annotations

import collections
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    create_mask,
    flex_attention,
)

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.ops.cpu.kernels import flex_reference
from longseq.attention.ops.geometry import cluster_order, num_log_levels
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.ops.partition import Partition

TILE = 128  # FlexAttention's default tile (queries x keys); ``tile_size`` shrinks it for short sequences
# create_mask evaluates the mask_mod on a (B, H, rows, KV) grid; above this many cells the CPU builder works in
# chunks of query tiles so the block mask never needs an O(L * KV) temporary (int64 intermediates: 8 bytes a cell)
MASK_CHUNK_CELLS = 1 << 22
FLEX_RECOMPILE_LIMIT = 64  # compiled flex frames kept per process (see ``_compiled``)
PADDED_MASKS_KEPT = 8  # block masks of padded batches kept per attention (one per padding signature)



@functools.cache
def _compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once per process and used on CUDA only (the fused kernels; on CPU flex runs
    eagerly). Made on first use so importing this module never touches dynamo.

    Every new ``mask_mod`` (one per variant and call layout) and every new length recompiles the one compiled
    frame. Past dynamo's recompile limit (8) the frame runs eagerly: on an H200, a gpu-check process that went past
    it built dense block masks (``axial``: 41 GB at L = 65,536) instead of fused kernels. So the limit is raised to
    ``FLEX_RECOMPILE_LIMIT`` (process-wide; dynamo keys the limit by frame, not by compiled function).

    Compiled for static shapes (``dynamic=False``): after a second length dynamo's automatic dynamic shapes made
    the key length symbolic, and torch 2.11's flex lowering then raised (``'ShapeAsConstantBuffer' object has no
    attribute 'dtype'``, 5 of 31 CUDA test cases on an H200). A run trains at one length, so static costs one
    compile per length."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


# ------------------------------------------------------------------------------------------------
# One flex call of a layout.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlexPlan:
    """One ``flex_attention`` call of a layout, in its own order of positions.

    Attributes:
        direct: ``direct(b, h, q, kv) -> bool`` for call-order indices ``q``, ``kv`` in ``[0, L)`` (0-d tensors under
            the mask's vmap, broadcast index grids in ``build_block_mask``): the query attends key ``kv`` directly.
        order: ``(L,)`` long, the position of each call-order index (None = sequence order).
        n_regions: R, the summaries appended after the keys.
        usable: ``usable(b, h, q, r) -> bool``: the query may use summary ``r`` in ``[0, R)``.
        summaries: ``summaries(qs, k, v, real) -> (k_bar, v_bar, occupied)``: summary keys ``(B, H, R, D)`` and values
            ``(B, H, R, Dv)`` from scaled queries, keys and values in sequence order; ``real`` ``(B, L)`` bool
            (True = real key) or None; ``occupied`` ``(B, R)`` (``(B, H, R)`` for per-head clusters) bool (the
            region holds a real key) or None.
        members: ``members() -> (R, L)`` bool, the positions (sequence order) each summary pools (tests only).
        anchors: ``anchors() -> (R,)`` long, the position whose own query summarizes each region (row-major axial),
            None for pooled regions (tests only).
        heads: how many heads the mask distinguishes (BigBird's per-head random blocks; 1 = shared).
        family: ``Partition.family`` of the call's regions (1 = horizontal; tests only).
        group: calls of one group share one softmax (merged by log-sum-exp); the groups' outputs are averaged
            (``combiner_mixture plans=average``: one group per partition plan).

    ``direct=None``: the call has no direct keys; its KV is the R summaries alone.
    """

    direct: Callable | None
    order: torch.Tensor | None = None
    n_regions: int = 0
    usable: Callable | None = None
    summaries: Callable | None = None
    members: Callable | None = None
    anchors: Callable | None = None
    heads: int = 1
    family: int = 0
    group: int = 0

    def kv_len(self, L: int, direct_only: bool = False) -> int:
        """KV length of the call: [L keys ;] R summaries (the keys alone with ``direct_only``)."""
        keys = L if self.direct is not None else 0
        return keys if direct_only else keys + self.n_regions

    def mask_mod(self, L: int, real: torch.Tensor | None = None, occupied: torch.Tensor | None = None,
                 direct_only: bool = False) -> Callable:
        """The call's ``mask_mod(b, h, q, kv)`` over ``[L keys ; R summaries]``; with ``real`` ``(B, L)`` (call
        order) and ``occupied`` ``(B, R)`` the per-document padding masks; ``direct_only`` drops the summaries."""
        R = 0 if direct_only else self.n_regions
        direct, usable = self.direct, self.usable
        keys = L if direct is not None else 0

        def mask_mod(b, h, q, kv):
            ok = None
            if keys:
                key = kv.clamp(max=L - 1)
                ok = direct(b, h, q, key) & (kv < L)
                if real is not None:
                    ok = ok & real[b, key]
            if R:
                region = (kv - keys).clamp(min=0, max=R - 1)
                use = usable(b, h, q, region) & (kv >= keys)
                if occupied is not None:  # (B, R), or (B, H, R) when the regions differ per head (clusters)
                    use = use & (occupied[b, region] if occupied.dim() == 2 else occupied[b, h, region])
                ok = use if ok is None else ok | use
            return ok

        return mask_mod


def tile_size(L: int) -> int:
    """The flex tile for a length-L sequence: ``TILE`` (128), or the next power of two >= L (at least 16, the
    kernels' smallest) when the whole sequence is shorter than one tile."""
    return min(TILE, max(16, 1 << max(L - 1, 1).bit_length()))


# ------------------------------------------------------------------------------------------------
# Block masks: built from the mask_mod, cached per (plan, L, tile, device, padding signature).
# ------------------------------------------------------------------------------------------------
def build_block_mask(mask_mod: Callable, B: int, H: int, Q_LEN: int, KV_LEN: int, device, tile: int) -> BlockMask:
    """``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=..., BLOCK_SIZE=tile)``; compiled on CUDA (no dense
    mask is materialized); on CPU above ``MASK_CHUNK_CELLS`` cells, the same tiles classified chunk by chunk of
    query tiles (``BlockMask.from_kv_blocks``) so memory stays O(chunk * KV)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _compiled(create_block_mask)(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=tile)
    if B * H * Q_LEN * KV_LEN <= MASK_CHUNK_CELLS:
        return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=tile)
    n_q, n_kv = -(-Q_LEN // tile), -(-KV_LEN // tile)
    rows = tile * max(1, MASK_CHUNK_CELLS // (B * H * tile * KV_LEN))
    partial, full = [], []
    for q0 in range(0, Q_LEN, rows):
        size = min(rows, Q_LEN - q0)
        # the mask_mods here are elementwise index arithmetic, so broadcast index grids evaluate them directly
        # (what create_mask's vmap does, without its per-call overhead); int32 halves the grids' memory traffic
        index = functools.partial(torch.arange, device=device, dtype=torch.int32)
        b, h = index(B).view(B, 1, 1, 1), index(H).view(1, H, 1, 1)
        q, kv = index(q0, q0 + size).view(1, 1, size, 1), index(KV_LEN).view(1, 1, 1, KV_LEN)
        chunk = mask_mod(b, h, q, kv).expand(B, H, size, KV_LEN)
        chunk = torch.nn.functional.pad(chunk, (0, n_kv * tile - KV_LEN, 0, -(-size // tile) * tile - size))
        count = chunk.view(B, H, -1, tile, n_kv, tile).sum((3, 5))  # (B, H, q tiles, kv tiles)
        full.append(count == tile * tile)
        partial.append((count > 0) & (count < tile * tile))
    partial, full = torch.cat(partial, 2), torch.cat(full, 2)

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = dense.sum(-1, dtype=torch.int32)
        index = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num, index

    assert partial.shape[2] == n_q
    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(tile, tile), mask_mod=mask_mod,
                                    seq_lengths=(Q_LEN, KV_LEN))


_layout_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> {key: value}


def _cache(attn: Attention) -> dict:
    return _layout_cache.setdefault(attn, {})


def plans_of(attn: Attention, L: int, device, tile: int) -> list[FlexPlan]:
    """The attention's flex calls at length L (cached per module, length, device and tile)."""
    reason = flex_unsupported_reason(attn)
    if reason is not None:
        raise AttentionConfigError(f"attention '{attn.name}' has no flex layout (attention.backend=flex): {reason}")
    if attn.name in DATA_LAYOUTS:
        raise ValueError(f"attention '{attn.name}': its flex calls depend on the data (DATA_LAYOUTS), not on L alone")
    key = ("plans", L, str(device), tile)
    cache = _cache(attn)
    if key not in cache:
        cache[key] = LAYOUTS[attn.name](attn, L, torch.device(device), tile)
    return cache[key]


def block_mask_of(attn: Attention, index: int, plan: FlexPlan, L: int, device, tile: int,
                  pad: torch.Tensor | None = None, occupied: torch.Tensor | None = None,
                  direct_only: bool = False) -> BlockMask:
    """The block mask of call ``index`` (cached per length, tile, device and padding signature); ``pad`` ``(B, L)``
    bool (True = pad, sequence order) and ``occupied`` ``(B, R)``."""
    signature = None
    if pad is not None:
        # the masks' bytes themselves (B * (L + R) booleans), not a hash: a collision would reuse a wrong mask
        signature = (tuple(pad.shape), pad.cpu().numpy().tobytes(),
                     None if occupied is None else (tuple(occupied.shape), occupied.cpu().numpy().tobytes()))
    key = ("mask", index, L, tile, str(device), signature, direct_only)
    cache = _cache(attn)
    if signature is not None:  # every padded batch differs (LRA): keep only the last few padded masks
        cache = cache.setdefault("padded", collections.OrderedDict())
        if key in cache:
            cache.move_to_end(key)
        else:
            while len(cache) >= PADDED_MASKS_KEPT:
                cache.popitem(last=False)
    if key not in cache:
        real = None
        if pad is not None:
            real = ~pad.to(device=device, dtype=torch.bool)
            real = real if plan.order is None else real[:, plan.order]
        B = 1 if pad is None else pad.shape[0]
        mask_mod = plan.mask_mod(L, real, occupied if pad is not None else None, direct_only)
        cache[key] = build_block_mask(mask_mod, B, plan.heads, L, plan.kv_len(L, direct_only), device, tile)
    return cache[key]


# ------------------------------------------------------------------------------------------------
# The exported entry points.
# ------------------------------------------------------------------------------------------------
def flex_unsupported_reason(attn: Attention) -> str | None:
    """None when the variant (as configured) has a flex layout; otherwise a short reason."""
    reason = unsupported_variant_reason(attn.name, getattr(attn, "family", "?"))
    if reason is not None:
        return reason
    check = UNSUPPORTED_CONFIG.get(attn.name)
    return check(attn) if check is not None else None


def unsupported_variant_reason(name: str, family: str) -> str | None:
    """Why the registered variant ``name`` has no flex layout whatever its knobs (None: it has one); needs no
    module (the benchmark asks before building a variant that may hold an (L, L) parameter)."""
    if name == "full":
        return "full attention stays on SDPA (FlashAttention), which needs no mask"
    if name not in LAYOUTS and name not in DATA_LAYOUTS:
        if family == "efficient":
            return f"'{name}' is not a partition of keys (an efficient approximation): no block mask describes it"
        return f"no flex layout is written for attention '{name}' yet"
    return None


def flex_attention_forward(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_padding_mask: torch.Tensor | None = None, tile: int | None = None) -> torch.Tensor:
    """The attention's forward through FlexAttention: unscaled q, k ``(B, H, L, D)``, v ``(B, H, L, Dv)`` ->
    ``(B, H, L, Dv)``; ``key_padding_mask`` ``(B, L)`` bool (True = pad, ``ops.padding``'s rule). Equals
    ``attention_matrix(q, k, v) @ v`` (no weight dropout). On CPU inputs must not require grad."""
    if attn.training and attn.dropout > 0:
        raise AttentionConfigError(
            f"attention '{attn.name}': the flex backend applies no weight dropout; with attention.dropout="
            f"{attn.dropout} in training use attention.backend=auto|cpu_flash|explicit")
    B, H, L, _ = q.shape
    attn.check_length(L)
    tile = tile or tile_size(L)
    pad = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.bool)
    qs = attn.scale(q)
    real = None if pad is None else ~pad
    data = attn.name in DATA_LAYOUTS  # masks from this batch's clusters: built per call, never cached
    plans = DATA_LAYOUTS[attn.name](attn, q, k, v, real) if data else plans_of(attn, L, q.device, tile)

    def mask_of(index, plan, occupied=None, direct_only=False):
        if not data:
            return block_mask_of(attn, index, plan, L, q.device, tile, None if direct_only else pad, occupied,
                                 direct_only)
        real_c = None if real is None or direct_only else _in_order(real.unsqueeze(-1), plan).squeeze(-1)
        mask_mod = plan.mask_mod(L, real_c, None if direct_only else occupied, direct_only)
        return build_block_mask(mask_mod, B, plan.heads, L, plan.kv_len(L, direct_only), q.device, tile)
    calls = []  # (plan, output, lse) in sequence order
    for index, plan in enumerate(plans):
        occupied = None
        if plan.n_regions:
            k_bar, v_bar, occupied = plan.summaries(qs, k, v, real)
            if occupied is not None:  # a region without a real key is masked; its NaN-free zeros keep 0 * v finite
                empty_region = ~(occupied[:, None, :, None] if occupied.dim() == 2 else occupied[..., None])
                k_bar, v_bar = k_bar.masked_fill(empty_region, 0.0), v_bar.masked_fill(empty_region, 0.0)
            keys, values = k_bar.to(k.dtype), v_bar.to(v.dtype)
            if plan.direct is not None:
                keys = torch.cat([_in_order(k, plan), keys], -2)
                values = torch.cat([_in_order(v, plan), values], -2)
        else:
            keys, values = _in_order(k, plan), _in_order(v, plan)
        mask = mask_of(index, plan, occupied)
        calls.append((plan, *_flex_in_order(qs, keys, values, mask, plan)))
    groups = sorted({plan.group for plan in plans})
    outputs = []
    for group in groups:
        out, lse = merge_by_lse(*zip(*[(o, l_) for plan, o, l_ in calls if plan.group == group]))
        if pad is not None:
            empty = torch.isneginf(lse)  # (B, H, L): a query with no real key and no usable region (rule 3)
            if bool(empty.any()):
                fallback = [_flex_in_order(qs, _in_order(k, plan), _in_order(v, plan),
                                           mask_of(index, plan, direct_only=True), plan)
                            for index, plan in enumerate(plans) if plan.group == group and plan.direct is not None]
                out = torch.where(empty.unsqueeze(-1), merge_by_lse(*zip(*fallback))[0], out)
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else sum(outputs) / len(outputs)


def _flex_in_order(qs, keys, values, mask, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """One call with the queries in the call's order; output ``(B, H, L, Dv)`` and lse ``(B, H, L)`` in sequence
    order."""
    out, lse = _flex(_in_order(qs, plan), keys, values, mask)
    return _to_sequence(out, plan), _to_sequence(lse.unsqueeze(-1), plan).squeeze(-1)


def flex_tiles_visited(attn: Attention, L: int, device="cpu", tile: int = TILE) -> float:
    """Tiles (``tile`` x ``tile``) the flex calls visit at length L, counted from their ``BlockMask``s (partial +
    full blocks, averaged over the heads the mask distinguishes), divided by causal full attention's at the same
    L and tile. Hardware independent; no attention runs. NaN for layouts that depend on the data (``routing``)."""
    if attn.name in DATA_LAYOUTS:
        return math.nan
    total = 0.0
    for index, plan in enumerate(plans_of(attn, L, device, tile)):
        mask = block_mask_of(attn, index, plan, L, device, tile)
        total += tiles_of(mask) / plan.heads
    return total / causal_full_tiles(L, tile)


def tiles_of(mask: BlockMask) -> float:
    """Tiles a block mask visits (partial + full), summed over batch and heads."""
    full = 0 if mask.full_kv_num_blocks is None else int(mask.full_kv_num_blocks.sum())
    return float(int(mask.kv_num_blocks.sum()) + full)


@functools.cache
def causal_full_tiles(L: int, tile: int = TILE) -> float:
    """Tiles causal full attention's block mask visits at length L (the denominator of ``flex_tiles_visited``)."""
    return tiles_of(build_block_mask(lambda b, h, q, kv: kv <= q, 1, 1, L, L, "cpu", tile))


def flex_partition(attn: Attention, L: int, head: int = 0) -> Partition:
    """The union of the flex calls' ``create_mask``s at length L as one dense ``Partition`` (sequence order; small
    L, tests): direct sets from the key columns, one region per summary column (``FlexPlan.members``)."""
    direct = torch.zeros(L, L, dtype=torch.bool)
    members, usable, anchors, families = [], [], [], []
    for plan in plans_of(attn, L, "cpu", tile_size(L)):
        mask = create_mask(plan.mask_mod(L), 1, plan.heads, L, plan.kv_len(L), "cpu")[0]  # (heads, L, KV)
        mask = mask[min(head, plan.heads - 1)]
        order = torch.arange(L) if plan.order is None else plan.order.cpu()
        keys = L if plan.direct is not None else 0
        if keys:
            block = torch.zeros(L, L, dtype=torch.bool)
            block[order.unsqueeze(1), order.unsqueeze(0)] = mask[:, :L]
            direct |= block
        if plan.n_regions:
            use = torch.zeros(L, plan.n_regions, dtype=torch.bool)
            use[order] = mask[:, keys:]
            usable.append(use)
            members.append(plan.members().cpu())
            anchors.append(torch.full((plan.n_regions,), -1, dtype=torch.long) if plan.anchors is None
                           else plan.anchors().cpu())
            families.append(torch.full((plan.n_regions,), plan.family, dtype=torch.long))
    if not members:
        return Partition.direct_only(direct)
    members = torch.cat(members)
    return Partition.from_candidates(direct, members, torch.cat(usable, 1), torch.cat(families), torch.cat(anchors))


# ------------------------------------------------------------------------------------------------
# Calls, orders and the log-sum-exp merge.
# ------------------------------------------------------------------------------------------------
def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """One flex call on scaled q (``scale=1``) -> output ``(B, H, L, Dv)`` and natural-log lse ``(B, H, L)``."""
    if q.is_cuda:
        out, aux = _compiled(flex_attention)(q, k, v, block_mask=mask, scale=1.0, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return flex_reference(q, k, v, mask)  # CPU: the unfused reference, forward only (``ops.cpu.kernels``)


def _in_order(x: torch.Tensor, plan: FlexPlan) -> torch.Tensor:
    """(B, H, L, .) in sequence order -> the call's order."""
    return x if plan.order is None else x.index_select(-2, plan.order)


def _to_sequence(x: torch.Tensor, plan: FlexPlan) -> torch.Tensor:
    """(B, H, L, .) in the call's order -> sequence order."""
    if plan.order is None:
        return x
    return torch.empty_like(x).index_copy_(-2, plan.order, x)


def merge_by_lse(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact joint softmax of calls over disjoint key sets from their outputs ``(B, H, L, Dv)`` and
    log-sum-exps ``(B, H, L)``; a query no call reaches keeps output 0 and lse -inf."""
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = functools.reduce(torch.logaddexp, lses)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = sum(o * (part - safe).exp().unsqueeze(-1).to(o.dtype) for o, part in zip(outs, lses))
    return out, lse


# ------------------------------------------------------------------------------------------------
# Layouts, one function a variant: index arithmetic only.
# ------------------------------------------------------------------------------------------------
def _arange(L, device):
    return torch.arange(L, device=device)


def _layout_combiner_fixed(attn, L, device, tile):
    grid = attn.grid(L)
    n, m = grid.n_rows, grid.n_cols
    causal = attn.causal

    def direct(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    def usable(b, h, q, r):
        return r < q // m if causal else r != q // m

    def summaries(qs, k, v, real):
        B, H = qs.shape[:2]
        blocks = [x.unflatten(-2, (n, m)) for x in (qs, k, v)]  # segments: (B, H, n, m, .)
        member = (torch.ones(1, 1, n, m, dtype=torch.bool, device=qs.device) if real is None
                  else real.view(B, 1, n, m))
        k_bar, v_bar = attn.summary.region_summaries(*blocks, member)
        return k_bar, v_bar, None if real is None else member.any(-1)[:, 0]

    def members():
        return grid.rows(device).unsqueeze(0) == _arange(n, device).unsqueeze(1)

    return [FlexPlan(direct, None, n, usable, summaries, members)]


def _logsparse_regions(L: int, tile: int, causal: bool, device):
    """Combiner-Logsparse's summarized blocks as tables ``(level, chunk, future)`` ``(R,)`` each, in KV order.

    Past block ``(l, c)`` (l >= 1, c even, full) is used by the queries p with ``p >> l == c + 1``; a future block is
    the mirror image (the past block of ``L - 1 - p`` in the reversed sequence). Order (tile count, not
    semantics): blocks shorter than a tile sorted by the first query that uses them, so a query tile's small
    blocks sit in one or two key tiles; blocks of a tile or more (each used by whole query tiles) last.
    """
    rows = []
    for future in ([False] if causal else [False, True]):
        for level in range(1, num_log_levels(L)):
            for chunk in range(0, L >> level, 2):
                first_user = (chunk + 1) << level
                if future:  # users of the mirrored block, in sequence order: L - 1 - p for p in the users
                    first_user = L - min(L, (chunk + 2) << level)
                big = (1 << level) >= tile
                rows.append(((big, first_user, level, future), (level, chunk, future)))
    rows.sort(key=lambda row: row[0])
    table = torch.tensor([row[1] for row in rows], dtype=torch.long, device=device).view(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2].bool()


def _layout_combiner_logsparse(attn, L, device, tile):
    causal = attn.causal
    level, chunk, future = _logsparse_regions(L, tile, causal, device)
    R = level.numel()

    def direct(b, h, q, kv):
        ok = (kv == q) | ((kv == q - 1) & (q % 2 == 1))
        if not causal:
            ok = ok | ((kv == q + 1) & ((L - 1 - q) % 2 == 1))
        return ok

    def usable(b, h, q, r):
        lvl, c, fut = level[r], chunk[r], future[r]
        p = torch.where(fut, L - 1 - q, q)  # the future of q is the past of L - 1 - q
        return (((p >> lvl) & 1) == 1) & ((p >> lvl) - 1 == c)

    def direction_summaries(qs, k, v, real, lvl_list):
        """Per level, the even full chunks' summaries (B, H, P, .) of sequences in (possibly reversed) order."""
        B, H = qs.shape[:2]
        out = {}
        for lvl in lvl_list:
            size, count = 1 << lvl, L >> lvl
            blocks = [x[..., : count * size, :].unflatten(-2, (count, size))[:, :, ::2] for x in (qs, k, v)]
            if real is None:
                member = torch.ones(1, 1, blocks[0].shape[2], size, dtype=torch.bool, device=qs.device)
            else:
                member = real[:, : count * size].view(B, 1, count, size)[:, :, ::2]
            k_bar, v_bar = attn.summary.region_summaries(*blocks, member)
            out[lvl] = (k_bar, v_bar, member.any(-1)[:, 0])
        return out

    def summaries(qs, k, v, real):
        levels = list(range(1, num_log_levels(L)))
        parts = [direction_summaries(qs, k, v, real, levels)]
        if not causal:
            flipped = [x.flip(-2) for x in (qs, k, v)]
            parts.append(direction_summaries(*flipped, None if real is None else real.flip(-1), levels))
        k_rows, v_rows, occ_rows = [], [], []
        for part in parts:
            k_rows.append(torch.cat([part[lvl][0] for lvl in levels], -2))
            v_rows.append(torch.cat([part[lvl][1] for lvl in levels], -2))
            occ_rows.append(torch.cat([part[lvl][2] for lvl in levels], -1))
        k_all, v_all, occ_all = torch.cat(k_rows, -2), torch.cat(v_rows, -2), torch.cat(occ_rows, -1)
        index = _logsparse_slot(level, chunk, future, L)  # KV order -> row of the level-major concatenation
        occupied = None if real is None else occ_all.index_select(-1, index)
        return k_all.index_select(-2, index), v_all.index_select(-2, index), occupied

    def members():
        pos = _arange(L, device)
        start = chunk << level
        inside = (pos.unsqueeze(0) >= start.unsqueeze(1)) & (pos.unsqueeze(0) < (start + (1 << level)).unsqueeze(1))
        mirrored = inside.flip(-1)
        return torch.where(future.unsqueeze(1), mirrored, inside)

    return [FlexPlan(direct, None, R, usable, summaries, members)]


def _logsparse_slot(level: torch.Tensor, chunk: torch.Tensor, future: torch.Tensor, L: int) -> torch.Tensor:
    """Row of each (level, chunk, future) in the level-major concatenation ``summaries`` builds (past levels 1..,
    then future levels 1..; even chunks only)."""
    levels = num_log_levels(L)
    per_level = torch.tensor([0, 0] + [((L >> lvl) + 1) // 2 for lvl in range(1, levels)], device=level.device)
    offsets = per_level.cumsum(0)[:-1]  # offsets[l] = rows of levels < l (levels from 1)
    direction = per_level.sum()  # rows of the past direction
    return future.long() * direction + offsets[level] + chunk // 2


def _pattern_plan(direct, heads: int = 1) -> list[FlexPlan]:
    return [FlexPlan(direct, heads=heads)]


def _layout_fixed(attn, L, device, tile):
    """Own block in sequence order + the other blocks' summary cells in column order (the cells of the last c
    columns are then contiguous keys, not one in every tile), merged by log-sum-exp."""
    grid = attn.grid(L)
    n, m, c, causal = grid.n_rows, grid.n_cols, attn.summary_cells, attn.causal

    def own_block(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    def summary_cells(b, h, q, kv):  # column order: column = index // n, row = index % n
        other = (kv % n) < (q % n) if causal else (kv % n) != (q % n)
        return (kv // n >= m - c) & other

    return [FlexPlan(own_block), FlexPlan(summary_cells, _column_order(grid, device))]


def _column_order(grid, device) -> torch.Tensor:
    """(L,) the position at each column-order index ``t = c * n + r`` (position ``r * m + c``)."""
    t = _arange(grid.length, device)
    return (t % grid.n_rows) * grid.n_cols + t // grid.n_rows


def _layout_axial(attn, L, device, tile):
    grid = attn.grid(L)
    n, m, causal = grid.n_rows, grid.n_cols, attn.causal

    def own_row(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    return [FlexPlan(own_row), FlexPlan(_own_column(n, causal), _column_order(grid, device))]


def _own_column(n: int, causal: bool) -> Callable:
    """Direct mask of a column-order call: same column, earlier rows (causal) or other rows (self is attended in
    the sequence-order call)."""
    def own_column(b, h, q, kv):  # column order: column = index // n, row = index % n
        same = (q // n) == (kv // n)
        return same & ((kv % n) < (q % n) if causal else (kv % n) != (q % n))

    return own_column


def _layout_local(attn, L, device, tile):
    back, ahead = attn.band()
    step, g = attn.dilation, attn.global_tokens

    def direct(b, h, q, kv):
        d = q - kv
        ok = (d % step == 0) & (d <= back * step) & (d >= -ahead * step)
        if g:
            ok = ok | (q < g) | (kv < g)
        return ok

    return _pattern_plan(direct)


def _layout_strided(attn, L, device, tile):
    """The band ``|i - j| < l`` (causal ``0 <= i - j < l``) in sequence order + the rest of ``(i - j) % l == 0`` (the
    query's column of the ``n x l`` grid, other / earlier rows) in column order, merged by log-sum-exp."""
    grid = attn.grid(L)
    l, causal = grid.n_cols, attn.causal

    def band(b, h, q, kv):
        d = q - kv
        return (d >= 0) & (d < l) if causal else d.abs() < l

    return [FlexPlan(band), FlexPlan(_own_column(grid.n_rows, causal), _column_order(grid, device))]


def _causal_logsparse(i, j):
    """j in the causal LogSparse set of i (``geometry.logsparse_keys``): j = i, or j + 1 = i with its bits below some
    set bit l cleared, i.e. i's bits at and above the lowest set bit of j + 1 equal j + 1's."""
    t = j + 1
    low = t & (-t)
    return (j == i) | ((j < i) & ((i & ~(low - 1)) == t))


def _layout_logsparse(attn, L, device, tile):
    causal = attn.causal

    def direct(b, h, q, kv):
        ok = _causal_logsparse(q, kv)
        return ok if causal else ok | _causal_logsparse(L - 1 - q, L - 1 - kv)

    return _pattern_plan(direct)


def _layout_bigbird(attn, L, device, tile):
    grid = attn.grid(L)
    n, size = grid.n_rows, grid.n_cols
    a, c = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    glob = attn.global_block_ids(n)
    allowed = ((a - c).abs() <= 1) | torch.isin(a, glob) | torch.isin(c, glob)  # (n, n) block table
    rand = attn.random_blocks_for(n).cpu()  # (H', n, r)
    hit = (rand.unsqueeze(-1) == torch.arange(n).view(1, 1, 1, n)).any(2)
    blocks = (allowed | hit).to(device)  # (H', n, n): query block a may attend key block c
    heads = blocks.shape[0]

    def direct(b, h, q, kv):
        return blocks[h if heads > 1 else 0, q // size, kv // size]

    return _pattern_plan(direct, heads)


def _layout_random(attn, L, device, tile):
    idx, valid = (x.to(device) for x in attn.index_table(L))  # (L, K) key table of each query
    K = idx.shape[1]

    def direct(b, h, q, kv):
        ok = (idx[q, 0] == kv) & valid[q, 0]
        for col in range(1, K):  # K = 1 + n_random, a handful: unrolled, no (L, L) mask
            ok = ok | ((idx[q, col] == kv) & valid[q, col])
        return ok

    return _pattern_plan(direct)


def _grid_views(grid, qs, k, v, real):
    """Row layouts ``(B, H, n, m, .)`` of scaled q, k, v and ``real`` ``(B or 1, 1, n, m)`` bool (all True unpadded)."""
    rows = [x.unflatten(-2, (grid.n_rows, grid.n_cols)) for x in (qs, k, v)]
    if real is None:
        real = torch.ones(1, 1, grid.n_rows, grid.n_cols, dtype=torch.bool, device=qs.device)
    else:
        real = real.view(-1, 1, grid.n_rows, grid.n_cols)
    return rows, real


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """``(..., n, m, .)`` row layout -> ``(..., m * n, .)`` in column order (index ``c * n + r``)."""
    return x.transpose(-3, -2).flatten(-3, -2)


def _interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Summaries of two region kinds per slot along ``dim`` (>= 0), side by side: index ``2 * slot + kind`` (one
    tile of slots, not two bands)."""
    return torch.stack([a, b], dim + 1).flatten(dim, dim + 1)


def _layout_combiner_axial(attn, L, device, tile):
    """Row-major Combiner-Axial: own row in sequence order; in column order, the summaries of the other (earlier)
    rows seen from the query's own column (region = row r' summarized by the anchor query (r', c)), merged by
    log-sum-exp. The column call has no direct keys: its KV is the L anchored summaries in column order."""
    grid = attn.grid(L)
    n, m, causal = grid.n_rows, grid.n_cols, attn.causal

    def own_row(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    def summaries(qs, k, v, real):
        (qr, kr, vr), real_r = _grid_views(grid, qs, k, v, real)
        logits = qr @ kr.transpose(-1, -2)  # (B, H, n, m[c], m[c']): anchor (r', c) attends its row r'
        pad = ~real_r.unsqueeze(-2)  # (B, 1, n, 1, m)
        empty_row = pad.all(-1, keepdim=True)  # its regions are masked; any finite inner row will do
        probs = logits.masked_fill(pad & ~empty_row, NEG_INF).softmax(-1)
        summary_v = probs @ vr
        summary_k = attn.summary_keys(summary_v, kr, probs @ kr if attn.row_summary == "wsum" else None)
        if real is not None:  # a padded anchor's summary is made by its row's first real position (ops.padding)
            cols = torch.arange(m, device=qs.device)
            real_rows = real_r[:, 0]
            anchor = torch.where(real_rows, cols, real_rows.int().argmax(-1, keepdim=True))  # (B, n, m)
            summary_v, summary_k = (x.gather(3, anchor[:, None, :, :, None].expand_as(x)) for x in (summary_v, summary_k))
        occupied = real_r[:, 0].any(-1, keepdim=True).expand(-1, n, m)  # (B, n[r'], m[c])
        return _column_major(summary_k), _column_major(summary_v), _column_major(occupied.unsqueeze(-1)).squeeze(-1)

    order = _column_order(grid, device)

    def anchors():
        return order

    def members():
        rows = grid.rows(device)
        return rows[order].unsqueeze(1) == rows.unsqueeze(0)

    return [FlexPlan(own_row),
            FlexPlan(None, order, L, _own_column(n, causal), summaries, members, anchors)]


def _layout_pooled_axial(attn, L, device, tile):
    """``combiner_axial_vertical`` / ``_horizontal`` / ``combiner_mixture`` (one joint softmax): in sequence order the
    own row and the vertical regions of the query's row (column c' above / below row r: slots ``(r, c')``
    row-major); in column order the own column and the horizontal regions of the query's column (row r' without
    column c, or its halves left / right of c: slots ``(r', c)`` column-major); merged by log-sum-exp. Summaries:
    the variant's running / excluding-own pools and inner softmaxes (``padded_*_summaries``, real = every key when
    unpadded)."""
    grid = attn.grid(L)
    n, m, causal = grid.n_rows, grid.n_cols, attn.causal
    vertical, horizontal = attn.use_vertical, attn.horizontal_regions
    average = attn.plans == "average"  # mixture: two plans, each its own softmax over [direct | its family]
    order = _column_order(grid, device)
    rows, cols = grid.rows(device), grid.cols(device)

    def own_row(b, h, q, kv):
        same = (q // m) == (kv // m)
        return same & (kv <= q) if causal else same

    plans = []
    if vertical:  # slots (r, c') row-major; bidirectional: (above, below) interleaved
        v_kinds = 1 if causal else 2

        def usable_vertical(b, h, q, s):
            slot, kind = s // v_kinds, s % v_kinds
            ok = (slot // m == q // m) & (slot % m != q % m)
            r = q // m
            return ok & torch.where(kind == 0, r >= 1, r <= n - 2)  # the column above / below row r is not empty

        def summaries_vertical(qs, k, v, real):
            (qr, kr, vr), real_r = _grid_views(grid, qs, k, v, real)
            qc, kc, vc = (x.transpose(2, 3) for x in (qr, kr, vr))  # (B, H, m, n, .): columns
            real_c = real_r.transpose(2, 3)
            parts = [attn.padded_prefix_summaries(qc, kc, vc, real_c)]  # column c' above row r, at (c', r)
            if not causal:
                parts.append(attn.padded_prefix_summaries(qc, kc, vc, real_c, reverse=True))  # below
            outs = [[x.transpose(2, 3).flatten(2, 3) for x in part[:2]] + [part[2][:, 0].transpose(-1, -2).flatten(-2, -1)]
                    for part in parts]
            if causal:
                return tuple(outs[0])
            return (_interleave(outs[0][0], outs[1][0], dim=2), _interleave(outs[0][1], outs[1][1], dim=2),
                    _interleave(outs[0][2], outs[1][2], dim=1))

        def members_vertical():
            slot = torch.arange(L * v_kinds, device=device) // v_kinds
            kind = torch.arange(L * v_kinds, device=device) % v_kinds
            r, c = (slot // m).unsqueeze(1), (slot % m).unsqueeze(1)
            side = torch.where(kind.unsqueeze(1) == 0, rows.unsqueeze(0) < r, rows.unsqueeze(0) > r)
            return (cols.unsqueeze(0) == c) & side

        plans.append(FlexPlan(own_row, None, L * v_kinds, usable_vertical, summaries_vertical, members_vertical))
        if average:  # the vertical plan's own column; the horizontal plan's own row
            plans += [FlexPlan(_own_column(n, causal), order), FlexPlan(own_row, group=1)]
    else:
        plans.append(FlexPlan(own_row))

    own_column = _own_column(n, causal)
    if horizontal is None:
        plans.append(FlexPlan(own_column, order))
        return plans
    h_kinds = 2 if horizontal == "split" else 1

    def usable_horizontal(b, h, t, s):  # column order: query t = c * n + r, slot = c * n + r'
        slot, kind = s // h_kinds, s % h_kinds
        ok = own_column(b, h, t, slot)
        c = t // n
        if horizontal == "split":
            return ok & torch.where(kind == 0, c >= 1, c <= m - 2)  # the left / right half is not empty
        return ok & (m > 1)  # the row without column c

    def summaries_horizontal(qs, k, v, real):
        (qr, kr, vr), real_r = _grid_views(grid, qs, k, v, real)
        if horizontal == "split":  # row r' left / right of column c, at (r', c)
            parts = [attn.padded_prefix_summaries(qr, kr, vr, real_r),
                     attn.padded_prefix_summaries(qr, kr, vr, real_r, reverse=True)]
        else:
            parts = [attn.padded_excluding_own_summaries(qr, kr, vr, real_r)]
        outs = [[_column_major(x) for x in part[:2]] + [_column_major(part[2][:, 0].unsqueeze(-1)).squeeze(-1)]
                for part in parts]
        if h_kinds == 1:
            return tuple(outs[0])
        return (_interleave(outs[0][0], outs[1][0], dim=2), _interleave(outs[0][1], outs[1][1], dim=2),
                _interleave(outs[0][2], outs[1][2], dim=1))

    def members_horizontal():
        s = torch.arange(L * h_kinds, device=device)
        position = order[s // h_kinds]  # the slot's (r', c)
        r, c = rows[position].unsqueeze(1), cols[position].unsqueeze(1)
        same_row = rows.unsqueeze(0) == r
        if horizontal == "split":
            return same_row & torch.where((s % h_kinds).unsqueeze(1) == 0, cols.unsqueeze(0) < c, cols.unsqueeze(0) > c)
        return same_row & (cols.unsqueeze(0) != c)

    plans.append(FlexPlan(own_column, order, L * h_kinds, usable_horizontal, summaries_horizontal, members_horizontal,
                          family=1, group=1 if average else 0))
    return plans


LAYOUTS: dict[str, Callable[..., list[FlexPlan]]] = {
    "combiner_axial": _layout_combiner_axial,
    "combiner_axial_vertical": _layout_pooled_axial,
    "combiner_axial_horizontal": _layout_pooled_axial,
    "combiner_mixture": _layout_pooled_axial,
    "combiner_fixed": _layout_combiner_fixed,
    "combiner_logsparse": _layout_combiner_logsparse,
    "fixed": _layout_fixed,
    "axial": _layout_axial,
    "local": _layout_local,
    "longformer": _layout_local,
    "strided": _layout_strided,
    "logsparse": _layout_logsparse,
    "bigbird": _layout_bigbird,
    "random": _layout_random,
}

def _data_routing(attn, q, k, v, real=None) -> list[FlexPlan]:
    """``routing`` (sparse, Routing Transformer): one call in sequence order whose mask reads this batch's k-means
    clusters ``(B, H, L)`` (``assign``; the centroids move in training as in ``forward``). Bidirectional: same key
    cluster. Causal: own segment up to self, plus (if the query took a slot of its route) its route's key cluster in
    earlier segments (``ClusteredAttention.causal_direct_mask``, by index)."""
    attn.kmeans._ensure(k)
    clusters, routes = attn.assign(k)
    attn.kmeans.update(k, clusters)  # a no-op in eval
    B, H, L, _ = k.shape
    if not attn.causal:
        def direct(b, h, q, kv):
            return clusters[b, h, q] == clusters[b, h, kv]
    else:
        M = attn.segment_len(L)
        own = _causal_routes(attn, routes, L)  # K: the query overflowed its centroid (no earlier cluster keys)

        def direct(b, h, q, kv):
            same_segment = q // M == kv // M
            return (kv <= q) & (same_segment | ((kv // M < q // M) & (clusters[b, h, kv] == own[b, h, q])))
    return [FlexPlan(direct, heads=H)]


def _causal_routes(attn, routes: torch.Tensor, L: int) -> torch.Tensor:
    """``(B, H, L)`` the key cluster a causal query attends in earlier segments: its route when it took one of the
    route's L / K query slots, else K (none; ``ClusteredAttention.causal_direct_mask``)."""
    K = attn.n_clusters
    routed = (cluster_order(routes, K + 1)[1] < L // K) & (routes < K)
    return torch.where(routed, routes, K)


def _data_combiner_routing(attn, q, k, v, real=None) -> list[FlexPlan]:
    """``combiner_routing``: one call over [keys ; cluster summaries] whose mask reads this batch's clusters
    ``(B, H, L)``. Bidirectional: own cluster directly, every other cluster through its summary (K slots).
    Causal: own segment up to self and (if routed) the route's cluster in earlier segments directly, every other
    cluster c through R(c, g) = its members in segments < g (slots ``g * K + c``: a segment's K summaries side by
    side). Summaries: the variant's pooling over the clusters' real members (``region_summaries``; causal the running
    pools ``_segment_prefix_padded``) and inner softmaxes."""
    attn.kmeans._ensure(k)
    clusters, routes = attn.assign(k, real)
    attn.kmeans.update(k, clusters, None if real is None else real.unsqueeze(1))  # a no-op in eval
    B, H, L, _ = k.shape
    K = attn.n_clusters
    order, _ = cluster_order(clusters, K)

    def members_of(real_keys):
        if real_keys is None:
            return torch.ones(B, H, K, L // K, dtype=torch.bool, device=k.device)
        return attn._members(order, real_keys)  # (B, H, K, S)

    if not attn.causal:
        def direct(b, h, q, kv):
            return clusters[b, h, q] == clusters[b, h, kv]

        def usable(b, h, q, r):
            return r != clusters[b, h, q]

        def summaries(qs, k, v, real):
            blocks = attn._blocks(order, qs, k, v)  # (B, H, K, S, .): each cluster's members in position order
            member = members_of(real)
            k_bar, v_bar = attn.summary.region_summaries(*blocks, member)
            return k_bar, v_bar, None if real is None else member.any(-1)

        return [FlexPlan(direct, None, K, usable, summaries, heads=H)]

    M = attn.segment_len(L)
    n = L // M
    own = _causal_routes(attn, routes, L)

    def direct(b, h, q, kv):
        same_segment = q // M == kv // M
        return (kv <= q) & (same_segment | ((kv // M < q // M) & (clusters[b, h, kv] == own[b, h, q])))

    def usable(b, h, q, r):
        g, c = r // K, r % K
        return (g == q // M) & (g >= 1) & (c != own[b, h, q])

    def summaries(qs, k, v, real):
        q_blk, k_blk, v_blk = attn._blocks(order, qs, k, v)  # (B, H, K, S, .); member t lies in segment t // (M/K)
        member = members_of(real)
        q_bar, occupied = attn._segment_prefix_padded(attn.summary.query_features(q_blk), member, n)  # (B,H,K,n,.)
        k_bar, _ = attn._segment_prefix_padded(attn.summary.key_features(k_blk), member, n)
        S = q_blk.shape[3]
        earlier = torch.arange(S, device=k.device) // (M // K) < torch.arange(n, device=k.device).unsqueeze(1)
        allowed = earlier & member.unsqueeze(3)  # (B, H, K, n, S): R(c, g)'s real members
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # an empty region keeps a finite row (it is masked)
        inner = (q_bar @ k_blk.transpose(-1, -2)).masked_fill(~allowed, NEG_INF).softmax(-1)
        v_bar = inner @ v_blk
        slots = [x.transpose(2, 3).flatten(2, 3) for x in (k_bar, v_bar)]  # (B, H, n * K, .): slot g * K + c
        return slots[0], slots[1], occupied.transpose(2, 3).flatten(2, 3)

    return [FlexPlan(direct, None, n * K, usable, summaries, heads=H)]


# Layouts whose masks depend on the batch (cluster ids): built per call by ``flex_attention_forward``.
DATA_LAYOUTS: dict[str, Callable[..., list[FlexPlan]]] = {"routing": _data_routing,
                                                          "combiner_routing": _data_combiner_routing}

# Configurations of a supported variant that have no layout (name -> check returning a reason or None).
UNSUPPORTED_CONFIG: dict[str, Callable[[Attention], str | None]] = {}

__all__ = ["flex_unsupported_reason", "flex_attention_forward", "flex_tiles_visited", "flex_partition", "FlexPlan"]
