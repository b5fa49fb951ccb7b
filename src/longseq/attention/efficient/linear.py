"""Linear Transformer (Katharopoulos et al. 2020): elu+1 feature map, O(L D^2).

``phi(x) = elu(x) + 1`` (strictly positive), ``out_i = phi(q_i)^T S / phi(q_i)^T z`` with ``S = sum_j phi(k_j) v_j^T``
and ``z = sum_j phi(k_j)`` over all keys, or over ``j <= i`` when causal (chunked prefix sums,
``prefix_sums.causal_kernel_attention``). The queries get the usual single 1/sqrt(D) scaling before the
feature map (it only sets the feature map's temperature; elu+1 has no other knob). There are no explicit
weights in the fast path, so ``dropout`` (attention-weight dropout) is not applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.ops.prefix_sums import (
    KernelSumsState,
    causal_kernel_attention,
    kernel_attention,
    kernel_step,
    kernel_weights,
)
from longseq.attention.registry import register_attention


@register_attention("linear")
class LinearAttention(Attention):
    """elu+1 linear attention; causal through chunked prefix sums.

    Args:
        chunk_size: causal chunk length C (memory ``O(L (C + D) + L/C * D^2)``); unused when bidirectional.
    """

    def __init__(self, *, causal: bool, chunk_size: int = 64, **common) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise AttentionConfigError(f"attention.chunk_size must be a positive integer, got {chunk_size!r}")
        super().__init__(causal=causal, **common)
        self.chunk_size = chunk_size

    @staticmethod
    def features(x: torch.Tensor) -> torch.Tensor:
        """elu(x) + 1 > 0, elementwise on ``(B, H, L, D)``."""
        return F.elu(x) + 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        phi_q, phi_k = self.features(self.scale(q)), self.features(k)
        if self.causal:
            return causal_kernel_attention(phi_q, phi_k, v, self.chunk_size)
        return kernel_attention(phi_q, phi_k, v)

    # -- incremental decoding: the running sums of the causal prefix, O(D^2) per step --------------------
    supports_decoding = True

    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> KernelSumsState:
        return KernelSumsState(batch_size, max_len, device, dtype)

    def step(self, state: KernelSumsState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_step(state, self.features(self.scale(q)), self.features(k), v)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_weights(self.features(self.scale(q)), self.features(k), self.causal)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, chunk_size={self.chunk_size}"
