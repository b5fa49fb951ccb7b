"""What a flex layout visits, keeps and means, without a GPU: tiles against causal full attention's, its backward's
longest serial loop and the bytes one layer keeps for its backward (the benchmark's hardware-independent columns),
and the calls' masks back as one dense ``Partition`` (tests)."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import create_mask

from longseq.attention.ops.flex import engine
from longseq.attention.ops.flex.block_masks import causal_full_tiles, static_layout, tiles_of
from longseq.attention.ops.flex.calls import TILE, tile_size
from longseq.attention.ops.partition import Partition


def flex_tiles_visited(attn, L: int, device="cpu", tile: int = TILE) -> float:
    """Tiles (``tile`` x ``tile``) the flex calls visit at length L, counted from their ``BlockMask``s (partial +
    full blocks, averaged over the heads the mask distinguishes), divided by causal full attention's at the same
    L and tile. Hardware independent; no attention runs. NaN for layouts whose tiles depend on the data (``routing``'s
    clusters; the blocks ``moba``, ``nsa`` and ``combiner_select`` choose per query)."""
    if attn.flex_from_data or attn.pattern_from_data:
        return math.nan
    layout = static_layout(attn, L, torch.device(device), tile)
    total = sum(tiles_of(mask) / call.heads for call, mask in zip(layout.calls, layout.masks))
    return total / causal_full_tiles(L, tile)


def flex_longest_loop(attn, L: int, device="cpu", tile: int = TILE) -> float:
    """The most query tiles that visit one key tile in any static call, divided by the query tiles of the sequence
    (causal full attention's longest, at key tile 0). FlexAttention's backward computes each key tile's dK and dV in
    one program that loops over those query tiles, so this is the backward's serial chain, hardware independent:
    1.0 where every query uses the same key tile (summaries laid out once, ``calls.FlexCall.summary_copies``). The
    blocks that ``moba``, ``nsa`` and ``combiner_select`` choose per batch are not counted; NaN for the k-means
    layouts (every call from the data)."""
    if attn.flex_from_data:
        return math.nan
    layout = static_layout(attn, L, torch.device(device), tile)
    longest = max(int((mask.q_num_blocks + (0 if mask.full_q_num_blocks is None else mask.full_q_num_blocks)).max())
                  for mask in layout.masks)
    return longest / -(-L // tile)


class KeptForBackward(NamedTuple):
    """Bytes one layer keeps for its backward, each divided by its output's (``flex_kept_for_backward``)."""

    whole: float  # everything, each storage once
    calls: float  # what the flex calls keep: their q, k, v, output, lse and the block masks made for this batch
    outside: float  # what the layer's other operations save (some of it the calls keep too)


def mask_tensors(mask) -> list[torch.Tensor]:
    """The tensors a ``BlockMask`` holds: its tile tables and whatever its mask_mod's closures capture (a batch's
    padding, chosen blocks, clusters), followed through the functions those closures hold."""
    tables = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, mask.q_num_blocks,
              mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
    tensors = [t for t in tables if t is not None]
    seen, functions = set(), [mask.mask_mod]
    while functions:
        function = functions.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif callable(value):
                functions.append(value)
    return tensors


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _kernel_shapes(kept: dict[int, int], alive: list) -> type[torch.autograd.Function]:
    """One flex call's contract without its arithmetic, for counting on CPU (whose FlexAttention has no backward):
    output ``(B, H, Lq, Dv)`` and lse ``(B, H, Lq)`` of zeros, zero gradients. What FlexAttention's backward keeps
    (q, k, v, the output, the lse) is held in ``alive`` and its storages' bytes recorded in ``kept``, out of sight of
    saved-tensor hooks, which then see the rest of the layer alone."""

    class KernelShapes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            lse = q.new_zeros(q.shape[:-1], dtype=torch.float32)
            ctx.shapes = [(x.shape, x.dtype) for x in (q, k, v)]
            alive.append((q, k, v, out, lse))
            kept.update(_storages((q, k, v, out, lse)))
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            return tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.shapes)

    return KernelShapes


@contextlib.contextmanager
def flex_calls_as_shapes(kept: dict[int, int] | None = None, alive: list | None = None):
    """Within: every flex call (``engine.flex_call``: the one entry of the layer's calls and of the gathered
    selections) computed by ``_kernel_shapes`` instead, its block mask's tensors recorded in ``kept`` too; so a
    layer runs its backward on CPU (tests: what a training step reads on the host; ``flex_kept_for_backward``)."""
    kept = {} if kept is None else kept
    alive = [] if alive is None else alive
    kernel, real = _kernel_shapes(kept, alive), engine.flex_call

    def call(q, k, v, mask, scale):
        alive.append(mask)
        kept.update(_storages(mask_tensors(mask)))
        return kernel.apply(q, k, v)

    engine.flex_call = call
    try:
        yield
    finally:
        engine.flex_call = real


