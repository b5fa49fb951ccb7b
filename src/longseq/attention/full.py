"""Full softmax attention through ``scaled_dot_product_attention`` (the dense baseline)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.registry import register_attention


@register_attention("full")
class FullAttention(Attention):
    """Every query attends to every key (or every earlier key when causal); O(L^2).

    Supports ``key_padding_mask`` ((B, L) bool, True = padded key): padded keys get zero weight.
    """

    supports_padding_mask = True

    def allowed_keys(self, key_padding_mask: torch.Tensor, L: int) -> torch.Tensor:
        """(B, 1, 1 or L, L) bool, True = may attend: the causal pattern minus padded keys.

        A row left with no key (an all-padded document, or only padding in a causal prefix) falls back to
        the unpadded pattern, so it stays a finite distribution instead of NaN.
        """
        allowed = ~key_padding_mask.bool()[:, None, None, :]
        if self.causal:
            allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=allowed.device).tril()
            allowed = allowed | ~allowed.any(-1, keepdim=True) & torch.ones_like(allowed).tril()
        else:
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        return allowed

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if key_padding_mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        mask = self.allowed_keys(key_padding_mask, q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.scale(q) @ k.transpose(-1, -2)
        L = q.shape[-2]
        if key_padding_mask is not None:
            return logits.masked_fill(~self.allowed_keys(key_padding_mask, L), float("-inf")).softmax(-1)
        if self.causal:
            future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        return logits.softmax(-1)
