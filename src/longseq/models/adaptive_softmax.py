"""Tied (adaptive) output softmax of Transformer-XL.

``cutoffs=[]`` is a plain softmax over the vocabulary (tied to the input embedding, with a bias), what the
enwik8 models use. With cutoffs ``[c_0, c_1, ...]`` (WikiText-103: 20k / 40k / 200k) the head scores the
``c_0`` most frequent tokens plus one logit per tail cluster, and tail cluster ``i`` holds tokens
``[c_i, c_{i+1})``: ``log p(t) = log p_head(cluster of t) + log p_tail(t)``. Only ``div_val = 1`` (the base
models): every cluster uses the full ``d_model`` embedding, so there are no projection matrices. Cluster
logits are read in forward order (cluster ``i`` = head column ``c_0 + i``), the TF / HF convention.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax in fp32 under mixed precision; fp64 stays fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class AdaptiveLogSoftmax(nn.Module):
    """Output layer: hidden states ``(N, d)`` -> log-probabilities / per-token NLL over ``vocab_size`` tokens.

    Args:
        vocab_size: output vocabulary.
        d_model: hidden width.
        cutoffs: increasing cluster boundaries, all in ``(0, vocab_size)``; empty = plain softmax.
        tied_weight: the input embedding matrix ``(vocab_size, d_model)`` to share (None: own matrix).
    """

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int] = (),
                 tied_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        cutoffs = [int(c) for c in cutoffs]
        if any(b <= a for a, b in zip([0] + cutoffs, cutoffs + [vocab_size])):
            raise ValueError(f"model.cutoffs={cutoffs} must be strictly increasing and inside (0, vocab_size="
                             f"{vocab_size}); use [] for a plain softmax")
        self.vocab_size, self.bounds = vocab_size, [0] + cutoffs + [vocab_size]
        if tied_weight is None:
            tied_weight = nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)
        self.weight = tied_weight
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.n_clusters = len(cutoffs)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_model))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))

    @property
    def shortlist(self) -> int:
        return self.bounds[1]

    def head_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, d) -> (N, shortlist + n_clusters)`` log-probabilities of the head."""
        weight, bias = self.weight[: self.shortlist], self.bias[: self.shortlist]
        if self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight])
            bias = torch.cat([bias, self.cluster_bias])
        return F.log_softmax(at_least_fp32(F.linear(hidden, weight, bias)), dim=-1)

    def tail_log_probs(self, hidden: torch.Tensor, cluster: int) -> torch.Tensor:
        """``(N, d) -> (N, size of cluster)`` log-probabilities inside tail cluster ``cluster`` (0-based)."""
        lo, hi = self.bounds[cluster + 1], self.bounds[cluster + 2]
        return F.log_softmax(at_least_fp32(F.linear(hidden, self.weight[lo:hi], self.bias[lo:hi])), dim=-1)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, d) -> (N, vocab_size)`` full log-probabilities (for tests and small vocabularies)."""
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
