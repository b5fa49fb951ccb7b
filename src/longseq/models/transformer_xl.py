"""Transformer-XL (Dai et al., 2019): segment recurrence + relative positional attention, with optional TRAMS.

Semantics follow kimiyoung/transformer-xl (``pytorch/mem_transformer.py``, attn_type 0):

- score(i, j) = [(q_i + u) . k_j] + [(q_i + v) . W_R R_{i-j}], times 1/sqrt(D); u, v shared by all layers
  (kimiyoung PyTorch) or one pair per layer (``untie_r``: the TF / HF released models);
  R = sinusoid table (sin half, then cos half) at distances ``klen-1 ... 0`` clamped at ``clamp_len``,
  aligned to each query by ``rel_shift``.
- q from the current segment; k, v from concat(memory, segment) of the layer input; no projection biases.
- post-LN residual blocks by default (``pre_lnorm=True``: pre-LN plus a final LayerNorm).
- memory = per-layer inputs of the previous segments (stop-gradient), last ``mem_len`` kept (FIFO);
  ``mem_init="empty"`` starts with none (Transformer-XL), ``"zeros"`` with ``mem_len`` visible zero
  states (HF / TRAMS).
- ``same_length``: every query sees the same number of keys once memory is full.
- embedding x sqrt(d_model); tied output softmax with bias, adaptive for large vocabularies; adaptive input
  embeddings with ``d_embed != d_model`` / ``div_val > 1`` and (tied) projections as in the released large
  models (``longseq.models.adaptive_softmax``).

Memories are lists of ``(B, T, d_model)`` tensors (batch first), one per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from longseq.models.adaptive_softmax import AdaptiveEmbedding, AdaptiveLogSoftmax
from longseq.models.trams import TramsSpec, gather_keys, kept_indices, key_scores, query_weights
from longseq.models.transformer import check_positive_int

MEM_INITS = ("empty", "zeros")


@dataclass(frozen=True)
class MemorySpec:
    """How a forward pass treats memory: ``mem_len`` cached states per layer (the TRAMS pool size M when
    ``trams`` is set), their initialisation, ``same_length`` / ``clamp_len`` (-1 = off), and the selection."""

    mem_len: int
    mem_init: str = "empty"
    same_length: bool = False
    clamp_len: int = -1
    trams: TramsSpec | None = None

    def __post_init__(self) -> None:
        if self.mem_init not in MEM_INITS:
            raise ValueError(f"memory.mem_init={self.mem_init!r} is not valid; choose one of {MEM_INITS}")
        if self.mem_len < 0:
            raise ValueError(f"memory.mem_len={self.mem_len} must be >= 0")
        if self.trams is not None and self.trams.topk > self.mem_len - self.trams.recent_keep:
            # Otherwise the layer never finds topk candidates and silently runs plain XL over the pool.
            raise ValueError(
                f"memory.topk={self.trams.topk} exceeds memory.pool - memory.recent_keep = {self.mem_len} - "
                f"{self.trams.recent_keep} = {self.mem_len - self.trams.recent_keep} older slots: TRAMS could "
                "never select that many; lower memory.topk or memory.recent_keep, or raise memory.pool")

    def with_(self, **changes) -> MemorySpec:
        return replace(self, **changes)


def sinusoid_embedding(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """``(K,)`` distances -> ``(K, dim)``: sin of all frequencies, then cos (not interleaved)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=distances.device, dtype=torch.float64) / dim))
    angles = distances.double()[:, None] * inv_freq[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Align per-distance scores to keys: ``(B, H, Q, K)`` where column ``c`` holds the term for distance
    ``K-1-c`` -> entry ``(i, j)`` holds the term for distance ``(K-Q+i) - j`` (entries with j > K-Q+i are
    garbage, hidden by the causal mask). Pad a zero column on the left, reinterpret as ``(K+1, Q)``, drop
    the first row."""
    B, H, Q, K = x.shape
    padded = F.pad(x, (1, 0)).view(B, H, K + 1, Q)
    return padded[:, :, 1:].reshape(B, H, Q, K)


def attention_mask(qlen: int, klen: int, mem_len: int, same_length: bool, device=None) -> torch.Tensor:
    """``(Q, K)`` bool, True = blocked: the future of the segment, and with ``same_length`` the memory
    slots beyond a constant-length window (query i loses the i+1 oldest memory slots once memory is full)."""
    ones = torch.ones(qlen, klen, dtype=torch.bool, device=device)
    blocked = ones.triu(1 + klen - qlen)
    if same_length:
        mask_len = klen - mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        blocked = blocked | ones.tril(-shift)
    return blocked


class RelMultiHeadAttention(nn.Module):
    """Relative multi-head attention of one layer, with optional TRAMS key selection."""

    def __init__(self, d_model: int, n_heads: int, d_head: int, dropout: float, dropatt: float,
                 pre_lnorm: bool) -> None:
        super().__init__()
        self.n_heads, self.d_head, self.pre_lnorm = n_heads, d_head, pre_lnorm
        self.qkv = nn.Linear(d_model, 3 * n_heads * d_head, bias=False)
        self.pos_proj = nn.Linear(d_model, n_heads * d_head, bias=False)  # W_{k,R}
        self.out = nn.Linear(n_heads * d_head, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop, self.dropatt = nn.Dropout(dropout), nn.Dropout(dropatt)
        self.scale = 1.0 / math.sqrt(d_head)

    def project(self, x: torch.Tensor, mem: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer input ``(B, Q, d)`` + memory ``(B, M, d)`` -> q ``(B, H, Q, D)``, k, v ``(B, H, M+Q, D)``."""
        B, Q, _ = x.shape
        cat = torch.cat([mem, x], dim=1)
        if self.pre_lnorm:
            cat = self.norm(cat)
        q, k, v = self.qkv(cat).view(B, cat.shape[1], 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        return q[:, :, -Q:], k, v

    def forward(self, x: torch.Tensor, mem: torch.Tensor, pos_emb: torch.Tensor, bias_u: torch.Tensor,
                bias_v: torch.Tensor, spec: MemorySpec, stats: dict | None = None) -> torch.Tensor:
        """``x`` ``(B, Q, d)``, ``mem`` ``(B, M, d)``, ``pos_emb`` ``(M+Q, d)`` for distances M+Q-1 ... 0 ->
        ``(B, Q, d)``. ``stats`` (if given) accumulates the attention mass the queries put on memory."""
        B, Q, _ = x.shape
        q, k, v = self.project(x, mem)
        klen, mlen = k.shape[2], k.shape[2] - Q
        r = self.pos_proj(pos_emb).view(klen, self.n_heads, self.d_head).permute(1, 0, 2)  # (H, K, D)
        mask = attention_mask(Q, klen, spec.mem_len, spec.same_length, x.device)
        q_v = q + bias_v[:, None]
        trams = spec.trams
        n_candidates = mlen - trams.recent_keep if trams is not None else 0
        # Before the pool fills (mem_init=empty: the first segments) there may be no more than
        # recent_keep + topk memory slots: all of them are kept, i.e. plain XL over the partial pool.
        # With a full pool this always selects (MemorySpec rejects topk > pool - recent_keep).
        if trams is not None and 0 < n_candidates and trams.topk <= n_candidates:
            w_q = query_weights(self.qkv.weight, self.n_heads, self.d_head)
            scores = key_scores(k[:, :, :n_candidates], w_q, trams.score)
            index = kept_indices(scores, trams.topk, klen)  # (B, H, L')
            kept = index.shape[-1]
            k, v = gather_keys(k, index), gather_keys(v, index)
            if trams.positions == "compressed":
                positional = rel_shift(q_v @ r[:, -kept:].transpose(-1, -2))
            else:
                full = rel_shift(q_v @ r.transpose(-1, -2))
                positional = full.gather(3, index[:, :, None, :].expand(-1, -1, Q, -1))
            mask = mask[:, -kept:]
            if stats is not None and "selected" in stats:  # tests ask for the kept indices
                stats["selected"].append(index)
        else:
            positional = rel_shift(q_v @ r.transpose(-1, -2))
        content = (q + bias_u[:, None]) @ k.transpose(-1, -2)
        logits = (content + positional) * self.scale
        if logits.dtype not in (torch.float32, torch.float64):  # softmax in fp32 under mixed precision
            logits = logits.float()
        probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
        if stats is not None:
            n_mem = probs.shape[-1] - Q
            mass = probs[..., :n_mem].sum().detach().double()
            stats["mem_mass"] = stats.get("mem_mass", 0.0) + mass
            stats["queries"] = stats.get("queries", 0) + probs[..., 0].numel()
        y = self.dropatt(probs) @ v  # (B, H, Q, D)
        y = self.drop(self.out(y.transpose(1, 2).reshape(B, Q, -1)))
        return x + y if self.pre_lnorm else self.norm(x + y)


class XLLayer(nn.Module):
    """Relative attention + position-wise FF (ReLU), post-LN (or pre-LN) residuals."""

    def __init__(self, d_model: int, n_heads: int, d_head: int, d_inner: int, dropout: float, dropatt: float,
                 pre_lnorm: bool) -> None:
        super().__init__()
        self.attn = RelMultiHeadAttention(d_model, n_heads, d_head, dropout, dropatt, pre_lnorm)
        self.ff = nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                nn.Linear(d_inner, d_model), nn.Dropout(dropout))
        self.ff_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, x, mem, pos_emb, bias_u, bias_v, spec, stats=None):
        x = self.attn(x, mem, pos_emb, bias_u, bias_v, spec, stats)
        if self.pre_lnorm:
            return x + self.ff(self.ff_norm(x))
        return self.ff_norm(x + self.ff(x))


