"""FNet (Lee-Thorp et al. 2021): Fourier token mixing instead of attention, O(L log L), no parameters.

FNet replaces the attention sublayer by ``y = Re(FFT_seq(FFT_hidden(x)))``. Here the layer receives the
per-head values ``v`` ``(B, H, L, D)`` (q and k are ignored); the hidden axis is the concatenation of all
heads (H * D, the model width, as in FNet) unless ``hidden_fft=false``:

    out = Re(DFT_L  V  DFT_HD)  with V the (L, H*D) value matrix, split back into heads.

``norm=ortho`` divides by sqrt(L * H * D) (unitary transforms, keeps the activation scale in the
pre-norm backbone); ``norm=none`` is the paper's unnormalized transform. Bidirectional only.

What ``attention_matrix`` returns: the sequence-mixing matrix ``P = Re(DFT_L)`` (times the L-part of the
normalization), ``(B, H, L, L)``. With ``hidden_fft=false`` the output is exactly ``P @ v``. With the
hidden FFT the output is ``C_L V C_HD - S_L V S_HD`` (C = cos, S = sin parts of the DFT matrices), which
is not a single (L, L) matrix applied to v: ``P`` is then the token-mixing half only and
``out != P @ v``. Rows of P do not sum to 1 (the first row sums to L, or sqrt(L) with ortho; the
others to 0).
"""

from __future__ import annotations

import math

import torch

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.registry import register_attention

NORMS = ("ortho", "none")


def real_dft_matrix(L: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``cos(2 pi i j / L)`` ``(L, L)``, the real part of the DFT matrix."""
    idx = torch.arange(L, device=device, dtype=torch.float64)
    return torch.cos(2 * math.pi * torch.outer(idx, idx).remainder(L) / L).to(dtype)


@register_attention("fnet")
class FNetMixing(Attention):
    """Parameter-free Fourier mixing of the values (see the module docstring).

    Args:
        hidden_fft: also transform the hidden axis (all heads together), as in FNet.
        norm: ``ortho`` (unitary) or ``none`` (the paper's unnormalized FFT).
    """

    supports_causal = False

    def __init__(self, *, causal: bool, hidden_fft: bool = True, norm: str = "ortho", **common) -> None:
        super().__init__(causal=causal, **common)
        if norm not in NORMS:
            raise AttentionConfigError(f"attention.norm must be one of {NORMS}, got {norm!r}")
        self.hidden_fft, self.norm = bool(hidden_fft), norm
        self.normalized_rows = False  # a Fourier transform, not a softmax
        self.matrix_is_exact = not self.hidden_fft  # the hidden-axis DFT is not one (L, L) matrix

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = v.shape
        norm = "ortho" if self.norm == "ortho" else "backward"
        dtype = v.dtype
        if dtype in (torch.bfloat16, torch.float16):  # CPU FFTs take fp32/fp64 only: transform in fp32
            v = v.float()
        if not self.hidden_fft:
            return torch.fft.fft(v, dim=2, norm=norm).real.to(dtype)
        x = v.transpose(1, 2).reshape(B, L, H * D)
        y = torch.fft.fft2(x, dim=(1, 2), norm=norm).real.to(dtype)
        return y.view(B, L, H, D).transpose(1, 2)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, _ = v.shape
        p = real_dft_matrix(L, v.dtype, v.device)
        if self.norm == "ortho":
            p = p / math.sqrt(L)
        return p.expand(B, H, L, L)

    def extra_repr(self) -> str:
        return f"name={self.name}, hidden_fft={self.hidden_fft}, norm={self.norm}"
