"""Reformer LSH attention (Kitaev et al. 2020), O(n_hashes L b + L log L).

Shared QK: the keys are the queries' own vectors, L2-normalized (the ``k`` input is ignored); logits
``q_i . khat_j / sqrt(D)``. Angular LSH per round r: ``bucket = argmax([x R_r ; -x R_r])`` with a
random rotation ``R_r`` ``(D, n_buckets / 2)``. Positions are sorted by (bucket, position) and the sorted
order is cut into chunks of ``b = bucket_size``.

- Bidirectional: each chunk attends to itself and the previous chunk (look one back, cyclic), keys of
  any bucket (``attend_across_buckets`` as in lucidrains).
- Causal: a query attends to the keys of its OWN bucket among the b sorted positions ending at itself,
  i.e. its b most recent same-bucket predecessors (self included). Sorting by (bucket, position) makes
  these earlier positions, and the set depends only on positions <= i. (Plain chunk alignment would
  not be causal: how many tokens fall in lower buckets, future ones included, moves the chunk borders.)
  Computed inside the same chunk + look-back blocks with a mask.
- A token never attends to itself unless nothing else is available: its logit is replaced by -5e4
  (large, finite), as in the paper.

Multi-round combination: the rounds' outputs are mixed with weights ``softmax_r(lse_r)``; every logit
is first reduced by ``log(count_ij)``, the number of rounds in which key j is visible to query i. The
result is exactly softmax attention over the UNION of the keys seen in any round (``attention_matrix``
builds that union densely; rows sum to 1, ``forward == P @ v``).

Randomness: the rotations are a buffer drawn from ``seed`` (fixed, not redrawn per call), so a checkpoint
round trip reproduces the hashes. ``n_buckets`` defaults to ``2 * ceil(seq_len / (2 b))`` (about L / b,
even); it must be set when ``seq_len`` is unknown.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError, check_int_knob
from longseq.attention.ops.masks import NEG_INF
from longseq.attention.registry import register_attention

SELF_LOGIT = -5e4


@register_attention("reformer")
class ReformerAttention(Attention):
    """LSH attention with shared QK (see the module docstring).

    Args:
        bucket_size: b, the chunk length (lucidrains 64; LRA 10). L must be a multiple of it, or <= it
            (then one chunk holds everything: full attention without self).
        n_hashes: hash rounds (lucidrains 8; LRA 1).
        n_buckets: even number of buckets (default from seq_len, see the module docstring); 1 = no
            hashing (one bucket: block-local with look-back, or full attention when bucket_size >= L).
        seed: seeds the rotations.
        head_dim: required (rotation size).
    """

    pattern_from_data = True  # hash buckets of the keys

    def __init__(
        self, *, causal: bool, seq_len: int | None = None, head_dim: int | None = None, bucket_size: int = 64,
        n_hashes: int = 4, n_buckets: int | None = None, seed: int = 0, **common,
    ) -> None:
        check_int_knob(bucket_size, "attention.bucket_size")
        check_int_knob(n_hashes, "attention.n_hashes")
        self.bucket_size = bucket_size
        super().__init__(causal=causal, seq_len=seq_len, head_dim=head_dim, **common)
        if seq_len is not None:
            self.check_length(seq_len)
        if n_buckets is None:
            if seq_len is None:
                raise AttentionConfigError("attention 'reformer' needs attention.n_buckets when seq_len is unknown")
            n_buckets = 2 * max(1, math.ceil(seq_len / (2 * bucket_size)))
        if not isinstance(n_buckets, int) or n_buckets < 1 or (n_buckets > 1 and n_buckets % 2):
            raise AttentionConfigError(f"attention.n_buckets must be 1 (no hashing) or an even integer >= 2, got {n_buckets!r}")
        if head_dim is None:
            raise AttentionConfigError("attention 'reformer' needs head_dim (model.d_model / model.n_heads) for its rotations")
        self.n_hashes, self.n_buckets, self.seed = n_hashes, n_buckets, int(seed)
        g = torch.Generator().manual_seed(self.seed)
        rotations = torch.randn(n_hashes, head_dim, max(1, n_buckets // 2), generator=g, dtype=torch.float64)
        self.register_buffer("rotations", rotations.to(torch.get_default_dtype()))

    def check_length(self, length: int) -> None:
        if length > self.bucket_size and length % self.bucket_size:
            raise AttentionConfigError(
                f"attention 'reformer': length {length} is not a multiple of attention.bucket_size={self.bucket_size} "
                f"(or at most it); valid bucket sizes for L={length}: divisors of {length} or >= {length}"
            )

    # -- hashing ----------------------------------------------------------------------------------
    def hash(self, x: torch.Tensor) -> torch.Tensor:
        """Bucket ids ``(B, H, R, L)`` of vectors ``(B, H, L, D)`` for every round."""
        if self.n_buckets == 1:
            return torch.zeros(x.shape[0], x.shape[1], self.n_hashes, x.shape[2], dtype=torch.long, device=x.device)
        rotated = torch.einsum("bhld,rdk->bhrlk", x.detach(), self.rotations.to(x.dtype))
        return torch.cat([rotated, -rotated], -1).argmax(-1)

    def _rounds(self, q: torch.Tensor):
        """Per round: sort order, sorted index of each position, bucket of each position, chunk geometry."""
        B, H, L, D = q.shape
        self.check_length(L)
        buckets = self.hash(q)  # (B, H, R, L)
        positions = torch.arange(L, device=q.device)
        order = torch.sort(buckets * L + positions, dim=-1).indices  # (B, H, R, L) positions in sorted order
        sorted_index = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
        chunk = min(self.bucket_size, L)
        return buckets, order, sorted_index, chunk, L // chunk

    def _visible(self, idx_q, idx_k, bucket_q, bucket_k, chunk: int, n: int) -> torch.Tensor:
        """Whether key is visible to query in a round, from their sorted indices and buckets (broadcast)."""
        if self.causal:
            distance = idx_q - idx_k
            return (bucket_q == bucket_k) & (distance >= 0) & (distance < chunk)
        if n <= 2:  # one chunk, or two chunks that look back at each other: everything
            return torch.ones_like(idx_q - idx_k, dtype=torch.bool)
        back = (idx_q // chunk - idx_k // chunk) % n
        return (back == 0) | (back == 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = q.shape
        R = self.n_hashes
        buckets, order, sorted_index, chunk, n = self._rounds(q)
        qs = self.scale(q)
        keys = F.normalize(q, dim=-1)

        def gather(x: torch.Tensor) -> torch.Tensor:  # (B, H, L, E) -> (B, H, R, n, chunk, E) in sorted order
            idx = order.unsqueeze(-1).expand(B, H, R, L, x.shape[-1])
            return x.unsqueeze(2).expand(B, H, R, L, x.shape[-1]).gather(3, idx).view(B, H, R, n, chunk, -1)

        def look_back(x: torch.Tensor) -> torch.Tensor:  # keys of own chunk and the previous one (cyclic)
            return x if n == 1 else torch.cat([x, x.roll(1, dims=3)], 4)

        q_c = gather(qs)
        k_c, v_c = look_back(gather(keys)), look_back(gather(v))
        pos_q = order.view(B, H, R, n, chunk)
        pos_k = look_back(pos_q.unsqueeze(-1)).squeeze(-1)
        logits = q_c @ k_c.transpose(-1, -2)  # (B, H, R, n, chunk, keys)

        def at(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # table (B, H, L) read at pos (B, H, ...)
            return table.gather(-1, pos.flatten(2)).view(pos.shape)

        is_self = pos_q.unsqueeze(-1) == pos_k.unsqueeze(-2)
        logits = logits.masked_fill(is_self, SELF_LOGIT)
        if R > 1:
            # count_ij: in how many rounds key j is visible to query i (the same pair may meet in several)
            count = torch.zeros(logits.shape, dtype=logits.dtype, device=q.device)
            for r in range(R):  # a handful of hash rounds
                idx, bucket = sorted_index[:, :, r], buckets[:, :, r]
                seen = self._visible(at(idx, pos_q).unsqueeze(-1), at(idx, pos_k).unsqueeze(-2),
                                     at(bucket, pos_q).unsqueeze(-1), at(bucket, pos_k).unsqueeze(-2), chunk, n)
                count = count + seen.to(count.dtype)
            logits = logits - count.clamp(min=1).log()

        if self.causal:  # bidirectional blocks see all their keys; causal ones only the same-bucket window
            def at_own(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # table (B, H, R, L)
                return table.gather(-1, pos.flatten(3)).view(pos.shape)

            own_visible = self._visible(
                at_own(sorted_index, pos_q).unsqueeze(-1), at_own(sorted_index, pos_k).unsqueeze(-2),
                at_own(buckets, pos_q).unsqueeze(-1), at_own(buckets, pos_k).unsqueeze(-2), chunk, n,
            )
            logits = logits.masked_fill(~own_visible, NEG_INF)
        lse = logits.logsumexp(-1, keepdim=True)  # (B, H, R, n, chunk, 1)
        weights = self.weight_dropout(torch.exp(logits - lse))
        Dv = v.shape[-1]
        out_sorted = (weights @ v_c).view(B, H, R, L, Dv)
        lse = lse.view(B, H, R, L, 1)
        # back to position order, then mix rounds by their total mass
        inverse = sorted_index.unsqueeze(-1)
        out = out_sorted.gather(3, inverse.expand(B, H, R, L, Dv))
        lse = lse.gather(3, inverse)
        return (out * lse.softmax(2)).sum(2)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax over the union of the keys visible in any round, self excluded unless alone."""
        B, H, L, D = q.shape
        buckets, _, sorted_index, chunk, n = self._rounds(q)
        visible = torch.zeros(B, H, L, L, dtype=torch.bool, device=q.device)
        for r in range(self.n_hashes):
            iq, bq = sorted_index[:, :, r], buckets[:, :, r]
            visible |= self._visible(iq.unsqueeze(-1), iq.unsqueeze(-2), bq.unsqueeze(-1), bq.unsqueeze(-2), chunk, n)
        logits = self.scale(q) @ F.normalize(q, dim=-1).transpose(-1, -2)
        eye = torch.eye(L, dtype=torch.bool, device=q.device)
        logits = logits.masked_fill(eye, SELF_LOGIT).masked_fill(~visible, NEG_INF)
        return logits.softmax(-1)

    def extra_repr(self) -> str:
        return (f"name={self.name}, causal={self.causal}, bucket_size={self.bucket_size}, n_hashes={self.n_hashes}, "
                f"n_buckets={self.n_buckets}")
