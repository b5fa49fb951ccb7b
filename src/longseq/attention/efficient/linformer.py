"""Linformer (Wang et al. 2020): learned length projections of keys and values, O(L k).

``out = softmax(Q (E K)^T / sqrt(D)) (F V)`` with learned ``E, F`` ``(k, seq_len)`` (shared by all
heads; ``share_kv=true`` uses one matrix for both). The projections are tied to the configured
``seq_len``; a shorter input uses the first L columns, which equals zero-padding the keys and values
to ``seq_len``. Bidirectional only: ``E`` mixes every position, the future included.

``attention_matrix`` returns the exact linear operator ``P = softmax(Q (E K)^T / sqrt(D)) F``
``(L, L)`` with ``forward == P @ v``; its rows do NOT sum to 1 (F is not a stochastic matrix).
Dropout acts on the ``(L, k)`` weights.
"""

from __future__ import annotations

import torch
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.registry import register_attention


@register_attention("linformer")
class LinformerAttention(Attention):
    """Low-rank attention through learned sequence projections (see the module docstring).

    Args:
        proj_len: k, the projected length (lucidrains / Nystromformer LRA 256).
        share_kv: one projection for keys and values (E = F).
        seed: seeds the uniform(-1/sqrt(k), 1/sqrt(k)) initialization of E and F.
        seq_len: required, the length the projections are built for (longest accepted input).
    """

    normalized_rows = False  # the exact operator includes a non-softmax part (see docstring)

    supports_causal = False
    has_parameters = True

    def __init__(
        self, *, causal: bool, seq_len: int | None = None, proj_len: int = 256, share_kv: bool = False,
        seed: int = 0, **common,
    ) -> None:
        super().__init__(causal=causal, seq_len=seq_len, **common)
        if seq_len is None:
            raise AttentionConfigError("attention 'linformer' needs seq_len (task.seq_len): its projections have one column per position")
        check_int_knob(proj_len, "attention.proj_len")
        self.proj_len, self.share_kv = proj_len, bool(share_kv)
        g = torch.Generator().manual_seed(int(seed))
        bound = proj_len**-0.5

        def init() -> nn.Parameter:
            w = (torch.rand(proj_len, seq_len, generator=g, dtype=torch.float64) * 2 - 1) * bound
            return nn.Parameter(w.to(torch.get_default_dtype()))

        self.key_proj = init()
        self.value_proj = None if self.share_kv else init()

    def projections(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """E, F restricted to the first L positions: ``(k, L)`` each."""
        if L > self.seq_len:
            raise AttentionConfigError(
                f"attention 'linformer' was built for seq_len={self.seq_len} (task.seq_len) but got length {L}"
            )
        e = self.key_proj[:, :L]
        f = e if self.value_proj is None else self.value_proj[:, :L]
        return e, f

    def _weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        e, _ = self.projections(q.shape[-2])
        k_proj = e.to(k.dtype) @ k  # (B, H, k, D)
        return (self.scale(q) @ k_proj.transpose(-1, -2)).softmax(-1)  # (B, H, L, k)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, f = self.projections(q.shape[-2])
        return self.weight_dropout(self._weights(q, k)) @ (f.to(v.dtype) @ v)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, f = self.projections(q.shape[-2])
        return self._weights(q, k) @ f.to(q.dtype)

    def extra_repr(self) -> str:
        return f"name={self.name}, seq_len={self.seq_len}, proj_len={self.proj_len}, share_kv={self.share_kv}"
