"""Nystromformer (Xiong et al. 2021): Nystrom approximation of softmax attention with m landmarks, O(L m).

Landmarks are segment means of the (scaled) queries and keys: position p belongs to segment
``floor(p m / L)`` (m contiguous segments whose sizes differ by at most one, so any L works; when
``L <= m`` every position is its own landmark). With ``Fq = softmax(Q Kl^T)`` ``(L, m)``,
``A = softmax(Ql Kl^T)`` ``(m, m)`` and ``Bk = softmax(Ql K^T)`` ``(m, L)`` (logits scaled by 1/sqrt(D) once):
``out = Fq A+ (Bk V) + conv(V)``. ``A+`` is the iterative pseudo-inverse (Razavi et al.):
``Z0 = A^T / (max column sum * max row sum)``, ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4``,
``pinv_iterations`` times (6 in the paper). ``conv`` is the optional depthwise residual convolution of
the values along the sequence, one kernel per head (``conv_kernel`` taps, 0 = off; 33 in lucidrains).
Bidirectional only: the segment means mix future positions.

``attention_matrix`` returns the exact linear operator ``P = Fq A+ Bk (+ the convolution's banded
matrix)`` with ``forward == P @ v``. Rows do not sum to 1 exactly (A+ is approximate; the convolution adds
its own weights). With ``m = L`` and an exact pseudo-inverse ``P`` is full softmax attention.
Dropout acts on ``Fq``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.registry import register_attention


def segment_means_matrix(L: int, m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(m', L)`` averaging matrix of m' = min(m, L) contiguous, near-equal segments."""
    m = min(m, L)
    segment = torch.arange(L, device=device) * m // L
    member = (segment.unsqueeze(0) == torch.arange(m, device=device).unsqueeze(1)).to(dtype)
    return member / member.sum(-1, keepdim=True)


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Approximate Moore-Penrose inverse of ``(..., m, m)`` matrices (see the module docstring)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    col = a.abs().sum(-2).amax(-1, keepdim=True).unsqueeze(-1)
    row = a.abs().sum(-1).amax(-1, keepdim=True).unsqueeze(-1)
    z = a.transpose(-1, -2) / (col * row)
    for _ in range(iterations):  # a fixed handful of matrix products on (m, m)
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


@register_attention("nystrom")
class NystromAttention(Attention):
    """Nystrom-approximated softmax attention (see the module docstring).

    Args:
        n_landmarks: m (lucidrains 256; the paper's LRA runs 32-256).
        pinv_iterations: iterations of the pseudo-inverse.
        conv_kernel: taps of the depthwise residual convolution over values (odd; 0 = no residual).
            Needs ``n_heads``.
        seed: seeds the convolution's initialization.
    """

    normalized_rows = False  # the exact operator includes a non-softmax part (see docstring)

    supports_causal = False

    def __init__(
        self, *, causal: bool, n_heads: int | None = None, n_landmarks: int = 64, pinv_iterations: int = 6,
        conv_kernel: int = 33, seed: int = 0, **common,
    ) -> None:
        super().__init__(causal=causal, n_heads=n_heads, **common)
        check_int_knob(n_landmarks, "attention.n_landmarks")
        check_int_knob(pinv_iterations, "attention.pinv_iterations", minimum=0)
        if not isinstance(conv_kernel, int) or conv_kernel < 0 or (conv_kernel and conv_kernel % 2 == 0):
            raise AttentionConfigError(f"attention.conv_kernel must be 0 (off) or an odd positive integer, got {conv_kernel!r}")
        self.n_landmarks, self.pinv_iterations, self.conv_kernel = n_landmarks, pinv_iterations, conv_kernel
        self.conv = None
        if conv_kernel:
            if n_heads is None:
                raise AttentionConfigError("attention 'nystrom' with attention.conv_kernel > 0 needs n_heads (model.n_heads)")
            g = torch.Generator().manual_seed(int(seed))
            bound = conv_kernel**-0.5  # PyTorch's default Conv1d bound for one input channel per group
            w = (torch.rand(n_heads, conv_kernel, generator=g, dtype=torch.float64) * 2 - 1) * bound
            self.conv = nn.Parameter(w.to(torch.get_default_dtype()))  # (H, taps), no bias
            self.has_parameters = True

    def _factors(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fq ``(B, H, L, m)``, A+ ``(B, H, m, m)``, Bk ``(B, H, m, L)``."""
        L = q.shape[-2]
        means = segment_means_matrix(L, self.n_landmarks, q.dtype, q.device)
        qs = self.scale(q)
        q_land, k_land = means @ qs, means @ k  # (B, H, m, D)
        f_q = (qs @ k_land.transpose(-1, -2)).softmax(-1)
        a = (q_land @ k_land.transpose(-1, -2)).softmax(-1)
        b_k = (q_land @ k.transpose(-1, -2)).softmax(-1)
        return f_q, iterative_pinv(a, self.pinv_iterations), b_k

    def band(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """``(H, rows, cols)`` convolution weights: ``band[h, i, j] = w[h, j - i]`` for ``0 <= j - i < taps``."""
        device = self.conv.device
        tap = torch.arange(cols, device=device).unsqueeze(0) - torch.arange(rows, device=device).unsqueeze(1)
        inside = (tap >= 0) & (tap < self.conv_kernel)
        return self.conv.to(dtype)[:, tap.clamp(0, self.conv_kernel - 1)] * inside

    def residual(self, v: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """Depthwise 'same' convolution of values along the sequence, per head: ``(B, H, L, D)``.

        Written as one batched matmul of ``(chunk, chunk + taps - 1)`` banded matrices with overlapping
        windows of the zero-padded values (a strided view): PyTorch's CPU depthwise ``conv1d`` backward
        is over 10x slower at long L.
        """
        B, H, L, D = v.shape
        half = self.conv_kernel // 2
        chunk = min(chunk, L)
        padded_len = -(-L // chunk) * chunk
        windows = F.pad(v, (0, 0, half, half + padded_len - L)).unfold(2, chunk + 2 * half, chunk)  # (B, H, n, D, c+2h)
        out = self.band(chunk, chunk + 2 * half, v.dtype).unsqueeze(1) @ windows.transpose(-1, -2)  # (B, H, n, c, D)
        return out.reshape(B, H, padded_len, D)[:, :, :L]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        f_q, a_inv, b_k = self._factors(q, k)
        out = self.weight_dropout(f_q) @ (a_inv @ (b_k @ v))
        return out if self.conv is None else out + self.residual(v)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        f_q, a_inv, b_k = self._factors(q, k)
        p = f_q @ a_inv @ b_k
        if self.conv is not None:
            L, half = q.shape[-2], self.conv_kernel // 2
            # out_i = sum_t w_t v_{i + t - half}; padded column j + half holds tap t = j - i + half
            p = p + self.band(L, L + 2 * half, q.dtype)[:, :, half : half + L]
        return p

    def extra_repr(self) -> str:
        return (f"name={self.name}, n_landmarks={self.n_landmarks}, pinv_iterations={self.pinv_iterations}, "
                f"conv_kernel={self.conv_kernel}")
