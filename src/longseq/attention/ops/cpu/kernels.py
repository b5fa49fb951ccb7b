"""The private ATen CPU flash-attention kernels, named in this one place.

``flash_attention(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None) -> (out, logsumexp)`` and
``flash_attention_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None)
-> (grad_q, grad_k, grad_v)``: the fused CPU kernels behind ``F.scaled_dot_product_attention``, called directly
because they return (and take back) the per-query log-sum-exp, which merging several fused calls into one exact
softmax needs. Inputs ``(B, H, L, D)`` with a unit last stride; ``attn_mask`` is additive float. Private API: a
torch upgrade that renames or changes them is fixed here (and checked by the CPU engine's tests).
"""

from __future__ import annotations

import torch

FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"

flash_attention = getattr(torch.ops.aten, FLASH_OP)
flash_attention_backward = getattr(torch.ops.aten, FLASH_BACKWARD_OP)
