"""Online k-means for learned partitions (Routing Transformer, Roy et al. 2020; Combiner-Learnable).

Per head, ``K`` unit-norm centroids live in a buffer (so they are saved with checkpoints but get no
gradient). A position is routed by the cosine similarity of its (unit-normalized) routing vector with
the centroids. Two assignments are offered:

- ``nearest``: each position takes its most similar centroid. A position's cluster depends only on its
  own vector, so it is safe for causal use, but cluster sizes vary.
- ``balanced``: every group of ``N`` consecutive positions is split into ``K`` clusters of exactly
  ``N / K`` members (a partition). Rule (``balanced_assignment``), a capacity-constrained greedy run
  in rounds: every unassigned position proposes to its most similar centroid that still has room;
  each centroid accepts its most similar proposers up to its remaining room (ties: earlier position
  first); rejected positions propose again next round. Each round fills at least one centroid (or
  ends the assignment), so there are at most ``K`` rounds; with centroids that already spread the
  data there are only a few. A position's cluster depends on the whole group (not causal inside it).

In training, ``update`` moves every centroid toward the mean of the routing vectors assigned to it:
``c <- normalize(decay * c + (1 - decay) * mean)`` (exponential moving average, decay 0.999 as in
Routing Transformer); centroids without members stay put. Eval mode never changes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longseq.attention.base import AttentionConfigError


def balanced_assignment(scores: torch.Tensor) -> torch.Tensor:
    """Partition ``N`` positions into ``K`` equal clusters from similarity ``scores`` ``(..., N, K)``.

    Returns ``(..., N)`` long cluster ids; each id occurs exactly ``N / K`` times per leading index.
    See the module docstring for the rule. Not differentiable (ids only).
    """
    *lead, n_pos, n_clusters = scores.shape
    if n_pos % n_clusters:
        raise AttentionConfigError(
            f"attention.n_clusters={n_clusters} must divide the {n_pos} positions being clustered"
        )
    flat_scores = scores.detach().reshape(-1, n_clusters)  # (G*N, K), one row per position
    device = flat_scores.device
    groups = flat_scores.shape[0] // n_pos
    assignment = torch.full((groups * n_pos,), -1, dtype=torch.long, device=device)
    room = torch.full((groups * n_clusters,), n_pos // n_clusters, dtype=torch.long, device=device)
    pending = torch.arange(groups * n_pos, device=device)  # increasing = earlier positions first
    first_round = True
    for _ in range(n_clusters):  # at most K rounds; usually a handful, each on the still-pending rows
        if pending.numel() == 0:
            break
        group = pending // n_pos
        if first_round:  # every centroid has room: no masking, no copy
            best, choice = flat_scores.max(-1)
            first_round = False
        else:
            full = (room.view(groups, n_clusters) == 0)[group]  # (P, K)
            best, choice = flat_scores[pending].masked_fill(full, float("-inf")).max(-1)
        slot = group * n_clusters + choice  # (group, centroid) proposed to
        # proposers of each slot, most similar first; stable sorts keep earlier positions first on ties
        by_score = torch.sort(-best, stable=True).indices
        order = by_score[torch.sort(slot[by_score], stable=True).indices]
        sorted_slot = slot[order]
        proposals = torch.bincount(slot, minlength=room.numel())
        first = proposals.cumsum(0) - proposals
        rank = torch.arange(order.numel(), device=device) - first[sorted_slot]
        accepted = rank < room[sorted_slot]
        assignment[pending[order[accepted]]] = choice[order[accepted]]
        room = room - torch.bincount(sorted_slot[accepted], minlength=room.numel())
        pending = torch.sort(pending[order[~accepted]]).values
    return assignment.view(*lead, n_pos)


class OnlineKMeans(nn.Module):
    """Per-head unit-norm centroids ``(H, K, D)`` with nearest / balanced routing and EMA updates.

    Args:
        n_clusters: K.
        n_heads, head_dim: H and D; when unknown at construction the centroids are created on first use
            (from the same seed, so still reproducible) and ``load_state_dict`` adopts the stored shape.
        ema_decay: weight of the old centroid in the training-time update.
        seed: seeds the Gaussian initialization (normalized to unit length).
    """

    def __init__(
        self,
        n_clusters: int,
        n_heads: int | None = None,
        head_dim: int | None = None,
        ema_decay: float = 0.999,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(n_clusters, int) or n_clusters < 1:
            raise AttentionConfigError(f"attention.n_clusters must be a positive integer, got {n_clusters!r}")
        if not 0.0 <= ema_decay <= 1.0:
            raise AttentionConfigError(f"attention.ema_decay must be in [0, 1], got {ema_decay}")
        self.n_clusters = n_clusters
        self.ema_decay = float(ema_decay)
        self.seed = int(seed)
        if n_heads is not None and head_dim is not None:
            self.register_buffer("centroids", self._initial_centroids(n_heads, head_dim))
        else:
            self.register_buffer("centroids", torch.empty(0))

    def _initial_centroids(self, n_heads: int, head_dim: int, like: torch.Tensor | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        c = F.normalize(torch.randn(n_heads, self.n_clusters, head_dim, generator=g, dtype=torch.float64), dim=-1)
        if like is None:
            return c.to(torch.get_default_dtype())
        return c.to(device=like.device, dtype=like.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        stored = state_dict.get(prefix + "centroids")
        if stored is not None and stored.shape != self.centroids.shape:
            self.centroids = torch.empty_like(stored, device=self.centroids.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _ensure(self, x: torch.Tensor) -> None:
        H, D = x.shape[1], x.shape[-1]
        if self.centroids.numel() == 0:
            self.centroids = self._initial_centroids(H, D, like=x)
        elif self.centroids.shape != (H, self.n_clusters, D):
            raise AttentionConfigError(
                f"k-means centroids have shape {tuple(self.centroids.shape)} but the input has H={H}, D={D}"
            )

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of routing vectors ``x`` ``(B, H, L, D)`` with the centroids -> ``(B, H, L, K)``."""
        self._ensure(x)
        x = F.normalize(x.detach(), dim=-1)
        return torch.einsum("bhld,hkd->bhlk", x, self.centroids.to(x.dtype))

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, L)`` id of the most similar centroid; depends only on each position's own vector."""
        return self.scores(x).argmax(-1)

    def balanced(self, x: torch.Tensor, group: int | None = None) -> torch.Tensor:
        """``(B, H, L)`` balanced ids: each run of ``group`` consecutive positions (default: all L) is
        split into K clusters of ``group / K`` members."""
        B, H, L, _ = x.shape
        group = L if group is None else group
        if L % group:
            raise AttentionConfigError(f"k-means group {group} does not divide the length {L}")
        scores = self.scores(x).view(B, H, L // group, group, self.n_clusters)
        return balanced_assignment(scores).view(B, H, L)

    @torch.no_grad()
    def update(self, x: torch.Tensor, clusters: torch.Tensor) -> None:
        """EMA step toward the mean routing vector of each cluster (training only; no-op in eval).

        x: ``(B, H, L, D)`` routing vectors (normalized here); clusters: ``(B, H, L)`` ids.
        """
        if not self.training or self.ema_decay >= 1.0:
            return
        self._ensure(x)
        x = F.normalize(x.detach(), dim=-1).to(self.centroids.dtype)
        H, K, D = self.centroids.shape
        one_hot = F.one_hot(clusters, K).to(x.dtype)  # (B, H, L, K)
        sums = torch.einsum("bhlk,bhld->hkd", one_hot, x)
        counts = one_hot.sum((0, 2)).unsqueeze(-1)  # (H, K, 1)
        means = sums / counts.clamp(min=1.0)
        moved = F.normalize(self.ema_decay * self.centroids + (1.0 - self.ema_decay) * means, dim=-1)
        self.centroids.copy_(torch.where(counts > 0, moved, self.centroids))

    def extra_repr(self) -> str:
        return f"n_clusters={self.n_clusters}, ema_decay={self.ema_decay}, seed={self.seed}"
