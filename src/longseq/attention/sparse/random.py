"""Random pattern: self plus seeded uniformly drawn keys per query, attended through its key table."""

from __future__ import annotations

import torch

from longseq.attention.base import check_int_knob
from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.ops.masks import mask_from_index_table
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention
from longseq.attention.sparse.kernels import dedupe_index_table


def attend_index_table(attn: SparseAttention, q, k, v, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Attention of every query to the keys listed in its row of an index table.

    q, k, v (B, H, L, D); ``idx`` (L, K) long and ``valid`` (L, K) bool, duplicate-free (see
    ``dedupe_index_table``), every row with at least one valid key. Gathers K and V to
    ``(B*H, L, K, D)`` (memory ``O(L K D)``) and applies one softmax over each row's K candidates.
    """
    B, H, L, D = k.shape
    flat = idx.reshape(-1)  # index_select: its backward (index_add) is much cheaper than indexing's
    k_rows = k.index_select(2, flat).view(B * H, L, -1, D)  # (B*H, L, K, D)
    v_rows = v.index_select(2, flat).view(B * H, L, -1, D)
    # one query per "head" of a 4-D SDPA call: the fused kernel avoids (B, H, L, K, D) temporaries
    q_rows = attn.scale(q).reshape(B * H, L, 1, D)
    return attn.sdpa(q_rows, k_rows, v_rows, valid.view(1, L, 1, -1)).view(B, H, L, D)


@register_attention("random")
class RandomAttention(SparseAttention):
    """Each query attends to itself plus ``n_random`` keys drawn uniformly (seeded); O(L R).

    Draws for query i are uniform over ``[0, i]`` (causal) or ``[0, L)`` (bidirectional), with
    replacement; repeats count once. The pattern is a deterministic function of (``seed``, L), shared
    by all heads; the table for ``seq_len`` is kept as a buffer (saved in checkpoints). Any length works.
    """

    def __init__(self, *, causal: bool, n_random: int = 8, seed: int = 0, **base) -> None:
        super().__init__(causal=causal, **base)
        self.n_random = check_int_knob(n_random, "attention.n_random", minimum=0)
        self.seed = int(seed)
        if self.seq_len:
            idx, valid = self.index_table(self.seq_len)
            self.register_buffer("random_keys", idx)
            self.register_buffer("random_valid", valid)

    def index_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "random_keys", None) is not None and self.random_keys.shape[0] == length:
            return self.random_keys, self.random_valid
        g = torch.Generator().manual_seed(self.seed)
        u = torch.rand(length, self.n_random, generator=g, dtype=torch.float64)
        i = torch.arange(length).unsqueeze(1)
        span = i + 1 if self.causal else torch.full_like(i, length)
        draws = (u * span).long().clamp(max=length - 1)
        idx = torch.cat([i, draws], 1)
        return dedupe_index_table(idx, torch.ones_like(idx, dtype=torch.bool), length)

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        idx, valid = (x.to(device) for x in self.index_table(length))  # (L, K) key table of each query
        K = idx.shape[1]

        def direct(b, h, q, kv):
            ok = (idx[q, 0] == kv) & valid[q, 0]
            for col in range(1, K):  # K = 1 + n_random, a handful: unrolled, no (L, L) mask
                ok = ok | ((idx[q, col] == kv) & valid[q, col])
            return ok

        return [FlexCall(direct)]

    def pattern(self, length: int) -> torch.Tensor:
        return mask_from_index_table(*self.index_table(length), length)

    def forward(self, q, k, v):
        L = q.shape[-2]
        idx, valid = self.cached("idx", L, q.device, lambda: tuple(x.to(q.device) for x in self.index_table(L)))
        return attend_index_table(self, q, k, v, idx, valid)
