"""The pre-norm transformer backbone shared by every task; only the attention changes between runs."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from longseq.attention import build_attention

POS_EMBEDDINGS = ("learned", "sinusoidal", "image", "none")


class MultiHeadAttention(nn.Module):
    """Projects ``(B, L, d_model)`` to per-head q, k, v ``(B, H, L, D)``, applies a registered attention."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, attention: Mapping[str, Any], attn_dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        spec = dict(attention)
        name = spec.pop("name")
        self.attention = build_attention(
            name, seq_len=seq_len, n_heads=n_heads, head_dim=self.head_dim, dropout=attn_dropout, **spec
        )

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``key_padding_mask`` (B, L) bool, True = padded key; only passed on when given, so variants
        without padding support keep their plain ``(q, k, v)`` signature."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if key_padding_mask is None:
            y = self.attention(q, k, v)  # (B, H, L, D)
        else:
            y = self.attention(q, k, v, key_padding_mask=key_padding_mask)
        return self.out(y.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    """Pre-norm residual block: ``x + drop(attn(LN(x)))`` then ``x + MLP(LN(x))``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: float, dropout: float, attn_dropout: float,
                 seq_len: int, attention: Mapping[str, Any]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, seq_len, attention, attn_dropout)
        self.norm2 = nn.LayerNorm(d_model)
        hidden = int(mlp_ratio * d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """(length, dim) fixed sine/cosine position table (Vaswani et al.)."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return table


class ImagePositionEmbedding(nn.Module):
    """Factorized learned embeddings: row + column + channel, for raster channel-interleaved images."""

    def __init__(self, image_shape: tuple[int, int, int], dim: int) -> None:
        super().__init__()
        self.image_shape = tuple(image_shape)
        h, w, c = self.image_shape
        self.row = nn.Embedding(h, dim)
        self.col = nn.Embedding(w, dim)
        self.channel = nn.Embedding(c, dim)
        for emb in (self.row, self.col, self.channel):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, length: int) -> torch.Tensor:
        h, w, c = self.image_shape
        pos = torch.arange(length, device=self.row.weight.device)
        return self.row(pos // (w * c)) + self.col((pos // c) % w) + self.channel(pos % c)


class Transformer(nn.Module):
    """Token embedding + positions -> N pre-norm blocks -> final LayerNorm -> linear head.

    Args:
        vocab_size: input token vocabulary (e.g. 256 sub-pixel levels).
        seq_len: maximum sequence length L.
        n_layers, d_model, n_heads, mlp_ratio: sizes (``model.*``).
        dropout: residual/MLP/embedding dropout; ``attn_dropout`` goes to the attention weights.
        attention: ``{"name": <registry name>, **knobs}`` from ``conf/attention``.
        pos_emb: ``learned`` (1D), ``sinusoidal`` (1D fixed), ``image`` (row/column/channel) or ``none``.
        image_shape: ``(H, W, C)``, required for ``pos_emb=image``.
        out_dim: head width (defaults to ``vocab_size``: next-token logits).

    ``forward(tokens (B, L) long) -> (B, L, out_dim)``; ``features`` returns the final-norm states.
    """

    def __init__(self, vocab_size: int, seq_len: int, n_layers: int, d_model: int, n_heads: int,
                 attention: Mapping[str, Any], mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attn_dropout: float = 0.0, pos_emb: str = "learned",
                 image_shape: tuple[int, int, int] | None = None, out_dim: int | None = None) -> None:
        super().__init__()
        if pos_emb not in POS_EMBEDDINGS:
            raise ValueError(f"model.pos_emb={pos_emb!r} is not valid; choose one of {POS_EMBEDDINGS}")
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.token.weight, std=0.02)
        self.pos_emb = pos_emb
        if pos_emb == "learned":
            self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        elif pos_emb == "sinusoidal":
            self.register_buffer("pos", sinusoidal_table(seq_len, d_model), persistent=False)
        elif pos_emb == "image":
            if image_shape is None or math.prod(image_shape) != seq_len:
                raise ValueError(f"model.pos_emb=image needs task.image_shape with H*W*C == seq_len ({seq_len}); got {image_shape}")
            self.pos = ImagePositionEmbedding(tuple(image_shape), d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_ratio, dropout, attn_dropout, seq_len, attention) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_dim or vocab_size)

    def positions(self, length: int) -> torch.Tensor | float:
        if self.pos_emb == "image":
            return self.pos(length)
        if self.pos_emb == "none":
            return 0.0
        return self.pos[:length]

    def features(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) tokens -> (B, L, d_model) final-norm hidden states.

        ``key_padding_mask`` (B, L) bool, True = padding: no position attends to padded keys (the
        attention must have ``supports_padding_mask``); padded positions still get (unused) states.
        """
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"input length {tokens.shape[1]} exceeds task.seq_len={self.seq_len}")
        x = self.drop(self.token(tokens) + self.positions(tokens.shape[1]))
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.features(tokens, key_padding_mask))
