"""Full softmax attention through ``scaled_dot_product_attention`` (the dense baseline)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.ops.decoding import KVCache, cached_causal_attention
from longseq.attention.ops.masks import full_mask
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention


@register_attention("full")
class FullAttention(Attention):
    """Every query attends to every key (or every earlier key when causal); O(L^2).

    Key padding (``key_padding_mask`` (B, L) bool, True = padded key) follows ``ops.padding``: its direct
    keys are its whole (causal) row, so a query with no real key falls back to the unpadded row.
    Decoding: a KV cache (``ops.decoding.KVCache``); a step attends to every cached key, O(t D) at position t.
    """

    supports_padding_mask = True
    supports_decoding = True

    def partition(self, length: int, device: torch.device | None = None) -> Partition:
        """Every key (causal: every earlier key) direct, no regions."""
        return Partition.direct_only(full_mask(length, self.causal, device))

    def allowed_keys(self, key_padding_mask: torch.Tensor, L: int) -> torch.Tensor:
        """(B, 1, L, L) bool, True = may attend: the partition's direct keys under ``ops.padding``'s rule."""
        direct = self.partition(L, key_padding_mask.device).direct
        allowed = direct & ~key_padding_mask.bool()[:, None, None, :]
        return torch.where(allowed.any(-1, keepdim=True), allowed, direct)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if key_padding_mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        mask = self.allowed_keys(key_padding_mask, q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) softmax over every (causal: every earlier) key, from ``partition`` (``ops.padding``'s rule
        under key padding)."""
        return self.partition(q.shape[-2], q.device).direct_matrix(self.scale(q), k, key_padding_mask)

    # -- incremental decoding ------------------------------------------------------------------
    def init_decoding_state(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        return KVCache(batch_size, max_len, device, dtype)

    def prefill(self, state: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cached_causal_attention(state, q, k, v)

    def step(self, state: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cached_causal_attention(state, q, k, v)
