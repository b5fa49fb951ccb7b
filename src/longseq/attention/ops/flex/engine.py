"""Running a variant's flex layout: summaries, ``flex_attention`` calls over ``[keys ; summaries]`` and the
log-sum-exp merge, as ONE compiled graph per layer on CUDA.

``flex_forward(attn, q, k, v, key_padding_mask)`` is what the dispatch runs for ``attention.backend=flex``:

- the static layout (calls and block masks, ``block_masks.static_layout``) is looked up outside the compiled
  function and passed in; layers with the same geometry share it, and it is never rebuilt per step;
- on CUDA the rest (``run_layer``: the variant's summaries, every flex call, the merge, the padding fallback) is one
  ``torch.compile(fullgraph=True, dynamic=False)`` graph, shared by every layer of a variant (dynamo guards on the
  module's attributes, not its identity); inside an outer ``torch.compile`` (``model.compile=true``) it is traced
  into the caller's graph instead;
- on CPU it runs eagerly, forward only (FlexAttention has no CPU backward): inference and tests under ``no_grad``.

Nothing is read on the host: padding is handled by per-batch ``mask_mod``s on the static tiles, and a padded query
that its padding leaves with nothing takes the output of its unpadded direct keys through a ``torch.where`` on its
log-sum-exp (computed for every padded batch, instead of asking the device whether any query needs it).
Layouts whose masks depend on the batch (``Attention.flex_from_data``: k-means clusters) build their block masks
on the device per call (``block_masks.build_block_mask``), without a sync.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from longseq.attention.errors import AttentionConfigError
from longseq.attention.ops.amp import dtype_preserving
from longseq.attention.ops.cpu.kernels import flex_reference
from longseq.attention.ops.flex.block_masks import (
    StaticLayout,
    build_block_mask,
    static_layout,
    with_mask_mod,
)
from longseq.attention.ops.flex.calls import FlexCall, tile_size, whole_tiles
from longseq.attention.ops.flex.regions import fused_applies, summary_kv

FLEX_RECOMPILE_LIMIT = 64  # compiled layer frames kept per process (see ``_compiled``)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once per process and used on CUDA only (on CPU flex runs eagerly). Made on first use
    so importing this module never touches dynamo.

    Every new variant configuration (the module attributes dynamo guards on) and every new length recompiles the one
    frame. Past dynamo's recompile limit (8) the frame runs eagerly: on an H200, a gpu-check process that went past
    it built dense block masks (``axial``: 41 GB at L = 65,536) instead of fused kernels. So the limit is raised to
    ``FLEX_RECOMPILE_LIMIT`` (process-wide; dynamo keys the limit by frame, not by compiled function).

    Compiled for static shapes (``dynamic=False``): after a second length dynamo's automatic dynamic shapes made
    the key length symbolic, and torch 2.11's flex lowering then raised (``'ShapeAsConstantBuffer' object has no
    attribute 'dtype'``, 5 of 31 CUDA test cases on an H200). A run trains at one length, so static costs one
    compile per length."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(fn, fullgraph=True, dynamic=False)


def flex_forward(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The attention's forward through FlexAttention: unscaled q, k ``(B, H, L, D)``, v ``(B, H, L, Dv)`` ->
    ``(B, H, L, Dv)``; ``key_padding_mask`` ``(B, L)`` bool (True = pad, ``ops.padding``'s rule). Equals
    ``attention_matrix(q, k, v) @ v`` (no weight dropout). On CPU inputs must not require grad."""
    reason = attn.flex_reason() or attn.flex_config_reason()
    if reason is not None:
        raise AttentionConfigError(f"attention '{attn.name}' has no flex layout (attention.backend=flex): {reason}")
    if attn.training and attn.dropout > 0:
        raise AttentionConfigError(
            f"attention '{attn.name}': the flex backend applies no weight dropout; with attention.dropout="
            f"{attn.dropout} in training use attention.backend=auto|cpu_flash|explicit")
    L = q.shape[-2]
    attn.check_length(L)
    tile = tile_size(L)
    layout = None
    if not attn.flex_from_data:
        layout = static_layout(attn, L, q.device, tile, padded=key_padding_mask is not None,
                               per_batch=attn.flex_selects)
    if q.is_cuda and not torch.compiler.is_compiling():
        return _compiled(run_layer)(attn, layout, q, k, v, key_padding_mask, tile)
    return run_layer(attn, layout, q, k, v, key_padding_mask, tile)


