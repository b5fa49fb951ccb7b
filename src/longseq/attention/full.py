"""Full softmax attention through ``scaled_dot_product_attention`` (the dense baseline)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.registry import register_attention


@register_attention("full")
class FullAttention(Attention):
    """Every query attends to every key (or every earlier key when causal); O(L^2)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        logits = self.scale(q) @ k.transpose(-1, -2)
        if self.causal:
            L = q.shape[-2]
            future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        return logits.softmax(-1)
