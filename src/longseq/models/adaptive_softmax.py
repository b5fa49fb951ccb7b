"""Adaptive input embedding and tied (adaptive) output softmax of Transformer-XL.

``cutoffs=[]`` is a plain softmax over the vocabulary (tied to the input embedding, with a bias), what the
enwik8 models use. With cutoffs ``[c_0, c_1, ...]`` (WikiText-103: 20k / 40k / 200k) the head scores the
``c_0`` most frequent tokens plus one logit per tail cluster, and tail cluster ``i`` holds tokens
``[c_i, c_{i+1})``: ``log p(t) = log p_head(cluster of t) + log p_tail(t)``. Cluster logits are read in
forward order (cluster ``i`` = head column ``c_0 + i``), the TF / HF convention (kimiyoung's PyTorch code
reads them reversed; ``longseq.models.xl_import`` flips its rows on import).

Widths (the released large models):

- ``div_val = 1``: one ``(vocab, d_embed)`` table. When ``d_embed != d_model`` a projection ``(d_model,
  d_embed)`` maps embeddings up and (per cluster, possibly shared with the input one: ``tie_projs``) maps
  hidden states down before the output table.
- ``div_val > 1`` (WT103 large: 4): cluster ``i`` (0 = the shortlist) has its own table of width
  ``d_embed // div_val**i`` and its own projection ``(d_model, width)``, in the embedding and the softmax.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax in fp32 under mixed precision; fp64 stays fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cluster_bounds(vocab_size: int, cutoffs: Sequence[int]) -> list[int]:
    """``[0, c_0, ..., vocab_size]`` after checking the cutoffs (the one rule for both modules)."""
    cutoffs = [int(c) for c in cutoffs]
    if any(b <= a for a, b in zip([0] + cutoffs, cutoffs + [vocab_size])):
        raise ValueError(f"model.cutoffs={cutoffs} must be strictly increasing and inside (0, vocab_size="
                         f"{vocab_size}); use [] for a plain softmax")
    return [0] + cutoffs + [vocab_size]


def cluster_widths(d_embed: int, n_parts: int, div_val: int) -> list[int]:
    """Embedding width of each of the ``n_parts`` clusters (shortlist first): ``d_embed // div_val**i``."""
    if div_val < 1:
        raise ValueError(f"model.div_val={div_val} must be >= 1")
    widths = [d_embed // div_val**i for i in range(n_parts)]
    if min(widths) < 1:
        raise ValueError(f"model.div_val={div_val} leaves cluster widths {widths} (model.d_embed={d_embed}); "
                         "every cluster needs at least 1")
    return widths


def project(x: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
    """Hidden ``(N, d_model)`` -> ``(N, width)`` through a ``(d_model, width)`` projection (None: identity)."""
    return x if projection is None else x @ projection


class AdaptiveEmbedding(nn.Module):
    """Token ids ``(...)`` -> embeddings ``(..., d_model)`` (unscaled; the model multiplies by sqrt(d_model)).

    ``div_val = 1``: ``weight`` ``(vocab, d_embed)`` and, when ``d_embed != d_model``, ``projections[0]``
    ``(d_model, d_embed)``. ``div_val > 1``: ``tables[i]`` ``(size_i, width_i)`` and ``projections[i]``
    ``(d_model, width_i)`` per cluster.
    """

    def __init__(self, vocab_size: int, d_model: int, d_embed: int | None = None, cutoffs: Sequence[int] = (),
                 div_val: int = 1) -> None:
        super().__init__()
        d_embed = d_embed or d_model
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.vocab_size, self.d_model, self.d_embed, self.div_val = vocab_size, d_model, d_embed, div_val
        self.widths = cluster_widths(d_embed, len(self.bounds) - 1, div_val)
        self.projections = nn.ParameterList()
        if div_val == 1:
            self.weight = nn.Parameter(torch.zeros(vocab_size, d_embed))
            if d_embed != d_model:
                self.projections.append(nn.Parameter(torch.zeros(d_model, d_embed)))
        else:
            self.tables = nn.ParameterList(nn.Parameter(torch.zeros(hi - lo, w)) for lo, hi, w in
                                           zip(self.bounds[:-1], self.bounds[1:], self.widths))
            self.projections.extend(nn.Parameter(torch.zeros(d_model, w)) for w in self.widths)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            out = F.embedding(tokens, self.weight)
            return F.linear(out, self.projections[0]) if len(self.projections) else out
        flat = tokens.reshape(-1)
        out = self.projections[0].new_zeros(flat.shape[0], self.d_model)
        for i, (table, projection) in enumerate(zip(self.tables, self.projections)):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            rows = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_copy(0, rows, F.linear(F.embedding(flat[rows] - lo, table), projection))
        return out.view(*tokens.shape, self.d_model)


class AdaptiveLogSoftmax(nn.Module):
    """Output layer: hidden states ``(N, d_model)`` -> log-probabilities / per-token NLL over ``vocab_size``.

    Args:
        vocab_size: output vocabulary.
        d_model: hidden width.
        cutoffs: increasing cluster boundaries, all in ``(0, vocab_size)``; empty = plain softmax.
        tied_weight: the input embedding matrix ``(vocab_size, d_embed)`` to share (None: own matrix;
            ``div_val = 1``).
        d_embed, div_val: cluster widths as in ``AdaptiveEmbedding``.
        tied_tables: ``div_val > 1``: the embedding's per-cluster tables to share (None: own tables).
        tied_projections: per cluster (shortlist first) an embedding projection to share, or None for an own
            one; only used where a projection exists (``div_val > 1`` or ``d_embed != d_model``).

    Parameters: ``weight`` (``div_val = 1``) or ``tables[i]``; ``bias`` ``(vocab_size,)`` (cluster ``i``'s
    output bias is ``bias[c_i:c_{i+1}]``); ``projections[i]`` ``(d_model, width_i)``; ``cluster_weight``
    ``(n_clusters, d_embed)`` and ``cluster_bias`` (head logits of the tail clusters).
    """

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int] = (),
                 tied_weight: nn.Parameter | None = None, d_embed: int | None = None, div_val: int = 1,
                 tied_tables: Sequence[nn.Parameter] | None = None,
                 tied_projections: Sequence[nn.Parameter | None] | None = None) -> None:
        super().__init__()
        d_embed = d_embed or d_model
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.vocab_size, self.d_model, self.d_embed, self.div_val = vocab_size, d_model, d_embed, div_val
        self.n_clusters = len(self.bounds) - 2
        self.widths = cluster_widths(d_embed, self.n_clusters + 1, div_val)
        if div_val == 1:
            self.weight = tied_weight if tied_weight is not None else nn.Parameter(
                torch.randn(vocab_size, d_embed) * 0.02)
        else:
            self.tables = nn.ParameterList(
                tied_tables[i] if tied_tables is not None else nn.Parameter(torch.randn(hi - lo, w) * 0.02)
                for i, (lo, hi, w) in enumerate(zip(self.bounds[:-1], self.bounds[1:], self.widths)))
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.projections = nn.ParameterList()
        if div_val > 1 or d_embed != d_model:
            tied_projections = list(tied_projections or [])
            for i, width in enumerate(self.widths):
                shared = tied_projections[i] if i < len(tied_projections) else None
                self.projections.append(shared if shared is not None else
                                        nn.Parameter(torch.randn(d_model, width) * 0.01))
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))

    @property
    def shortlist(self) -> int:
        return self.bounds[1]

    def cluster(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Weight ``(size_i, width_i)``, bias and projection (or None) of cluster ``i`` (0 = shortlist)."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        weight = self.weight[lo:hi] if self.div_val == 1 else self.tables[i]
        projection = self.projections[i] if len(self.projections) else None
        return weight, self.bias[lo:hi], projection

    def head_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, d_model) -> (N, shortlist + n_clusters)`` log-probabilities of the head."""
        weight, bias, projection = self.cluster(0)
        if self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight])
            bias = torch.cat([bias, self.cluster_bias])
        return F.log_softmax(at_least_fp32(F.linear(project(hidden, projection), weight, bias)), dim=-1)

    def tail_log_probs(self, hidden: torch.Tensor, cluster: int) -> torch.Tensor:
        """``(N, d_model) -> (N, size of cluster)`` log-probabilities inside tail cluster ``cluster`` (0-based)."""
        weight, bias, projection = self.cluster(cluster + 1)
        return F.log_softmax(at_least_fp32(F.linear(project(hidden, projection), weight, bias)), dim=-1)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, d_model) -> (N, vocab_size)`` full log-probabilities (for tests and small vocabularies)."""
        head = self.head_log_probs(hidden)
        parts = [head[:, : self.shortlist]]
        for i in range(self.n_clusters):
            parts.append(head[:, self.shortlist + i, None] + self.tail_log_probs(hidden, i))
        return torch.cat(parts, dim=-1)

    def nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token NLL in nats, ``(N, d), (N,) -> (N,)`` in the order of ``targets``; targets < 0 give 0."""
        valid = targets >= 0
        safe = targets.clamp(min=0)
        head = self.head_log_probs(hidden)
        if not self.n_clusters:
            return -head.gather(1, safe[:, None]).squeeze(1) * valid
        logp = head.gather(1, safe.clamp(max=self.shortlist - 1)[:, None]).squeeze(1)
        for i in range(self.n_clusters):  # a handful of clusters: each tail only for its own rows
            lo, hi = self.bounds[i + 1], self.bounds[i + 2]
            rows = (safe >= lo) & (safe < hi)
            if rows.any():
                tail = self.tail_log_probs(hidden[rows], i).gather(1, (safe[rows] - lo)[:, None]).squeeze(1)
                logp = logp.masked_scatter(rows, head[rows, self.shortlist + i] + tail)
        return -logp * valid