def run_layer(attn, layout: StaticLayout | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: torch.Tensor | None, tile: int) -> torch.Tensor:
    """The traced body of ``flex_forward``: the variant's per-batch state (``flex_batch_state``: its block choices),
    summaries, the calls, the parts computed apart (``flex_extra_parts``: chosen blocks at full resolution), each
    group's merge into one softmax and the groups' average (or the variant's weights, ``flex_group_weights``).
    ``layout`` None: the variant's calls depend on this batch (``flex_data_calls``)."""
    L = q.shape[-2]
    qs = attn.scale(q)
    real = None if key_padding_mask is None else ~key_padding_mask.to(device=q.device, dtype=torch.bool)
    state = attn.flex_batch_state(qs, k, v, real, tile)
    calls = layout.calls if layout is not None else attn.flex_data_calls(q, k, v, real)
    parts = []  # (group, output, lse, call) in the call's order (call None: sequence order)
    for index, call in enumerate(calls):
        occupied = None
        keys, values = [], []
        kv_len = whole_tiles(call.kv_len(L), tile)
        fused = layout.fused[index] if layout is not None and layout.fused else None
        if fused is not None and fused_applies(q, real is not None):  # the whole KV in one kernel on CUDA
            kv = attn.flex_fused_kv(index, *summary_kv(q, k, v, fused, query_scale(q)))
            keys, values = [kv[0]], [kv[1]]
        else:
            fused = None
        if call.direct is not None and fused is None:
            keys.append(in_order(k, call))
            values.append(in_order(v, call))
        if call.n_regions and fused is None:
            if call.summaries is not None:
                k_bar, v_bar, occupied = call.summaries(qs, k, v, real)
            else:
                k_bar, v_bar, occupied = attn.flex_summaries(index, qs, k, v, real, state)
            if call.summary_order is not None:
                k_bar, v_bar = k_bar.index_select(-2, call.summary_order), v_bar.index_select(-2, call.summary_order)
                occupied = None if occupied is None else occupied.index_select(-1, call.summary_order)
            if occupied is not None:  # a region without a real key is masked; its zeros keep 0 * v finite
                empty_region = ~(occupied[:, None, :, None] if occupied.dim() == 2 else occupied[..., None])
                k_bar, v_bar = k_bar.masked_fill(empty_region, 0.0), v_bar.masked_fill(empty_region, 0.0)
            keys.append(call.summary_kv(k_bar.to(k.dtype), L))
            values.append(call.summary_kv(v_bar.to(v.dtype), L))
        also = attn.flex_call_mask(index, state)
        real_c = None if real is None else in_order_rows(real, call)
        if layout is None:
            mask = build_block_mask(call.mask_mod(L, real_c, occupied, also=also), q.shape[0], call.heads, L, kv_len,
                                    q.device, tile)
        elif real is None and also is None:
            mask = layout.masks[index]
        else:  # the same tiles under a mask_mod that reads this batch
            mask = with_mask_mod(layout.partial_masks[index], call.mask_mod(L, real_c, occupied, also=also))
        out, lse = flex_call(in_order(q, call), _tile_padded(keys, kv_len), _tile_padded(values, kv_len), mask,
                             query_scale(q))
        parts.append((call.group, out, lse, call))
    parts += [(group, out, lse, None) for group, out, lse in attn.flex_extra_parts(state, q, k, v, real, tile)]

    outputs = []
    for group in sorted({part[0] for part in parts}):
        out, lse = merge_by_lse([part[1:] for part in parts if part[0] == group])
        if real is not None:  # a query with no real key and no usable region (ops.padding, rule 3)
            fallback = _direct_fallback(layout, calls, group, q, qs, k, v, tile)
            if fallback is not None:
                out = torch.where(torch.isneginf(lse).unsqueeze(-1), fallback, out)
        outputs.append(out)
    weights = attn.flex_group_weights(state, q)
    if weights is not None:  # (B, H, L, groups)
        return sum(w.unsqueeze(-1).to(out.dtype) * out for w, out in zip(weights.unbind(-1), outputs))
    return outputs[0] if len(outputs) == 1 else sum(outputs) / len(outputs)


def _direct_fallback(layout: StaticLayout | None, calls, group: int, q, qs, k, v, tile: int) -> torch.Tensor | None:
    """The group's output over its unpadded fallback keys alone (``ops.padding``'s rule for empty queries; None: the
    group has no direct keys); ``q`` unscaled, ``qs`` scaled (the summaries'). A call of single keys laid out as
    regions (``FlexCall.key_regions``) without direct keys of its own contributes those keys, unpadded (its static
    mask)."""
    L = qs.shape[-2]
    parts = []
    for index, call in enumerate(calls):
        if call.group != group or (call.direct is None and not call.key_regions):
            continue
        if call.direct is None:
            assert layout is not None, "key regions are written for static layouts (their unpadded mask)"
            k_bar, v_bar, _ = call.summaries(qs, k, v, None)
            kv_len, mask = layout.kv_lens[index], layout.masks[index]
            keys, values = [call.summary_kv(k_bar, L)], [call.summary_kv(v_bar, L)]
        else:
            kv_len = whole_tiles(L, tile)
            if layout is not None:
                mask = layout.direct_masks[index]
            else:
                mask = build_block_mask(call.mask_mod(L, direct_only=True), qs.shape[0], call.heads, L, kv_len,
                                        qs.device, tile)
            keys, values = [in_order(k, call)], [in_order(v, call)]
        out, lse = flex_call(in_order(q, call), _tile_padded(keys, kv_len), _tile_padded(values, kv_len), mask,
                             query_scale(q))
        parts.append((out, lse, call))
    return merge_by_lse(parts)[0] if parts else None


