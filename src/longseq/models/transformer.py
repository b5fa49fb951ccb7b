"""The pre-norm transformer backbone shared by every task; only the attention changes between runs."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from longseq.attention import build_attention
from longseq.attention.ops import dispatch
from longseq.models.layer_plan import layer_errors, layer_specs
from longseq.utils.errors import ConfigError

POS_EMBEDDINGS = ("learned", "sinusoidal", "image", "rotary", "none")
RESIDUAL_GAINS = ("none", "zero")  # model.residual_gain: zero = ReZero (Bachlechner et al. 2021)


def check_positive_int(key: str, value: Any) -> int:
    """``value`` when it is an integer >= 1, else a ``ConfigError`` naming ``key`` (a model size, a length)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
    return value


def check_fraction(key: str, value: Any) -> float:
    """``value`` when it is a probability in [0, 1) (a dropout rate), else a ``ConfigError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(key, f"must be a number in [0, 1), got {value!r}")
    return float(value)


def check_backbone_sizes(vocab_size: Any, seq_len: Any, n_layers: Any, d_model: Any, n_heads: Any, mlp_ratio: Any,
                         dropout: Any, attn_dropout: Any) -> None:
    """Reject backbone sizes that cannot build a working model, naming the config key (``model.n_layers=0``
    would otherwise train an embedding-only model without a word)."""
    for key, value in (("task.vocab_size", vocab_size), ("task.seq_len", seq_len), ("model.n_layers", n_layers),
                       ("model.d_model", d_model), ("model.n_heads", n_heads)):
        check_positive_int(key, value)
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not 0 < mlp_ratio < math.inf \
            or int(mlp_ratio * d_model) < 1:
        raise ConfigError("model.mlp_ratio", f"must be a number > 0 with mlp_ratio x model.d_model >= 1, got {mlp_ratio!r}")
    check_fraction("model.dropout", dropout)
    check_fraction("model.attn_dropout", attn_dropout)
    if d_model % n_heads:
        raise ConfigError("model.n_heads", f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}")


class Rotary(nn.Module):
    """Rotary position embeddings (RoFormer, Su et al. 2021; ``model.pos_emb=rotary``): each head's q and k are
    rotated pairwise (channels d and d + D/2) by angles ``position * 10000^(-2d/D)``, so ``q_i . k_j`` depends on
    the offset i - j. Applied in every layer to the per-head q and k before any attention sees them (before
    Combiner's pooling, k-means routing or block scoring), so it composes with every registered attention.
    ``forward(x (B, H, T, D), start)`` rotates positions ``start .. start + T - 1``."""

    def __init__(self, head_dim: int, seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ConfigError("model.pos_emb", f"rotary needs an even head width model.d_model / model.n_heads, "
                                               f"got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(seq_len, dtype=torch.float64).unsqueeze(1) * inv_freq  # (L, D / 2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        T = x.shape[-2]
        cos, sin = (t[start : start + T].to(x.dtype) for t in (self.cos, self.sin))
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MultiHeadAttention(nn.Module):
    """Projects ``(B, L, d_model)`` to per-head q, k, v ``(B, H, L, D)``, applies a registered attention; with
    ``rotary``, q and k are rotated (``Rotary``) before the attention."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, attention: Mapping[str, Any], attn_dropout: float,
                 rotary: bool = False) -> None:
        super().__init__()
        if d_model % n_heads:  # checked with every size by check_backbone_sizes; kept for direct use of the layer
            raise ConfigError("model.n_heads", f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        spec = dict(attention)
        name = spec.pop("name")
        self.attention = build_attention(
            name, seq_len=seq_len, n_heads=n_heads, head_dim=self.head_dim, dropout=attn_dropout, **spec
        )
        self.rotary = Rotary(self.head_dim, seq_len) if rotary else None

    def heads(self, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, d_model) at positions ``start ..`` -> per-head q, k, v, each (B, H, T, D), unscaled."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        return q, k, v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) attention outputs -> (B, T, d_model) through the output projection."""
        B, _, T, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``key_padding_mask`` (B, L) bool, True = padded key; only passed on when given, so variants
        without padding support keep their plain ``(q, k, v)`` signature."""
        q, k, v = self.heads(x)
        if key_padding_mask is None:
            y = self.attention(q, k, v)  # (B, H, L, D)
        else:
            y = self.attention(q, k, v, key_padding_mask=key_padding_mask)
        return self.merge(y)

    def decode(self, x: torch.Tensor, state: Any, step: bool) -> torch.Tensor:
        """(B, T, d_model) for the next T positions -> (B, T, d_model), through the attention's decoding
        ``state``: ``attention.step`` for one new position (``step``), else ``attention.prefill``."""
        q, k, v = self.heads(x, state.length)  # the attention state counts the positions consumed so far
        return self.merge((self.attention.step if step else self.attention.prefill)(state, q, k, v))


class ShortConv(nn.Module):
    """Short causal depthwise convolution over time (``model.short_conv`` = kernel size ``k``).

    Zoology / MAD put one before each sequence mixer so that a shallow model can form induction heads: after it
    a position holds its own token and the ``k - 1`` before it, so one attention layer can match "the key
    before this value". Output ``t`` mixes inputs ``t - k + 1 .. t`` only (left zero padding): no future leaks.
    ``forward((B, T, d)) -> (B, T, d)``; ``decode`` continues a sequence from a rolling cache of the last
    ``k - 1`` inputs (``new_cache``), equal to ``forward`` at those positions.
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model, padding=kernel_size - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    def new_cache(self, batch_size: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
        """(B, k - 1, d) zeros: the padding ``forward`` puts before position 0."""
        return torch.zeros(batch_size, self.kernel_size - 1, self.conv.in_channels, device=device, dtype=dtype)

    def decode(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """(B, T, d) next inputs -> (B, T, d) outputs; ``cache`` (B, k - 1, d) is advanced in place."""
        window = torch.cat([cache, x], dim=1)  # (B, k - 1 + T, d)
        y = nn.functional.conv1d(window.transpose(1, 2), self.conv.weight, self.conv.bias, groups=self.conv.groups)
        if self.kernel_size > 1:
            cache.copy_(window[:, -(self.kernel_size - 1):])
        return y.transpose(1, 2)


def check_short_conv(value: Any) -> int | None:
    """``model.short_conv``: null / 0 (off) or a kernel size >= 1; else a ``ConfigError`` naming the key."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("model.short_conv", f"must be null / 0 (off) or a kernel size >= 1, got {value!r}")
    return value


class Block(nn.Module):
    """Pre-norm residual block: ``x + drop(attn(conv(LN(x))))`` then ``x + MLP(LN(x))``; ``conv`` is the
    optional ``ShortConv`` (``model.short_conv``), applied to the normed input of the attention sublayer, so
    q, k and v all see the same short causal mix.

    ``residual_gain="zero"`` (ReZero, ``model.residual_gain``): each branch is scaled by its own learned scalar
    (``gain``, (2,): attention, MLP), starting at 0, so the block starts as the identity on the residual stream and
    each layer's contribution grows only as far as training takes it. For mixed stacks: in a two-layer hybrid the
    trained Combiner layer 0 wrote outputs six times the embedding's norm, which drowned the token identity the full
    layer 1 needed (issue 44)."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: float, dropout: float, attn_dropout: float,
                 seq_len: int, attention: Mapping[str, Any], short_conv: int | None = None,
                 rotary: bool = False, residual_gain: str = "none") -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(2)) if residual_gain == "zero" else None
        self.norm1 = nn.LayerNorm(d_model)
        self.short_conv = ShortConv(d_model, short_conv) if short_conv else None
        self.attn = MultiHeadAttention(d_model, n_heads, seq_len, attention, attn_dropout, rotary)
        self.norm2 = nn.LayerNorm(d_model)
        hidden = int(mlp_ratio * d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        if self.short_conv is not None:
            h = self.short_conv(h)
        x = x + self.scaled(self.drop(self.attn(h, key_padding_mask)), 0)
        return x + self.scaled(self.drop(self.mlp(self.norm2(x))), 1)

    def scaled(self, branch: torch.Tensor, which: int) -> torch.Tensor:
        """A residual branch times its ``gain`` (0: attention, 1: MLP), or as it is without one."""
        return branch if self.gain is None else self.gain[which] * branch

    def decode(self, x: torch.Tensor, state: Any, step: bool, conv_cache: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` for the next positions of ``x`` (B, T, d_model) through the layer's attention ``state``
        and, with ``short_conv``, its rolling ``conv_cache`` (called in eval mode: dropout is off)."""
        h = self.norm1(x)
        if self.short_conv is not None:
            h = self.short_conv.decode(h, conv_cache)
        x = x + self.scaled(self.attn.decode(h, state, step), 0)
        return x + self.scaled(self.mlp(self.norm2(x)), 1)


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

    def forward(self, length: int, start: int = 0) -> torch.Tensor:
        """(length, dim) embeddings of positions ``start .. start + length - 1``."""
        h, w, c = self.image_shape
        pos = torch.arange(start, start + length, device=self.row.weight.device)
        return self.row(pos // (w * c)) + self.col((pos // c) % w) + self.channel(pos % c)


@dataclass
class DecodingState:
    """Incremental-decoding state of a ``Transformer``: one attention state per layer (``layers``), the
    number of positions consumed so far (``length``, also the next position's index) and the most it may
    consume (``max_len``). Made by ``Transformer.new_decoding_state``; tensors only, no parameters."""

    layers: list[Any]
    max_len: int
    length: int = 0
    conv: list[torch.Tensor | None] | None = None  # per layer: the short conv's last k - 1 inputs (model.short_conv)


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Run the body with ``module`` in eval mode (no dropout), restoring its mode afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


class Transformer(nn.Module):
    """Token embedding + positions -> N pre-norm blocks -> final LayerNorm -> linear head.

    Args:
        vocab_size: input token vocabulary (e.g. 256 sub-pixel levels).
        seq_len: maximum sequence length L.
        n_layers, d_model, n_heads, mlp_ratio: sizes (``model.*``).
        dropout: residual/MLP/embedding dropout; ``attn_dropout`` goes to the attention weights.
        attention: ``{"name": <registry name>, **knobs}`` from ``conf/attention``.
        layer_attention: a hybrid layer plan (``model.layer_attention``, ``longseq.models.layer_plan``): a list with
            one entry per layer (``["combiner_fixed", "full"]``) or a pattern (``{"every": 2, "attention": "full"}``);
            None: ``attention`` in every layer.
        attention_presets: name -> preset spec for the plan's other names (``model.attention_presets``: the
            ``conf/attention`` presets resolved against the task; a name without one gets the variant's defaults).
        pos_emb: ``learned`` (1D), ``sinusoidal`` (1D fixed), ``image`` (row/column/channel), ``rotary`` (q and k
            rotated in every layer, ``Rotary``; nothing added to the embeddings) or ``none``.
        image_shape: ``(H, W, C)``, required for ``pos_emb=image``.
        out_dim: head width (defaults to ``vocab_size``: next-token logits).
        short_conv: kernel size of a short causal depthwise convolution before each attention (``ShortConv``;
            null / 0: off).
        residual_gain: ``none`` or ``zero`` (ReZero: every block's branches scaled by learned gains starting at 0,
            ``Block``; at initialization the backbone's output is the head of the normed embeddings).

    ``forward(tokens (B, L) long) -> (B, L, out_dim)``; ``features`` returns the final-norm states.

    Incremental decoding (sampling, generation; causal attentions with ``supports_decoding``):
    ``state = new_decoding_state(B, max_len)``, then ``prefill(tokens (B, T), state) -> (B, T, out_dim)`` for
    the first T positions and ``step(tokens (B,), state) -> (B, out_dim)`` per further position, equal to
    ``forward``'s logits at those positions (in eval mode: dropout is off while decoding).
    """

    def __init__(self, vocab_size: int, seq_len: int, n_layers: int, d_model: int, n_heads: int,
                 attention: Mapping[str, Any], mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attn_dropout: float = 0.0, pos_emb: str = "learned",
                 image_shape: tuple[int, int, int] | None = None, out_dim: int | None = None,
                 short_conv: int | None = None, layer_attention: Any = None,
                 attention_presets: Mapping[str, Mapping[str, Any]] | None = None, residual_gain: str = "none") -> None:
        super().__init__()
        check_backbone_sizes(vocab_size, seq_len, n_layers, d_model, n_heads, mlp_ratio, dropout, attn_dropout)
        short_conv = check_short_conv(short_conv)
        if residual_gain not in RESIDUAL_GAINS:
            raise ConfigError("model.residual_gain", f"{residual_gain!r} is not valid; choose one of {RESIDUAL_GAINS}")
        if pos_emb not in POS_EMBEDDINGS:
            raise ConfigError("model.pos_emb", f"{pos_emb!r} is not valid; choose one of {POS_EMBEDDINGS}")
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
                raise ConfigError("model.pos_emb", f"image needs task.image_shape with H*W*C == seq_len ({seq_len}); "
                                                   f"got {image_shape}")
            self.pos = ImagePositionEmbedding(tuple(image_shape), d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList()
        for layer, spec in enumerate(layer_specs(attention, layer_attention, n_layers, attention_presets)):
            with layer_errors(layer, spec, planned=spec != dict(attention)):
                self.blocks.append(Block(d_model, n_heads, mlp_ratio, dropout, attn_dropout, seq_len, spec, short_conv,
                                         rotary=pos_emb == "rotary", residual_gain=residual_gain))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_dim or vocab_size)

    @property
    def layer_names(self) -> list[str]:
        """The registry name of each layer's attention, bottom first."""
        return [block.attn.attention.name for block in self.blocks]

    def prepare_flex_layouts(self, device: torch.device | str, padded: bool = False) -> int:
        """Before ``torch.compile`` traces this backbone (``model.compile=true``): every layer's static flex layout at
        ``seq_len`` on ``device`` (``ops.dispatch.prepare_flex``; ``padded``: the batches carry key padding), so the
        first trace is one graph and the second step does not recompile. Returns how many layouts it looked up."""
        device = torch.device(device)
        return sum(dispatch.prepare_flex(block.attn.attention, self.seq_len, device, padded) for block in self.blocks)

    def positions(self, length: int, start: int = 0) -> torch.Tensor | float:
        """(length, d_model) position embeddings of positions ``start .. start + length - 1`` (or 0.0)."""
        if self.pos_emb == "image":
            return self.pos(length, start)
        if self.pos_emb in ("none", "rotary"):  # rotary positions live in the attention layers
            return 0.0
        return self.pos[start : start + length]

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

    # -- incremental decoding -------------------------------------------------------------------------
    def new_decoding_state(self, batch_size: int, max_len: int | None = None) -> DecodingState:
        """A decoding state for ``batch_size`` sequences of up to ``max_len`` positions (default ``seq_len``).

        Raises ``longseq.attention.DecodingNotSupported`` (from the attention) when the attention has no
        decoding state; callers then recompute the sequence instead (see ``longseq.tasks.sampling``).
        """
        max_len = self.seq_len if max_len is None else int(max_len)
        if not 1 <= max_len <= self.seq_len:
            raise ValueError(f"decoding length {max_len} must be in [1, task.seq_len={self.seq_len}]")
        weight = self.token.weight
        layers = [block.attn.attention.new_state(batch_size, max_len, device=weight.device, dtype=weight.dtype)
                  for block in self.blocks]
        conv = [block.short_conv.new_cache(batch_size, weight.device, weight.dtype) if block.short_conv else None
                for block in self.blocks]
        return DecodingState(layers, max_len, conv=conv)

    def prefill(self, tokens: torch.Tensor, state: DecodingState) -> torch.Tensor:
        """(B, T) tokens at the next T positions -> (B, T, out_dim) logits (``forward``'s at those positions)."""
        return self._decode(tokens, state, step=False)

    def step(self, tokens: torch.Tensor, state: DecodingState) -> torch.Tensor:
        """(B,) tokens at the next position -> (B, out_dim) logits; advances ``state`` by one position."""
        return self._decode(tokens[:, None], state, step=True)[:, 0]

    def _decode(self, tokens: torch.Tensor, state: DecodingState, step: bool) -> torch.Tensor:
        start, count = state.length, tokens.shape[1]
        if start + count > state.max_len:
            raise ValueError(f"decoding past the state's max_len={state.max_len} (at position {start}, "
                             f"{count} more token(s)); make a new state")
        with eval_mode(self) if self.training else contextlib.nullcontext():
            x = self.token(tokens) + self.positions(count, start)
            conv = state.conv or [None] * len(self.blocks)
            for block, layer_state, conv_cache in zip(self.blocks, state.layers, conv):
                x = block.decode(x, layer_state, step, conv_cache)
            state.length = start + count
            return self.head(self.norm(x))