def flex_kept_for_backward(attn, L: int, heads: int, head_dim: int, padded: bool = False,
                           seed: int = 0) -> KeptForBackward:
    """What one training layer keeps for its backward at length L on the flex backend (the memory beside its
    output that a GPU step holds until the backward), in bytes divided by its output's, ``L * head_dim * 2 * heads``
    (B 1, bf16; ``attn`` is cast to bf16); the layer's q, k, v, its parameters and its static layout's block masks
    (shared by every layer) not counted. ``padded``: the batch's last eighth of keys is padding. Full attention
    (SDPA) keeps about 1: its output.

    The layer's own code runs on CPU on random data, each flex call replaced by one that keeps what FlexAttention
    keeps (``_kernel_shapes``: q, k, v, output, lse, and the block mask with what its mask_mod captures); the rest is
    counted by saved-tensor hooks. It runs outside a compiled graph, where inductor may keep less (it can recompute
    pointwise results in the backward). Hardware independent: no attention is computed."""
    generator = torch.Generator().manual_seed(seed)
    module = attn.to(torch.bfloat16).train()
    shape = (1, heads, L, head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_() for _ in range(3))
    pad = None
    if padded:
        pad = torch.zeros(1, L, dtype=torch.bool)
        pad[:, L - L // 8:] = True
    own = {x.untyped_storage()._cdata for x in (q, k, v, *module.parameters(), *module.buffers())}
    if not module.flex_from_data:
        layout = static_layout(module, L, torch.device("cpu"), tile_size(L), padded=padded,
                               per_batch=module.flex_selects)
        shared = [*layout.masks, *(layout.partial_masks or ()), *(m for m in layout.direct_masks or () if m)]
        own |= {t.untyped_storage()._cdata for mask in shared for t in mask_tensors(mask)}
    saved: dict[int, int] = {}
    kept: dict[int, int] = {}
    alive: list = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with flex_calls_as_shapes(kept, alive), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = engine.flex_forward(module, q, k, v, pad)
    out.float().sum().backward()
    unit = L * head_dim * 2 * heads

    def share(*parts: dict[int, int]) -> float:
        return sum(n for key, n in {key: n for part in parts for key, n in part.items()}.items()
                   if key not in own) / unit

    return KeptForBackward(share(saved, kept), share(kept), share(saved))


def flex_partition(attn, L: int, head: int = 0) -> Partition:
    """The union of the flex calls' ``create_mask``s at length L as one dense ``Partition`` (sequence order; small
    L, tests): direct sets from the key columns, one region per summary column (``FlexCall.members``)."""
    direct = torch.zeros(L, L, dtype=torch.bool)
    members, usable, anchors, families = [], [], [], []
    for call in static_layout(attn, L, torch.device("cpu"), tile_size(L)).calls:
        mask = create_mask(call.mask_mod(L), 1, call.heads, L, call.kv_len(L), "cpu")[0]  # (heads, L, KV)
        mask = mask[min(head, call.heads - 1)]
        order = torch.arange(L) if call.order is None else call.order.cpu()
        keys = L if call.direct is not None else 0
        if keys:
            block = torch.zeros(L, L, dtype=torch.bool)
            block[order.unsqueeze(1), order.unsqueeze(0)] = mask[:, :L]
            direct |= block
        if call.n_regions:
            use = torch.zeros(L, call.n_regions, dtype=torch.bool)
            use[order] = call.summary_columns(mask[:, keys:], L)
            if call.key_regions:  # single keys laid out as regions: direct keys
                direct |= (use.double() @ call.members().cpu().double()) > 0
                continue
            usable.append(use)
            members.append(call.members().cpu())
            anchors.append(torch.full((call.n_regions,), -1, dtype=torch.long) if call.anchors is None
                           else call.anchors().cpu())
            families.append(torch.full((call.n_regions,), call.family, dtype=torch.long))
    if not members:
        return Partition.direct_only(direct)
    return Partition.from_candidates(direct, torch.cat(members), torch.cat(usable, 1), torch.cat(families),
                                     torch.cat(anchors))
