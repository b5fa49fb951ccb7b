"""Synthesizer (Tay et al. 2021): attention weights synthesized without query-key dot products, O(L^2).

Modes (``mode``), all per head, logits over the configured ``seq_len`` key positions:
- ``dense``: ``B_i = W2 relu(W1 q_i + b1) + b2`` ``(seq_len,)`` from each token's own query vector
  (the per-head projection of the token; there is no key interaction);
- ``random``: one ``(seq_len, seq_len)`` logit matrix per head, input-independent; a learned parameter,
  or a fixed buffer with ``trainable=false``;
- ``factorized_random``: ``R1 R2^T`` with ``R1, R2`` ``(seq_len, rank)`` (LRA default, rank 32).
Output ``softmax(B) V``; causal masks the future. A shorter input (L < seq_len) keeps the first L rows and
columns (equivalent to padding to seq_len and masking the padded keys); a longer one is rejected. The
1/sqrt(D) scaling does not apply (there is no dot product). ``attention_matrix`` is ``softmax(B)``: rows
sum to 1. Random logits and every initialization are drawn from ``seed``; fixed random logits are a
buffer, so they survive a checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.ops.masks import NEG_INF, causal_mask
from longseq.attention.registry import register_attention

MODES = ("dense", "random", "factorized_random")


@register_attention("synthesizer")
class SynthesizerAttention(Attention):
    """Dense / random / factorized-random synthesized attention (see the module docstring).

    Args:
        mode: ``dense``, ``random`` or ``factorized_random``.
        hidden: width of the dense mode's hidden layer (default: head_dim).
        rank: rank of ``factorized_random``.
        trainable: learn the random logits (``random`` / ``factorized_random``); false = fixed buffer.
        seed: seeds every initialization.
        seq_len, n_heads, head_dim: required (the logits have one entry per position, per head).
    """

    has_parameters = True

    def __init__(
        self, *, causal: bool, seq_len: int | None = None, n_heads: int | None = None, head_dim: int | None = None,
        mode: str = "dense", hidden: int | None = None, rank: int = 32, trainable: bool = True, seed: int = 0,
        **common,
    ) -> None:
        super().__init__(causal=causal, seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, **common)
        if mode not in MODES:
            raise AttentionConfigError(f"attention.mode must be one of {MODES}, got {mode!r}")
        for key, value in (("seq_len", seq_len), ("n_heads", n_heads), ("head_dim", head_dim)):
            if value is None:
                raise AttentionConfigError(
                    f"attention 'synthesizer' needs {key} (given by the model from task.seq_len / model.n_heads / "
                    "model.d_model): its logits have one entry per position, per head"
                )
        check_int_knob(rank, "attention.rank")
        self.mode, self.rank, self.trainable = mode, rank, bool(trainable)
        self.hidden = hidden or head_dim
        g = torch.Generator().manual_seed(int(seed))
        dtype = torch.get_default_dtype()

        def uniform(*shape: int, fan_in: int) -> nn.Parameter:
            bound = fan_in**-0.5  # nn.Linear's default init range
            return nn.Parameter(((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * bound).to(dtype))

        if mode == "dense":
            self.w1 = uniform(n_heads, head_dim, self.hidden, fan_in=head_dim)
            self.b1 = uniform(n_heads, 1, self.hidden, fan_in=head_dim)
            self.w2 = uniform(n_heads, self.hidden, seq_len, fan_in=self.hidden)
            self.b2 = uniform(n_heads, 1, seq_len, fan_in=self.hidden)
            return
        shapes = [(n_heads, seq_len, seq_len)] if mode == "random" else [(n_heads, seq_len, rank)] * 2
        # unit-variance logits for ``random``; each factor scaled so the product has unit variance too
        scale = 1.0 if mode == "random" else rank**-0.25
        for name, shape in zip(("r1", "r2"), shapes):
            value = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
            if self.trainable:
                setattr(self, name, nn.Parameter(value))
            else:
                self.register_buffer(name, value)
        if not self.trainable:
            self.has_parameters = False

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        """Synthesized logits ``(B or 1, H, L, L)`` for an input of length L (future masked when causal)."""
        L = q.shape[-2]
        if L > self.seq_len:
            raise AttentionConfigError(
                f"attention 'synthesizer' was built for seq_len={self.seq_len} (task.seq_len) but got length {L}"
            )
        if self.mode == "dense":
            hidden = F.relu(q @ self.w1.to(q.dtype) + self.b1.to(q.dtype))  # (B, H, L, hidden)
            logits = (hidden @ self.w2[..., :L].to(q.dtype) + self.b2[..., :L].to(q.dtype))
        elif self.mode == "random":
            logits = self.r1[:, :L, :L].to(q.dtype).unsqueeze(0)
        else:
            logits = (self.r1[:, :L].to(q.dtype) @ self.r2[:, :L].to(q.dtype).transpose(-1, -2)).unsqueeze(0)
        if self.causal:
            future = ~causal_mask(L, q.device)
            logits = logits.masked_fill(future, NEG_INF)
        return logits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.weight_dropout(self.logits(q).softmax(-1)) @ v

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.logits(q).softmax(-1).expand(q.shape[0], -1, -1, -1)

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}, mode={self.mode}, seq_len={self.seq_len}"
