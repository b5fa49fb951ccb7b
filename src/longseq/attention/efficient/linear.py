"""Linear Transformer (Katharopoulos et al. 2020): elu+1 feature map, O(L D^2).

``phi(x) = elu(x) + 1`` (strictly positive), ``out_i = phi(q_i)^T S / phi(q_i)^T z`` with ``S = sum_j phi(k_j) v_j^T``
and ``z = sum_j phi(k_j)`` over all keys, or over ``j <= i`` when causal (``prefix_sums.causal_kernel_attention``:
chunked prefix sums, tile by tile, with this feature map applied inside each tile and recomputed there in
backward). The queries get the usual single 1/sqrt(D) scaling before the feature map (it only sets the
feature map's temperature; elu+1 has no other knob), folded into the map. There are no explicit weights in
the fast path, so ``dropout`` (attention-weight dropout) is not applied.

The map is computed as ``exp(min(x, 0)) + max(x, 0)`` with the derivative ``min(phi, 1)`` (backward needs
only phi): ``F.elu`` measured about 5x slower than ``exp`` over the same tensor on CPU (``expm1`` is not
vectorized), and was 18% of the causal forward + backward before.
"""

from __future__ import annotations

import math

import torch

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.ops.prefix_sums import (
    KernelFeatures,
    KernelSumsState,
    causal_kernel_attention,
    kernel_attention,
    kernel_step,
    kernel_weights,
    key_features,
    query_features,
)
from longseq.attention.registry import register_attention


def elu_plus_one(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``elu(scale x) + 1 = exp(scale min(x, 0)) + scale max(x, 0)`` (see the module docstring)."""
    return torch.clamp(x, max=0).mul_(scale).exp_().add_(torch.relu(x), alpha=scale)


def elu_plus_one_grad(phi: torch.Tensor, grad_phi: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``d loss / d x`` from ``phi = elu_plus_one(x, scale)``: ``d phi / d x = scale min(phi, 1)``."""
    grad_x = torch.clamp(phi, max=1).mul_(grad_phi)
    return grad_x.mul_(scale) if scale != 1 else grad_x


class EluFeatures(KernelFeatures):
    """``phi(q) = elu(q / sqrt(D)) + 1`` and ``phi(k) = elu(k) + 1`` (the single 1/sqrt(D) scaling on queries)."""

    def __init__(self, head_dim: int) -> None:
        self.query_scale = 1.0 / math.sqrt(head_dim)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return elu_plus_one(q, self.query_scale)

    def query_grad(self, q: torch.Tensor, phi: torch.Tensor, grad_phi: torch.Tensor) -> torch.Tensor:
        return elu_plus_one_grad(phi, grad_phi, self.query_scale)

    def key(self, k: torch.Tensor) -> tuple[torch.Tensor, None]:
        return elu_plus_one(k), None

    def key_grad(self, k, phi, grad_phi, grad_log_scale) -> torch.Tensor:
        return elu_plus_one_grad(phi, grad_phi)


@register_attention("linear")
class LinearAttention(Attention):
    """elu+1 linear attention; causal through chunked prefix sums.

    Args:
        chunk_size: causal chunk length C (kept for backward: ``O(L (C + D))``); unused when bidirectional.
    """

    def __init__(self, *, causal: bool, chunk_size: int = 64, **common) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise AttentionConfigError(f"attention.chunk_size must be a positive integer, got {chunk_size!r}")
        super().__init__(causal=causal, **common)
        self.chunk_size = chunk_size

    def features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable ``(phi(q), phi(k))`` ``(B, H, L, D)`` (the causal forward maps them tile by tile instead)."""
        feature_map = EluFeatures(q.shape[-1])
        return query_features(feature_map, q), key_features(feature_map, k)[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.causal:
            return causal_kernel_attention(q, k, v, self.chunk_size, features=EluFeatures(q.shape[-1]))
        return kernel_attention(*self.features(q, k), v)

    # -- incremental decoding: the running sums of the causal prefix, O(D^2) per step --------------------
    supports_decoding = True

    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> KernelSumsState:
        return KernelSumsState(batch_size, max_len, device, dtype)

    def step(self, state: KernelSumsState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_step(state, *self.features(q, k), v)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel_weights(*self.features(q, k), self.causal)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, chunk_size={self.chunk_size}"