class TransformerXL(nn.Module):
    """Transformer-XL language model.

    Args:
        vocab_size: tokens; n_layers, d_model, n_heads, d_inner: sizes; d_head: per-head width
            (None: d_model // n_heads); dropout / dropatt: residual / attention-weight dropout;
        pre_lnorm: pre-LN blocks; cutoffs: adaptive-softmax cluster boundaries ([] = plain softmax);
        tie_weight: share the input embedding (tables) with the output layer;
        d_embed: embedding width (None: d_model; otherwise projected to d_model);
        div_val: cluster ``i`` has width ``d_embed // div_val**i`` (1 = one table);
        tie_projs: per cluster (shortlist first), share the output projection with the input one
            (``div_val = 1``: the single input projection; else cluster ``i``'s); [] = none shared;
        untie_r: one u/v pair per layer instead of one shared pair;
        proj_init_std: std of the embedding / softmax projections at initialisation.

    ``forward(tokens (B, Q), mems, spec) -> (hidden (B, Q, d), new mems)``;
    ``nll(hidden, targets) -> (B, Q)``.
    """

    def __init__(self, vocab_size: int, n_layers: int, d_model: int, n_heads: int, d_inner: int,
                 d_head: int | None = None, dropout: float = 0.1, dropatt: float = 0.0,
                 pre_lnorm: bool = False, cutoffs: Sequence[int] = (), tie_weight: bool = True,
                 init_std: float = 0.02, d_embed: int | None = None, div_val: int = 1,
                 tie_projs: Sequence[bool] = (), untie_r: bool = False, proj_init_std: float = 0.01) -> None:
        super().__init__()
        for key, value in (("task.vocab_size", vocab_size), ("model.n_layers", n_layers), ("model.d_model", d_model),
                           ("model.n_heads", n_heads), ("model.d_inner", d_inner)):
            check_positive_int(key, value)
        d_head = d_head or d_model // n_heads
        self.vocab_size, self.n_layers, self.d_model = vocab_size, n_layers, d_model
        self.n_heads, self.d_head, self.pre_lnorm, self.untie_r = n_heads, d_head, pre_lnorm, untie_r
        self.token_embedding = AdaptiveEmbedding(vocab_size, d_model, d_embed, cutoffs, div_val)
        bias_shape = (n_layers, n_heads, d_head) if untie_r else (n_heads, d_head)
        self.pos_bias_u = nn.Parameter(torch.zeros(bias_shape))  # u (per layer with untie_r)
        self.pos_bias_v = nn.Parameter(torch.zeros(bias_shape))  # v
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(XLLayer(d_model, n_heads, d_head, d_inner, dropout, dropatt, pre_lnorm)
                                    for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model) if pre_lnorm else nn.Identity()
        embedding = self.token_embedding
        tie_projs = list(tie_projs) + [False] * (len(cutoffs) + 1 - len(tie_projs))
        shared = [(embedding.projections[0] if div_val == 1 else embedding.projections[i])
                  if tie and len(embedding.projections) else None for i, tie in enumerate(tie_projs)]
        self.output = AdaptiveLogSoftmax(
            vocab_size, d_model, cutoffs, embedding.weight if tie_weight and div_val == 1 else None, d_embed,
            div_val, list(embedding.tables) if tie_weight and div_val > 1 else None, shared)
        self.reset_parameters(init_std, proj_init_std)

    def reset_parameters(self, std: float, proj_std: float = 0.01) -> None:
        """N(0, std) weights, zero biases, LayerNorm (1, 0), projections N(0, proj_std) (Transformer-XL's init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        tables = [self.token_embedding.weight] if self.token_embedding.div_val == 1 else self.token_embedding.tables
        output = self.output
        own_tables = [output.weight] if output.div_val == 1 else list(output.tables)
        for p in (*tables, *own_tables, self.pos_bias_u, self.pos_bias_v, getattr(output, "cluster_weight", None)):
            if p is not None:
                nn.init.normal_(p, std=std)
        for p in (*self.token_embedding.projections, *output.projections):
            nn.init.normal_(p, std=proj_std)

    def layer_biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """u, v ``(H, D)`` of layer ``layer`` (the shared pair unless ``untie_r``)."""
        if self.untie_r:
            return self.pos_bias_u[layer], self.pos_bias_v[layer]
        return self.pos_bias_u, self.pos_bias_v

    def init_memory(self, batch: int, spec: MemorySpec, device=None, dtype=None) -> list[torch.Tensor]:
        """Empty memories ``(B, 0, d)``, or ``mem_len`` zero states per layer (``mem_init=zeros``)."""
        device = device or self.pos_bias_u.device
        dtype = dtype or self.pos_bias_u.dtype
        length = spec.mem_len if spec.mem_init == "zeros" else 0
        return [torch.zeros(batch, length, self.d_model, device=device, dtype=dtype)
                for _ in range(self.n_layers)]

    def positions(self, klen: int, clamp_len: int, device) -> torch.Tensor:
        """``(klen, d)`` sinusoid rows for distances ``klen-1 ... 0`` (clamped at ``clamp_len`` when > 0)."""
        distances = torch.arange(klen - 1, -1, -1.0, device=device)
        if clamp_len > 0:
            distances = distances.clamp(max=clamp_len)
        return sinusoid_embedding(distances, self.d_model).to(self.pos_bias_u.dtype)

    def forward(self, tokens: torch.Tensor, mems: list[torch.Tensor] | None, spec: MemorySpec,
                stats: dict | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One segment: ``tokens (B, Q)`` with per-layer memories -> hidden ``(B, Q, d)`` and the updated
        memories (last ``spec.mem_len`` layer inputs, detached)."""
        B, Q = tokens.shape
        if mems is None:
            mems = self.init_memory(B, spec, tokens.device)
        x = self.drop(self.token_embedding(tokens) * self.d_model ** 0.5)
        pos_emb = self.drop(self.positions(mems[0].shape[1] + Q, spec.clamp_len, tokens.device))
        layer_inputs = []
        for i, (layer, mem) in enumerate(zip(self.layers, mems)):
            layer_inputs.append(x)
            x = layer(x, mem, pos_emb, *self.layer_biases(i), spec, stats)
        hidden = self.drop(self.final_norm(x))
        with torch.no_grad():
            new_mems = [torch.cat([mem, h], dim=1)[:, max(0, mem.shape[1] + Q - spec.mem_len):].detach()
                        if spec.mem_len > 0 else mem[:, :0] for mem, h in zip(mems, layer_inputs)]
        return hidden, new_mems

    def nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token NLL (nats) ``(B, Q)``; negative targets (ignored) give 0."""
        B, Q, d = hidden.shape
        return self.output.nll(hidden.reshape(-1, d), targets.reshape(-1)).view(B, Q)