def _tile_padded(parts: list[torch.Tensor], kv_len: int) -> torch.Tensor:
    """``parts`` ``(B, H, ., D)`` concatenated along the keys and zero-padded to ``kv_len`` slots (masked)."""
    missing = kv_len - sum(p.shape[-2] for p in parts)
    if missing:
        parts = [*parts, parts[0].new_zeros(*parts[0].shape[:-2], missing, parts[0].shape[-1])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -2)


def query_scale(q: torch.Tensor) -> float:
    """The logits' 1/sqrt(D) (``Attention.scale``'s) for unscaled q ``(..., D)``, applied inside the flex calls: a
    call on scaled queries kept that scaled copy for its backward (one more output's worth of memory per layer)."""
    return 1.0 / math.sqrt(q.shape[-1])


def flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One flex call, logits ``scale * q . k`` -> output ``(B, H, L, Dv)`` and natural-log lse ``(B, H, L)``."""
    if q.is_cuda or torch.compiler.is_compiling():
        out, aux = flex_attention(q, k, v, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return flex_reference(q, k, v, mask, scale)  # CPU, eager: the unfused reference, forward only (``ops.cpu.kernels``)


@dtype_preserving
class _Reorder(torch.autograd.Function):
    """Rows ``(..., L, .)`` put in another order by a permutation, whose backward is the inverse permutation: a
    gather that inductor fuses into its neighbours, where ``index_select``'s backward is a zero fill and an
    ``index_add`` (two launches per reordered tensor on an sm90 target, ``longseq.bench.launches``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(-2, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(-2, inverse), None, None


def in_order(x: torch.Tensor, call: FlexCall | None) -> torch.Tensor:
    """(B, H, L, .) in sequence order -> the call's order (``call`` None: sequence order)."""
    return x if call is None or call.order is None else _Reorder.apply(x, call.order, call.sequence_order)


def in_order_rows(real: torch.Tensor, call: FlexCall) -> torch.Tensor:
    """(B, L) per-position flags in sequence order -> the call's order."""
    return real if call.order is None else real.index_select(-1, call.order)


def to_sequence(x: torch.Tensor, call: FlexCall | None) -> torch.Tensor:
    """(B, H, L, .) in the call's order (``call`` None: already in sequence order) -> sequence order."""
    return x if call is None or call.order is None else _Reorder.apply(x, call.sequence_order, call.order)


def logsumexp_of(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last axis, -inf where every entry is -inf, with zero gradients there: torch's own
    gives NaN gradients for such a row (exp(-inf - -inf)), even under a zero upstream gradient, and a padded query
    with no key left would send them into FlexAttention's lse gradient."""
    empty = torch.isneginf(x).all(-1, keepdim=True)
    return torch.logsumexp(x.masked_fill(empty, 0.0), -1).masked_fill(empty.squeeze(-1), float("-inf"))


def logaddexp_of(xs: list[torch.Tensor]) -> torch.Tensor:
    """``logsumexp`` over a few tensors of one shape, element by element, as ``logsumexp_of`` over their stack would
    give it (-inf where all are -inf, zero gradients there), in pointwise operations only: a stack and a reduction
    over it compiled into four kernels of the merge's five on an sm90 target (``longseq.bench.launches``), these
    into the merge's one. The maximum is a constant of the formula (its gradient cancels), so it is detached."""
    top = functools.reduce(torch.maximum, xs).detach()
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    total = sum(torch.exp(x - top) for x in xs)
    some = total > 0
    return torch.where(some, top + torch.log(torch.where(some, total, torch.ones_like(total))), float("-inf"))


def merge_by_lse(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact joint softmax of calls over disjoint key sets from their ``(output (B, H, L, Dv), log-sum-exp
    (B, H, L), call)``, each in its call's order (call None: sequence order) -> output and lse in sequence order;
    a query no call reaches keeps output 0 and lse -inf. Each output is weighted in its own order before it is
    reordered, so the backward keeps the call's output (which FlexAttention keeps anyway), not a reordered copy."""
    lses = [to_sequence(lse.unsqueeze(-1), call).squeeze(-1) for _, lse, call in parts]
    if len(parts) == 1:
        return to_sequence(parts[0][0], parts[0][2]), lses[0]
    lse = logaddexp_of(lses)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    if torch.compiler.is_compiling():  # one kernel: inductor reads the reordered outputs and lses in place
        out = sum(to_sequence(o, call) * (part.unsqueeze(-1) - safe).exp().to(o.dtype)
                  for (o, _, call), part in zip(parts, lses))
    else:  # eager, a reordered output would be a copy the backward keeps
        out = sum(to_sequence(o * (part.unsqueeze(-1) - in_order(safe, call)).exp().to(o.dtype), call)
                  for o, part, call in parts)
    return out, lse
