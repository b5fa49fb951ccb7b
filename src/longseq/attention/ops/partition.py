"""The one partition type: which keys a query attends directly and which region summaries it uses.

Every Combiner variant (fixed, logsparse, axial row-major, vertical, horizontal, mixture) and every
sparse pattern that is "a set of allowed keys" (no regions) describes its geometry as a ``Partition`` of
dense index sets (small L: tests, figures, ``attention_matrix``; decoding tables are built from it once).
``effective_matrix`` is the one dense reference of a joint softmax over direct keys and summaries, and
``without_padding`` the one key-padding rule (see ``ops.padding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longseq.attention.ops.masks import NEG_INF


@dataclass
class Partition:
    """A partition as dense index sets.

    Attributes:
        direct: ``(L, L)`` bool, query i attends key j directly.
        members: ``(R, L)`` bool, the positions each (non-empty) region summarizes.
        usable: ``(L, R)`` bool, query i may use region R (one joint-softmax logit).
        family: ``(R,)`` long, which factorization a region belongs to (0 = rows, segments, blocks or
            vertical, 1 = horizontal); within one family the regions a query uses are disjoint.
        anchor: ``(R,)`` long, the position whose own query summarizes the region (row-major axial), or -1
            for pooled regions (max/mean/DeepSets of the region's queries).
    """

    direct: torch.Tensor
    members: torch.Tensor
    usable: torch.Tensor
    family: torch.Tensor
    anchor: torch.Tensor

    @classmethod
    def from_candidates(cls, direct, members, usable, family=None, anchor=None) -> Partition:
        """Drop the empty candidate regions (e.g. "rows above row 0") and keep the rest; family 0 and
        pooled regions (anchor -1) unless given."""
        n_regions, device = members.shape[0], members.device
        family = torch.zeros(n_regions, dtype=torch.long, device=device) if family is None else family
        anchor = torch.full((n_regions,), -1, dtype=torch.long, device=device) if anchor is None else anchor
        keep = members.any(-1)
        return cls(direct.bool(), members[keep].bool(), usable[:, keep].bool(), family[keep], anchor[keep])

    @classmethod
    def direct_only(cls, allowed: torch.Tensor) -> Partition:
        """A sparse pattern: ``allowed`` ``(L, L)`` bool (True = may attend), no regions."""
        L, device = allowed.shape[-1], allowed.device
        empty = torch.zeros(0, L, dtype=torch.bool, device=device)
        return cls.from_candidates(allowed, empty, empty.T)

    @property
    def length(self) -> int:
        return self.direct.shape[-1]

    def allowed(self, family: int | None = None) -> torch.Tensor:
        """(L, L) bool: keys reached directly or through a usable region (of ``family`` if given)."""
        usable = self.usable if family is None else self.usable & (self.family == family)
        return self.direct | ((usable.double() @ self.members.double()) > 0)

    def plan(self, family: int) -> Partition:
        """The same partition with only the regions of ``family`` usable (one plan of a mixture)."""
        return Partition(self.direct, self.members, self.usable & (self.family == family), self.family, self.anchor)

    def without_padding(self, pad: torch.Tensor) -> Partition:
        """This partition for one document with key padding ``pad`` ``(L,)`` bool (True = pad).

        THE key-padding rule of every variant with ``supports_padding_mask`` (``ops.padding`` documents it):
        padded keys leave the direct set and the regions; a region left without a real key is dropped; a
        region summarized by its anchor's own query whose anchor is padding is summarized by its first real
        member's query instead; a query left with nothing (only a padded query can be: self is always
        direct) falls back to its unpadded direct keys, so no row is NaN.
        """
        anchor = self.anchor
        on_pad = (anchor >= 0) & pad[anchor.clamp(min=0)]  # (R,); -1 = pooled region
        first_real = (self.members & ~pad).int().argmax(-1)  # (R,) first real member (any if none: dropped)
        anchor = torch.where(on_pad, first_real, anchor)
        members = self.members & ~pad
        usable = self.usable & members.any(-1)
        direct = self.direct & ~pad
        empty = ~(direct.any(-1) | usable.any(-1))
        direct = torch.where(empty.unsqueeze(-1), self.direct, direct)
        return Partition.from_candidates(direct, members, usable, self.family, anchor)

    def direct_matrix(self, q: torch.Tensor, k: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Dense weights ``(B, H, L, L)`` of a partition without regions (a pattern: ``full``, the sparse family):
        one softmax over each query's direct keys (q scaled, k ``(B, H, L, D)``); with ``key_padding_mask``
        ``(B, L)`` (True = pad), each document's ``without_padding`` (a loop over the batch, small L only)."""
        if key_padding_mask is None:
            return self.effective_matrix(q, k, None, None)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([self.without_padding(pad).effective_matrix(q[b : b + 1], k[b : b + 1], None, None)
                          for b, pad in enumerate(pads)])

    def effective_matrix(self, q: torch.Tensor, k: torch.Tensor, summary_q: torch.Tensor,
                         summary_k: torch.Tensor) -> torch.Tensor:
        """Dense weights ``(B, H, L, L)`` of one joint softmax over direct keys and region summaries.

        Args:
            q: scaled queries ``(B, H, L, D)``; k: keys ``(B, H, L, D)``.
            summary_q, summary_k: ``(B, H, R, D)`` each region's summary query and key.
        Returns ``w_direct + sum_R w(i, R) p(j | R)`` with ``p(j | R)`` the region's own softmax of
        ``summary_q . k_j`` over its members. O(L^2 + R L) memory: small L only.
        """
        direct_logits = (q @ k.transpose(-1, -2)).masked_fill(~self.direct, NEG_INF)
        if self.members.shape[0] == 0:
            return direct_logits.softmax(-1)
        inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~self.members, NEG_INF).softmax(-1)  # (B,H,R,L)
        region_logits = (q @ summary_k.transpose(-1, -2)).masked_fill(~self.usable, NEG_INF)
        weights = torch.cat([direct_logits, region_logits], -1).softmax(-1)
        L = q.shape[-2]
        return weights[..., :L] + weights[..., L:] @ inner
