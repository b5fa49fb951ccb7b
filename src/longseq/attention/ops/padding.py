"""Key padding, the one rule (LRA's variable-length documents), shared by every ``supports_padding_mask`` variant.

A padded task passes ``key_padding_mask`` ``(B, L)`` bool, **True = padded key** (PyTorch's
``nn.MultiheadAttention`` convention; the one exception to "True = may attend", kept because it is the
convention users know). For every variant with ``supports_padding_mask``:

1. a padded key gets zero weight from every query that has at least one real key to attend;
2. a padded key is left out of every region summary (pooled query, pooled key, inner softmax), and a region
   without a real key is unusable; a region summarized by one position's own query whose position is
   padding is summarized by the region's first real member instead (row-major axial);
3. a query left with no real key (only a padded query can be: self is always a direct key) falls back to
   its **unpadded direct keys** (for ``full`` and the sparse patterns: its whole unpadded pattern), so no
   row is NaN; its output is never pooled (pooling skips padded positions).

``ops.partition.Partition.without_padding`` writes the rule on index sets (the reference every
``attention_matrix`` uses); the fast paths follow it and a registry-wide test checks them against it.
Variants whose weights are ``softmax(q k^T / sqrt(D))`` over a fixed pattern get it for free from
``append_padding_channel``.
"""

from __future__ import annotations

import math

import torch

PADDING_PENALTY = 1.0e4  # logit offset of padded keys: exp(-1e4) is exactly 0 in fp32, and 1e4 fits fp16


def append_padding_channel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key padding for any variant whose weights are ``softmax(q k^T / sqrt(D))`` over a fixed pattern.

    Appends one channel so that the variant's own scaled logits become ``q.k / sqrt(D) - PADDING_PENALTY * pad_j``:
    q' = [q * sqrt((D+1)/D), sqrt(D+1)], k' = [k, -PADDING_PENALTY * pad], v' = [v, 0]. After the variant's
    1/sqrt(D+1) scaling the first D channels give exactly ``q.k / sqrt(D)``. Padded keys then get zero weight
    in every row that has a real key; a row whose allowed keys are all padded keeps its unpadded weights (all
    logits shift equally): rule 3 above. Drop the last output channel: ``variant(q', k', v')[..., :-1]``.
    q, k, v (B, H, L, D), key_padding_mask (B, L) bool (True = pad) -> (B, H, L, D + 1) each.
    """
    D = q.shape[-1]
    pad = key_padding_mask.to(k.dtype)[:, None, :, None].expand(*k.shape[:-1], 1)
    q_extra = torch.full_like(q[..., :1], math.sqrt(D + 1))
    q2 = torch.cat([q * math.sqrt((D + 1) / D), q_extra], dim=-1)
    k2 = torch.cat([k, -PADDING_PENALTY * pad], dim=-1)
    v2 = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
    return q2, k2, v2
