"""The private ATen CPU flash-attention kernels, named in this one place.

``flash_attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None) -> (out, logsumexp)`` and
``flash_attention_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None)
-> (grad_q, grad_k, grad_v)``: the fused CPU kernels behind ``F.scaled_dot_product_attention``, called directly
because they return (and take back) the per-query log-sum-exp, which merging several fused calls into one exact
softmax needs. Inputs ``(B, H, L, D)`` with a unit last stride; ``attn_mask`` is additive float. Private API: a
torch upgrade that renames or changes them is fixed here (and checked by the CPU engine's tests).

``flex_reference(q, k, v, block_mask) -> (out, logsumexp)``: FlexAttention's unfused CPU reference (forward only),
called through torch's private module switch (the flex backend on CPU, ``ops.flex``).
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"

flash_attention = getattr(torch.ops.aten, FLASH_OP)
flash_attention_backward = getattr(torch.ops.aten, FLASH_BACKWARD_OP)


def flex_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   block_mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention on CPU tensors, scaled q (``scale=1``): output ``(B, H, L, Dv)`` and lse ``(B, H, L)``.

    Uncompiled, ``flex_attention`` still traces its higher-order op with dynamo's eager backend, once per new
    ``mask_mod`` closure (about 0.5 s each: every padded batch and every module makes one), to run the same math the
    op runs when called directly; torch's switch for calling it directly is this private module flag (documented as
    unsafe for backward only, which CPU refuses anyway).
    """
    previous = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=1.0, return_aux=AuxRequest(lse=True))
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous
    return out, aux.lse
