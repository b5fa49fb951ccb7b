"""The attention contract shared by every registered variant.

A variant is an ``nn.Module`` whose ``forward(q, k, v)`` maps unscaled per-head tensors
``(B, H, L, D)`` to ``(B, H, L, D)`` and whose ``attention_matrix(q, k, v)`` returns the effective,
normalized weights ``(B, H, L, L)`` it applied (for tests and figures, small L only). The 1/sqrt(D)
scaling happens once, inside the module.

Capabilities are class attributes, checked at construction so that an impossible choice fails before
any training starts, with a message naming the offending key.

Padding: variable-length inputs (LRA ListOps / Text / Retrieval) are padded to the fixed length the
geometry was built for and pass ``key_padding_mask`` ``(B, L)`` bool, **True = padded key** (PyTorch's
``nn.MultiheadAttention`` convention). A padded key gets zero weight from every query. Only variants with
``supports_padding_mask = True`` accept the keyword; a padded task rejects the others when it is built
(``check_padding_support``). A query whose every allowed key is padded (an empty document) has no valid
key; variants give such a row uniform weight over its allowed keys instead of NaN (its output is never
pooled, since pooling skips padded positions).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class AttentionConfigError(ValueError):
    """An attention was asked for something it cannot do; the message names the key and valid values."""


class Attention(nn.Module):
    """Base class: stores the common arguments and validates capabilities.

    Subclasses set the capability flags and implement ``forward`` and ``attention_matrix``.

    Args:
        causal: forbid attending to later positions (autoregressive tasks).
        seq_len: the sequence length the layer will see, when known at construction; used to
            validate geometry early (``requires_len_multiple_of``) and by length-dependent variants.
        n_heads: number of heads H (variants with per-head parameters need it).
        head_dim: per-head width D (variants with learned maps need it).
        dropout: dropout on attention weights during training.
    """

    name: str = "?"  # set by the registry
    supports_causal: bool = True
    supports_bidirectional: bool = True
    supports_padding_mask: bool = False  # forward/attention_matrix accept key_padding_mask=(B, L), True = pad
    has_parameters: bool = False
    # What ``attention_matrix`` promises (tests read these): rows sum to 1 (a softmax-style method),
    # and ``forward(q, k, v) == attention_matrix(q, k, v) @ v`` exactly (the output is linear in v
    # through one (L, L) matrix).
    normalized_rows: bool = True
    matrix_is_exact: bool = True

    def __init__(
        self,
        *,
        causal: bool,
        seq_len: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if causal and not self.supports_causal:
            raise AttentionConfigError(
                f"attention '{self.name}' cannot be causal (attention.causal=true); it supports "
                "bidirectional tasks only (MLM, LRA). Pick a causal variant for LM/image tasks."
            )
        if not causal and not self.supports_bidirectional:
            raise AttentionConfigError(
                f"attention '{self.name}' supports causal use only (attention.causal=false given)."
            )
        if not 0.0 <= dropout < 1.0:
            raise AttentionConfigError(f"attention.dropout must be in [0, 1), got {dropout}")
        self.causal = bool(causal)
        self.seq_len = seq_len
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.dropout = float(dropout)
        multiple = self.requires_len_multiple_of()
        if seq_len is not None and multiple > 1 and seq_len % multiple:
            raise AttentionConfigError(
                f"attention '{self.name}': sequence length {seq_len} is not a multiple of "
                f"{multiple} ({self.geometry_key()}); choose a value that divides {seq_len}, "
                f"e.g. one of {divisors(seq_len)}"
            )

    # -- capabilities -------------------------------------------------------------------------
    def requires_len_multiple_of(self) -> int:
        """The sequence length must be a multiple of this (1 = any length)."""
        return 1

    def geometry_key(self) -> str:
        """The config key that sets ``requires_len_multiple_of`` (for error messages)."""
        return "attention.block_size"

    def check_length(self, length: int) -> None:
        """Raise a clear error when a runtime length does not fit the geometry."""
        multiple = self.requires_len_multiple_of()
        if multiple > 1 and length % multiple:
            raise AttentionConfigError(
                f"attention '{self.name}': length {length} is not a multiple of {multiple} "
                f"({self.geometry_key()}); valid block sizes for L={length}: {divisors(length)}"
            )

    def check_padding_support(self, task: str = "this task") -> None:
        """Raise when a padded task (variable-length inputs) uses a variant without key-padding support."""
        if not self.supports_padding_mask:
            raise AttentionConfigError(
                f"attention '{self.name}' does not support key_padding_mask (supports_padding_mask=False), "
                f"which {task} needs for its padded variable-length inputs; pick an attention that does "
                "(e.g. attention=full) or a task without padding"
            )

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def scale(q: torch.Tensor) -> torch.Tensor:
        """Apply the single 1/sqrt(D) scaling to queries ``(..., D)``."""
        return q * (1.0 / math.sqrt(q.shape[-1]))

    def weight_dropout(self, weights: torch.Tensor) -> torch.Tensor:
        """Dropout on attention weights, active only in training."""
        if self.training and self.dropout > 0:
            return nn.functional.dropout(weights, p=self.dropout)
        return weights

    # -- the contract ---------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: D401
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D).

        Variants with ``supports_padding_mask`` also take ``key_padding_mask=None`` ((B, L) bool, True = pad).
        """
        raise NotImplementedError

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, L, L) effective normalized weights such that ``forward == P @ v`` (no dropout).

        Variants with ``supports_padding_mask`` also take ``key_padding_mask=None`` (zero columns at pads).
        """
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}"


PADDING_PENALTY = 1.0e4  # logit offset of padded keys: exp(-1e4) is exactly 0 in fp32, and 1e4 fits fp16


def append_padding_channel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key padding for any variant whose weights are ``softmax(q k^T / sqrt(D))`` over a fixed pattern.

    Appends one channel so that the variant's own scaled logits become ``q.k / sqrt(D) - PADDING_PENALTY * pad_j``:
    q' = [q * sqrt((D+1)/D), sqrt(D+1)], k' = [k, -PADDING_PENALTY * pad], v' = [v, 0]. After the variant's
    1/sqrt(D+1) scaling the first D channels give exactly ``q.k / sqrt(D)``. Padded keys then get zero weight
    in every row that has a real key; a row whose allowed keys are all padded keeps its unpadded weights (all
    logits shift equally). Drop the last output channel: ``variant(q', k', v')[..., :-1]``.
    q, k, v (B, H, L, D), key_padding_mask (B, L) bool (True = pad) -> (B, H, L, D + 1) each.
    """
    D = q.shape[-1]
    pad = key_padding_mask.to(k.dtype)[:, None, :, None].expand(*k.shape[:-1], 1)
    q_extra = torch.full_like(q[..., :1], math.sqrt(D + 1))
    q2 = torch.cat([q * math.sqrt((D + 1) / D), q_extra], dim=-1)
    k2 = torch.cat([k, -PADDING_PENALTY * pad], dim=-1)
    v2 = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
    return q2, k2, v2


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` (used in error messages listing valid block sizes)."""
    return [d for d in range(1, n + 1) if n % d == 0]
