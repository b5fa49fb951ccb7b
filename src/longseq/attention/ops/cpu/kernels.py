"""The private ATen CPU flash-attention kernels, named in this one place.

``flash_attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None) -> (out, logsumexp)`` and
``flash_attention_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None)
-> (grad_q, grad_k, grad_v)``: the fused CPU kernels behind ``F.scaled_dot_product_attention``, called directly
because they return (and take back) the per-query log-sum-exp, which merging several fused calls into one exact
softmax needs. Inputs ``(B, H, L, D)`` with a unit last stride; ``attn_mask`` is additive float. Private API: a
torch upgrade that renames or changes them is fixed here (and checked by the CPU engine's tests).

``flex_reference(q, k, v, block_mask, scale) -> (out, logsumexp)``: FlexAttention's unfused CPU reference (forward only),
called through torch's private module switch (the flex backend on CPU, ``ops.flex``), made to read the block mask's
tile tables as the GPU kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"

flash_attention = getattr(torch.ops.aten, FLASH_OP)
flash_attention_backward = getattr(torch.ops.aten, FLASH_BACKWARD_OP)


def flex_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention on CPU tensors (logits ``scale * q . k``): output ``(B, H, L, Dv)`` and lse ``(B, H, L)``.

    Uncompiled, ``flex_attention`` still traces its higher-order op with dynamo's eager backend, once per new
    ``mask_mod`` closure (about 0.5 s each: every padded batch and every module makes one), to run the same math the
    op runs when called directly; torch's switch for calling it directly is this private module flag (documented as
    unsafe for backward only, which CPU refuses anyway).
    """
    previous = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        out, aux = flex_attention(q, k, v, block_mask=as_the_kernels_read_it(block_mask), scale=scale,
                                  return_aux=AuxRequest(lse=True))
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous
    return out, aux.lse


def as_the_kernels_read_it(block_mask: BlockMask) -> BlockMask:
    """``block_mask`` with a mask_mod that reads its tile tables as FlexAttention's GPU kernels do: a cell counts
    where its tile is a full one, or a partial one and the mask_mod allows it; a tile neither table names is never
    visited. The unfused reference evaluates the mask_mod alone on every cell, so without this a CPU test could not
    see a table that leaves out a tile the mask_mod needs (the GPU would drop those keys)."""
    q_tile, kv_tile = block_mask.BLOCK_SIZE
    kv_tiles = -(-block_mask.seq_lengths[1] // kv_tile)
    partial = _tile_table(block_mask.kv_num_blocks, block_mask.kv_indices, kv_tiles)
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = _tile_table(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_tiles)
    inner = block_mask.mask_mod

    def mask_mod(b, h, q, kv):
        # tensors only: torch 2.9's vmap read a Python int index mixed with batched ones with .item() and raised
        tile = (b if partial.shape[0] > 1 else b * 0, h if partial.shape[1] > 1 else h * 0, q // q_tile, kv // kv_tile)
        ok = partial[tile] & inner(b, h, q, kv)
        return ok if full is None else ok | full[tile]

    return BlockMask(block_mask.seq_lengths, block_mask.kv_num_blocks, block_mask.kv_indices,
                     block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block_mask.q_num_blocks,
                     block_mask.q_indices, block_mask.full_q_num_blocks, block_mask.full_q_indices,
                     block_mask.BLOCK_SIZE, mask_mod)


def _tile_table(num: torch.Tensor, indices: torch.Tensor, kv_tiles: int) -> torch.Tensor:
    """``(B, H, q tiles, kv tiles)`` bool: the tiles the first ``num`` entries of each row of ``indices`` name."""
    named = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    table = torch.zeros(*indices.shape[:-1], kv_tiles + 1, dtype=torch.bool, device=indices.device)
    return table.scatter_(-1, torch.where(named, indices, kv_tiles).long(), True)[..., :kv_tiles]
